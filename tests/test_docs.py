"""The docs stay true to the code: every `kstep` command in the shell blocks of README.md and
docs/**/*.md names a subcommand that `kstep --help` lists and only flags that subcommand's `--help`
shows; every repository path a command names exists; every relative link and image points to a file
(and, into a Markdown page, to a heading); the README stays short.

The help texts come from one subprocess that builds kstep's parser and prints each (sub)command's
`format_help()`, which is what `kstep ... --help` prints: one torch import instead of one per
subcommand."""
import json
import os
import re
import subprocess
import sys
import unicodedata
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MAX_README_LINES = 210
SHELL_LANGS = {"bash", "sh", "shell", "console"}
SEPARATORS = ("&&", "||", "|", ";", "&", "\n")
REPO_DIRS = ("docs/", "scripts/", "tests/", "kstep/")   # a word naming a path under these must exist

HELP_DUMP = r"""
import argparse, json, sys
from kstep.cli import build_parser

def walk(parser, path, out):
    out[" ".join(path)] = parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                walk(sub, path + [name], out)

out = {}
walk(build_parser(), [], out)
json.dump(out, sys.stdout)
"""


@cache
def help_texts() -> dict[str, str]:
    """`kstep [SUB [KIND]] --help` for every command path ("" is `kstep --help`)."""
    done = subprocess.run([sys.executable, "-c", HELP_DUMP], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def help_flags(text: str) -> set[str]:
    """The option strings of an argparse help text (`--max-tokens`, `-h`, ...)."""
    flags = set()
    for line in text.splitlines():
        stripped = line.strip()
        if line.startswith("  ") and stripped.startswith("-"):
            head = re.split(r"\s{2,}", stripped)[0]
            for option in head.split(", "):
                flags.add(option.split()[0].split("=")[0])
    return flags


# ---------------------------------------------------------------------------------------------- shell


def shell_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number of the opening fence, from 1; language; body) of every fenced code block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = re.match(r"\s*(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not fence:
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence.group(1)):
            body.append(lines[i])
            i += 1
        blocks.append((start, fence.group(2).lower(), "\n".join(body)))
        i += 1
    return blocks


def console_commands(body: str) -> str:
    """The command lines of a console block (`$ ` prompts and their continuation lines); output
    lines become empty lines, so line numbers stay."""
    kept, continuing = [], False
    for line in body.splitlines():
        if line.startswith("$ ") or continuing:
            text = line[2:] if line.startswith("$ ") and not continuing else line
            kept.append(text)
            continuing = text.rstrip().endswith("\\")
        else:
            kept.append("")
    return "\n".join(kept)


def split_commands(text: str) -> list[list[str]]:
    """Shell text as commands (lists of words): quotes (also over several lines, and $'...'),
    backslash escapes and line continuations, comments, and the separators newline ; && || | &."""
    return [words for _, words in commands_by_line(text)]


def commands_by_line(text: str) -> list[tuple[int, list[str]]]:
    """split_commands, each command with the line (from 0) it starts on."""
    commands, words, word, i, start = [], [], None, 0, 0

    def end_word():
        nonlocal word
        if word is not None:
            words.append(word)
            word = None

    def begin():
        nonlocal word, start
        if word is None and not words:
            start = text.count("\n", 0, i)
        return word or ""

    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            if text[i + 1] != "\n":
                word = begin() + text[i + 1]
            i += 2
        elif c == "'" or (c == "$" and text.startswith("$'", i)):
            opened = i + (2 if c == "$" else 1)
            end = text.find("'", opened)
            if end < 0:
                raise ValueError(f"unclosed ' in: {text[i:i + 60]!r}")
            word, i = begin() + text[opened:end], end + 1
        elif c == '"':
            j, piece = i + 1, []
            while j < len(text) and text[j] != '"':
                if text[j] == "\\" and j + 1 < len(text) and text[j + 1] in '"\\$`\n':
                    piece.append(text[j + 1] if text[j + 1] != "\n" else "")
                    j += 2
                else:
                    piece.append(text[j])
                    j += 1
            if j >= len(text):
                raise ValueError(f'unclosed " in: {text[i:i + 60]!r}')
            word, i = begin() + "".join(piece), j + 1
        elif c == "#" and word is None:
            newline = text.find("\n", i)
            i = len(text) if newline < 0 else newline
        elif text.startswith(">&", i):
            word, i = begin() + ">&", i + 2
        elif c in " \t":
            end_word()
            i += 1
        elif sep := next((s for s in SEPARATORS if text.startswith(s, i)), None):
            end_word()
            if words:
                commands.append((start, words))
                words = []
            i += len(sep)
        else:
            word, i = begin() + c, i + 1
    end_word()
    if words:
        commands.append((start, words))
    return commands


def kstep_call(words: list[str]) -> list[str] | None:
    """The arguments after `kstep` (`kstep`, `.venv/bin/kstep`, `python -m kstep`), or None."""
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words = words[1:]
    if words and Path(words[0]).name == "kstep":
        return words[1:]
    if len(words) >= 3 and Path(words[0]).name.startswith("python") and words[1:3] == ["-m", "kstep"]:
        return words[3:]
    return None


def check_command(words: list[str]) -> list[str]:
    """What is wrong with one shell command, as messages (none: nothing)."""
    problems = []
    for n, word in enumerate(words):
        path = word.split("=", 1)[1] if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", word) else word
        program = n == 0 and path.startswith("./")
        if (path.startswith(REPO_DIRS) or program) and not (ROOT / path).exists():
            problems.append(f"{path} does not exist")
    args = kstep_call(words)
    if args is None:
        return problems
    helps = help_texts()
    positional = [a for a in args if not a.startswith("-")]
    if not positional:
        return problems + ["no subcommand"]
    sub = positional[0]
    if sub not in helps or not re.search(rf"^\s+{re.escape(sub)}\b", helps[""], re.M):
        return problems + [f"`{sub}` is not a subcommand in `kstep --help`"]
    command = sub
    if any(key.startswith(f"{sub} ") for key in helps):   # a command with kinds: `kstep bench compare`
        kind = positional[1] if len(positional) > 1 else None
        if f"{sub} {kind}" not in helps:
            return problems + [f"`{kind}` is not a kind in `kstep {sub} --help`"]
        command = f"{sub} {kind}"
    known = help_flags(helps[command])
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and flag != "--" and flag not in known:
            problems.append(f"{flag} is not in `kstep {command} --help`")
    return problems


def doc_problems(name: str, text: str) -> list[str]:
    problems = []
    for line, lang, body in shell_blocks(text):
        if lang not in SHELL_LANGS:
            continue
        try:
            commands = commands_by_line(console_commands(body) if lang == "console" else body)
        except ValueError as e:
            problems.append(f"{name}:{line + 1}: {e}")
            continue
        for offset, words in commands:
            for problem in check_command(words):
                problems.append(f"{name}:{line + 1 + offset}: `{' '.join(words)[:120]}`: {problem}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_exist(page):
    problems = doc_problems(str(page.relative_to(ROOT)), page.read_text())
    assert not problems, "\n".join(problems)


def test_the_readme_has_commands():
    text = (ROOT / "README.md").read_text()
    calls = [kstep_call(words) for _, lang, body in shell_blocks(text) if lang in SHELL_LANGS
             for words in split_commands(body)]
    subs = {call[0] for call in calls if call}
    assert {"generate", "serve", "bench", "eval"} <= subs, subs


def test_split_commands():
    text = """./setup.sh && .venv/bin/kstep generate 'def f(s):
    \"\"\"Doc.\"\"\"' --max-tokens 64   # a comment --not-a-flag
kstep serve --model A \\
    --port 1 | tee out.log
X=1 kstep bench compare --quick; kstep eval --suffix $'\\n  x\\n' 2>&1 | cat"""
    assert split_commands(text) == [
        ["./setup.sh"], [".venv/bin/kstep", "generate", 'def f(s):\n    """Doc."""', "--max-tokens", "64"],
        ["kstep", "serve", "--model", "A", "--port", "1"], ["tee", "out.log"],
        ["X=1", "kstep", "bench", "compare", "--quick"], ["kstep", "eval", "--suffix", "\\n  x\\n", "2>&1"],
        ["cat"]]


def test_the_check_catches_bad_commands():
    """The check fails, naming file, command and flag, on a bogus flag, subcommand, kind or path."""
    page = "\n".join(["```bash", "kstep generate 'x' --max-tokens 8 --bogus-flag 1",
                      ".venv/bin/kstep bench compare --quick --no-such-thing", "kstep bench nonsense --quick",
                      "kstep frobnicate", "python scripts/not_a_script.py", "```",
                      "```console", "$ kstep serve --model a \\", "    --wrong", "output --ignored", "```"])
    problems = doc_problems("page.md", page)
    assert len(problems) == 6, problems
    expected = ["page.md:2: `kstep generate x --max-tokens 8 --bogus-flag 1`: --bogus-flag is not in "
                "`kstep generate --help`", "--no-such-thing is not in `kstep bench compare --help`",
                "`nonsense` is not a kind", "`frobnicate` is not a subcommand", "scripts/not_a_script.py does not exist",
                "page.md:9: `kstep serve --model a --wrong`: --wrong is not in `kstep serve --help`"]
    for problem, want in zip(problems, expected):
        assert want in problem, (problem, want)


# ---------------------------------------------------------------------------------------------- links


def without_fences(text: str) -> str:
    return re.sub(r"^\s*(```+|~~~+).*?^\s*\1\s*$", "", text, flags=re.M | re.S)


def without_code(text: str) -> str:
    """The text without fenced code blocks and inline code spans."""
    return re.sub(r"(`+).+?\1", "", without_fences(text), flags=re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", without_fences(page.read_text()), re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        result.add(base if n == 0 else f"{base}-{n}")
    return result


def link_problems(page: Path) -> list[str]:
    problems = []
    for target in re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", without_code(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
            continue   # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        name = page.relative_to(ROOT)
        if not file.exists():
            problems.append(f"{name}: ({target}): {path} does not exist")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            problems.append(f"{name}: ({target}): no heading #{anchor} in {file.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_exist(page):
    problems = link_problems(page)
    assert not problems, "\n".join(problems)


def test_every_page_is_linked_from_the_readme():
    readme = without_code((ROOT / "README.md").read_text())
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"(docs/{p.name}" not in readme]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): move the detail to docs/"


def test_the_decoder_table_in_decoding_md_is_the_codes():
    """docs/decoding.md holds `python -m kstep.decoding.table`'s output, as the code builds it now."""
    from kstep.decoding.table import markdown
    text = (ROOT / "docs" / "decoding.md").read_text()
    found = re.search(r"<!-- decoder table: python -m kstep.decoding.table -->\n(.*?)\n<!-- end of the decoder table -->",
                      text, re.S)
    assert found, "docs/decoding.md lost its decoder table markers"
    assert found.group(1).strip() == markdown().strip(), "regenerate it: python -m kstep.decoding.table"
