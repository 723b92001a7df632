"""Running generated code against its tests (HumanEval format), never in the kstep process: a
fresh `python -I` subprocess per program, with a timeout, memory and CPU limits, sockets
disabled, in an empty temporary directory."""
import os
import subprocess
import sys
import tempfile

# Prepended to every program: no network (sockets refuse to be created), no forking more workers.
_PREAMBLE = """\
import resource, socket
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu}))
def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in kstep eval")
socket.socket = _no_network
socket.create_connection = _no_network
del resource, socket, _no_network
"""


def passes_tests(program: str, timeout: float = 10.0) -> bool:
    """True if `program` (prompt + completion + tests + check call) exits 0 within the timeout."""
    source = _PREAMBLE.format(cpu=max(1, int(timeout))) + program
    with tempfile.TemporaryDirectory() as workdir:
        try:
            proc = subprocess.run([sys.executable, "-I", "-c", source], cwd=workdir, capture_output=True,
                                  timeout=timeout, env={"PATH": os.environ.get("PATH", ""), "HOME": workdir},
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False
    return proc.returncode == 0


def humaneval_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
    return f"{prompt}{completion}\n\n{test}\n\ncheck({entry_point})\n"
