"""What the engine needs of the model it serves (kstep/llm.py's LLM is one): its runner, tokenizer,
ids and decoders. A protocol, so the engine sits below the LLM, whose `generate` runs on it."""
from typing import Any, Protocol

from kstep.decoding.base import Decoder
from kstep.params import GenerationParams
from kstep.runner.model_runner import ModelRunner
from kstep.tokenizer import Tokenizer


class ServedModel(Protocol):
    runner: ModelRunner
    tokenizer: Tokenizer | None
    cfg: Any                       # the model's config (cfg.mask_token_id, cfg.block_size, cfg.family)
    stop_ids: list[int]
    pad_id: int
    pass_costs: Any                # budget.planner.PassCosts: the time-budget planner's table

    @property
    def kind(self) -> str: ...

    @property
    def drafter(self) -> "ModelRunner | str | None": ...

    def resolve(self, params: GenerationParams) -> GenerationParams: ...

    def make_decoder(self, rows: list[list[int]], params: GenerationParams, prefix_cache=None,
                     include_canvas: bool = False, first_tokens: list[list[int]] | None = None,
                     suffixes: list[list[int]] | None = None, grammar=None) -> Decoder: ...

    def generate(self, prompts, params: GenerationParams | None = None, suffix=None, **overrides) -> list: ...
