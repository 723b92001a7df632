"""The step budget (issue 45, `max_num_batched_tokens`). Whole-canvas diffusion requests join only
while their passes fit it beside the running ones' (the first always joins), so a step's activations
and logits stay bounded; their outputs are as alone. Chunked prefill: under the budget (`max_num_batched_tokens`) a long AR prompt is
prefilled in fixed chunks, one a step, packed with the running streams' decode passes: no step runs
more than the budget plus one chunk, the streams commit a token every step while it prefills, and
every output is the one the same request gets alone under the same budget (chunk boundaries do not
depend on the neighbours). A chunk that does not fit what a step has left waits; the step's first
prefill always goes."""
import pytest
import torch

import kstep
from kstep.engine.engine import Engine
from kstep.engine.request import Request
from kstep.random_checkpoint import write_random_checkpoint

CHUNK = 64


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return kstep.load(write_random_checkpoint(tmp_path_factory.mktemp("qwen2"), family="qwen2", seed=4))


def _request(llm, prompt: list[int], max_tokens: int) -> Request:
    return Request([prompt], llm.resolve(kstep.GenerationParams(max_tokens=max_tokens, temperature=0)))


def _run(engine: Engine, requests: list[Request], join_after: dict[int, int] | None = None) -> list:
    """Step until done; request i joins once `join_after[i]` steps have run. Every step's stats."""
    join_after, steps = join_after or {}, []
    pending = dict(enumerate(requests))
    while pending or engine.has_work():
        for i in [i for i in pending if join_after.get(i, 0) <= len(steps)]:
            engine.add_request(pending.pop(i))
        steps.append(engine.step()[1])
    return steps


def test_a_long_prompt_prefills_in_chunks_beside_running_streams(llm):
    g = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(0, llm.cfg.vocab_size, (300,), generator=g).tolist()
    short = [torch.randint(0, llm.cfg.vocab_size, (5,), generator=g).tolist() for _ in range(3)]
    streams = [_request(llm, p, 24) for p in short]
    long_request = _request(llm, long_prompt, 8)
    steps = _run(Engine(llm, max_num_batched_tokens=CHUNK), streams + [long_request], {3: 2})
    assert max(s.num_tokens for s in steps) <= CHUNK + len(streams)  # a chunk and the streams' decode tokens
    prefill_steps = -(-len(long_prompt) // CHUNK)
    assert long_request.nfe == prefill_steps + 7  # its chunks, then one pass a token
    # while it prefilled (steps 2 .. 2 + prefill_steps) the streams went on committing a token each step
    assert all(s.num_committed >= len(streams) for s in steps[2:2 + prefill_steps])
    for request in streams + [long_request]:  # each as alone under the same budget
        again = _request(llm, request.prompts[0], request.params.max_tokens)
        _run(Engine(llm, max_num_batched_tokens=CHUNK), [again])
        assert again.output_ids == request.output_ids


def test_a_second_prefill_waits_for_a_step_with_room(llm):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, llm.cfg.vocab_size, (100,), generator=g).tolist() for _ in range(2)]
    requests = [_request(llm, p, 4) for p in prompts]
    steps = _run(Engine(llm, max_num_batched_tokens=CHUNK), requests)
    assert max(s.num_tokens for s in steps) <= CHUNK + 1  # never both prompts' chunks in one step
    assert len(steps) >= 2 * -(-100 // CHUNK) + 3  # so the second's chunks came after the first's


def test_the_chunk_can_be_smaller_than_the_step_budget(llm, capsys):
    """long_prefill_token_threshold (vLLM's name, `--long-prefill-token-threshold`): chunks of CHUNK
    tokens under a step budget of 4 x CHUNK, so two long prompts prefill side by side, a chunk each
    a step, where one budget for both made the second wait."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, llm.cfg.vocab_size, (100,), generator=g).tolist() for _ in range(2)]
    requests = [_request(llm, p, 4) for p in prompts]
    engine = lambda: Engine(llm, max_num_batched_tokens=4 * CHUNK, long_prefill_token_threshold=CHUNK)  # noqa: E731
    steps = _run(engine(), requests)
    assert max(s.num_tokens for s in steps) == 2 * CHUNK  # both prompts' first chunks in one step
    assert len(steps) == -(-100 // CHUNK) + 3  # their 2 chunks side by side, then 3 decode steps
    for request in requests:  # each as alone under the same settings
        again = _request(llm, request.prompts[0], request.params.max_tokens)
        _run(engine(), [again])
        assert again.output_ids == request.output_ids
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        Engine(llm, long_prefill_token_threshold=0)
    from kstep.cli import main
    assert main(["serve", "--long-prefill-token-threshold", "0"]) == 2
    assert "--long-prefill-token-threshold 0 must be > 0" in capsys.readouterr().err


def test_diffusion_requests_join_while_their_canvases_fit_the_step(tmp_path):
    llada = kstep.load(write_random_checkpoint(tmp_path, family="llada", seed=2))
    prompts = [[4 + i, 9, 11 + i] for i in range(5)]  # canvases of 3 + 12 tokens
    requests = [_request(llada, p, 12) for p in prompts]
    steps = _run(Engine(llada, max_num_batched_tokens=2 * 15), requests)
    assert max(s.batch_size for s in steps) == 2 and max(s.num_tokens for s in steps) <= 30
    assert [r.output_ids[0] for r in requests] == [r.token_ids for r in llada.generate(prompts, max_tokens=12)]
    huge = _request(llada, [5] * 40, 12)  # alone it joins, over the budget or not
    _run(Engine(llada, max_num_batched_tokens=30), [huge])
    assert huge.is_finished and len(huge.output_ids[0]) == 12


@pytest.mark.parametrize("family, settings", [("sdar", {}), ("fast_dllm_v2", {"cache": "dual"}),
                                              ("llada2_moe", {}), ("sdar", {"draft": "self"})])
def test_a_block_model_prefills_in_chunks_of_whole_blocks(tmp_path, family, settings):
    """A block-causal prompt in chunks of whole blocks beside a running request: no step runs more
    than the budget plus a block (the last chunk carries the block the outputs are read from), and
    every output is the one it gets alone, unchunked."""
    llm = kstep.load(write_random_checkpoint(tmp_path, family=family, seed=3))
    bs = llm.cfg.block_size
    g = torch.Generator().manual_seed(5)
    long_prompt = torch.randint(0, llm.cfg.vocab_size, (20 * bs + 3,), generator=g).tolist()
    short = torch.randint(0, llm.cfg.vocab_size, (bs + 1,), generator=g).tolist()
    chunk = 4 * bs
    params = dict(max_tokens=4 * bs, temperature=0, **settings)
    requests = [Request([p], llm.resolve(kstep.GenerationParams(**params))) for p in (short, long_prompt)]
    steps = _run(Engine(llm, max_num_batched_tokens=chunk), requests, {1: 1})
    assert max(s.num_tokens for s in steps) <= chunk + 3 * bs + 2 * bs * (1 + bool(settings.get("draft")) * 4)
    # its first chunk ran beside the short request's pass; under self-speculation the short one's K
    # drafts fill the budget alone (step_tokens), so the long one joins once it has finished
    assert steps[1].batch_size == (1 if settings.get("draft") else 2)
    for request in requests:  # as alone, unchunked
        again = Request(request.prompts, request.params)
        _run(Engine(llm, max_num_batched_tokens=None), [again])
        assert again.output_ids == request.output_ids
    # 20 blocks in chunks of 4 blocks: at least 4 whole chunks before the last, each a pass of its own
    assert requests[1].nfe - again.nfe >= 4


def test_generate_is_one_request_on_the_engine(llm):
    """LLM.generate takes the engine's path: a seeded batch equals the same request stepped by a
    server's engine; unseeded, it draws from torch's generator (the engine seeds only a server's
    requests); its timings count its passes."""
    prompts, params = [[5, 6, 7], [8, 9, 10, 11, 12]], dict(max_tokens=8, temperature=1.0)
    results = llm.generate(prompts, seed=11, **params)
    served = _request(llm, [0], 8)
    served.prompts, served.params = prompts, llm.resolve(kstep.GenerationParams(seed=11, **params))
    _run(Engine(llm), [served])
    assert [r.token_ids for r in results] == [llm.cut_at_stop(row)[0] for row in served.output_ids]
    assert results[0].timings["num_prefill_passes"] + results[0].timings["num_decode_passes"] == results[0].nfe
    torch.manual_seed(3)
    first = llm.generate(prompts, **params)
    torch.manual_seed(3)
    assert [r.token_ids for r in llm.generate(prompts, **params)] == [r.token_ids for r in first]


CAUSAL_PROMPT_CASES = [("diffusion_gemma", {}), ("nemotron_labs_diffusion", {}),
                       ("nemotron_labs_diffusion", {"mode": "linear_spec"}), ("qwen2", {"num_draft_tokens": 3})]


@pytest.mark.parametrize("family, settings", CAUSAL_PROMPT_CASES,
                         ids=[f"{f}-{'-'.join(map(str, s.values())) or 'default'}" for f, s in CAUSAL_PROMPT_CASES])
def test_causal_prompts_of_other_decoders_prefill_in_chunks(tmp_path, family, settings):
    """DiffusionGemma's encoder, Nemotron's causal context (and LinearSpec) and the speculative
    decoder's target and draft prefill a long prompt in chunks beside a running request: each output
    as the same request alone and unchunked, in more passes."""
    path = write_random_checkpoint(tmp_path / "target", family=family, seed=6)
    draft = write_random_checkpoint(tmp_path / "draft", family=family, seed=7, n_layers=1) \
        if "num_draft_tokens" in settings else None
    llm = kstep.load(path, draft=draft)
    g = torch.Generator().manual_seed(8)
    long_prompt = torch.randint(3, llm.cfg.vocab_size - 3, (70,), generator=g).tolist()
    short = torch.randint(3, llm.cfg.vocab_size - 3, (5,), generator=g).tolist()
    params = llm.resolve(kstep.GenerationParams(max_tokens=8, temperature=0, seed=1, **settings))
    requests = [Request([p], params) for p in (short, long_prompt)]
    steps = _run(Engine(llm, max_num_batched_tokens=16), requests, {1: 1})
    assert max(s.num_tokens for s in steps[1:]) <= 16 * (2 if draft else 1) + 40  # a chunk (both models') and the other's pass
    for request in requests:
        again = Request(request.prompts, params)
        _run(Engine(llm, max_num_batched_tokens=None), [again])
        assert again.output_ids == request.output_ids
    assert again.nfe < requests[1].nfe  # unchunked, the long prompt took fewer passes
