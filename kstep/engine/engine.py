"""The engine step: schedule -> one packed forward pass for every running request -> each
request's decoder updates -> outputs (committed text deltas) per request.

Requests with different prompts, lengths, settings and even decoding stages (a diffusion block's
full pass, a cached window pass, an AR decode) share the pass: the runner packs their tokens,
reads the weights once, and keeps attention per request, so a request's output does not depend
on its neighbours. Requests join at any step and leave when done (continuous batching).
"""
import time
from dataclasses import dataclass

import torch

from kstep.engine.prefix_cache import PrefixCache
from kstep.engine.request import ChoiceDelta, Request, RequestOutput
from kstep.engine.scheduler import Scheduler
from kstep.engine.text_stream import TextStream, render_canvas
from kstep.llm import LLM


@dataclass(slots=True)
class StepStats:
    batch_size: int              # requests in the pass
    num_tokens: int              # tokens run through the model
    seconds: float
    num_committed: int           # tokens newly committed across the batch


class Engine:
    def __init__(self, llm: LLM, max_batch_size: int = 16, max_queue: int = 256, prefix_cache_bytes: int = 0):
        self.llm = llm
        self.scheduler = Scheduler(max_batch_size, max_queue)
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 and not llm.is_diffusion else None
        self.streams: dict[str, list[TextStream]] = {}

    def add_request(self, request: Request) -> None:
        """Queue a request (raises QueueFull). Prompts must already be encoded and validated."""
        self.scheduler.add(request)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def _admit(self, request: Request) -> RequestOutput | None:
        """Create the request's decoder (allocates its KV cache); a failure fails only this request."""
        try:
            request.decoder = self.llm.make_decoder(request.rows, request.params, self.prefix_cache)
        except (ValueError, RuntimeError) as e:  # e.g. out of memory for its cache
            self.scheduler.finish(request)
            return RequestOutput(request.request_id, [], 0, is_finished=True, error=str(e))
        self.streams[request.request_id] = [TextStream(self.llm.tokenizer, self.llm.stop_ids, request.stop)
                                            for _ in range(request.num_rows)]
        return None

    @torch.inference_mode()  # the decoders' own tensor work too, not only the forward pass
    def step(self) -> tuple[list[RequestOutput], StepStats | None]:
        batch, admitted = self.scheduler.schedule()
        outputs = [out for r in admitted if (out := self._admit(r)) is not None]
        batch = [r for r in batch if r.decoder is not None]
        for request in list(self.streams):
            if not any(r.request_id == request for r in batch):
                self.streams.pop(request)  # aborted: its decoder and KV cache go with it
        if not batch:
            return outputs, None
        start = time.perf_counter()
        passes = [r.decoder.next_pass() for r in batch]
        logits = self.llm.runner.execute(passes)
        num_committed = 0
        for request, request_logits in zip(batch, logits, strict=True):
            request.decoder.update(request_logits)
            out = self._output(request)
            num_committed += sum(len(c.token_ids) for c in out.choices)
            outputs.append(out)
            if out.is_finished:
                self.scheduler.finish(request)
                self.streams.pop(request.request_id, None)
                request.decoder = None
        stats = StepStats(len(batch), sum(p.num_tokens for p in passes), time.perf_counter() - start, num_committed)
        return outputs, stats

    def _output(self, request: Request) -> RequestOutput:
        decoder, streams = request.decoder, self.streams[request.request_id]
        lengths = decoder.committed_lengths()
        completions = decoder.completions
        rows = completions.tolist() if request.include_canvas else None
        choices = []
        for index, (stream, length) in enumerate(zip(streams, lengths, strict=True)):
            if stream.finish_reason is not None:
                continue
            committed = completions[index, :length].tolist()
            text, ids = stream.update(committed, decoder.is_finished)
            canvas = None
            if rows is not None:
                canvas = render_canvas(self.llm.tokenizer, rows[index], self.llm.cfg.mask_token_id)
            if text or ids or stream.finish_reason or canvas is not None:
                choices.append(ChoiceDelta(index, text, ids, stream.finish_reason, canvas))
        is_finished = all(s.finish_reason is not None for s in streams)
        return RequestOutput(request.request_id, choices, decoder.nfe, is_finished,
                             prompt_tokens=sum(len(p) for p in request.prompts) * request.n,
                             completion_tokens=sum(s.num_tokens for s in streams))


def warm_up(llm: LLM) -> None:
    """One tiny generation so the first request does not pay for lazy initialisation."""
    with torch.inference_mode():
        llm.generate([llm.pad_id if llm.pad_id != llm.cfg.mask_token_id else 0], max_tokens=2)
