"""The source layout's rules (STYLE.md): no import circle between kstep's modules, no source file
over 300 lines, bundled model cards that a user can run from a checkout (no machine's absolute
paths), and a `kstep --help` that says what kstep does."""
import ast
import re
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kstep.train.paths import portable_path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kstep"
MAX_LINES = 300
ABSOLUTE_PATH = re.compile(r"(?:^|[\s\"'(`=])(?:/|~/)[\w.-]+/[\w./-]*")  # /a/b, ~/a/b


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the kstep modules it imports anywhere in its body (lazy imports included: a circle
    through a function-level import is still a circle in the design)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    deps.add(submodule if submodule in modules else node.module)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_a_circle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_in_kstep():
    graph = import_graph()
    assert "kstep.llm" in graph and "kstep.registry" in graph["kstep.weights"]
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def room(module: str) -> str:
    """The part of the tree a module is in: a top-level module, or the top-level package holding it."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_the_packages_import_each_other_in_one_direction():
    """With each top-level package taken as one part (decoding/, runner/, server/, ... and each top-level
    module), no import runs back up: the parts' import graph has no circle (so they stack in floors,
    every import pointing down), which a lazy import inside a function would break as much as a
    top-level one."""
    graph: dict[str, set[str]] = {}
    for module, deps in import_graph().items():
        graph.setdefault(room(module), set()).update(room(d) for d in deps if room(d) != room(module))
    for deps in list(graph.values()):
        for dep in deps:
            graph.setdefault(dep, set())
    cycle = find_cycle(graph)
    assert cycle is None, "parts that import each other: " + " -> ".join(cycle)


def test_the_registry_and_the_request_knobs_stay_below_the_decoders():
    """Checkpoint I/O reads the registry, so the registry imports no decoder and no runner; the knobs
    (kstep.params) and the kinds stay plain Python (no torch: the scheduler imports them)."""
    graph = import_graph()
    assert not {d for d in graph["kstep.registry"] if d.startswith(("kstep.decoding", "kstep.runner"))}
    for module in ("kstep.params", "kstep.params.generation", "kstep.params.denoising", "kstep.params.validation",
                   "kstep.kinds"):
        assert not {d for d in graph[module] if d.startswith(("kstep.models", "kstep.registry", "kstep.runner"))}


def test_params_name_the_families_the_registry_has():
    """The knobs' declared families and the tri-mode families are the registry's (a rename there must
    show here)."""
    from kstep.kinds import AUTOREGRESSIVE, BLOCK_DIFFUSION, DIFFUSION, UNIFORM_DIFFUSION
    from kstep.params.generation import TRI_MODE, user_knobs
    from kstep.registry import FAMILIES
    assert set(TRI_MODE) == {name for name, family in FAMILIES.items() if family.modes}
    kinds = {AUTOREGRESSIVE, BLOCK_DIFFUSION, DIFFUSION, UNIFORM_DIFFUSION}
    for knob in user_knobs():
        assert set(knob.metadata["families"]) <= kinds | set(FAMILIES), knob.name


def test_no_source_file_over_300_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by noun (STYLE.md): {long}"


@pytest.mark.parametrize("card", sorted((PACKAGE / "bundled").glob("*/README.md")), ids=lambda p: p.parent.name)
def test_bundled_cards_carry_no_absolute_paths(card):
    text = card.read_text()
    config = card.parent / "train_config.json"
    for line in text.splitlines() + (config.read_text().splitlines() if config.is_file() else []):
        found = ABSOLUTE_PATH.search(line)
        assert found is None, f"{card}: absolute path {found.group(0)!r} in {line.strip()[:80]!r}"
    if config.is_file():
        assert f"--out {json.loads(config.read_text())['out']}" in text


def test_portable_path_keeps_relative_paths_and_rewrites_absolute_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert portable_path("runs/x") == "runs/x"
    assert portable_path(str(tmp_path / "kstep" / "bundled" / "default")) == "kstep/bundled/default"
    assert portable_path("/elsewhere/runs/bd8-stage2/distill.jsonl") == "runs/bd8-stage2/distill.jsonl"
    assert portable_path("/scratch/model-7") == "runs/model-7"


def test_kstep_help_says_what_it_does_and_lists_the_commands():
    out = subprocess.run([sys.executable, "-m", "kstep", "--help"], capture_output=True, text=True, check=True).stdout
    first = out.split("\n\n")[1]
    assert "diffusion language models" in first and "autoregressive" in first and "server/cli.py" not in out
    for command in ("generate", "serve", "eval", "train", "distill", "train-report", "bench", "random-checkpoint"):
        assert f"\n    {command}" in out, command
