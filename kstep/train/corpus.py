"""The training corpus: the running interpreter's Python standard library, split by file.

Test suites, vendored third-party code and generated tables are left out. Each file lands in the
held-out set by a hash of its path, so the split is stable and recorded next to the model.
"""
import ast
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Top-level stdlib folders that are tests, vendored code, generated data or installed packages.
EXCLUDED_TOP = {"site-packages", "dist-packages", "test", "idlelib", "lib2to3", "pydoc_data", "encodings",
                "turtledemo", "ensurepip", "__phello__", "__pycache__"}
EXCLUDED_PARTS = {"test", "tests", "__pycache__", "_vendor", "idle_test"}
HELD_OUT_PERCENT = 5


@dataclass(slots=True)
class CorpusFile:
    path: Path
    rel: str
    is_held_out: bool


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[CorpusFile]:
    """All included .py files of the stdlib, sorted, each marked train or held-out."""
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        if parts[0] in EXCLUDED_TOP or parts[0].startswith("config-") or EXCLUDED_PARTS & set(parts[:-1]):
            continue
        if parts[-1].startswith("test_"):
            continue
        bucket = int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 100
        files.append(CorpusFile(path, rel, bucket < HELD_OUT_PERCENT))
    return files


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


@dataclass(slots=True)
class FunctionExample:
    file: str
    name: str
    prompt: str      # signature + docstring, without the last newline (see function_examples)
    body: str        # from that newline to the end of the function


def function_examples(files: list[CorpusFile], min_body_lines: int = 3) -> list[FunctionExample]:
    """Functions with a docstring, split into prompt (signature + docstring) and body."""
    out = []
    for f in files:
        text = read_text(f.path)
        if text is None:
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or ast.get_docstring(node) is None:
                continue
            doc = node.body[0]
            if len(node.body) < 2 or node.end_lineno - doc.end_lineno < min_body_lines:
                continue
            start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            indent = len(lines[start - 1]) - len(lines[start - 1].lstrip())
            dedent = lambda s: "".join(ln[indent:] if ln[:indent].strip() == "" else ln for ln in s)  # noqa: E731
            # The prompt stops before the docstring line's newline and the body starts with it:
            # byte-level BPE merges a newline with the next line's indentation into one token, so a
            # prompt ending in a bare newline is a token boundary the model never saw in training
            # (it then writes blank lines or a new `def` instead of the body).
            prompt = dedent(lines[start - 1: doc.end_lineno])[:-1]
            body = "\n" + dedent(lines[doc.end_lineno: node.end_lineno])
            out.append(FunctionExample(f.rel, node.name, prompt, body))
    return out
