"""The grammar off the hot path (issue 44): a decoder batch's packed masks, filled at once and applied
at each row's frontier column only, give exactly the logits the per-row unpacked masks gave, for
rows under a grammar, closed, released and undecided (a free-text answer beside tools); a walk that
keeps the states it reached gives what walking afresh gives; DiffusionGemma's candidates, drawn once
per pass, give a kept sample from the allowed tokens' renormalised distribution (also where none of
the top k is allowed), and its constrained runs repeat under a seed, equal themselves alone and are
valid."""
import json
import random
from collections import Counter

import jsonschema
import numpy as np
import pytest
import torch

from kstep.decoding import walk_candidates
from kstep.decoding.walk_candidates import WalkCandidates
from kstep.engine.engine import Engine
from kstep.engine.request import Request
from kstep.params import GenerationParams
from kstep.structured import StructuredSpec, token_mask
from kstep.structured.search import bits
from test_engine import run
from test_structured import PERSON, SPECS, valid

TOOLS = StructuredSpec.tool_calls([("add", {"type": "object", "properties": {"a": {"type": "integer"}}})], "auto",
                                  False)
ROOM = 1 << 20


@pytest.fixture(scope="module")
def models(random_models):
    return random_models


def reference_allowed(row) -> torch.Tensor:
    """A row's mask as matcher.py computed it before packed masks: a byte per token."""
    if row.is_free:
        return torch.ones(row.vocab_size, dtype=torch.bool)
    if row.is_closed:
        allowed = torch.zeros(row.vocab_size, dtype=torch.bool)
        allowed[row.stop_token] = True
        return allowed
    allowed = torch.from_numpy(bits(row.tokens.compute_bitmask(), row.vocab_size).astype(bool))
    if row.trigger is not None:
        allowed[row.stop_ids] = True
    return allowed


def reference_mask(rows, logits: torch.Tensor, output_index) -> torch.Tensor:
    """Constraint.mask as it was: every row's mask stacked, applied over the block where it is the frontier."""
    allowed = torch.stack([reference_allowed(row) for row in rows])
    pad = logits.shape[-1] - allowed.shape[-1]
    allowed = torch.cat([allowed, allowed.new_zeros(len(rows), pad)], -1)  # a padded head: never allowed
    frontier = torch.tensor([row.num_committed for row in rows])[:, None]
    at_frontier = (torch.as_tensor(output_index) == frontier).expand(logits.shape[:2])
    return logits.masked_fill(at_frontier[..., None] & ~allowed[:, None, :], float("-inf"))


def rows_in_every_state(llm):
    """A constraint whose rows are: a JSON schema's at its start, part way and closed; a regex's; a
    tool answer undecided (nothing yet, and a start of the call's opening) and released."""
    person, tools = (llm.grammar.compile(spec) for spec in (StructuredSpec.json_schema(PERSON), TOOLS))
    constraint = llm.grammar.constraint(person, 3, ROOM)
    rows = constraint.rows + [llm.grammar.constraint(llm.grammar.compile(SPECS[2]), 1, ROOM).rows[0]]
    for row, n in zip(rows, (3, 1000, 0, 2)):
        for token in row.closing[1][:n]:
            assert row.admit(token, ROOM)
    assert rows[1].is_closed
    table, stop_ids = tools.tokens, llm.stop_ids
    texts = {t: table.decode_bytes([t]) for t in range(llm.cfg.vocab_size) if t not in stop_ids}
    opening = next(t for t, b in texts.items() if b and b"<tool_call>".startswith(b))
    leaving = next(t for t, b in texts.items() if b and not b"<tool_call>".startswith(b) and b[:1] != b"<")
    undecided, started, released = (llm.grammar.constraint(tools, 1, ROOM).rows[0] for _ in range(3))
    assert started.admit(opening, ROOM) and released.admit(leaving, ROOM)
    assert undecided.trigger is not None and started.trigger is not None and not started.is_free and released.is_free
    constraint.rows = rows + [undecided, started, released]
    return constraint


def test_packed_masks_equal_the_per_row_masks_in_every_row_state(models):
    llm = models("llama")
    constraint = rows_in_every_state(llm)
    rows, B, V = constraint.rows, len(constraint.rows), llm.cfg.vocab_size
    for row in rows:
        assert torch.equal(row.allowed(), reference_allowed(row))
    frontier = torch.tensor(constraint.frontier())
    logits = torch.randn(B, 4, V + 3, generator=torch.Generator().manual_seed(0))  # 3 ids past the table
    shift = torch.tensor([1, 0, 3, 5, 1, 2, -1])[:B, None]  # the frontier at column 1, 0, 3, past, ..., before
    for index in (frontier[:, None] - shift + torch.arange(4), frontier[:, None]):  # a block; one column
        want = reference_mask(rows, logits[:, :index.shape[1]], index)
        assert torch.equal(constraint.mask(logits[:, :index.shape[1]], index), want)
    at = constraint.frontier()[0]  # an int index: the rows whose frontier it is
    assert torch.equal(constraint.mask(logits[:, :1], at), reference_mask(rows, logits[:, :1], at))


def test_packed_masks_equal_the_per_row_masks_along_real_schemas():
    """bench structured --batch's rows (bench/grammar_step.py): JSONSchemaBench schemas, each row on a
    valid instance, the two ways to mask equal at every step."""
    from kstep.bench import grammar_step, structured
    from kstep.bundled import resolve_model
    from kstep.structured.grammar import GrammarCompiler
    compiler, grammars = GrammarCompiler(resolve_model("default") / "tokenizer.json", 4096, [0]), []
    for sample in structured.load_sample(20)["schemas"]:
        try:
            grammars.append(compiler.compile(StructuredSpec.json_schema(sample["schema"])))
        except ValueError:  # a schema the engine refuses
            continue
    walk = grammar_step.BatchWalk(grammars, grammar_step.instances(grammars), 12, 4096, 0)
    walk.start_at(2)
    logits = torch.randn(12, 1, 4096, generator=torch.Generator().manual_seed(1))
    for _ in range(24):
        index = torch.tensor(walk.constraint.frontier())[:, None]
        want = grammar_step.per_row_mask(walk.constraint, logits, index)
        assert torch.equal(walk.constraint.mask(logits, index), want)
        walk.step("packed", logits)


def test_packed_mask_helpers_read_the_bits_llguidance_writes():
    rng = np.random.default_rng(1)
    for vocab in (33, 500, 4096):
        width = token_mask.num_words(vocab)
        words = token_mask.trim(rng.integers(-2 ** 31, 2 ** 31, size=(3, width), dtype=np.int64).astype(np.int32),
                                vocab)
        want = np.array([[(int(words[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)] for r in range(3)], bool)
        assert (token_mask.unpack(words, vocab) == want).all()
        assert torch.equal(token_mask.unpack_bytes(torch.from_numpy(words), vocab + 5),  # the device path, on the CPU
                           torch.from_numpy(np.concatenate([want, np.zeros((3, 5), bool)], 1)))
        for r in range(3):
            ids = np.flatnonzero(want[r])
            assert token_mask.count(words[r]) == len(ids)
            assert [token_mask.nth(words[r], i) for i in range(len(ids))] == list(ids)
            assert [token_mask.has(words[r], t) for t in range(vocab)] == list(want[r])


def plain_walk(row, index: list[int], choose, max_tokens: int) -> list[int]:
    """A canvas walked from the row's state with no state kept (Constraint.walk before issue 44)."""
    trial, tokens = row.copy(), []
    for c, i in enumerate(index):
        room = max_tokens - i
        forced = trial.forced() if room > 0 or trial.is_closed else None
        if forced is None or not trial.admit(forced, room):
            token = choose(0, c, trial.packed())
            if token is None or not trial.admit(token, room):
                token = trial.fallback()
                assert trial.admit(token, room)
            forced = token
        tokens.append(forced)
    return tokens


def chooser(pass_idx: int, vocab: int):
    """A seeded choice per (pass, column): an allowed token, any token (maybe refused) or none."""
    def choose(b: int, c: int, words: np.ndarray) -> int | None:
        rng = random.Random(pass_idx * 1000 + c)
        kind = rng.random()
        if kind < 0.6:
            return token_mask.nth(words, rng.randrange(token_mask.count(words)))
        return rng.randrange(vocab) if kind < 0.9 else None
    return choose


@pytest.mark.parametrize("slack", [2, 40])
def test_a_walk_that_keeps_its_states_walks_as_one_that_keeps_none(models, slack):
    """Over two canvases of passes that walk some prefixes again; `slack`: room past the shortest completion."""
    llm = models("llama")
    grammar = llm.grammar.compile(StructuredSpec.json_schema(PERSON))
    max_tokens = len(grammar.start[1]) + slack
    constraint = llm.grammar.constraint(grammar, 1, max_tokens)
    for canvas in range(2):
        index, start = list(range(canvas * 13, canvas * 13 + 13)), constraint.rows[0].copy()
        for p in range(6):
            choose = chooser(p % 3, llm.cfg.vocab_size)  # passes 3-5 walk again what 0-2 walked
            [walked] = constraint.walk(index, choose, [True])
            assert walked == plain_walk(start, index, choose, max_tokens), (canvas, p)
        constraint.take([walked], index)
        for token, i in zip(walked, index):
            assert start.admit(token, max_tokens - i)
        row = constraint.rows[0]
        assert (row.num_committed, row.closing, row.is_closed) == (start.num_committed, start.closing, start.is_closed)
        assert (row.packed() == start.packed()).all()


def draws(logits: torch.Tensor, words: np.ndarray, accepted: bool, n: int) -> Counter:
    probs = torch.softmax(logits, -1)
    flags = torch.tensor([[accepted]])
    return Counter(WalkCandidates(logits, probs, flags, torch.Generator().manual_seed(i)).drawn(0, 0, words)
                   for i in range(n))


@pytest.mark.parametrize("k", [16, 2])
def test_a_kept_sample_is_drawn_from_the_allowed_tokens_renormalised(monkeypatch, k):
    """The first allowed Gumbel-perturbed candidate, or where none of the k is allowed a draw on the
    device: either way p restricted to the allowed tokens (k = 2 takes the second way often)."""
    monkeypatch.setattr(walk_candidates, "TOP_K", k)
    logits = torch.linspace(2.0, -2.0, 12)[None, None]  # (1, 1, 12)
    allowed = [1, 4, 7, 11]
    words, n = token_mask.only(allowed, 1), 3000
    p = torch.softmax(logits[0, 0], -1)[allowed]
    p = p / p.sum()
    for counts, want in ((draws(logits, words, True, n), p.tolist()), (draws(logits, words, False, n), [0.25] * 4)):
        assert set(counts) <= set(allowed)
        for token, q in zip(allowed, want):
            assert abs(counts[token] / n - q) < 4 * (q * (1 - q) / n) ** 0.5 + 1e-3, (k, token, counts)
    candidates = WalkCandidates(logits, torch.softmax(logits, -1), torch.tensor([[True]]), None)
    assert candidates.best(0, 0, words) == 1  # the argmax among the allowed
    assert candidates.best(0, 0, token_mask.only(allowed[1:], 1)) == 4  # k = 2: past the candidates, on the device
    filtered = logits.masked_fill(torch.arange(12) > 0, float("-inf"))  # only token 0 has mass
    candidates = WalkCandidates(filtered, torch.softmax(filtered, -1), torch.tensor([[True]]), None)
    assert candidates.best(0, 0, words) is None and candidates.drawn(0, 0, words) in allowed


@pytest.mark.parametrize("top_k", [16, 1])
def test_diffusion_gemma_constrained_runs_repeat_under_a_seed_and_are_valid(models, monkeypatch, top_k):
    monkeypatch.setattr(walk_candidates, "TOP_K", top_k)  # 1: most kept samples need the device's draw
    llm = models("diffusion_gemma")
    for spec in SPECS[:3]:
        settings = dict(max_tokens=64, structured=spec, temperature=1.0, seed=3, max_denoising_steps=6)
        [first], [again] = llm.generate("x", **settings), llm.generate("x", **settings)
        assert first.token_ids == again.token_ids and first.finish_reason == "stop" and valid(spec, first.text)
        if spec.kind == "json":
            jsonschema.validate(json.loads(first.text), json.loads(spec.value))


def test_diffusion_gemma_constrained_requests_batched_equal_alone_each_with_its_seed(models):
    """Greedy (a sampled pass's floats differ once batched, with or without a grammar), but every draw of
    the walk (the canvas, renoised tokens, the candidates' noise) from each request's own seed."""
    llm = models("diffusion_gemma")
    requests, alone = [], {}
    for seed, (prompt, spec) in enumerate([("a", SPECS[0]), ("b", None), ("c", SPECS[2]), ("d", SPECS[3])]):
        params = llm.resolve(GenerationParams(max_tokens=48, structured=spec, seed=seed,
                                              max_denoising_steps=6))
        request = Request([llm.encode_prompt(prompt)], params)
        requests.append(request)
        alone[request.request_id] = llm.generate(llm.encode_prompt(prompt), params)[0]
    run(Engine(llm, max_batch_size=8), {0: requests[:2], 1: requests[2:]})
    for request in requests:
        want = alone[request.request_id]
        assert llm.cut_at_stop(request.output_ids[0]) == (want.token_ids, want.finish_reason)
