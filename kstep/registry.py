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
"""
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from kstep.decoding.autoregressive import AutoregressiveDecoder
from kstep.decoding.base import DecodeBatch, Decoder
from kstep.decoding.block_cache import BlockCacheDecoder
from kstep.decoding.block_diffusion import BlockDiffusionDecoder, BlockRules
from kstep.decoding.block_self_speculation import BlockSelfSpeculativeDecoder
from kstep.decoding.dream import DreamDecoder
from kstep.decoding.masked_diffusion import DiffusionDecoder
from kstep.decoding.self_speculation import SelfSpeculativeDecoder
from kstep.decoding.speculative import SpeculativeDecoder
from kstep.decoding.uniform_diffusion import UniformDiffusionDecoder
from kstep.models import diffusion_gemma, dream, fast_dllm_v2, llada, llada2_moe, llada_moe, llama, sdar
from kstep.models.diffusion_gemma_model import DiffusionGemma
from kstep.models.config import ModelConfig
from kstep.params import AUTOREGRESSIVE, BLOCK_DIFFUSION, DIFFUSION, SELF_DRAFT, UNIFORM_DIFFUSION, GenerationParams
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

    def parse_config(self, raw: dict) -> ModelConfig:
        return self.layout.parse_config(raw, self.name, self.attention)

    def knob_defaults(self, cfg: ModelConfig, params: GenerationParams) -> dict:
        """Generation knobs this family fills in for a request: a block model's block size (its
        checkpoint's), Fast-dLLM v2's sub-block of 8 where it divides the block (else the whole block)."""
        if self.kind != BLOCK_DIFFUSION:
            return {}
        block = params.block_length or cfg.block_size
        defaults = {"block_length": block}
        if self.sub_block_length and block % self.sub_block_length == 0:
            defaults["sub_block_length"] = self.sub_block_length
        if self.threshold is not None and not (params.exact or params.draft):
            defaults["threshold"] = self.threshold
        return defaults

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
