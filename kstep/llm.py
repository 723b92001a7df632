"""The model handle behind `kstep.load`: prompts in, `GenerationResult`s out.

Owns the loaded model (its runner, tokenizer, family, special ids, an optional draft), prompt
validation, params resolution for its family, and the offline loop: one decoder stepped alone.
Which decoder runs is the family's (kstep/registry.py); the serving engine steps the same
decoders with other requests' (kstep/engine)."""
import time
import weakref
from dataclasses import replace
from pathlib import Path

import torch

from kstep.budget.planner import PassCosts, Plan, plan
from kstep.bundled import resolve_model
from kstep.decoding.drafters import NGRAM, check_draft
from kstep.engine.offline import run_alone
from kstep.engine.request import Request
from kstep.outputs import GenerationResult
from kstep.params import AUTOREGRESSIVE, DIFFUSION, SELF_SPECULATION, GenerationParams, knob_applies
from kstep.decoding.base import DecodeBatch, Decoder, DecoderResources
from kstep.decoding.table import grammar_refusal, make_decoder
from kstep.params.context import check_context
from kstep.params.family_defaults import checkpoint_defaults, knob_defaults
from kstep.registry import FAMILIES
from kstep.runner.kv_pool import make_kv_pools
from kstep.runner.prefix_cache import PrefixCache
from kstep.loading import load_runner
from kstep.runner.model_runner import ModelRunner
from kstep.structured.grammar import Grammar
from kstep.structured.model_grammar import ModelGrammar
from kstep.tokenizer import Tokenizer, load_tokenizer
from kstep.weights import read_json, resolve_dtype

Prompt = str | list[int]


class LLM:
    def __init__(self, path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
                 draft: "str | Path | LLM | None" = None, quantize: str | None = None, tensor_parallel_size: int = 1,
                 distributed_executor_backend: str = "mp", kv_cache_memory: int | str | None = None,
                 memory_utilization: float | None = None, kv_pool: bool = True):
        self.path = resolve_model(path)
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was requested but no CUDA device is available")
        self.quantize, self.tensor_parallel_size = quantize, tensor_parallel_size
        self.runner = load_runner(self.path, self.device, resolve_dtype(dtype), quantize, tensor_parallel_size,
                                  backend=distributed_executor_backend)
        self.model = self.runner.model  # a tensor-parallel model: rank 0's share
        self.close = weakref.finalize(self, self.runner.close)  # its ranks stop with it
        self.cfg = self.model.cfg
        self.family = FAMILIES[self.cfg.family]
        self.tokenizer: Tokenizer | None = load_tokenizer(self.path)
        experts = None if self.cfg.moe is None else self.cfg.moe.expected_experts
        self.pass_costs = PassCosts(experts=experts)  # this device's measured pass costs, for time budgets (budget/planner.py)
        eot = self.tokenizer.end_of_turn_ids() if self.tokenizer else []
        self.stop_ids = list(dict.fromkeys([*self.cfg.eos_token_ids, *eot]))
        self.pad_id = next(i for i in (self.cfg.pad_token_id, *self.stop_ids, 0) if i is not None
                           and i != self.cfg.mask_token_id)
        self.checkpoint_defaults = self._checkpoint_defaults()
        # draft: None, "ngram" (lookup in the text itself, no model), or an AR model over the same vocabulary.
        self.draft: LLM | str | None = draft if draft in (None, NGRAM) or isinstance(draft, LLM) else \
            LLM(draft, device, dtype, quantize=quantize, kv_pool=False)  # its pool: a share of this one's budget
        if self.draft == NGRAM and self.is_diffusion:
            raise ValueError(f"speculative decoding (draft {NGRAM!r}) needs an autoregressive model, "
                             f"not {self.path.name} ({self.cfg.family})")
        if isinstance(self.draft, LLM):
            check_draft(self, self.draft)
        if kv_pool:  # a draft model it loaded shares its budget
            make_kv_pools([self.runner, getattr(self.draft, "runner", None)], self.device, kv_cache_memory,
                          memory_utilization)
        self.grammar = ModelGrammar(self.path / "tokenizer.json" if self.tokenizer else None, self.cfg.vocab_size,
                                    self.stop_ids, self.cfg.mask_token_id)  # structured outputs (kstep/structured)

    def _checkpoint_defaults(self) -> dict:
        """Knob values the checkpoint's generation_config.json gives (params/family_defaults.py)."""
        path = self.path / "generation_config.json"
        return checkpoint_defaults(self.family, read_json(path) if path.is_file() else {})

    @property
    def is_diffusion(self) -> bool:
        """Decodes by unmasking (masked or block diffusion), not token by token."""
        return self.family.kind != AUTOREGRESSIVE

    @property
    def kind(self) -> str:
        return self.family.kind

    @property
    def drafter(self) -> ModelRunner | str | None:
        """What speculative decoding drafts with: the draft model's runner, "ngram", or None."""
        return self.draft.runner if isinstance(self.draft, LLM) else self.draft

    def resolve(self, params: GenerationParams) -> GenerationParams:
        """`params` resolved for this model's family (raises ValueError naming a bad knob)."""
        checkpoint = dict(self.checkpoint_defaults)
        if params.exact or params.draft or params.steps is not None or params.factor is not None:
            for knob in ("threshold", "editing_threshold", "max_post_steps"):
                checkpoint.pop(knob, None)  # the request chose another unmask policy
        block = params.block_length or self.cfg.block_size
        if block and block % checkpoint.get("sub_block_length", block):
            checkpoint.pop("sub_block_length")  # the request's block is not made of the checkpoint's sub-blocks
        kind = self.family.kind_for(params.mode)  # a tri-mode model: its request's mode's
        checkpoint = {k: v for k, v in checkpoint.items() if knob_applies(k, self.cfg.family, kind)}
        defaults = {**knob_defaults(self.family, self.cfg.block_size, params), **checkpoint}
        unset = {k: v for k, v in defaults.items() if getattr(params, k) is None}
        if unset and not params.is_resolved:
            params = replace(params, **unset)
        has_draft = self.draft is not None or params.mode == SELF_SPECULATION  # LinearSpec: drafts for itself
        resolved = params.resolve(self.cfg.family, kind, has_draft, self.cfg.canvas_length,
                                  self.family.whole_canvas_reference)
        self.check_output_rules(resolved)
        return resolved

    def check_output_rules(self, params: GenerationParams) -> None:
        """What the params ask of the output, for this model (a ValueError naming the field): logit_bias's ids
        in its vocabulary; a structured output its decoder keeps, that compiles and whose completion fits."""
        if params.logit_bias and (bad := [i for i, _ in params.logit_bias if i >= self.cfg.vocab_size]):
            raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        if params.structured is not None and (refusal := grammar_refusal(self.family, params)) is not None:
            raise ValueError(f"{params.structured.field}: a structured output is not kept {refusal}")
        if params.structured is not None:
            self.grammar.check(params.structured, params.max_tokens)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of one prompt, checked against the vocabulary and the mask id."""
        ids = self._encode(prompt, "prompt", special_tokens=True)
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        return ids

    def encode_suffix(self, suffix: Prompt) -> list[int]:
        """Token ids of an infilling suffix (no special tokens: it continues the text), checked as a
        prompt's are. Only a model that attends to text after the gap can use one."""
        self.require_infilling()
        return self._encode(suffix, "suffix", special_tokens=False)

    def require_infilling(self) -> None:
        if self.family.attention != "bidirectional":
            raise ValueError(f"suffix: infilling needs a model that attends to text after the gap (a full-attention "
                             f"diffusion model: LLaDA, Dream); {self.path.name} is {self.cfg.family} "
                             f"({self.family.attention.replace('_', '-')} attention), which cannot see it")

    def _encode(self, text_or_ids: Prompt, what: str, special_tokens: bool) -> list[int]:
        if isinstance(text_or_ids, str):
            if self.tokenizer is None:
                raise ValueError(f"checkpoint {self.path} has no tokenizer.json: pass token ids, not text")
            ids = self.tokenizer.encode(text_or_ids, add_special_tokens=special_tokens)
        else:
            ids = [int(i) for i in text_or_ids]
        bad = [i for i in ids if not 0 <= i < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"{what} token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        if (image_id := self.cfg.image_token_id) is not None and image_id in ids:
            raise ValueError(f"{what} contains the image token id {image_id}: {self.cfg.family} runs text only")
        if self.cfg.mask_token_id is not None and self.cfg.mask_token_id in ids:
            raise ValueError(f"{what} contains the mask token id {self.cfg.mask_token_id}, "
                             "which only the sampler may place")
        return ids

    def heal(self, ids: list[int], params: GenerationParams, is_text: bool) -> tuple[list[int], str, list[int]]:
        """Token healing of a text prompt's ids (Tokenizer.heal) when the params ask for it: (ids, the
        text given back, the ids the first token may take); token-id prompts are taken as they are."""
        if not params.token_healing or not is_text or self.tokenizer is None or params.structured is not None:
            return ids, "", []  # a structured output's grammar starts at the completion, not mid-token
        return self.tokenizer.heal(ids)

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation (and the tools it may call) rendered with the checkpoint's chat template."""
        if self.tokenizer is None:
            raise ValueError(f"checkpoint {self.path} has no tokenizer: chat needs one")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        return self.encode_prompt(self.tokenizer.encode(text, add_special_tokens=False))

    def check_fits(self, rows: list[list[int]], params: GenerationParams, suffixes: list[list[int]] | None = None) -> None:
        """Prompts and completion must fit the model's context (params/context.py)."""
        check_context(rows, params, suffixes, self.family.kind_for(params.mode), self.family.kind,
                      self.cfg.max_positions, self.cfg.canvas_length)

    def make_decoder(self, rows: list[list[int]], params: GenerationParams, prefix_cache: PrefixCache | None = None,
                     include_canvas: bool = False, first_tokens: list[list[int]] | None = None,
                     suffixes: list[list[int]] | None = None, grammar: Grammar | None = None) -> Decoder:
        """The decoder of this model's family for encoded prompts `rows` (left-padded into one batch)
        under resolved `params`; stepped alone by `generate`, or with other requests by the engine.
        `first_tokens`: per row, the ids its first token may take (token healing; [] = any).
        `suffixes`: per row, the encoded text after the gap (infilling; full-attention families only).
        `grammar`: params.structured compiled (a server did it, off its event loop), else compiled here (cached)."""
        if not params.is_resolved:
            raise RuntimeError("internal: params reach a decoder resolved (GenerationParams.resolve, at the edge)")
        if suffixes and any(suffixes):
            self.require_infilling()
        self.check_fits(rows, params, suffixes)
        first_allowed = None
        if first_tokens and any(first_tokens):
            first_allowed = torch.ones(len(rows), self.cfg.vocab_size, dtype=torch.bool)
            for row, allowed in ((row, allowed) for row, allowed in enumerate(first_tokens) if allowed):
                first_allowed[row], first_allowed[row, allowed] = False, True
        if grammar is None and params.structured is not None:
            grammar = self.grammar.compile(params.structured)
        constraint = None if grammar is None else self.grammar.constraint(grammar, len(rows), params.max_tokens)
        batch = DecodeBatch.from_prompts(rows, self.pad_id, self.stop_ids, self.cfg.mask_token_id, self.device,
                                         params.seed, include_canvas, first_allowed, suffixes, constraint)
        decoder = make_decoder(self.family, self.runner, batch, params, DecoderResources(prefix_cache, self.drafter))
        decoder.constraint = constraint
        return decoder

    def calibrate_pass_costs(self) -> None:
        """Time the time-budget planner's table once, on the thread that runs torch (budget/costs.py)."""
        if not self.pass_costs.is_calibrated:
            whole = self.runner.whole_pass if self.tensor_parallel_size > 1 else None  # every rank takes part
            self.pass_costs.calibrate(self.model, self.device, self.cfg.max_positions, self.resolve, self.make_decoder,
                                      forward=whole)

    def plan_budget(self, params: GenerationParams, prompt_len: int, suffix_len: int = 0, load: float = 0) -> Plan:
        """The plan that fits params.time_budget here (budget/planner.py); `load`: seconds per step of the batch it joins."""
        self.calibrate_pass_costs()
        return plan(self.pass_costs, self.family, params, prompt_len, suffix_len, params.time_budget, self.resolve,
                    load, self.cfg.max_positions, self.cfg.canvas_length)

    def cut_at_stop(self, row: list[int], ignore_eos: bool = False) -> tuple[list[int], str]:
        """A completion up to its first end-of-sequence token (`ignore_eos`: all of it), and why it ended."""
        if ignore_eos:
            return row, "length"
        for i, token in enumerate(row):
            if token in self.stop_ids:
                return row[:i], "stop"
        return row, "length"

    @torch.inference_mode()  # the decoder's tensor work too, not only the forward passes
    def generate(self, prompts: Prompt | list[Prompt], params: GenerationParams | None = None,
                 suffix: Prompt | list[Prompt] | None = None, **overrides) -> list[GenerationResult]:
        """Generate for one prompt or a batch (text or token ids); one result per prompt, in order.
        `suffix` (infilling, full-attention diffusion models): the text after the gap, one for every
        prompt or a list with one per prompt; the completion is what goes between prompt and suffix."""
        params = params or GenerationParams()
        if overrides:
            params = replace(params, **overrides)
        params = self.resolve(params)
        items = [prompts] if is_one_prompt(prompts) else prompts
        healed = [self.heal(self.encode_prompt(p), params, isinstance(p, str)) for p in items]
        batch = [ids for ids, _, _ in healed]
        suffixes = None
        if suffix is not None:
            per_prompt = suffix if not is_one_prompt(suffix) else [suffix] * len(items)
            if len(per_prompt) != len(items):
                raise ValueError(f"suffix: give one, or one per prompt ({len(items)}), not {len(per_prompt)}")
            suffixes = [self.encode_suffix(s) for s in per_prompt]
        timings: dict[str, float] = {}
        plan = None
        if params.time_budget is not None:
            plan = self.plan_budget(params, max(len(ids) for ids in batch),
                                    max((len(s) for s in suffixes), default=0) if suffixes else 0)
            params = plan.params
            timings = {"time_budget": params.time_budget, "predicted_seconds": plan.predicted_seconds,
                       "planned_passes": plan.passes}
        if self.family.kind == DIFFUSION:  # both kinds of pass reported, even when one did not run
            timings.update({"full_pass_seconds": 0.0, "window_pass_seconds": 0.0, "num_full_passes": 0,
                            "num_window_passes": 0})
        request = Request(batch, params, given_back=[back for _, back, _ in healed], first_tokens=[
            allowed for _, _, allowed in healed], suffixes=suffixes or [], plan=plan, timings=timings)
        start = time.perf_counter()
        run_alone(self, request)
        seconds = time.perf_counter() - start
        timings = {"decode_seconds": seconds, **request.timings, "batch_passes": request.nfe}
        results = []
        for b, (prompt, (_, given_back, _), row, nfe) in enumerate(zip(batch, healed, request.output_ids,
                                                                        request.row_nfe, strict=True)):
            tokens, reason = self.cut_at_stop(row, params.ignore_eos)
            text = self.tokenizer.decode(tokens) if self.tokenizer else None
            if text is not None and given_back and text.startswith(given_back):
                text = text[len(given_back):]  # it was the prompt's: the completion is what follows
            results.append(GenerationResult(tokens, reason, nfe, seconds, len(prompt), text,
                                            {**timings, **request.row_stats[b]}))  # its own drafts' figures
        return results


def is_one_prompt(prompt) -> bool:
    """A text or a list of token ids (one prompt), not a list of prompts."""
    return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int))


def load(path: str | Path = "default", device: str | torch.device = "cpu",
         dtype: str | torch.dtype = "float32", draft: str | Path | None = None, quantize: str | None = None,
         tensor_parallel_size: int = 1, distributed_executor_backend: str = "mp",
         kv_cache_memory: int | str | None = None, memory_utilization: float | None = None) -> LLM:
    """Load a checkpoint directory (config.json + safetensors [+ tokenizer.json]) or a bundled model
    by name (`default`, `default-ar`, `default-draft`) for generation; `draft` adds a draft model
    (or "ngram": n-gram lookup, no model) for speculative decoding (`num_draft_tokens`); `quantize`
    ("int8" or "int4") quantizes the linear layers' weights at load time; `tensor_parallel_size`
    splits the model over that many processes (kstep/distributed: CUDA devices, or CPU cores), its
    other ranks started by `distributed_executor_backend`: "mp" (processes) or "ray" (Ray actors).
    `kv_cache_memory` ("2GiB") or `memory_utilization` sizes its KV pool (runner/memory_budget.py)."""
    return LLM(path, device, dtype, draft, quantize, tensor_parallel_size, distributed_executor_backend,
               kv_cache_memory, memory_utilization)
