"""The kinds of decoding a family has (registry.py gives each family its kind), which decide which
request knobs apply (params/). Plain Python, no torch: the request bookkeeping imports it.

Masked diffusion over a canvas (LLaDA, Dream), block diffusion (bidirectional inside a block, causal
across: Fast-dLLM v2, SDAR, LLaDA2), autoregressive; uniform diffusion: canvases that start from
random tokens and are refined at every position each pass (DiffusionGemma)."""
DIFFUSION, BLOCK_DIFFUSION, AUTOREGRESSIVE = "diffusion", "block-diffusion", "autoregressive"
UNIFORM_DIFFUSION = "uniform-diffusion"
# A tri-mode model's decodings (Nemotron-Labs-Diffusion), the first its default; Family.modes gives their kinds.
MODES, SELF_SPECULATION = ("diffusion", "ar", "linear_spec"), "linear_spec"
