"""A real `kstep serve` in a subprocess on 127.0.0.1: for `kstep bench serve` and the server tests."""
import os
import random
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx


# Ports no process is handed unasked: above Ray's worker ports (10002-19999) and below the kernel's
# ephemeral range (Linux 32768-60999, macOS 49152-65535), which bind(0) and outgoing connections draw
# from. A port picked by bind(0) and released is free again for them: Ray's own processes, starting
# before its proxy binds the port it was given, took one once ("Failed to bind to address").
QUIET_PORTS = (20000, 32768)


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return QUIET_PORTS[1]


def free_port() -> int:
    """A port free now that nothing else will take before the server binds it (QUIET_PORTS); picked at
    random so that runs side by side differ."""
    low, high = QUIET_PORTS[0], min(QUIET_PORTS[1], _ephemeral_low())
    for port in random.Random(time.time_ns() ^ os.getpid()).sample(range(low, high), min(500, max(0, high - low))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    with socket.socket() as s:  # none there (an ephemeral range that starts low): the kernel's pick
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
            try:  # a probe waits for its answer: under Ray Serve, one its client dropped while the replicas
                # started stayed counted on a replica, whose router then sent every request to the other
                if httpx.get(url + "/health", timeout=30).status_code == 200:
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
