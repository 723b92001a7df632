"""`kstep serve --replicas 2` on Ray Serve, on loopback: requests spread over both replicas, greedy
output equals a single process's, streaming works through Ray's proxy, a killed replica is replaced
and later requests succeed (in-flight ones end, none hangs), SIGTERM exits cleanly and leaves no Ray
processes of its own behind."""
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from test_server import client

import kstep
from kstep.bench.server_process import running_server

pytest.importorskip("ray.serve")

PROMPTS = ["def add(a, b):", "class Stack:\n    def push(self, x):", "for i in range(10):", "x = ["]


def ray_processes() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "raylet|gcs_server|ray::"], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


@pytest.fixture(scope="module")
def replicated(llama_path, tmp_path_factory):
    before = ray_processes()
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with running_server(f"tiny={llama_path}", "--replicas", "2", "--threads", "1", "--cpus-per-replica", "0.5",
                        log=log) as (url, proc):
        yield url, proc, before
    assert proc.wait(timeout=60) == 0, log.read_text()[-2000:]


def replica_of(url: str, prompt: str = PROMPTS[0]) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                   "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers["x-kstep-replica"]


def test_requests_spread_over_both_replicas(replicated):
    url, _, _ = replicated
    assert len({replica_of(url) for _ in range(24)}) == 2


def test_greedy_output_equals_a_single_process(replicated, llama_path):
    url, _, _ = replicated
    alone = kstep.load(llama_path)
    for prompt in PROMPTS:
        out = client(url).completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
        assert out.choices[0].text == alone.generate(prompt, max_tokens=16)[0].text


def test_streaming_through_the_proxy(replicated, llama_path):
    url, _, _ = replicated
    chunks = list(client(url).completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                                  stream=True))
    assert len(chunks) > 1 and chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].text for c in chunks) == kstep.load(llama_path).generate(PROMPTS[1],
                                                                                         max_tokens=16)[0].text
    with pytest.raises(openai.NotFoundError):  # the same errors as one process
        client(url).completions.create(model="nope", prompt="x", max_tokens=4)


def test_metrics_name_their_replica(replicated):
    url, _, _ = replicated
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200
    replica = r.headers["x-kstep-replica"]
    assert f'kstep_replica{{replica="{replica}"}} 1.0' in r.text
    assert "# HELP kstep_requests_total" in r.text  # and the same series as one process


def replica_pids(url: str) -> dict[str, int]:
    pids = {}
    for _ in range(200):  # /health lands on either replica
        health = httpx.get(url + "/health", timeout=30).json()
        pids[health["replica"]] = health["pid"]
        if len(pids) == 2:
            return pids
    raise AssertionError(f"/health answered from {pids} only")


def test_a_killed_replica_is_replaced(replicated):
    url, _, _ = replicated
    # a long stream in flight on the replica about to die ends (cut short), it does not hang
    pids = replica_pids(url)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 900, "min_tokens": 900, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
        victim = stream.headers["x-kstep-replica"]
        os.kill(pids[victim], signal.SIGKILL)
        events, ended = [], "complete"
        try:
            events = [line for line in stream.iter_lines() if line.startswith("data:")]
        except httpx.HTTPError as e:
            ended = type(e).__name__
    received = len(events)
    assert ended != "complete" or "data: [DONE]" not in events, (ended, received)  # cut short, and it ended
    # requests right after the kill end (an error from the dead replica, or served by the other): none hangs
    statuses = []
    for _ in range(8):
        try:
            statuses.append(httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4},
                                       timeout=60).status_code)
        except httpx.HTTPError as e:
            statuses.append(type(e).__name__)
    assert len(statuses) == 8
    print(f"in-flight stream: {ended} after {received} events; right after the kill: {statuses}")
    deadline, seen = time.monotonic() + 120, set()
    while time.monotonic() < deadline and len(seen - {victim}) < 2:  # Ray starts a replacement
        try:
            seen.add(replica_of(url))
        except (AssertionError, httpx.HTTPError, KeyError):
            time.sleep(1)
    assert len(seen - {victim}) == 2, seen
    assert replica_of(url) != victim


def test_sigterm_exits_and_leaves_no_ray_processes(replicated):
    url, proc, before = replicated
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0
    deadline = time.monotonic() + 30
    while ray_processes() - before and time.monotonic() < deadline:
        time.sleep(1)
    assert not ray_processes() - before


@pytest.mark.parametrize("flags", [["--replicas", "0"], ["--replicas", "2", "--cpus-per-replica", "0"]])
def test_bad_replica_flags_are_refused(llama_path, flags):
    out = subprocess.run([sys.executable, "-m", "kstep", "serve", "--model", str(llama_path), *flags],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "must be positive" in out.stderr
    assert "Traceback" not in out.stderr
