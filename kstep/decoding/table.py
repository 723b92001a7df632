"""The decoder table: which decoder class serves a request, from its family's decoder key
(registry.py) and its resolved settings (draft, cache, drafts per pass, mode). The only place a
decoder is chosen; docs/decoding.md prints `markdown()` (tests/test_docs.py checks it is current).

Each row holds when all its conditions do; a key's rows are tried in order, the last with none.
Settings that change a decoder's rule but not its class are the params' (`exact`: the fixed
schedule; a threshold or factor: the unmask policy; LLaDA2.1's `editing_threshold`: token editing
inside the block decoder, token_editing.py) and show in the per-family table below it.
"""
from collections.abc import Callable
from dataclasses import dataclass, replace

from kstep.decoding.autoregressive import AutoregressiveDecoder
from kstep.decoding.base import DecodeBatch, Decoder, DecoderResources
from kstep.decoding.block_cache import BlockCacheDecoder
from kstep.decoding.block_diffusion import BlockDiffusionDecoder
from kstep.decoding.block_self_speculation import BlockSelfSpeculativeDecoder
from kstep.decoding.causal_context import CausalContextDecoder
from kstep.decoding.dream import DreamDecoder
from kstep.decoding.masked_diffusion import DiffusionDecoder
from kstep.decoding.self_speculation import SelfSpeculativeDecoder
from kstep.decoding.speculative import SpeculativeDecoder
from kstep.decoding.uniform_diffusion import UniformDiffusionDecoder
from kstep.params import SELF_DRAFT, SELF_SPECULATION, GenerationParams
from kstep.params.family_defaults import knob_defaults
from kstep.registry import FAMILIES, Family
from kstep.runner.model_runner import ModelRunner


@dataclass(frozen=True, slots=True)
class Condition:
    """One test on resolved params, with the words the table prints for it."""
    text: str
    holds: Callable[[GenerationParams], bool]


DRAFT_SELF = Condition("draft self", lambda p: p.draft == SELF_DRAFT)
DUAL_CACHE = Condition("cache dual", lambda p: p.cache == "dual")
DRAFT_TOKENS = Condition("num_draft_tokens > 0", lambda p: bool(p.num_draft_tokens))
DIFFUSION_MODE = Condition("mode diffusion", lambda p: p.mode == "diffusion")


@dataclass(frozen=True, slots=True)
class Row:
    key: str                          # a family's decoder key (Family.decoder)
    when: tuple[Condition, ...]       # all hold; () = otherwise
    decoder: type[Decoder]            # built as decoder(runner, batch, params, resources)
    wrapper: type[Decoder] | None = None  # then wrapper(decoder, params.num_draft_tokens): self-speculation

    @property
    def name(self) -> str:
        return self.decoder.__name__ if self.wrapper is None else f"{self.wrapper.__name__}({self.decoder.__name__})"


TABLE: tuple[Row, ...] = (
    Row("autoregressive", (DRAFT_TOKENS,), SpeculativeDecoder),
    Row("autoregressive", (), AutoregressiveDecoder),
    Row("masked_diffusion", (DRAFT_SELF,), DiffusionDecoder, SelfSpeculativeDecoder),
    Row("masked_diffusion", (), DiffusionDecoder),
    Row("dream", (DRAFT_SELF,), DreamDecoder, SelfSpeculativeDecoder),
    Row("dream", (), DreamDecoder),
    Row("block_diffusion", (DUAL_CACHE,), BlockCacheDecoder),  # Fast-dLLM v2's block cache
    Row("block_diffusion", (DRAFT_SELF,), BlockDiffusionDecoder, BlockSelfSpeculativeDecoder),
    Row("block_diffusion", (), BlockDiffusionDecoder),
    Row("uniform_diffusion", (), UniformDiffusionDecoder),
    Row("tri_mode", (DIFFUSION_MODE,), CausalContextDecoder),  # Nemotron's `generate`
    Row("tri_mode", (DRAFT_TOKENS,), SpeculativeDecoder),      # `linear_spec_generate`: it drafts for itself
    Row("tri_mode", (), AutoregressiveDecoder),                # `ar_generate`
)


def choose(family: Family, params: GenerationParams) -> Row:
    """The row that serves `family` under resolved `params`."""
    for row in TABLE:
        if row.key == family.decoder and all(c.holds(params) for c in row.when):
            return row
    raise RuntimeError(f"internal: no decoder for {family.name} (decoder key {family.decoder!r})")


def make_decoder(family: Family, runner: ModelRunner, batch: DecodeBatch, params: GenerationParams,
                 resources: DecoderResources) -> Decoder:
    """The decoder of `family` for `batch` under resolved `params`."""
    row = choose(family, params)
    decoder = row.decoder(runner, batch, params, replace(resources, rules=family.block_rules))
    return decoder if row.wrapper is None else row.wrapper(decoder, params.num_draft_tokens)


def grammar_refusal(family: Family, params: GenerationParams) -> str | None:
    """Why a structured output cannot run with `family` under resolved `params` (the decoder that
    would serve it does not keep a grammar yet: `Decoder.keeps_grammar`), or None when it can."""
    row = choose(family, params)
    if row.wrapper is not None:
        return f"with draft 'self' ({row.name}) yet"
    if not row.decoder.keeps_grammar:
        return f"by {row.name} ({family.name}{f', mode {params.mode}' if params.mode else ''}) yet"
    return None


# --- The table as docs/decoding.md prints it ------------------------------------------------------

# Request settings shown per family: (column, knobs). A cell is the decoder, or why the knobs are refused.
SETTINGS = (("default", {}), ("exact", {"exact": True}), ("cache prefix", {"cache": "prefix"}),
            ("cache dual", {"cache": "dual"}), ("draft self", {"draft": "self"}),
            ("draft self, cache dual", {"draft": "self", "cache": "dual"}),
            ("mode ar", {"mode": "ar"}), ("mode linear_spec", {"mode": "linear_spec"}))
BLOCK_SIZE = 32  # a block model's checkpoint block, as the table's requests take it


def _cell(family: Family, knobs: dict) -> str:
    """The decoder a request with `knobs` gets (no checkpoint defaults), or the knob that refuses it."""
    params = GenerationParams(max_tokens=64, **knobs)
    try:
        params = replace(params, **{k: v for k, v in knob_defaults(family, BLOCK_SIZE, params).items()
                                    if getattr(params, k) is None})
        resolved = params.resolve(family.name, family.kind_for(params.mode), params.mode == SELF_SPECULATION,
                                  whole_canvas_reference=family.whole_canvas_reference)
    except ValueError as e:
        return f"refused ({str(e).split()[0]})"  # every refusal names its knob first
    return f"`{choose(family, resolved).name}`" + _rule(resolved)


def _rule(params: GenerationParams) -> str:
    """A denoising request's unmask policy and cache, as a cell's note."""
    if params.policy is None:
        return ""
    policy = params.policy.kind + (f" {params.policy.value:g}" if params.policy.kind == "threshold" else "")
    return f" ({policy}" + ("" if params.cache in (None, "none") else f", cache {params.cache}") + ")"


def markdown() -> str:
    """The decoder rows, then per family the decoder each setting gets (docs/decoding.md)."""
    lines = ["| decoder key | when | decoder | keeps a structured output's grammar |", "|---|---|---|---|"]
    lines += [f"| {row.key} | {', '.join(c.text for c in row.when) or 'otherwise'} | `{row.name}` | "
              f"{'yes' if row.decoder.keeps_grammar and row.wrapper is None else 'not yet (refused)'} |"
              for row in TABLE]
    lines += ["", "| family (key) | " + " | ".join(name for name, _ in SETTINGS) + " |",
              "|---" * (len(SETTINGS) + 1) + "|"]
    for family in FAMILIES.values():
        lines.append(f"| {family.name} ({family.decoder}) | " + " | ".join(_cell(family, knobs) for _, knobs in SETTINGS)
                     + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m kstep.decoding.table: the table docs/decoding.md holds
    print(markdown())
