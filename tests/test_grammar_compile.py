"""A grammar is compiled once per spec, off the server's event loop: while one compiles (held here
until the test lets it go), the server answers other requests; a refused spec is refused again from
the cache, and a spec that several requests bring at once is compiled once."""
import socket
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
from kstep.structured.grammar import GrammarCompiler, Refusal


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
