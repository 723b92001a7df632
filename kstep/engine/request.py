"""A request's life in the engine, and what each engine step reports about it. Plain Python, no
torch: the decoder is opaque here, and the committed tokens arrive as `StepOutput`s."""
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from kstep.outputs import StepOutput
from kstep.params import GenerationParams

_ids = itertools.count()


@dataclass(slots=True, eq=False)
class Request:
    """`prompts` (encoded) x `n` rows decode together as one canvas batch: row i is prompt i // n.
    `params` arrive resolved for the served model (GenerationParams.resolve, at the edge)."""
    prompts: list[list[int]]
    params: GenerationParams
    n: int = 1
    stop: list[str] = field(default_factory=list)
    include_canvas: bool = False
    given_back: list[str] = field(default_factory=list)       # per prompt: text token healing took off its end
    first_tokens: list[list[int]] = field(default_factory=list)  # per prompt: the ids its first token may take
    suffixes: list[list[int]] = field(default_factory=list)      # per prompt: infilling's text after the gap
    plan: Any = None                 # a time budget's budget.Plan (its prediction goes out in the usage)
    grammar: Any = None              # params.structured compiled (kstep/structured: once, off the event loop)
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    arrival_time: float = field(default_factory=time.monotonic)
    admitted_time: float | None = None  # when it joined the batch (the server's max_request_seconds counts from it)
    limit: tuple[str, float] | None = None  # the server limit that ended it (name, value), if one did
    ran_alone: bool = True           # no other request shared its steps (a time budget's outcome then counts)
    decoder: Any = None              # created when the request is admitted; dropped when it finishes
    stats: dict = field(default_factory=dict)  # its decoder's figures, kept when it finishes (Decoder.stats)
    is_aborted: bool = False
    is_finished: bool = False
    output_ids: list[list[int]] = field(default_factory=list)  # per row, the committed tokens so far
    nfe: int = 0                     # the request's forward passes so far
    preemptions: int = 0             # times its KV pages were taken back (it then resumed by recomputing)
    replayed: list[list[int]] | None = None  # while it recomputes: per row, the tokens committed again so far
    error: str | None = None         # why it failed inside the engine, if it did
    exception: BaseException | None = None  # ... the exception behind it (LLM.generate raises it again)
    row_nfe: list[int] = field(default_factory=list)  # per row, the passes it needed
    timings: dict = field(default_factory=dict)  # its passes by kind: seconds (its share of each step's), counts
    row_stats: list[dict] = field(default_factory=list)  # once finished: per row, its decoder's figures

    def append(self, out: StepOutput) -> None:
        """Record one step of the request's decoder. While it recomputes after a preemption, the
        tokens it commits again must be the ones it had (checked: else it ends with `error`, the text
        sent never contradicted); only those past them are new."""
        if not self.output_ids:
            self.output_ids = [[] for _ in out.new_token_ids]
        if self.replayed is not None:
            for row, (had, again, new) in enumerate(zip(self.output_ids, self.replayed, out.new_token_ids, strict=True)):
                again.extend(new)
                if again[:len(had)] != had[:len(again)]:
                    self.error = (f"request {self.request_id}: after its preemption, row {row} recomputed other "
                                  "tokens than it had sent (rounding in a recomputed prefill); it ends here")
                    self.is_finished = True
                    return
                had.extend(again[len(had):])
            if all(len(again) >= len(had) for had, again in zip(self.output_ids, self.replayed)):
                self.replayed = None
        else:
            for row, new in zip(self.output_ids, out.new_token_ids, strict=True):
                row.extend(new)
        self.nfe, self.row_nfe = out.nfe, out.row_nfe
        self.is_finished = out.is_finished

    def count_passes(self, passes: list[tuple[str, int]], seconds_each: float) -> None:
        """Add a step's passes of this request, (kind, tokens) each, and their share of its time."""
        for kind, tokens in passes:
            self.timings[f"{kind}_pass_seconds"] = self.timings.get(f"{kind}_pass_seconds", 0.0) + seconds_each
            self.timings[f"num_{kind}_passes"] = self.timings.get(f"num_{kind}_passes", 0) + 1
            self.timings["positions_computed"] = self.timings.get("positions_computed", 0) + tokens

    def preempt(self) -> None:
        """Its KV pages go. A decoder that can drop its caches alone (Decoder.evict: AR) is kept and
        resumes where it was; another goes, and the request recomputes from its prompt, what it
        committed checked on the way (`append`)."""
        self.preemptions += 1
        if self.decoder is not None and self.decoder.evict():
            return
        self.decoder = None
        self.replayed = [[] for _ in self.output_ids] if self.output_ids else None

    @property
    def plan_outcome_counts(self) -> bool:
        """A time budget's plan whose outcome tells the planner how far plans scatter here: the request
        finished alone, by its own end (no server limit), one row (a plan is for one)."""
        return self.is_finished and self.plan is not None and self.ran_alone and self.limit is None \
            and self.num_rows == 1

    @property
    def num_rows(self) -> int:
        return len(self.prompts) * self.n

    @property
    def rows(self) -> list[list[int]]:
        return [prompt for prompt in self.prompts for _ in range(self.n)]

    def per_row(self, values: list) -> list:
        """A per-prompt list repeated for the request's rows (empty stays empty)."""
        return [value for value in values for _ in range(self.n)]


@dataclass(slots=True)
class ChoiceDelta:
    index: int
    text: str                        # newly committed text since the last output
    token_ids: list[int]             # newly committed token ids
    finish_reason: str | None = None  # stop | length | None while running
    canvas: str | None = None        # the whole current canvas, masks as MASK_PLACEHOLDER (include_canvas)
    canvas_pieces: list[str | None] | None = None  # per canvas position: its token's text, None if masked
    canvas_edits: list[int] | None = None  # canvas positions whose token changed to another token since the last


@dataclass(slots=True)
class RequestOutput:
    """What one engine step changed for one request."""
    request_id: str
    choices: list[ChoiceDelta]
    step: int                        # the request's forward passes so far (its nfe)
    is_finished: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    admitted: bool = False           # the output that says the request joined the batch (its KV pages granted)
    error: str | None = None         # a request that failed inside the engine (the others keep running)
    error_status: int = 500          # ... its HTTP status: 500, or 503 when the server is shutting down
    error_code: str = "engine_error"
    limit: tuple[str, float] | None = None  # the server limit (name, value) that ended the request
    stats: dict = field(default_factory=dict)  # once finished: its decoder's figures (drafts, positions computed)


@dataclass(slots=True, frozen=True)
class RequestLimits:
    """A server's ceiling on one request, whatever its knobs: forward passes, and seconds since it
    joined the batch (None: no limit). A request that reaches one ends at once with what it has
    committed (finish_reason "length"), so none can hold a slot indefinitely."""
    max_passes: int | None = None
    max_seconds: float | None = None

    def reached(self, passes: int, seconds: float) -> tuple[str, float] | None:
        """The limit (name, value) a request with these passes and seconds has reached, if any."""
        if self.max_passes is not None and passes >= self.max_passes:
            return "max_request_passes", self.max_passes
        if self.max_seconds is not None and seconds >= self.max_seconds:
            return "max_request_seconds", self.max_seconds
        return None


@dataclass(slots=True)
class StepStats:
    batch_size: int              # requests in the step
    num_passes: int              # packed forward passes (one per model that had work: target, draft)
    num_tokens: int              # tokens run through the models
    seconds: float
    num_committed: int           # tokens newly committed across the batch
    queue_seconds: list[float] = field(default_factory=list)  # the requests that joined: arrival to joining
