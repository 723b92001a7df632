"""Tensor parallel with the "ray" backend, on local Ray clusters (CPU, one thread per rank): rank
actors in a placement group give TP=1's tokens (llama, llada) and run this checkout's kstep; a
killed rank actor fails its group at once (GroupLost) and Ray, started by kstep, stops with the last
model; `kstep serve --replicas 1 -tp 2` (a replica spanning 2 ranks, behind Ray Serve's proxy)
answers concurrent mixed requests as a single TP=1 process does, a rank actor killed mid-request
ends it with a 503, the replica is replaced and answers the same again; SIGTERM leaves none of its
processes behind; bad flags are refused naming the value."""
import asyncio
import os
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest

import kstep
from kstep.bench.server_process import running_server
from kstep.cli import main
from kstep.distributed.runner import GroupLost
from kstep.random_checkpoint import write_random_checkpoint
from test_server import client

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
from kstep.server.replicas import check_fits  # noqa: E402  (Ray Serve: only where it is installed)
pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two ranks need two cores")
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
FAMILIES = {  # family: (checkpoint sizes, generation settings)
    "llama": ({"n_kv_heads": 1, "vocab_size": 503}, [{}, {"temperature": 0.8, "seed": 1}]),
    "llada": ({}, [{}, {"exact": True}]),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {f: write_random_checkpoint(tmp_path_factory.mktemp(f), family=f, seed=7, **sizes)
            for f, (sizes, _) in FAMILIES.items()}


def descendants(pid: int) -> dict[int, str]:
    """The processes below `pid` (a local Ray's raylet, and its workers below it), with their command lines."""
    rows = subprocess.run(["ps", "-wweo", "pid=,ppid=,args="], capture_output=True, text=True).stdout.splitlines()
    table = [(int(p), int(pp), " ".join(rest)) for p, pp, *rest in (r.split(maxsplit=2) for r in rows)]
    found, frontier = {}, {pid}
    while frontier:
        below = {p: args for p, parent, args in table if parent in frontier and p not in found}
        found.update(below)
        frontier = set(below)
    return found


def alive(pids) -> set[int]:
    """Those of `pids` still running (a zombie, gone but not yet reaped, is not)."""
    rows = subprocess.run(["ps", "-eo", "pid=,stat="], capture_output=True, text=True).stdout.splitlines()
    return {int(p) for p, stat in (r.split() for r in rows) if not stat.startswith("Z")} & set(pids)


def test_rank_actors_generate_what_one_rank_does(checkpoints):
    assert not ray.is_initialized()
    twos = {}
    try:
        for family, path in checkpoints.items():  # the first starts Ray here; both groups fit its 2 CPUs
            twos[family] = kstep.load(path, tensor_parallel_size=2, distributed_executor_backend="ray")
        raylets = {p for p, args in descendants(os.getpid()).items() if "raylet" in args}
        assert raylets
        for family, two in twos.items():
            one = kstep.load(checkpoints[family])
            for settings in FAMILIES[family][1]:
                want, got = one.generate(PROMPTS, max_tokens=24, **settings), two.generate(PROMPTS, max_tokens=24,
                                                                                             **settings)
                assert [r.token_ids for r in got] == [r.token_ids for r in want], (family, settings)
                assert [r.nfe for r in got] == [r.nfe for r in want], (family, settings)
            (rank,) = two.runner.channels
            assert rank.where["kstep"] == kstep.__file__ and rank.where["pid"] != os.getpid()  # this checkout's
            group = ray.util.placement_group_table()[rank.where["placement_group"]]
            assert group["strategy"] == "STRICT_PACK" and group["state"] == "CREATED"
            assert [b["CPU"] for b in group["bundles"].values()] == [1.0]  # rank 1's; rank 0 is this process
        with pytest.raises(ValueError, match=r"3 ranks of \{'CPU': 1\} do not fit"):
            kstep.load(checkpoints["llama"], tensor_parallel_size=4, distributed_executor_backend="ray")
        with pytest.raises(ValueError, match=r"need \{'CPU': 4.0\} on one node"):  # serve --replicas 1 -tp 4 here
            check_fits([{"CPU": 1.0}] + [{"CPU": 1}] * 3)
        llama = twos["llama"]
        llama.runner.channels[0].kill()  # ray.kill
        start = time.monotonic()
        with pytest.raises(GroupLost, match="kstep-rank-1 stopped"):
            llama.generate(PROMPTS[0], max_tokens=4)
        assert time.monotonic() - start < 10
        assert len(twos["llada"].generate(PROMPTS[0], max_tokens=4)[0].token_ids) == 4  # the other group goes on
    finally:
        for two in twos.values():
            two.close()
    assert not ray.is_initialized()  # kstep started it, and stopped it with its last model
    deadline = time.monotonic() + 30
    while alive(raylets) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(raylets)


def test_bad_flags_are_refused_naming_the_value(checkpoints, capsys):
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of mp, ray, got 'nope'"):
        kstep.load(checkpoints["llama"], tensor_parallel_size=2, distributed_executor_backend="nope")
    with pytest.raises(SystemExit):
        main(["generate", "x", "--model", str(checkpoints["llama"]), "--distributed-executor-backend", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    assert main(["serve", "--model", str(checkpoints["llama"]), "--replicas", "1", "-tp", "2",
                 "--distributed-executor-backend", "mp"]) == 2
    assert "--distributed-executor-backend mp with --replicas" in capsys.readouterr().err


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    """One replica: the llada model over 2 ranks (the replica and a rank actor), the llama one on the
    replica alone (both at 2 ranks need a third CPU)."""
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with running_server(f"ld={checkpoints['llada']}", "--model", f"ar={checkpoints['llama']}:tp=1", "-tp", "2",
                        "--replicas", "1", "--threads", "1", "--cpus-per-replica", "1", "--graceful-timeout", "2",
                        log=log) as (url, proc):
        yield url, proc, log


REQUESTS = [(m, p) for m in ("ld", "ar") for p in ("def f(x):", "x = [", "class A:")]


def test_a_replica_over_two_ranks_batches_as_one_process_answers(served, checkpoints):
    url, _, _ = served
    ones = {"ld": kstep.load(checkpoints["llada"]), "ar": kstep.load(checkpoints["llama"])}
    want = [ones[m].generate(p, max_tokens=16, temperature=0)[0].text for m, p in REQUESTS]

    async def together():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as c:
            return await asyncio.gather(*(c.completions.create(model=m, prompt=p, max_tokens=16, temperature=0)
                                          for m, p in REQUESTS))
    assert [out.choices[0].text for out in asyncio.run(together())] == want
    alone = client(url).completions.create(model="ld", prompt=REQUESTS[0][1], max_tokens=16, temperature=0)
    assert alone.choices[0].text == want[0]


def answer(url: str) -> tuple[int, str, str]:
    r = httpx.post(url + "/v1/completions", json={"model": "ld", "prompt": REQUESTS[0][1], "max_tokens": 16,
                                                   "temperature": 0}, timeout=60)
    return r.status_code, r.headers.get("x-kstep-replica", ""), r.json()["choices"][0]["text"] if r.is_success \
        else ""


def test_a_killed_rank_actor_ends_the_request_with_503_and_the_replica_is_replaced(served):
    url, proc, _ = served
    status, replica, text = answer(url)
    assert status == 200
    (rank,) = [p for p, args in descendants(proc.pid).items() if args.startswith("ray::RankActor")]
    got = {}

    def long_request():
        try:
            got["r"] = client(url, timeout=60).completions.create(
                model="ld", prompt="x", max_tokens=512, temperature=0, extra_body={"exact": True})
        except openai.APIStatusError as e:
            got["r"] = e
    worker = threading.Thread(target=long_request)
    worker.start()
    deadline = time.monotonic() + 30
    while not httpx.get(url + "/health", timeout=30).json()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(rank, signal.SIGKILL)  # mid-request
    worker.join(60)
    assert not worker.is_alive()
    assert got["r"].status_code == 503 and "tensor-parallel group" in got["r"].message
    # the broken replica answers 503 until Serve's health check replaces it; the new one answers as before
    deadline, statuses = time.monotonic() + 90, []
    while time.monotonic() < deadline:
        statuses.append(answer(url))
        if statuses[-1][0] == 200:
            break
        time.sleep(0.5)
    assert statuses[-1][0] == 200 and statuses[-1][1] != replica and statuses[-1][2] == text, statuses
    assert {s for s, _, _ in statuses} <= {200, 503}


def test_sigterm_stops_the_replica_and_its_rank_actors(served):
    _, proc, log = served
    below = descendants(proc.pid)
    assert any(args.startswith("ray::RankActor") for args in below.values())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0, log.read_text()[-2000:]
    deadline = time.monotonic() + 30
    while alive(below) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(below), {p: below[p] for p in alive(below)}
