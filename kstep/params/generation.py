"""Per-request generation knobs: declared once here (type, default, help, which families use them),
validated here, and resolved here into what a decoder runs.

The declaration drives the edges: the CLI's flags (`kstep generate`, `kstep serve`'s defaults) and
the HTTP extra fields are generated from it, so a new knob is one field below. Plain Python, no
torch: the scheduler and request bookkeeping import it.

Sampling knobs serve every family; `steps`, `block_length`, `remasking`, `cfg_scale` are the
masked-diffusion knobs of LLaDA's `generate()` (`gen_length` is `max_tokens`); `alg_temp` and `eps`
are Dream's (`diffusion_generate`).
"""
from dataclasses import dataclass, field, fields, replace

from kstep.params.denoising import (DEFAULT_NUM_DRAFT_TOKENS, SELF_DRAFT, UnmaskPolicy, resolve_block_diffusion,
                                    resolve_diffusion)
from kstep.params.validation import MAX_SEED, check_int, check_number, check_pass_bound
from kstep.structured.spec import StructuredSpec
from kstep.kinds import AUTOREGRESSIVE, BLOCK_DIFFUSION, DIFFUSION, MODES, SELF_SPECULATION, UNIFORM_DIFFUSION

TRI_MODE = ("nemotron_labs_diffusion",)  # the families that take `mode` (those the registry gives modes)
# transformers' DiffusionGemmaGenerationConfig defaults, where the checkpoint's generation_config.json has none
UNIFORM_DEFAULTS = {"max_denoising_steps": 48, "entropy_bound": 0.1, "t_min": 0.4, "t_max": 0.8,
                    "stability_threshold": 1, "confidence_threshold": 0.005}
DENOISING = (DIFFUSION, BLOCK_DIFFUSION)
CACHE_MODES = ("none", "prefix", "dual")
# Unmask rules (confidence scores, `decoding/unmask.py`): LLaDA's low_confidence / random, Dream's
# maskgit_plus (= low_confidence), topk_margin (= margin) and entropy.
REMASKING_RULES = ("low_confidence", "random", "margin", "entropy")


def knob(default, help: str, families: tuple[str, ...] = (), choices: tuple | None = None,
         server_default: bool = True, http: bool = True, flag: bool = True):
    """A GenerationParams field. `families`: the family kinds or names it applies to (empty: all);
    `server_default`: `kstep serve` takes it as a per-model default flag; `http`: a kstep extra field
    of the OpenAI protocol (the standard fields are declared there with OpenAI's semantics); `flag`:
    its flag is generated (else the commands declare it themselves)."""
    return field(default=default, metadata={"help": help, "families": families, "choices": choices,
                                            "server_default": server_default, "http": http, "flag": flag})


@dataclass(slots=True, frozen=True)
class GenerationParams:
    max_tokens: int = knob(128, "completion length (diffusion: the canvas size, LLaDA's gen_length)",
                           server_default=False, http=False)
    mode: str | None = knob(None, "a tri-mode model's decoding: diffusion (blocks; the default), ar, linear_spec "
                                  "(drafts its blocks bidirectionally, verifies them causally: the ar output)",
                            TRI_MODE, MODES)
    temperature: float = knob(0.0, "0 is greedy", http=False)
    top_k: int | None = knob(None, "sample among the k most likely tokens")
    top_p: float | None = knob(None, "nucleus sampling: the smallest set with this much mass", http=False)
    seed: int | None = knob(None, "random seed of this request's sampling", server_default=False, http=False)
    steps: int | None = knob(None, "diffusion forward passes with the fixed schedule (default: max tokens); "
                                   "block diffusion: denoising passes per block (SDAR's denoising_steps)",
                             DENOISING, server_default=False)
    block_length: int | None = knob(None, "semi-autoregressive block (default: 32 when it divides max tokens, "
                                          "else max tokens; block diffusion: the checkpoint's block size)", DENOISING)
    remasking: str = knob("low_confidence", "unmask rule", DENOISING, REMASKING_RULES)
    cfg_scale: float = knob(0.0, "LLaDA's unsupervised classifier-free guidance", ("llada", "llada_moe"))
    cache: str | None = knob(None, "diffusion KV cache: none, prefix, dual (Fast-dLLM; the default); Fast-dLLM v2: "
                                   "dual = its block cache (use_block_cache: a sub-block's passes against the "
                                   "block's cached keys), none the default", (DIFFUSION, "fast_dllm_v2"), CACHE_MODES)
    threshold: float | None = knob(None, "unmask every mask with confidence >= T per pass (block diffusion: > T, "
                                         "as its references), at least one "
                                         "(default 0.9 unless steps or factor is given; block diffusion: with steps, "
                                         "at least the schedule's count)", DENOISING)
    factor: float | None = knob(None, "Fast-dLLM's factor unmask rule", ("llada", "llada_moe"))
    exact: bool = knob(False, "the reference sampler: no cache, fixed schedule, one token per pass "
                              "(or steps passes); LLaDA/Dream with cache prefix or dual: that schedule run with "
                              "Fast-dLLM's cache (what draft self with that cache equals)", DENOISING)
    alg_temp: float | None = knob(None, "Dream's alg_temp: sample which masks to unmask from "
                                        "softmax(confidence / alg_temp)", ("dream",))
    eps: float | None = knob(None, "Dream's eps: the schedule runs from t = 1 to eps (default: the "
                                   "checkpoint's generation_config, else 1e-3)", ("dream",))
    sub_block_length: int | None = knob(None, "Fast-dLLM v2's small_block_size: unmask only inside the current "
                                              "sub-block of this many tokens (default 8)", ("fast_dllm_v2",))
    editing_threshold: float | None = knob(None, "LLaDA2.1's token editing: inside the current block, a filled token is "
                                                 "replaced when another token's confidence is above this (default: "
                                                 "the checkpoint's generation_config, else off)", ("llada2_moe",))
    max_post_steps: int | None = knob(None, "token editing: passes after a block's last mask that may still edit it "
                                            "(LLaDA2.1's max_post_steps; default 16)", ("llada2_moe",))
    max_denoising_steps: int | None = knob(None, "decoder passes per canvas at most (default: the checkpoint's "
                                                 "generation_config, else 48)", (UNIFORM_DIFFUSION,))
    entropy_bound: float | None = knob(None, "each pass keeps the sampled tokens of the lowest-entropy positions "
                                             "whose lower entropies sum to at most this, renoises the rest "
                                             "(default 0.1)", (UNIFORM_DIFFUSION,))
    t_max: float | None = knob(None, "temperature of a canvas's first pass; the schedule falls linearly toward "
                                     "t_min over the steps remaining (default 0.8)", (UNIFORM_DIFFUSION,))
    t_min: float | None = knob(None, "where the temperature schedule ends (default 0.4)", (UNIFORM_DIFFUSION,))
    stability_threshold: int | None = knob(None, "a canvas stops once its argmax equals that of this many passes "
                                                 "before and it is confident (default 1; 0: always stable)", (UNIFORM_DIFFUSION,))
    confidence_threshold: float | None = knob(None, "confident: the canvas's mean entropy (nats) is below this "
                                                    "(default 0.005; 0: never, every canvas runs all its steps)",
                                              (UNIFORM_DIFFUSION,))
    fused_commit: bool = knob(True, "block diffusion: a finished block's keys/values are written by the next "
                                    "block's first pass, not by a pass of their own (one pass fewer per block; "
                                    "exact, or off: the references' commit pass)", (BLOCK_DIFFUSION,))
    early_stop: bool = knob(True, "diffusion: stop a row once an end-of-sequence token has nothing masked "
                                  "before it (an AR row always stops at its end-of-sequence token)")
    token_healing: bool = knob(True, "a text prompt ending mid-token (a trailing newline or space) backs up to the "
                                     "last token boundary; the first token must start with the text given back")
    ignore_eos: bool = knob(False, "always produce max tokens: no stop at end-of-sequence")
    min_tokens: int = knob(0, "no end-of-sequence or stop token among the first N tokens (vLLM's min_tokens)")
    num_draft_tokens: int | None = knob(None, "draft tokens per target pass with a draft loaded (diffusion with draft "
                                              f"self: drafted steps per pass; default {DEFAULT_NUM_DRAFT_TOKENS}; "
                                              "linear_spec: the block size - 1; 0 turns it off)",
                                        (AUTOREGRESSIVE, *DENOISING))
    draft: str | None = knob(None, "self: lossless self-speculation, the exact sampler's tokens in fewer passes "
                                   "(num_draft_tokens steps drafted per pass)", DENOISING, (SELF_DRAFT,), flag=False)
    logit_bias: tuple[tuple[int, float], ...] | None = knob(None, "(token id, bias) pairs added to the logits every "
                                                                  "sample is drawn from (OpenAI's logit_bias: -100 "
                                                                  "to 100)", server_default=False, http=False,
                                                            flag=False)
    structured: StructuredSpec | None = knob(None, "the output must match this JSON schema, regex, choice or grammar "
                                                   "(kstep/structured; over HTTP response_format / structured_outputs)",
                                             server_default=False, http=False, flag=False)
    time_budget: float | None = knob(None, "seconds the completion may take: the passes are chosen to fit, from "
                                           "this device's measured pass costs (diffusion: fewer passes; AR: fewer "
                                           "tokens)", server_default=False)
    # Filled by `resolve` (never by a user): a resolved object is what decoders run.
    policy: UnmaskPolicy | None = field(default=None, metadata={"resolved": True})
    is_resolved: bool = field(default=False, metadata={"resolved": True})

    def __post_init__(self):
        check_int("max_tokens", self.max_tokens, 1)
        check_int("min_tokens", self.min_tokens, 0, self.max_tokens, f"[0, max_tokens={self.max_tokens}]")
        check_number("temperature", self.temperature, 0)
        check_int("top_k", self.top_k, 1)
        check_number("top_p", self.top_p, 0, 1, exclusive_low=True)
        check_int("seed", self.seed, 0, MAX_SEED, f"an integer in [0, {MAX_SEED}]")
        check_int("steps", self.steps, 1)
        check_int("block_length", self.block_length, 1)
        check_int("sub_block_length", self.sub_block_length, 1)
        check_number("cfg_scale", self.cfg_scale, 0)
        check_number("threshold", self.threshold, 0, 1, exclusive_low=True)
        check_number("factor", self.factor, 0, exclusive_low=True)
        check_number("alg_temp", self.alg_temp, 0)
        check_number("eps", self.eps, 0, 1, exclusive_low=True)
        check_int("num_draft_tokens", self.num_draft_tokens, 0, 64, "[0, 64]")
        check_number("time_budget", self.time_budget, 0, exclusive_low=True)
        check_number("editing_threshold", self.editing_threshold, 0, 1, exclusive_low=True)
        check_int("max_post_steps", self.max_post_steps, 0)
        check_int("max_denoising_steps", self.max_denoising_steps, 1)
        check_int("stability_threshold", self.stability_threshold, 0)
        check_number("entropy_bound", self.entropy_bound, 0, exclusive_low=True)
        for name in ("t_max", "t_min", "confidence_threshold"):
            check_number(name, getattr(self, name), 0)
        for name in ("exact", "early_stop", "ignore_eos", "token_healing", "fused_commit"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name, allowed, what in (("remasking", REMASKING_RULES, "a known unmask rule"),
                                    ("cache", CACHE_MODES, "a cache mode"), ("mode", MODES, "a decoding mode")):
            if (value := getattr(self, name)) is not None and value not in allowed:
                raise ValueError(f"{name} {value!r} is not {what} (choose from {', '.join(allowed)})")
        if self.draft is not None and self.draft != SELF_DRAFT:  # a draft model is the model's, chosen at load
            raise ValueError(f"draft {self.draft!r}: a request's draft can only be '{SELF_DRAFT}' (a diffusion "
                             "model drafting for itself); an AR model's draft model or 'ngram' is chosen when it "
                             "is loaded (kstep.load(..., draft=...), --draft)")
        if (self.threshold is not None or self.factor is not None) and self.remasking == "entropy":
            raise ValueError("threshold and factor compare confidences with probabilities; remasking 'entropy' "
                             "scores negative entropy: use low_confidence, margin or random")
        if self.threshold is not None and self.factor is not None:
            raise ValueError("threshold and factor are two unmask policies: give one, not both")
        if self.logit_bias is not None:
            pairs = self.logit_bias if isinstance(self.logit_bias, tuple) else ()
            if len(pairs) != len(self.logit_bias) or not all(
                    isinstance(p, tuple) and len(p) == 2 for p in pairs) or len({i for i, _ in pairs}) != len(pairs):
                raise ValueError("logit_bias must be distinct (token id, bias) pairs")
            for token_id, bias in pairs:
                check_int("logit_bias token id", token_id, 0)
                check_number(f"logit_bias[{token_id}]", bias, -100, 100)
        if self.structured is not None:
            if not isinstance(self.structured, StructuredSpec):
                raise ValueError(f"structured must be a StructuredSpec, got {type(self.structured).__name__}")
            if self.ignore_eos:
                raise ValueError(f"ignore_eos: a structured output ({self.structured.field}) ends where its grammar "
                                 "does, with an end-of-sequence token")
        if self.exact and (self.threshold is not None or self.factor is not None):
            raise ValueError(f"{'threshold' if self.threshold is not None else 'factor'}: exact is the reference "
                             "sampler's fixed schedule, which takes no threshold or factor")

    def _not_applying(self, name: str, family: str, kind: str) -> str:
        """Why knob `name` is refused for `family` (of `kind`): what it is for, in words that match the
        request (a tri-mode model's kind is its mode's)."""
        where = f"a {family} model ({kind})" if family not in TRI_MODE else \
            f"mode {self.mode!r} of a {family} model ({kind} decoding)"
        users = GenerationParams.__dataclass_fields__[name].metadata["families"]
        return f"{name} does not apply to {where}; it is for {' / '.join(users)} decoding"

    @property
    def num_blocks(self) -> int:
        return self.max_tokens // self.block_length

    def resolve(self, family: str, kind: str, has_draft: bool = False, canvas_length: int | None = None,
                whole_canvas_reference: bool = False) -> "GenerationParams":
        """The params a decoder of `family` (of `kind`) runs: knobs it does not use are refused, the
        defaults filled in, the unmask policy chosen, the passes bounded (MAX_PASSES_PER_POSITION;
        `canvas_length`: a random-start model's canvas; `whole_canvas_reference`: the family's exact
        sampler runs the canvas as one block, registry.Family). Called once, at the edge."""
        if self.is_resolved:
            return self
        for f in user_knobs():
            if not knob_applies(f.name, family, kind) and getattr(self, f.name) != f.default:
                raise ValueError(self._not_applying(f.name, family, kind))
        if self.draft and family in TRI_MODE:
            raise ValueError(f"draft 'self': a {family} model drafts for itself in mode '{SELF_SPECULATION}'")
        if family in TRI_MODE and kind != AUTOREGRESSIVE and self.num_draft_tokens:
            raise ValueError(f"num_draft_tokens: mode {self.mode!r} of a {family} model takes no drafts; it drafts "
                             f"for itself in mode '{SELF_SPECULATION}' (num_draft_tokens there)")
        if kind == AUTOREGRESSIVE:
            draft_tokens = self.num_draft_tokens
            if draft_tokens is None:
                draft_tokens = DEFAULT_NUM_DRAFT_TOKENS if has_draft else 0
            if draft_tokens > 0 and not has_draft:
                raise ValueError("num_draft_tokens > 0 needs a draft model (kstep.load(..., draft=...), --draft)")
            return replace(self, num_draft_tokens=draft_tokens, is_resolved=True)
        if kind == BLOCK_DIFFUSION:
            return resolve_block_diffusion(self)
        if kind == UNIFORM_DIFFUSION:
            filled = replace(self, **{k: v for k, v in UNIFORM_DEFAULTS.items() if getattr(self, k) is None})
            if filled.t_max <= filled.t_min:
                raise ValueError(f"t_max ({filled.t_max}) must be greater than t_min ({filled.t_min})")
            if canvas_length is not None:
                check_pass_bound("max_denoising_steps", filled.max_denoising_steps, canvas_length,
                                 f"a canvas of {canvas_length}", UNIFORM_DEFAULTS["max_denoising_steps"])
            # Its canvases start from random tokens: temperature 0 (top-1 sampling) repeats only with a
            # fixed seed, so it gets one (0) unless the request chose its own.
            seed = 0 if filled.seed is None and filled.temperature == 0 else filled.seed
            return replace(filled, seed=seed, is_resolved=True)
        return resolve_diffusion(self, whole_canvas_reference)


def user_knobs() -> list:
    """The declared knobs (dataclass fields), in order, without the fields `resolve` fills."""
    return [f for f in fields(GenerationParams) if not f.metadata.get("resolved")]


def knob_applies(name: str, family: str, kind: str) -> bool:
    """Whether a family (of a kind) uses the knob `name`."""
    applies = GenerationParams.__dataclass_fields__[name].metadata.get("families")
    return not applies or family in applies or kind in applies
