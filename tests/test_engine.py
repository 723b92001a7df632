"""The real Engine stepping mock decoders on fake runners (nanochat's habit: engine tests on the CPU
with a mock model), then real tiny diffusion and AR models in one batch. Requests join and leave at
any step without changing each other's output; passes of two runners in one step both run."""
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import kstep
from kstep.budget.planner import PassCosts
from kstep.decoding.base import Decoder
from kstep.engine.engine import Engine
from kstep.engine.request import Request, RequestOutput, StepStats
from kstep.outputs import StepOutput
from kstep.params import GenerationParams
from kstep.runner.model_runner import ForwardPass

VOCAB = 32
STOP = 0


class FakeRunner:
    """Stands in for ModelRunner. The logits are a pure function of each pass's tokens (next token
    (5 * token + shift) % VOCAB: a full-period cycle, so every row reaches STOP within VOCAB tokens),
    computed for all passes at once as the real runner packs them: a misrouted logit changes an output."""

    def __init__(self, shift: int):
        self.shift = shift
        self.calls: list[int] = []  # passes per execute() call

    def execute(self, passes: list[ForwardPass]) -> list[torch.Tensor]:
        self.calls.append(len(passes))
        ids = torch.cat([p.ids.reshape(-1) for p in passes])  # (N,) packed
        logits = F.one_hot((ids * 5 + self.shift) % VOCAB, VOCAB).float()  # (N, V)
        chunks = logits.split([p.num_tokens for p in passes])
        return [c.view(*p.ids.shape, VOCAB)[:, p.logits_from:p.logits_to] for p, c in zip(passes, chunks)]

    def synchronize(self) -> None:
        pass


class FakeDecoder(Decoder):
    """A toy AR decoder: each step feeds every row's last token to each of its runners and commits
    (sum of the runners' argmax) % VOCAB; a row stops at STOP, the decoder after max_tokens steps."""

    def __init__(self, rows: list[list[int]], max_tokens: int, runners: list[FakeRunner]):
        self.last = torch.tensor([[row[-1]] for row in rows])  # (B, 1)
        self.max_tokens, self.runners = max_tokens, runners
        self.row_done = [False] * len(rows)
        self.lengths = [0] * len(rows)

    def next_passes(self) -> list[ForwardPass]:
        if self.is_finished:
            return []
        positions = torch.zeros_like(self.last)
        return [ForwardPass(self.last, positions, None, 0, 1, "decode", runner) for runner in self.runners]

    def update(self, logits: list[torch.Tensor]) -> StepOutput:
        assert len(logits) == len(self.runners) and all(x.shape == (len(self.lengths), 1, VOCAB) for x in logits)
        tokens = (sum(x[:, -1].argmax(-1) for x in logits) % VOCAB).tolist()  # (B,)
        self.nfe += 1
        new = [[] if done else [t] for t, done in zip(tokens, self.row_done)]
        self.lengths = [n + len(ids) for n, ids in zip(self.lengths, new)]
        self.row_done = [done or t == STOP for t, done in zip(tokens, self.row_done)]
        self.is_finished = all(self.row_done) or self.nfe == self.max_tokens
        self.row_done = [True] * len(tokens) if self.is_finished else self.row_done
        self.last = torch.tensor(tokens)[:, None]
        return StepOutput(new, self.lengths, list(self.row_done), [self.nfe] * len(tokens), self.nfe, self.is_finished)


def expected_tokens(prompt: list[int], max_tokens: int, shifts: tuple[int, ...]) -> list[int]:
    """What FakeDecoder commits for one row, computed without the engine."""
    token, out = prompt[-1], []
    while len(out) < max_tokens and STOP not in out:
        token = sum(5 * token + s for s in shifts) % VOCAB
        out.append(token)
    return out


@pytest.fixture
def fake_engine():
    """The real Engine over a stand-in LLM; admitted requests get FakeDecoders on runner `main`, plus
    runner `draft` for requests that ask for draft tokens (as speculative decoding would)."""
    main, draft = FakeRunner(shift=1), FakeRunner(shift=3)

    def fake_make_decoder(rows, params, prefix_cache=None, include_canvas=False, first_tokens=None,
                          suffixes=None, grammar=None):
        if params.max_tokens > 40:
            raise ValueError("the fake model's context is 40 tokens")
        return FakeDecoder(rows, params.max_tokens, [main, draft] if params.num_draft_tokens else [main])

    llm = SimpleNamespace(resolve=lambda params: params, tokenizer=None, stop_ids=[STOP], kind="autoregressive",
                          cfg=SimpleNamespace(mask_token_id=None, block_size=None), is_diffusion=False,
                          pass_costs=PassCosts(), make_decoder=fake_make_decoder)
    return SimpleNamespace(make=lambda **kw: Engine(llm, **kw), main=main, draft=draft)


def fake_request(name: str, prompts: list[list[int]], max_tokens: int, num_draft_tokens: int | None = None) -> Request:
    return Request(prompts, GenerationParams(max_tokens=max_tokens, num_draft_tokens=num_draft_tokens),
                   request_id=name)


def run(engine: Engine, arrivals: dict[int, list[Request]], abort_at: dict[int, str] | None = None,
        max_steps: int = 200) -> tuple[dict[str, list[RequestOutput]], list[StepStats]]:
    """Step the engine until it is idle; `arrivals[i]` are added (and `abort_at[i]` aborted) before
    step i. Returns each request's outputs in order (not the one saying it joined the batch) and the
    stats of every step that ran passes."""
    outputs: dict[str, list[RequestOutput]] = {}
    stats: list[StepStats] = []
    for i in range(max_steps):
        for request in arrivals.get(i, []):
            engine.add_request(request)
        if abort_at and i in abort_at:
            engine.abort(abort_at[i])
        if not engine.has_work() and i > max(arrivals):
            return outputs, stats
        step_outputs, step_stats = engine.step()
        for out in step_outputs:
            if not out.admitted:
                outputs.setdefault(out.request_id, []).append(out)
        if step_stats is not None:
            stats.append(step_stats)
    raise AssertionError(f"the engine still has work after {max_steps} steps")


# Rows chosen so the requests end at different steps, by STOP or by max_tokens.
REQUESTS = {"a": ([[4, 9], [7, 3, 2]], 12), "b": ([[2]], 30), "c": ([[5, 6, 11]], 6)}


def make_requests(**kw) -> dict[str, Request]:
    return {name: fake_request(name, prompts, max_tokens, **kw) for name, (prompts, max_tokens) in REQUESTS.items()}


def alone(fake_engine, request: Request) -> list[list[int]]:
    engine = fake_engine.make()
    run(engine, {0: [request]})
    return request.output_ids


@pytest.mark.parametrize("join_step", [0, 1, 3, 7])
def test_a_request_joining_at_any_step_gets_its_output_alone(fake_engine, join_step):
    solo = {name: alone(fake_engine, r) for name, r in make_requests().items()}
    for name, (prompts, max_tokens) in REQUESTS.items():
        assert solo[name] == [expected_tokens(p, max_tokens, (1,)) for p in prompts]
    fake_engine.main.calls.clear()
    requests = make_requests()
    arrivals = {0: [requests["a"], requests["c"]]}
    arrivals.setdefault(join_step, []).append(requests["b"])
    outputs, stats = run(fake_engine.make(), arrivals)
    assert {name: r.output_ids for name, r in requests.items()} == solo
    # b runs from the step it arrived at, not after the others: its first pass is step join_step
    assert outputs["b"][0].step == 1 and len(outputs["b"]) == len(solo["b"][0])
    assert stats[join_step].batch_size == 1 + sum(len(outputs[n]) > join_step for n in "ac")
    # one packed execute per step, holding every running request's pass
    assert fake_engine.main.calls == [s.batch_size for s in stats]
    assert all(s.num_passes == 1 for s in stats)


def test_finish_reasons_and_the_last_output(fake_engine):
    engine = fake_engine.make()
    requests = make_requests()
    outputs, _ = run(engine, {0: list(requests.values())})
    for name, request in requests.items():
        outs = outputs[name]
        assert request.is_finished and request.decoder is None
        assert outs[-1].is_finished and not any(o.is_finished for o in outs[:-1])
        assert outs[-1].step == request.nfe == len(outs)
    reasons = {name: {c.index: c.finish_reason for o in outputs[name] for c in o.choices if c.finish_reason}
               for name in requests}
    assert reasons == {"a": {0: "stop", 1: "length"}, "b": {0: "stop"}, "c": {0: "length"}}
    # a row that stopped reports no further choices while its neighbour row runs on
    stopped_at = next(i for i, o in enumerate(outputs["a"]) if any(c.finish_reason for c in o.choices))
    assert stopped_at < len(outputs["a"]) - 1
    assert all(c.index == 1 for o in outputs["a"][stopped_at + 1:] for c in o.choices)
    row0, row1 = requests["a"].output_ids
    assert row0[-1] == STOP and len(row1) == 12
    assert outputs["a"][-1].completion_tokens == len(row0) - 1 + len(row1)  # the stop token is not counted
    assert not engine.has_work() and engine.streams == {}


def test_abort_mid_generation_leaves_the_others_unchanged(fake_engine):
    solo = {name: alone(fake_engine, r) for name, r in make_requests().items()}
    engine = fake_engine.make()
    requests = make_requests()
    outputs, stats = run(engine, {0: list(requests.values())}, abort_at={3: "b"})
    assert requests["a"].output_ids == solo["a"] and requests["c"].output_ids == solo["c"]
    b = requests["b"]
    assert len(outputs["b"]) == 3 and not outputs["b"][-1].is_finished  # nothing for b after the abort
    assert b.output_ids == [solo["b"][0][:3]] and not b.is_finished
    assert [s.batch_size for s in stats[2:4]] == [3, 2]  # b left the batch at the next step
    assert b not in engine.scheduler.running and "b" not in engine.streams
    assert b.decoder is None  # its decoder (and KV cache) is dropped, not kept until the Request is freed


def test_a_request_whose_decoder_fails_fails_alone(fake_engine):
    engine = fake_engine.make()
    requests = make_requests()
    too_long = fake_request("too-long", [[3]], 64)
    outputs, _ = run(engine, {0: [requests["a"], too_long, requests["c"]]})
    [failed] = outputs["too-long"]
    assert failed.is_finished and "context" in failed.error and too_long.decoder is None
    assert requests["a"].output_ids == alone(fake_engine, make_requests()["a"])
    assert requests["c"].is_finished


def test_passes_of_two_runners_in_one_step_both_run(fake_engine):
    engine = fake_engine.make()
    speculative = make_requests(num_draft_tokens=2)  # these use the draft runner too
    plain = fake_request("plain", [[8]], 9)
    outputs, stats = run(engine, {0: [speculative["a"], plain], 2: [speculative["c"]]})
    for name, request in speculative.items():
        if name != "b":
            prompts, max_tokens = REQUESTS[name]
            assert request.output_ids == [expected_tokens(p, max_tokens, (1, 3)) for p in prompts]
    assert plain.output_ids == [expected_tokens([8], 9, (1,))]
    assert all(s.num_passes == 2 for s in stats)  # two runners had work in every step
    # each runner ran once per step, packing the passes of every request that used it
    assert len(fake_engine.main.calls) == len(fake_engine.draft.calls) == len(stats)
    assert fake_engine.main.calls[2] == 3 and fake_engine.draft.calls[2] == 2
    assert [s.num_tokens for s in stats[:3]] == [2 * 2 + 1, 2 * 2 + 1, 2 * 2 + 1 + 2]  # (rows x runners) per step


DIFFUSION_REQUESTS = [  # (prompts, settings, joins before step)
    (["def add(a, b):"], dict(max_tokens=16, steps=8), 0),
    (["import os\n", "x = ["], dict(max_tokens=32, block_length=8, cache="prefix"), 0),
    (["class Stack:\n    def push(self, x):"], dict(max_tokens=16), 5),  # dual cache + threshold (the default)
]
AR_REQUESTS = [
    (["for i in range(10):"], dict(max_tokens=12), 0),
    (["print(", "while True:\n    x += 1"], dict(max_tokens=10), 2),
]


def test_engine_step_mixes_diffusion_and_ar_requests(llada_path, llama_path, monkeypatch):
    diffusion, ar = kstep.load(llada_path), kstep.load(llama_path)

    own_make_decoder = diffusion.make_decoder

    def make_either(rows, params, prefix_cache=None, include_canvas=False, first_tokens=None, suffixes=None,
                    grammar=None):
        # Routes each request to its model: resolve() gives only diffusion params an unmask policy.
        make = own_make_decoder if params.policy is not None else ar.make_decoder
        return make(rows, params, prefix_cache, include_canvas, first_tokens, suffixes, grammar)

    monkeypatch.setattr(diffusion, "make_decoder", make_either)
    engine = Engine(diffusion, max_batch_size=8)
    arrivals: dict[int, list[Request]] = {}
    expected: dict[str, list] = {}
    for llm, specs in ((diffusion, DIFFUSION_REQUESTS), (ar, AR_REQUESTS)):
        for prompts, settings, join in specs:
            params = llm.resolve(replace(GenerationParams(), **settings))  # temperature 0
            request = Request([llm.encode_prompt(p) for p in prompts], params)
            arrivals.setdefault(join, []).append(request)
            # as ids, like the request (a text prompt would be token-healed)
            expected[request.request_id] = [llm.generate(llm.encode_prompt(p), params)[0] for p in prompts]
    outputs, stats = run(engine, arrivals)
    for step_requests in arrivals.values():
        for request in step_requests:
            got = [diffusion.cut_at_stop(row) for row in request.output_ids]
            want = [(r.token_ids, r.finish_reason) for r in expected[request.request_id]]
            assert got == want, request.request_id
            assert outputs[request.request_id][-1].is_finished
    assert max(s.batch_size for s in stats) == len(DIFFUSION_REQUESTS) + len(AR_REQUESTS)
    assert any(s.num_passes == 2 for s in stats)  # the two models' passes ran in the same step
