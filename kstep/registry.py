"""The model families kstep runs: for each, its checkpoint layout (config keys, tensor names), its
attention mode, its kind of decoding, its decoder (by key) and the rules its reference sampler
follows. A new family is one entry here, plus a layout file in models/ and a decoder in decoding/
(or a reused one). This module is data: it imports no decoder and no runner, so checkpoint I/O
(weights.py) and the request knobs (params/) can read it from below. Which decoder class serves a
family under which request settings is decoding/table.py's, printed in docs/decoding.md.

    family           layout (models/)            attention      kind               decoder key
    llada            llada.py                    bidirectional  diffusion          masked_diffusion
    llada_moe        llada_moe.py                bidirectional  diffusion          masked_diffusion
    dream            dream.py                    bidirectional  diffusion          dream
    fast_dllm_v2     fast_dllm_v2.py             block_causal   block-diffusion    block_diffusion (shifted)
    sdar             sdar.py                     block_causal   block-diffusion    block_diffusion
    llada2_moe       llada2_moe.py               block_causal   block-diffusion    block_diffusion (steps capped)
    llama, qwen2     llama.py                    causal         autoregressive     autoregressive
    diffusion_gemma  diffusion_gemma.py          two_mode       uniform-diffusion  uniform_diffusion
    nemotron_labs_diffusion  nemotron_labs_diffusion.py  causal  per request (`mode`)  tri_mode
"""
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from kstep.kinds import AUTOREGRESSIVE, BLOCK_DIFFUSION, DIFFUSION, MODES, SELF_SPECULATION, UNIFORM_DIFFUSION
from kstep.models import (diffusion_gemma, dream, fast_dllm_v2, llada, llada2_moe, llada_moe, llama,
                          nemotron_labs_diffusion, sdar)
from kstep.models.config import ModelConfig
from kstep.models.diffusion_gemma_model import DiffusionGemma

__all__ = ["AUTOREGRESSIVE", "BLOCK_DIFFUSION", "DIFFUSION", "FAMILIES", "MODES", "SELF_SPECULATION",
           "UNIFORM_DIFFUSION", "BlockRules", "Family", "family_for"]


@dataclass(slots=True, frozen=True)
class BlockRules:
    """What differs between the block-diffusion references (the decoders and the time-budget planner
    both read these)."""
    is_shifted: bool          # Fast-dLLM v2: the token at j from the output at j - 1; a commit gives the next first token
    steps_capped: bool = False  # LLaDA2: passes per block = min(steps, max_tokens), steps defaulting to the block
    has_causal_context: bool = False  # Nemotron: blocks follow the prompt, denoised against a causal cache


@dataclass(slots=True, frozen=True)
class Family:
    name: str
    layout: ModuleType               # parse_config(raw, family, attention), checkpoint_names(cfg), to_raw_config(cfg)
    attention: str                   # "causal" | "bidirectional" | "block_causal" | "two_mode"
    kind: str                        # AUTOREGRESSIVE | DIFFUSION | BLOCK_DIFFUSION | UNIFORM_DIFFUSION
    decoder: str                     # its row of decoding/table.py's decoder table
    architectures: tuple[str, ...]   # config.json `architectures` that select it
    model_types: tuple[str, ...]     # config.json `model_type` that selects it
    block_rules: BlockRules | None = None  # a block-diffusion family's
    sub_block_length: int | None = None  # block diffusion: unmask inside sub-blocks of this size (Fast-dLLM v2)
    threshold: float | None = None   # the reference sampler's confidence threshold, with steps too (LLaDA2: 0.95)
    whole_canvas_reference: bool = False  # its exact sampler runs the canvas as one block (Dream's diffusion_generate)
    config_test: Callable[[dict], bool] | None = None  # whether a config.json of a shared model_type is this family's
    network: type | None = None      # its own nn.Module (None: models/transformer.py's Transformer)
    modes: dict[str, str] | None = None  # a tri-mode model: each `mode` and its kind (the first: `kind`'s)

    def parse_config(self, raw: dict) -> ModelConfig:
        return self.layout.parse_config(raw, self.name, self.attention)

    def kind_for(self, mode: str | None) -> str:
        """The kind of decoding a request of `mode` runs: the family's, or (a tri-mode model) its mode's."""
        return self.modes[mode or next(iter(self.modes))] if self.modes else self.kind

    def matches_model_type(self, raw: dict) -> bool:
        """config.json's `model_type` is this family's (and, where a model_type is shared, its fields
        say so: LLaDA-MoE's is "llada" too, told apart by its experts)."""
        return raw.get("model_type") in self.model_types and (self.config_test is None or self.config_test(raw))


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llada", llada, "bidirectional", DIFFUSION, "masked_diffusion", ("LLaDAModelLM",), ("llada",),
           config_test=lambda raw: not raw.get("num_experts")),
    Family("llada_moe", llada_moe, "bidirectional", DIFFUSION, "masked_diffusion", ("LLaDAMoEModelLM",),
           ("llada",), config_test=lambda raw: bool(raw.get("num_experts"))),
    Family("dream", dream, "bidirectional", DIFFUSION, "dream", ("DreamModel",), ("Dream",),
           whole_canvas_reference=True),
    Family("fast_dllm_v2", fast_dllm_v2, "block_causal", BLOCK_DIFFUSION, "block_diffusion",
           ("Fast_dLLM_QwenForCausalLM",), ("Fast_dLLM_Qwen",), BlockRules(is_shifted=True), sub_block_length=8),
    Family("sdar", sdar, "block_causal", BLOCK_DIFFUSION, "block_diffusion", ("SDARForCausalLM",), ("sdar",),
           BlockRules(is_shifted=False)),
    Family("llada2_moe", llada2_moe, "block_causal", BLOCK_DIFFUSION, "block_diffusion", ("LLaDA2MoeModelLM",),
           ("llada2_moe",), BlockRules(is_shifted=False, steps_capped=True), threshold=0.95),
    Family("llama", llama, "causal", AUTOREGRESSIVE, "autoregressive", ("LlamaForCausalLM",), ("llama",)),
    Family("qwen2", llama, "causal", AUTOREGRESSIVE, "autoregressive", ("Qwen2ForCausalLM",), ("qwen2",)),
    Family("diffusion_gemma", diffusion_gemma, "two_mode", UNIFORM_DIFFUSION, "uniform_diffusion",
           ("DiffusionGemmaForBlockDiffusion",), ("diffusion_gemma",), network=DiffusionGemma),
    Family("nemotron_labs_diffusion", nemotron_labs_diffusion, "causal", BLOCK_DIFFUSION, "tri_mode",
           (nemotron_labs_diffusion.ARCHITECTURE,), (nemotron_labs_diffusion.MODEL_TYPE,),
           BlockRules(is_shifted=False, has_causal_context=True),
           modes=dict(zip(MODES, (BLOCK_DIFFUSION, AUTOREGRESSIVE, AUTOREGRESSIVE), strict=True))),
)}


def family_for(raw: dict) -> Family:
    """The family of a checkpoint's config.json, chosen by `architectures`, then `model_type`."""
    by_architecture = [f for f in FAMILIES.values() if any(a in f.architectures for a in raw.get("architectures") or [])]
    if by_architecture:
        return by_architecture[0]
    for family in FAMILIES.values():
        if family.matches_model_type(raw):
            return family
    known = sorted(a for f in FAMILIES.values() for a in f.architectures)
    raise ValueError(f"unknown architecture {raw.get('architectures')} / model_type {raw.get('model_type')!r}"
                     f" (supported: {', '.join(known)})")
