"""No request holds a slot past its client or the server's limits: a client that leaves (streaming
or not) is aborted before the next step and counted as 499; knobs that multiply passes have upper
bounds (400 naming the field and the limit); `--max-request-passes` / `--max-request-seconds` end a
request with finish_reason "length"; a shutdown ends the requests in flight at once, cleanly.
Through a real `kstep serve` and the official `openai` client."""
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

import kstep
from kstep.bench.server_process import running_server
from kstep.engine.engine import Engine
from kstep.engine.request import Request, RequestLimits
from test_server import client, metric

# A long request on the tiny LLaDA: one pass per token over a 512-token canvas (seconds of work).
LONG = {"model": "ld", "prompt": "def f(x):", "max_tokens": 512, "temperature": 0, "exact": True}
PASS_LIMIT = 600


def long_request(c: openai.OpenAI, **kw):
    return c.completions.create(**{k: v for k, v in LONG.items() if k != "exact"}, extra_body={"exact": True}, **kw)


@pytest.fixture(scope="module")
def server(llada_path, llama_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with running_server(f"ld={llada_path}", "--model", f"ar={llama_path}", "--max-request-passes", str(PASS_LIMIT),
                        log=log) as (url, _):
        yield url


def wait_until_idle(url: str, within: float) -> float:
    """Seconds until the server runs no request (fails past `within`)."""
    start = time.monotonic()
    while httpx.get(url + "/health").json()["running"]:
        if time.monotonic() - start > within:
            pytest.fail(f"a request still holds its slot {within} s after its client left")
        time.sleep(0.02)
    return time.monotonic() - start


def wait_until_running(url: str) -> None:
    for _ in range(200):
        if httpx.get(url + "/health").json()["running"]:
            return
        time.sleep(0.02)
    pytest.fail("the request never started")


def test_a_non_streaming_client_that_leaves_frees_its_slot_at_once(server):
    left = metric(server, "kstep_requests_total", 'model="ld",status="499"')
    with pytest.raises(openai.APITimeoutError):
        long_request(client(server, timeout=1.0))
    assert wait_until_idle(server, within=2.0) < 2.0
    assert metric(server, "kstep_requests_total", 'model="ld",status="499"') == left + 1


def test_a_streaming_client_that_leaves_frees_its_slot_at_once(server):
    left = metric(server, "kstep_requests_total", 'model="ld",status="499"')
    stream = long_request(client(server), stream=True, stream_options={"include_canvas": True})
    next(iter(stream))
    stream.close()
    assert wait_until_idle(server, within=2.0) < 2.0
    assert metric(server, "kstep_requests_total", 'model="ld",status="499"') == left + 1


def test_the_server_pass_limit_ends_a_request_with_length(server):
    out = client(server).completions.create(model="ar", prompt="def f(x):", max_tokens=1000, temperature=0,
                                            extra_body={"ignore_eos": True})
    usage = out.usage.model_extra
    assert out.choices[0].finish_reason == "length"
    assert (usage["nfe"], usage["server_limit"], usage["server_limit_value"]) == (PASS_LIMIT, "max_request_passes",
                                                                                 PASS_LIMIT)
    assert out.usage.completion_tokens == PASS_LIMIT  # ignore_eos: every token is the completion's
    short = client(server).completions.create(model="ar", prompt="def f(x):", max_tokens=8, temperature=0)
    assert "server_limit" not in short.usage.model_extra


@pytest.mark.parametrize("fields, param, limit", [
    ({"steps": 10**9}, "steps", "2048"),                               # 4 passes per position of 512 tokens
    ({"max_tokens": 16, "steps": 65}, "steps", "64"),
])
def test_knobs_that_multiply_passes_are_bounded(server, fields, param, limit):
    r = httpx.post(server + "/v1/completions", json={**LONG, "exact": None, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and f"limit of {limit}" in error["message"], error


def test_negative_seed_is_refused_and_type_errors_count_under_the_named_model(server):
    r = httpx.post(server + "/v1/completions", json={"model": "ar", "prompt": "x", "seed": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    before = metric(server, "kstep_requests_total", 'model="ar",status="400"')
    r = httpx.post(server + "/v1/completions", json={"model": "ar", "prompt": "x", "max_tokens": "5"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert metric(server, "kstep_requests_total", 'model="ar",status="400"') == before + 1
    unknown = metric(server, "kstep_requests_total", 'model="",status="400"')
    httpx.post(server + "/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": "5"})
    assert metric(server, "kstep_requests_total", 'model="",status="400"') == unknown + 1  # no such model


def test_prompt_tokens_count_the_prompt_once_with_n_choices(server):
    one = client(server).completions.create(model="ar", prompt="def f(x):", max_tokens=4, temperature=0)
    two = client(server).completions.create(model="ar", prompt="def f(x):", max_tokens=4, temperature=0, n=2)
    assert two.usage.prompt_tokens == one.usage.prompt_tokens > 0
    assert len(two.choices) == 2


def test_the_seconds_limit_ends_a_running_request(llada_path):
    llm = kstep.load(llada_path)
    engine = Engine(llm, limits=RequestLimits(max_seconds=0.2))
    request = Request([[5, 6, 7]], llm.resolve(kstep.GenerationParams(max_tokens=512, exact=True)))
    engine.add_request(request)
    start, outputs = time.monotonic(), []
    while engine.has_work():
        outputs += engine.step()[0]
    assert 0.2 <= time.monotonic() - start < 5 and 0 < request.nfe < 512
    assert outputs[-1].is_finished and outputs[-1].limit == ("max_request_seconds", 0.2)
    assert outputs[-1].choices[-1].finish_reason == "length"


def test_shutdown_ends_requests_in_flight_at_once_and_cleanly(llada_path, tmp_path):
    log = tmp_path / "serve.log"
    with running_server(f"ld={llada_path}", "--log-level", "info", log=log) as (url, proc):
        answers = {}

        def plain():
            answers["plain"] = httpx.post(url + "/v1/completions", json=LONG, timeout=60)

        def streamed():
            with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
                answers["stream"] = [line for line in r.iter_lines() if line]
        workers = [threading.Thread(target=f) for f in (plain, streamed)]
        for worker in workers:
            worker.start()
        for _ in range(1500):  # up to 30 s: on a loaded machine the requests are admitted late
            if httpx.get(url + "/health").json()["running"] == 2:
                break
            time.sleep(0.02)
        else:
            pytest.fail("the two requests were not both running after 30 s")
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.join(timeout=30)
        answered = time.monotonic() - start
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        exited = time.monotonic() - start
    assert answered < 2 and exited < 10, (answered, exited)
    assert answers["plain"].status_code == 503 and answers["plain"].json()["error"]["code"] == "server_shutdown"
    assert '"code": "server_shutdown"' in answers["stream"][-2] and answers["stream"][-1] == "data: [DONE]"
    text = log.read_text()
    assert "Traceback" not in text and "CancelledError" not in text and "timeout graceful shutdown" not in text


def test_random_start_model_at_temperature_zero_repeats_without_a_seed(gemma_path):
    llm = kstep.load(gemma_path)
    runs = [llm.generate([5, 6, 7], max_tokens=8, temperature=0)[0].token_ids for _ in range(2)]
    assert runs[0] == runs[1]
    assert llm.resolve(kstep.GenerationParams(temperature=0)).seed == 0
    assert llm.resolve(kstep.GenerationParams(temperature=0.5)).seed is None


def test_no_profiler_lines_in_benchmark_output(llada_path):
    """kineto prints `USDT:... profiler_start` to fd 2 from C++; `bench compare`'s profile must not."""
    code = ("import kstep; from kstep.params import GenerationParams;"
            "from kstep.bench.compare import profile_generation;"
            f"llm = kstep.load({str(llada_path)!r}); print(sorted(profile_generation(llm, [5, 6, 7], "
            "GenerationParams(max_tokens=8, exact=True))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "attention" in done.stdout and "USDT" not in done.stderr + done.stdout, done.stderr
