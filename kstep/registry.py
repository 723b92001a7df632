"""The model families kstep runs: for each, its checkpoint layout (config keys, tensor names), its
attention mode, its kind of decoding and its decoder. A new family is one entry here, plus a layout
file in models/ and a decoder in decoding/ (or a reused one).

    family   layout (models/)   attention       kind            decoder (decoding/)
    llada    llada.py           bidirectional   diffusion       masked_diffusion.DiffusionDecoder
    dream    dream.py           bidirectional   diffusion       dream.DreamDecoder
             (llada, llada_moe, dream with draft "self": self_speculation.SelfSpeculativeDecoder around it;
              the block families: block_self_speculation.BlockSelfSpeculativeDecoder)
    fast_dllm_v2  fast_dllm_v2.py  block_causal  block-diffusion  block_diffusion.BlockDiffusionDecoder (shifted)
    sdar     sdar.py            block_causal    block-diffusion block_diffusion.BlockDiffusionDecoder
    llada2_moe  llada2_moe.py   block_causal    block-diffusion block_diffusion.BlockDiffusionDecoder (+ token editing)
    llada_moe   llada_moe.py    bidirectional   diffusion       masked_diffusion.DiffusionDecoder
    llama    llama.py           causal          autoregressive  autoregressive (speculative with a draft)
    qwen2    llama.py           causal          autoregressive  autoregressive (speculative with a draft)
    diffusion_gemma  diffusion_gemma.py  two_mode  uniform-diffusion  uniform_diffusion.UniformDiffusionDecoder
                     (its own network: diffusion_gemma_model.py)
    nemotron_labs_diffusion  nemotron_labs_diffusion.py  causal (its diffusion passes: bidirectional masks)
             per request (`mode`): diffusion  block-diffusion  causal_context.CausalContextDecoder
                                   ar         autoregressive   autoregressive
                                   linear_spec  autoregressive speculative, drafting for itself (drafters.SelfDrafter)
"""
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from kstep.decoding.autoregressive import AutoregressiveDecoder
from kstep.decoding.base import DecodeBatch, Decoder
from kstep.decoding.block_cache import BlockCacheDecoder
from kstep.decoding.block_diffusion import BlockDiffusionDecoder, BlockRules
from kstep.decoding.block_self_speculation import BlockSelfSpeculativeDecoder
from kstep.decoding.causal_context import CausalContextDecoder
from kstep.decoding.drafters import SELF
from kstep.decoding.dream import DreamDecoder
from kstep.decoding.masked_diffusion import DiffusionDecoder
from kstep.decoding.self_speculation import SelfSpeculativeDecoder
from kstep.decoding.speculative import SpeculativeDecoder
from kstep.decoding.uniform_diffusion import UniformDiffusionDecoder
from kstep.models import (diffusion_gemma, dream, fast_dllm_v2, llada, llada2_moe, llada_moe, llama,
                          nemotron_labs_diffusion, sdar)
from kstep.models.diffusion_gemma_model import DiffusionGemma
from kstep.models.config import ModelConfig
from kstep.params import (AUTOREGRESSIVE, BLOCK_DIFFUSION, DIFFUSION, MODES, SELF_DRAFT, SELF_SPECULATION,
                          UNIFORM_DIFFUSION, GenerationParams, knob_applies)
from kstep.runner.model_runner import ModelRunner
from kstep.runner.prefix_cache import PrefixCache


@dataclass(slots=True, frozen=True)
class DecoderResources:
    """What a decoder may share with other requests: the AR prefix cache, a speculative drafter
    (a draft model's runner, or "ngram")."""
    prefix_cache: PrefixCache | None = None
    draft: "ModelRunner | str | None" = None


DecoderFactory = Callable[[ModelRunner, DecodeBatch, GenerationParams, DecoderResources], Decoder]


def autoregressive_decoder(runner: ModelRunner, batch: DecodeBatch, params: GenerationParams,
                           resources: DecoderResources) -> Decoder:
    """Plain AR decoding, or speculative decoding when the params ask for draft tokens."""
    if params.num_draft_tokens:
        return SpeculativeDecoder(runner, batch, params, resources.draft)
    return AutoregressiveDecoder(runner, batch, params, resources.prefix_cache)


@dataclass(slots=True, frozen=True)
class Family:
    name: str
    layout: ModuleType               # parse_config(raw, family, attention), checkpoint_names(cfg), to_raw_config(cfg)
    attention: str                   # "causal" | "bidirectional" | "block_causal"
    kind: str                        # AUTOREGRESSIVE | DIFFUSION | BLOCK_DIFFUSION: which generation knobs apply
    decoder: DecoderFactory
    architectures: tuple[str, ...]   # config.json `architectures` that select it
    model_types: tuple[str, ...]     # config.json `model_type` that selects it
    sub_block_length: int | None = None  # block diffusion: unmask inside sub-blocks of this size (Fast-dLLM v2)
    threshold: float | None = None   # the reference sampler's confidence threshold, with steps too (LLaDA2: 0.95)
    config_test: Callable[[dict], bool] | None = None  # whether a config.json of a shared model_type is this family's
    network: type | None = None      # its own nn.Module (None: models/transformer.py's Transformer)
    modes: dict[str, str] | None = None  # a tri-mode model: each `mode` and its kind (the first: `kind`'s)

    def parse_config(self, raw: dict) -> ModelConfig:
        return self.layout.parse_config(raw, self.name, self.attention)

    def kind_for(self, params: GenerationParams) -> str:
        """The kind of decoding a request runs: the family's, or (a tri-mode model) its mode's."""
        return self.modes[params.mode or next(iter(self.modes))] if self.modes else self.kind

    def knob_defaults(self, cfg: ModelConfig, params: GenerationParams) -> dict:
        """Generation knobs this family fills in for a request: a tri-mode model's mode (its first)
        and LinearSpec's drafts (a block: the block size - 1), a block model's block size (its
        checkpoint's), Fast-dLLM v2's sub-block of 8 where it divides the block (else the whole block)."""
        defaults = {"mode": params.mode or next(iter(self.modes))} if self.modes else {}
        if defaults.get("mode") == SELF_SPECULATION:
            defaults["num_draft_tokens"] = cfg.block_size - 1
        if self.kind_for(params) != BLOCK_DIFFUSION:
            return defaults
        block = params.block_length or cfg.block_size
        defaults["block_length"] = block
        if self.sub_block_length and block % self.sub_block_length == 0:
            defaults["sub_block_length"] = self.sub_block_length
        if self.threshold is not None and not (params.exact or params.draft):
            defaults["threshold"] = self.threshold
        return defaults

    def defaults_for_mode(self, defaults: dict, mode: str | None) -> dict:
        """Per-model defaults (`kstep serve`'s flags) that a request of `mode` takes: a tri-mode model's
        knobs for another mode's kind (a `--threshold` under `mode` ar) are left out, not refused."""
        if not self.modes:
            return defaults
        kind = self.modes.get(mode or next(iter(self.modes)), self.kind)  # a bad mode: refused by its params
        return {k: v for k, v in defaults.items() if knob_applies(k, self.name, kind)}

    def generation_defaults(self, raw: dict) -> dict:
        """Knob values a checkpoint's generation_config.json (`raw`) gives for knobs kstep leaves unset
        by default, as vLLM takes a checkpoint's sampling defaults: Dream's `eps`, `alg_temp`; a block
        model's `threshold` and `small_block_size` (Fast-dLLM v2's name for `sub_block_length`). The
        family's own (a block model's block size) come from knob_defaults. Its other keys (e.g.
        Dream's `steps: 512`, `alg: origin`) are not taken: kstep's defaults decide those."""
        if hasattr(self.layout, "generation_defaults"):  # knobs under the checkpoint's own names
            return self.layout.generation_defaults(raw)
        names = {"eps": "eps", "alg_temp": "alg_temp", "threshold": "threshold", "small_block_size": "sub_block_length",
                 "editing_threshold": "editing_threshold", "max_post_steps": "max_post_steps"}
        return {knob: raw[key] for key, knob in names.items() if raw.get(key) is not None
                and knob_applies(knob, self.name, self.kind)}

    def matches_model_type(self, raw: dict) -> bool:
        """config.json's `model_type` is this family's (and, where a model_type is shared, its fields
        say so: LLaDA-MoE's is "llada" too, told apart by its experts)."""
        return raw.get("model_type") in self.model_types and (self.config_test is None or self.config_test(raw))


def _diffusion(cls) -> DecoderFactory:
    def make(runner, batch, params, resources):
        decoder = cls(runner, batch, params)
        return SelfSpeculativeDecoder(decoder, params.num_draft_tokens) if params.draft == SELF_DRAFT else decoder
    return make


def _block(rules: BlockRules) -> DecoderFactory:
    def make(runner, batch, params, resources):
        cls = BlockCacheDecoder if params.cache == "dual" else BlockDiffusionDecoder  # Fast-dLLM v2's block cache
        decoder = cls(runner, batch, params, rules, resources.prefix_cache)
        return BlockSelfSpeculativeDecoder(decoder, params.num_draft_tokens) if params.draft == SELF_DRAFT else decoder
    return make


def tri_mode_decoder(runner: ModelRunner, batch: DecodeBatch, params: GenerationParams,
                     resources: DecoderResources) -> Decoder:
    """Nemotron-Labs-Diffusion's decodings (its remote code's three): `diffusion` its `generate`
    (blocks against a causal context), `ar` its `ar_generate`, `linear_spec` its
    `linear_spec_generate` (speculative decoding, the model drafting for itself)."""
    if params.mode == "diffusion":
        return CausalContextDecoder(runner, batch, params, resources.prefix_cache)
    if params.num_draft_tokens:  # linear_spec (a diffusion family takes no draft model)
        return SpeculativeDecoder(runner, batch, params, SELF)
    return autoregressive_decoder(runner, batch, params, resources)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llada", llada, "bidirectional", DIFFUSION, _diffusion(DiffusionDecoder), ("LLaDAModelLM",), ("llada",),
           config_test=lambda raw: not raw.get("num_experts")),
    Family("llada_moe", llada_moe, "bidirectional", DIFFUSION, _diffusion(DiffusionDecoder), ("LLaDAMoEModelLM",),
           ("llada",), config_test=lambda raw: bool(raw.get("num_experts"))),
    Family("dream", dream, "bidirectional", DIFFUSION, _diffusion(DreamDecoder), ("DreamModel",), ("Dream",)),
    Family("fast_dllm_v2", fast_dllm_v2, "block_causal", BLOCK_DIFFUSION,
           _block(BlockRules(is_shifted=True)), ("Fast_dLLM_QwenForCausalLM",), ("Fast_dLLM_Qwen",),
           sub_block_length=8),
    Family("sdar", sdar, "block_causal", BLOCK_DIFFUSION, _block(BlockRules(is_shifted=False)),
           ("SDARForCausalLM",), ("sdar",)),
    Family("llada2_moe", llada2_moe, "block_causal", BLOCK_DIFFUSION, _block(BlockRules(is_shifted=False, steps_capped=True)),
           ("LLaDA2MoeModelLM",), ("llada2_moe",), threshold=0.95),
    Family("llama", llama, "causal", AUTOREGRESSIVE, autoregressive_decoder, ("LlamaForCausalLM",), ("llama",)),
    Family("qwen2", llama, "causal", AUTOREGRESSIVE, autoregressive_decoder, ("Qwen2ForCausalLM",), ("qwen2",)),
    Family("diffusion_gemma", diffusion_gemma, "two_mode", UNIFORM_DIFFUSION, _diffusion(UniformDiffusionDecoder),
           ("DiffusionGemmaForBlockDiffusion",), ("diffusion_gemma",), network=DiffusionGemma),
    Family("nemotron_labs_diffusion", nemotron_labs_diffusion, "causal", BLOCK_DIFFUSION, tri_mode_decoder,
           (nemotron_labs_diffusion.ARCHITECTURE,), (nemotron_labs_diffusion.MODEL_TYPE,),
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


__all__ = ["AUTOREGRESSIVE", "BLOCK_DIFFUSION", "DIFFUSION", "UNIFORM_DIFFUSION", "FAMILIES", "DecoderResources", "Family", "family_for"]
