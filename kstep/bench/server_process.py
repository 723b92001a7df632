"""A real `kstep serve` in a subprocess on 127.0.0.1: for `kstep bench serve` and the server tests."""
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(model: Path | str, *args: str, log: Path | None = None):
    """Yields (base_url, process); the server is stopped (SIGTERM) on exit."""
    port = free_port()
    threads = os.environ.get("KSTEP_TEST_THREADS", "2")
    cmd = [sys.executable, "-m", "kstep", "serve", "--model", str(model), "--port", str(port), "--threads", threads,
           "--log-level", "warning", *args]
    err = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kstep serve exited with {proc.returncode}: {log.read_text() if log else ''}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("kstep serve did not become healthy in 120 s")
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if log:
            err.close()
