"""The engine step: schedule -> one packed forward pass for every running request -> each
request's decoder updates -> the scheduler records the step outputs -> outputs (committed text
deltas) per request.

Requests with different prompts, lengths, settings and even decoding stages (a diffusion block's
full pass, a cached window pass, an AR decode, a draft model's pass) share the step: the runner
packs their tokens (one pass per model), reads the weights once, and keeps attention per request,
so a request's output does not depend on its neighbours. Requests join at any step and leave when
done (continuous batching).
"""
import gc
import random
import time
from dataclasses import replace

import torch

from kstep.engine.request import ChoiceDelta, Request, RequestLimits, RequestOutput, StepStats
from kstep.engine.scheduler import Scheduler
from kstep.engine.text_stream import TextStream, canvas_pieces, render_canvas
from kstep.engine.served_model import ServedModel
from kstep.outputs import StepOutput
from kstep.params import DIFFUSION
from kstep.runner.kv_pages import PoolFull
from kstep.runner.kv_pool import KVBudgetExceeded
from kstep.runner.model_runner import execute_passes

WAIT = object()  # a request whose KV pages are not free yet: back to the head of the queue


class Engine:
    def __init__(self, llm: ServedModel, max_batch_size: int = 16, max_queue: int = 256, prefix_cache_bytes: int = 0,
                 limits: RequestLimits = RequestLimits(), max_num_batched_tokens: int | None = None,
                 offline: bool = False, long_prefill_token_threshold: int | None = None):
        if any(v is not None and v <= 0 for v in (max_num_batched_tokens, long_prefill_token_threshold)):
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) and long_prefill_token_threshold "
                             f"({long_prefill_token_threshold}) must be > 0")
        self.llm, self.limits = llm, limits
        # A server's engine seeds every request (a preempted one draws the same again) and keeps each row's
        # text. LLM.generate's (`offline`, engine/offline.py) draws from torch's generator when unseeded, as
        # callers of a seeded torch expect; its caller reads the token ids and the per-pass timings.
        self.offline = offline
        self.max_num_batched_tokens = max_num_batched_tokens  # a step's tokens: prefills go in chunks under it
        # a prompt's chunk (vLLM's long_prefill_token_threshold): at most the step's budget, less if given
        self.prefill_chunk = min(filter(None, (max_num_batched_tokens, long_prefill_token_threshold)), default=None)
        self.scheduler = Scheduler(max_batch_size, max_queue)
        # AR and block-diffusion prompts share keys (causal across blocks); a canvas diffusion model's do not.
        # A cached block must hold whole model blocks (a block's keys depend on all of it).
        block = llm.cfg.block_size or 1
        self.prefix_cache = llm.runner.make_prefix_cache(prefix_cache_bytes, -(-16 // block) * block) \
            if prefix_cache_bytes > 0 and llm.kind != DIFFUSION else None
        self.streams: dict[str, list[TextStream]] = {}
        self._refused_at: int | None = None  # scheduler.departed when the queue's head last could not join
        self.preemptions = 0  # requests preempted so far (their KV pages taken back to let another grow)
        self.step_seconds = 0.0  # recent steps' time (moving average): what a joining request waits per pass

    def load_seconds(self) -> float:
        """Seconds per step of the running batch, 0 when idle: each pass of a request that joins now
        takes that plus its own (time budgets plan with it)."""
        return self.step_seconds if self.scheduler.num_running else 0.0

    def add_request(self, request: Request) -> None:
        """Queue a request (raises QueueFull, or ValueError for params this model cannot run).
        Prompts must already be encoded and validated; params resolved by the server are taken as
        they are (resolving compiles a structured output's grammar: not on the event loop)."""
        if not request.params.is_resolved:
            request.params = self.llm.resolve(request.params)
        if request.params.seed is None and not self.offline:  # its own draws, so that a preempted request draws the same again
            request.params = replace(request.params, seed=random.getrandbits(63))
        self.scheduler.add(request)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @torch.inference_mode()  # the decoders' own tensor work too, not only the forward pass
    def step(self) -> tuple[list[RequestOutput], StepStats | None]:
        may_admit = self._refused_at is None or self.scheduler.departed > self._refused_at
        batch, admitted = self.scheduler.schedule(may_admit)
        outputs, joined = [], []
        for i, request in enumerate(admitted):
            out = self._admit(request)
            if out is WAIT:  # its pages are not free: it and those after it wait, in order (first come, first served)
                self.scheduler.requeue(admitted[i:])
                break
            outputs.append(out)
            if out.admitted:
                joined.append(request.admitted_time - request.arrival_time)
        batch = [r for r in batch if r in self.scheduler.running and r.decoder is not None]  # not those that wait
        self._drop_streams_of_aborted(batch)
        if not batch:
            return outputs, None
        start = time.perf_counter()
        passes = dict(zip(map(id, batch), self._next_passes(batch)))
        batch = [r for r in batch if r in self.scheduler.running]  # the preempted have left
        passes = [passes[id(r)] for r in batch]
        flat = [p for request_passes in passes for p in request_passes]
        logits = iter(self._timed(batch, passes, flat) if self.offline else execute_passes(flat))
        step_outputs = [r.decoder.update([next(logits) for _ in ps]) for r, ps in zip(batch, passes, strict=True)]
        for r in batch:
            if r.decoder.is_finished:  # before the scheduler drops the decoder
                # a structured output's figures (structured/constraint.py), and if it was preempted
                more = {**({} if r.decoder.constraint is None else r.decoder.constraint.stats()),
                        **({"preemptions": r.preemptions} if r.preemptions else {})}
                r.stats = {**r.decoder.stats(), **more}
                r.row_stats = [{**r.decoder.stats(row), **more} for row in range(r.num_rows)]
        self.scheduler.update(batch, step_outputs)
        self._end_at_limits(batch)
        self._observe_plans(batch)
        outputs += [self._output(r, out) for r, out in zip(batch, step_outputs, strict=True)]
        stats = StepStats(len(batch), len({id(p.runner) for p in flat}), sum(p.num_tokens for p in flat),
                          time.perf_counter() - start, sum(out.num_committed for out in step_outputs),
                          joined)
        self.step_seconds = stats.seconds if not self.step_seconds else 0.8 * self.step_seconds + 0.2 * stats.seconds
        if self.llm.pass_costs.is_calibrated:  # a request alone: its step refreshes the planner's table
            self.llm.pass_costs.observe_step(flat, stats.seconds)
        return outputs, stats

    def _timed(self, batch: list[Request], passes: list[list], flat: list) -> list:
        """The step's packed pass, offline: each request's timings get its passes (by kind), their
        tokens and their share of its time."""
        start = time.perf_counter()
        outputs = execute_passes(flat)
        for runner in {id(p.runner): p.runner for p in flat}.values():
            runner.synchronize()
        share = (time.perf_counter() - start) / max(1, len(flat))
        for request, request_passes in zip(batch, passes, strict=True):
            request.count_passes([(p.kind, p.num_tokens) for p in request_passes], share)
        return outputs

    def _next_passes(self, batch: list[Request]) -> list[list]:
        """Each request's passes for this step, those under way first (in the order they joined). A
        decoder whose cache cannot grow (PoolFull) has the newest request not yet asked preempted (maybe
        itself: then it has none). Under a token budget, prefill chunks take what the others' passes
        leave; one that does not fit waits, except the step's first (a long prompt always moves on)."""
        budget, prefilled, out, preempted = self.max_num_batched_tokens, False, {}, set()
        order = sorted(batch, key=lambda r: r.decoder.nfe == 0)
        for i, request in enumerate(order):
            evictions = 1  # cached prefix blocks to give back before its next try
            while id(request) not in preempted:
                request.decoder.prefill_budget = budget if prefilled else None
                try:
                    out[id(request)] = passes = request.decoder.next_passes()
                except PoolFull:
                    if self._evict_cached_prefix(evictions):
                        evictions *= 2
                        continue
                    victim = next(r for r in reversed(order[i:]) if id(r) not in preempted)
                    self._preempt(victim)
                    preempted.add(id(victim))
                    continue
                if budget is not None:
                    budget -= sum(p.num_tokens for p in passes)
                prefilled |= any(p.kind == "prefill" for p in passes)
                break
        return [[] if id(r) in preempted else out.get(id(r), []) for r in batch]

    def _evict_cached_prefix(self, count: int) -> bool:
        """Up to `count` cached prefix blocks (LRU leaves) give their pages back before a request waits or
        is preempted: True if one did (callers double `count` a try: few tries, not one a block)."""
        return self.prefix_cache is not None and self.prefix_cache.evict_leaves(count) > 0

    def _preempt(self, request: Request) -> None:
        """Its KV pages go back; it waits at the head of the queue and resumes by recomputing what it
        had committed (the same draws: its own seed), which it does not send again."""
        request.preempt()
        self.scheduler.requeue([request])
        self.scheduler.departed += 1  # pages freed: the queue's head may try again
        self.preemptions += 1

    def _observe_plans(self, batch: list[Request]) -> None:
        """A time-budgeted request that ran alone tells the planner how far its plans scatter here."""
        for request in batch:
            request.ran_alone &= len(batch) == 1
            if request.plan_outcome_counts:
                self.llm.pass_costs.observe_outcome(request.plan.predicted_seconds, request.plan.passes,
                                                    time.monotonic() - request.admitted_time, request.nfe)

    def _end_at_limits(self, batch: list[Request]) -> None:
        """End the running requests that reached a server limit (RequestLimits)."""
        now = time.monotonic()
        for request in batch:
            if not request.is_finished and (limit := self.limits.reached(request.nfe, now - request.admitted_time)):
                request.is_finished, request.limit = True, limit
                self.scheduler.finish(request)

    def _admit(self, request: Request) -> RequestOutput | object:
        """Create the request's decoder, its KV caches from the model's pool: the request's admitted
        output; WAIT when the pool has not the pages free now; a failure fails only this request (a 400
        when its caches exceed the whole pool: it could never run)."""
        request.admitted_time = time.monotonic()
        attempt, evictions = 0, 1
        while attempt < 2:
            try:
                if request.decoder is None:
                    request.decoder = self._make_decoder(request)
                else:  # it resumes where it was (Decoder.evict): its caches whole now, not preempted again
                    request.decoder.reserve()
                break
            except PoolFull:
                pass  # out of the except clause: a half-made decoder's caches go with its traceback
            except KVBudgetExceeded as e:
                return self._refuse(request, str(e), 400, "kv_budget_exceeded", e)
            except (ValueError, RuntimeError) as e:  # e.g. out of memory for a step's work
                return self._refuse(request, str(e), 500, "engine_error", e)
            if self._evict_cached_prefix(evictions):
                evictions *= 2
                continue
            if any(r.decoder is not None for r in self.scheduler.running if r is not request):
                self._refused_at = self.scheduler.departed  # the others free pages as they finish
                return WAIT
            gc.collect()  # alone: only a cache held in a reference cycle can still free pages
            attempt += 1
        else:
            runners = [self.llm.runner] + ([self.llm.drafter] if hasattr(self.llm.drafter, "kv_pool") else [])
            pools = ", ".join(f"{r.kv_pool.capacity_tokens} slots ({r.kv_pool.nbytes / 2**20:.1f} MiB)"
                              for r in runners)
            message = (f"this request's KV caches do not fit the model's KV pool even alone ({pools}: "
                       "--kv-cache-memory / --memory-utilization); ask for fewer tokens or rows")
            return self._refuse(request, message, 400, "kv_budget_exceeded", KVBudgetExceeded(message))
        if not request.preemptions and not self._fits_step_budget(request):
            request.decoder, self._refused_at = None, self.scheduler.departed
            return WAIT
        self._refused_at = None
        if self.offline:
            return RequestOutput(request.request_id, [], 0, admitted=True)
        given_back = request.per_row(request.given_back) or [""] * request.num_rows
        stop_ids = [] if request.params.ignore_eos else self.llm.stop_ids  # every token is the completion's
        grammar = request.decoder.constraint
        is_text = [None if grammar is None else lambda i=i: grammar.rows[i].is_free for i in range(request.num_rows)]
        if request.request_id in self.streams:  # it resumes after a preemption: its text so far was sent
            for stream, row_is_text in zip(self.streams[request.request_id], is_text):
                stream.is_text = row_is_text or stream.is_text
        else:
            self.streams[request.request_id] = [TextStream(self.llm.tokenizer, stop_ids, request.stop, text, row_is_text)
                                                for text, row_is_text in zip(given_back, is_text)]
        return RequestOutput(request.request_id, [], 0, admitted=True)

    def _fits_step_budget(self, request: Request) -> bool:
        """Whether the request's steps fit the step budget beside the running ones' (a whole-canvas
        diffusion pass counts its canvas, an AR decode its rows): a step's activations and logits stay
        bounded. The first request always joins."""
        if self.max_num_batched_tokens is None:
            return True
        others = [max(r.decoder.step_tokens(), r.num_rows) for r in self.scheduler.running
                  if r is not request and r.decoder is not None]
        mine = max(request.decoder.step_tokens(), request.num_rows)
        return not others or sum(others) + mine <= self.max_num_batched_tokens

    def _make_decoder(self, request: Request):
        decoder = self.llm.make_decoder(request.rows, request.params, self.prefix_cache, request.include_canvas,
                                        request.per_row(request.first_tokens), request.per_row(request.suffixes) or None,
                                        request.grammar)
        decoder.prefill_chunk = self.prefill_chunk
        if request.preemptions:  # it resumes: every page it may need now, so it is not preempted again
            decoder.reserve()
        return decoder

    def _refuse(self, request: Request, message: str, status: int, code: str,
                cause: BaseException | None = None) -> RequestOutput:
        request.exception = cause  # (LLM.generate raises it again)
        self.scheduler.finish(request)
        return RequestOutput(request.request_id, [], 0, is_finished=True, error=message, error_status=status,
                             error_code=code)

    def _drop_streams_of_aborted(self, batch: list[Request]) -> None:
        kept = {r.request_id for r in batch} | {r.request_id for r in self.scheduler.waiting if r.preemptions}
        for request_id in [r for r in self.streams if r not in kept]:
            self.streams.pop(request_id)

    def _output(self, request: Request, out: StepOutput) -> RequestOutput:
        if request.error is not None:
            self.streams.pop(request.request_id, None)
            return RequestOutput(request.request_id, [], request.nfe, is_finished=True, error=request.error)
        if self.offline:
            return RequestOutput(request.request_id, [], request.nfe, request.is_finished, limit=request.limit)
        streams = self.streams[request.request_id]
        choices = []
        for index, (stream, committed) in enumerate(zip(streams, request.output_ids, strict=True)):
            if stream.finish_reason is not None:
                continue
            text, ids = stream.update(committed, request.is_finished)
            canvas = pieces = edits = None
            if out.canvas is not None:
                row, mask_id = out.canvas[index], self.llm.cfg.mask_token_id
                canvas = render_canvas(self.llm.tokenizer, row, mask_id)
                pieces = canvas_pieces(self.llm.tokenizer, row, mask_id)
                edits = stream.canvas_edits(row, mask_id)
            if text or ids or stream.finish_reason or canvas is not None:
                choices.append(ChoiceDelta(index, text, ids, stream.finish_reason, canvas, pieces, edits))
        if request.is_finished:
            self.streams.pop(request.request_id, None)
        # OpenAI counts the prompt once however many choices (n) it has
        return RequestOutput(request.request_id, choices, request.nfe, request.is_finished,
                             prompt_tokens=sum(len(p) for p in request.prompts),
                             completion_tokens=sum(s.num_tokens for s in streams), limit=request.limit,
                             stats=request.stats if request.is_finished else {})
