"""A grammar is compiled once per spec, off the server's event loop: while one compiles (held here
until the test lets it go), the server answers other requests; a refused spec is refused again from
the cache, and a spec that several requests bring at once is compiled once. A server's compiles run
in a worker process of the lowest priority, which ends with the server; a compile that kills it is
refused, and a worker that cannot start leaves compiles in the process."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

import kstep
from kstep.random_checkpoint import write_random_checkpoint
from kstep.server.app import ServeConfig, ServedModel, build_app
from kstep.structured import StructuredSpec
from kstep.bench.server_process import running_server
from kstep.structured.compile_worker import CompileWorker
from kstep.structured.grammar import GrammarCompiler, Plan, Refusal

SLOW_REGEX = StructuredSpec("regex", "x(a{1000}){1000}", "structured_outputs")  # about a second to refuse


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return kstep.load(write_random_checkpoint(tmp_path_factory.mktemp("m"), family="qwen2", seed=3))


def counting_builds(monkeypatch, hold: threading.Event | None = None) -> tuple[list, threading.Event]:
    """GrammarCompiler._build, counted; with `hold`, each build waits for it (`started` is set first)."""
    built, started, build = [], threading.Event(), GrammarCompiler._build

    def counted(self, spec):
        built.append(spec)
        started.set()
        if hold is not None:
            hold.wait(60)
        return build(self, spec)
    monkeypatch.setattr(GrammarCompiler, "_build", counted)
    return built, started


@pytest.fixture
def served(llm):
    """`kstep serve`'s app for `llm`, in this process (so a test can hold a compile), on a bound socket."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app([ServedModel("m", llm)], ServeConfig()), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(30)


def test_the_server_answers_while_a_grammar_compiles(served, monkeypatch):
    hold = threading.Event()
    built, started = counting_builds(monkeypatch, hold)
    body = {"model": "m", "prompt": "x", "max_tokens": 8, "temperature": 0}
    with ThreadPoolExecutor(1) as pool:
        structured = pool.submit(httpx.post, served + "/v1/completions", timeout=120,
                                 json={**body, "structured_outputs": {"regex": "[ab]{3}"}})
        try:
            assert started.wait(60)
            assert httpx.get(served + "/health", timeout=30).status_code == 200  # the event loop is free ...
            free = httpx.post(served + "/v1/completions", json=body, timeout=30)  # ... and serves the rest
            assert free.status_code == 200 and not structured.done()
        finally:
            hold.set()
        reply = structured.result()
    assert reply.status_code == 200 and len(reply.json()["choices"][0]["text"]) == 3 and len(built) == 1


def test_a_refused_spec_is_refused_again_from_the_cache(llm, monkeypatch):
    built, _ = counting_builds(monkeypatch)
    hostile = StructuredSpec.json_schema({"type": "string", "minLength": 1_000_000})
    for _ in range(3):
        with pytest.raises(ValueError, match="no output satisfies the JSON schema, or none the completion search"):
            llm.grammar.compile(hostile)
    assert len(built) == 1
    assert isinstance(llm.grammar._compiler.cache[("json", hostile.value)], Refusal)


def test_a_spec_several_requests_bring_at_once_compiles_once(llm, monkeypatch):
    hold = threading.Event()
    built, started = counting_builds(monkeypatch, hold)
    spec = StructuredSpec("regex", "[0-9]{2}-[a-z]{2}")
    with ThreadPoolExecutor(4) as pool:
        grammars = [pool.submit(llm.grammar.compile, spec) for _ in range(4)]
        assert started.wait(60)
        time.sleep(0.2)  # the others reach the compiler while the first is held
        hold.set()
        first, *others = [g.result() for g in grammars]
    assert len(built) == 1 and all(g is first for g in others)


def _workers_of(pid: int) -> list[int]:
    """The compile worker processes whose parent is `pid` (Linux's /proc)."""
    found = []
    for child in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()
            cmdline = open(f"/proc/{child}/cmdline", "rb").read()
        except OSError:
            continue
        if int(stat[1]) == pid and b"spawn_main" in cmdline:
            found.append(int(child))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_servers_compiles_run_in_a_low_priority_worker_that_ends_with_it(llama_path, tmp_path):
    with running_server(llama_path, "--served-model-name", "m", log=tmp_path / "serve.log") as (url, proc):
        body = {"model": "m", "prompt": "x", "max_tokens": 8, "structured_outputs": {"regex": "[ab]{3}"}}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        [worker] = _workers_of(proc.pid)
        assert os.getpriority(os.PRIO_PROCESS, worker) == 19
        proc.send_signal(signal.SIGKILL)  # no shutdown runs: the worker notices its parent is gone
        proc.wait(10)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{worker}") or "Z" in open(f"/proc/{worker}/stat").read().split()[2]


def test_a_compile_that_ends_its_worker_is_refused_and_the_next_gets_a_new_one():
    worker = CompileWorker()
    worker.start()
    assert isinstance(worker.plan(StructuredSpec("regex", "[ab]{3}")), Plan)
    [pid] = list(worker._pool._processes)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(worker.plan, SLOW_REGEX)
        time.sleep(0.3)  # likely in the slow compile; killed before it, the pending task fails the same way
        os.kill(pid, signal.SIGKILL)
        refused = slow.result(60)
    assert isinstance(refused, Refusal) and "compile worker" in refused.reason
    assert isinstance(worker.plan(StructuredSpec("regex", "[ab]{4}")), Plan)
    assert list(worker._pool._processes) != [pid]
    worker.close()


def test_a_worker_that_cannot_start_leaves_compiles_in_the_process(tmp_path):
    script = tmp_path / "unguarded.py"  # spawn imports the main module again: this one plans at import
    script.write_text("from kstep.structured.compile_worker import CompileWorker\n"
                      "from kstep.structured.spec import StructuredSpec\n"
                      "print(type(CompileWorker().plan(StructuredSpec('regex', '[ab]{3}'))).__name__)\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().splitlines()[-1] == "Plan", run.stderr
    assert "the grammar compile worker did not start" in run.stderr
