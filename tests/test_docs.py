"""Every code block in README.md and docs/ runs, so none can go stale.

The rules a page follows (docs/contributing.md says them for writers):

- ```` ```console ````: lines starting with `$ ` are commands (a trailing `\\` continues one);
  the lines up to the next command are its output, compared with what it prints (stdout and
  stderr together, trailing spaces and blank lines dropped). In the shown output a line `...`
  stands for any lines and `...` inside a line for any text. A command whose shown output has
  an `error:` line must exit non-zero; every other command must exit 0.
- ```` ```sh ````: every line is a command (comments after `#`), which must exit 0.
- ```` ```python ````: executed; the blocks of one page share a namespace, in order.
- ```` ```sched ````: parsed (and verified) by `pipeir.parse`.
- ```` ```toml ````: parsed; a cost file (no `[project]` table) is loaded by `CostModel`.
- ```` ```text ````: a diagram or a layout, not code: nothing to run.

A comment on the line before a block's fence marks it: `<!-- test: mp -->` (it starts
processes or runs long: the test runs under the `mp` marker, in a directory of its own),
`<!-- test: numbers-vary -->` (the numbers in its shown output are measured, so any number
matches; the words around them still must), `<!-- test: file PATH -->` (the block is the
repository file PATH, exactly), `<!-- test: ci -->` (the block's commands are what `.ci/run`
runs). Commands and Python run in a temporary directory holding copies of `examples/`,
`tests/errors/` and the `.sched` files of `docs/`, one directory per page.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

from pipeir import parse, verify
from pipeir.cli import main
from pipeir.sim import CostModel

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
LANGUAGES = frozenset({"console", "sh", "python", "sched", "toml", "text"})
MARKS = frozenset({"mp", "numbers-vary", "file", "ci"})

_FENCE = re.compile(r"^(```+)(\S*)\s*$")
_MARK = re.compile(r"^<!--\s*test:\s*(.*?)\s*-->\s*$")
#: A number as the CLI prints it: 1,073,741 or 27.3 or 1e-05.
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")

#: What a doc's commands may read, copied into each page's directory.
_COPIED = ("examples", "tests/errors")
#: Environment of every command: output that does not depend on the reader's terminal.
_ENV = {"NO_COLOR": "1", "COLUMNS": "100", "PYTHONHASHSEED": "0"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    text: str
    marks: tuple[str, ...]  # e.g. ("mp",), ("file examples/1f1b.sched",)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    def marked(self, name: str) -> str | None:
        """The mark's argument ('' for a bare mark), or None without it."""
        for m in self.marks:
            word, _, arg = m.partition(" ")
            if word == name:
                return arg
        return None


def blocks(page: Path) -> list[Block]:
    out: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2), i
        marks: list[str] = []
        j = start - 1
        while j >= 0 and (mark := _MARK.match(lines[j])):
            marks.extend(s.strip() for s in mark.group(1).split(";"))
            j -= 1
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i].rstrip() != fence:
            body.append(lines[i])
            i += 1
        i += 1
        out.append(Block(page, start + 1, lang, "\n".join(body) + "\n", tuple(marks)))
    return out


ALL = [b for p in PAGES for b in blocks(p)]


# -- the rules themselves ----------------------------------------------------------------

def test_pages_exist_and_blocks_are_known() -> None:
    assert len(PAGES) > 5, PAGES
    bad = [f"{b.where}: ```{b.language}" for b in ALL if b.language not in LANGUAGES]
    assert not bad, "a code block without a known language (" + ", ".join(sorted(LANGUAGES)) \
        + "):\n" + "\n".join(bad)
    marks = [f"{b.where}: {m}" for b in ALL for m in b.marks if m.split(" ")[0] not in MARKS]
    assert not marks, "unknown marks:\n" + "\n".join(marks)


def test_readme_is_short() -> None:
    n = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= 300, f"README.md has {n} lines; the rest belongs in docs/"


def test_ci_blocks_are_what_ci_runs() -> None:
    ci = {part.strip() for line in (REPO / ".ci/run").read_text().splitlines()
          for part in line.split(" && ")}
    marked = [b for b in ALL if b.marked("ci") is not None]
    assert marked, "README's set-up commands carry <!-- test: ci -->"
    for b in marked:
        for cmd in _joined(b.text.splitlines()):
            for part in cmd.strip().split(" && "):
                assert part in ci, f"{b.where}: .ci/run does not run `{part}`"


def test_file_blocks_equal_their_files() -> None:
    for b in ALL:
        path = b.marked("file")
        if path is not None:
            assert b.text == (REPO / path).read_text(encoding="utf-8"), \
                f"{b.where}: differs from {path}"


def test_no_history_in_docs() -> None:
    """Docs say what is; history (dates, what it used to take) belongs in commits."""
    dated = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bit (?:used to|took about) |\bonce, with seed")
    found = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in PAGES
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if dated.search(line)]
    assert not found, "\n".join(found)


def test_shown_output_is_compared_strictly() -> None:
    """The comparison itself: what `...` and numbers-vary let through, and what they do not."""
    exact = _pattern(["makespan 33; bubble 27.3%"], numbers_vary=False)
    assert exact.fullmatch("makespan 33; bubble 27.3%\n")
    assert not exact.fullmatch("makespan 34; bubble 27.3%\n")
    assert not exact.fullmatch("makespan 33; bubble 27.3%\nmore\n")
    gap = _pattern(["first", "...", "last"], numbers_vary=False)
    assert gap.fullmatch("first\nlast\n") and gap.fullmatch("first\na\nb\nlast\n")
    assert not gap.fullmatch("first\nlast\nextra\n")
    inline = _pattern(["step ... ms"], numbers_vary=False)
    assert inline.fullmatch("step 585.5 ms\n") and not inline.fullmatch("step 585.5 s\n")
    vary = _pattern(["  r0    24.5     9  72.7%"], numbers_vary=True)
    assert vary.fullmatch("  r0  1024.25     19  8.1%\n")
    assert not vary.fullmatch("  r1    24.5     9  72.7%\n".replace("r1", "rX"))
    assert not vary.fullmatch("  r0    24.5     9  72.7 %\n")


def test_console_blocks_split_into_commands() -> None:
    b = Block(REPO / "README.md", 1, "console",
              "$ pipeirc check a.sched \\\n    --set x=1\nok\n\n$ pipeirc show 'b c.sched'\n", ())
    assert _session(b) == [("pipeirc check a.sched --set x=1", ["ok"]),
                           ("pipeirc show 'b c.sched'", [])]


# -- running the blocks ------------------------------------------------------------------

def _page_ids(ps: list[Path]) -> list[str]:
    return [str(p.relative_to(REPO)) for p in ps]


@pytest.mark.parametrize("page", PAGES, ids=_page_ids(PAGES))
def test_page_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page's blocks that run quickly, in order, in one directory and one namespace."""
    _workdir(tmp_path, monkeypatch)
    namespace = _namespace(monkeypatch)
    for b in blocks(page):
        if b.marked("mp") is None and b.marked("ci") is None:
            _run_block(b, namespace, in_process=True)


MP = [b for b in ALL if b.marked("mp") is not None]


@pytest.mark.mp
@pytest.mark.parametrize("block", MP, ids=[b.where for b in MP])
def test_long_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block that starts processes or runs long, on its own."""
    _workdir(tmp_path, monkeypatch)
    _run_block(block, _namespace(monkeypatch), in_process=False)


def _workdir(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for rel in _COPIED:
        shutil.copytree(REPO / rel, tmp / rel)
    (tmp / "docs").mkdir()
    for f in (REPO / "docs").glob("*.sched"):
        shutil.copy(f, tmp / "docs" / f.name)
    monkeypatch.chdir(tmp)
    for k, v in _ENV.items():
        monkeypatch.setenv(k, v)


def _namespace(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """A module's namespace for a page's Python: dataclasses and pickling look classes up
    through `sys.modules[cls.__module__]`."""
    module = types.ModuleType("pipeir_docs_page")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module.__dict__


def _run_block(b: Block, namespace: dict[str, object], *, in_process: bool) -> None:
    if b.language == "python":
        code = compile(b.text, b.where, "exec")
        exec(code, namespace)
    elif b.language == "sched":
        if b.marked("file") is None:  # files are parsed where they are used
            verify(parse(b.text))
    elif b.language == "toml":
        data = tomllib.loads(b.text)
        if "project" not in data:  # a cost file
            path = Path(f"doc-{b.line}.toml")
            path.write_text(b.text, encoding="utf-8")
            CostModel.load(path)
    elif b.language == "sh":
        for cmd in _commands(b):
            code, out = _execute(cmd, in_process)
            assert code == 0, f"{b.where}: `{cmd}` exited {code}:\n{out}"
    elif b.language == "console":
        for cmd, expected in _session(b):
            code, out = _execute(cmd, in_process)
            want_error = any("error:" in line for line in expected)
            assert (code != 0) == want_error, f"{b.where}: `{cmd}` exited {code}:\n{out}"
            if expected:
                _compare(b, cmd, expected, out)


def _commands(b: Block) -> list[str]:
    """An sh block's commands: continuation lines joined, comments dropped."""
    out: list[str] = []
    for cmd in _joined(b.text.splitlines()):
        cmd = shlex.join(shlex.split(cmd, comments=True))
        if cmd:
            out.append(cmd)
    return out


def _joined(lines: list[str]) -> Iterator[str]:
    acc = ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            acc += line.rstrip()[:-1] + " "
        else:
            yield acc + line
            acc = ""
    if acc:
        yield acc


def _session(b: Block) -> list[tuple[str, list[str]]]:
    """A console block's (command, shown output lines) pairs."""
    out: list[tuple[str, list[str]]] = []
    lines = b.text.splitlines()
    i = 0
    while i < len(lines):
        assert lines[i].startswith("$ "), f"{b.where}: output before the first `$ ` command"
        cmd = lines[i][2:]
        while cmd.rstrip().endswith("\\"):
            i += 1
            cmd = cmd.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        shown: list[str] = []
        while i < len(lines) and not lines[i].startswith("$ "):
            shown.append(lines[i].rstrip())
            i += 1
        while shown and not shown[-1]:
            shown.pop()
        out.append((shlex.join(shlex.split(cmd)), shown))
    return out


def _execute(cmd: str, in_process: bool) -> tuple[int, str]:
    """Run one command line in the current directory: (exit code, stdout + stderr)."""
    words = shlex.split(cmd)
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        k, _, v = words.pop(0).partition("=")
        env[k] = v
    assert words, cmd
    if in_process and words[0] == "pipeirc" and "&&" not in words and "|" not in words:
        return _pipeirc(words[1:], env)
    assert words[0] in {"pipeirc", "python", "torchrun"}, \
        f"`{cmd}`: a doc command runs pipeirc, python or torchrun"
    bin_dir = Path(sys.executable).parent
    full_env = {**os.environ, **env, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run(cmd, shell=True, env=full_env, capture_output=True, text=True,
                       timeout=900, check=False)
    return r.returncode, r.stdout + r.stderr


def _pipeirc(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    buf = io.StringIO()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            code = main(argv)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return code, buf.getvalue()


def _compare(b: Block, cmd: str, expected: list[str], actual: str) -> None:
    got = "".join(line.rstrip() + "\n" for line in actual.rstrip().splitlines())
    pattern = _pattern(expected, numbers_vary=b.marked("numbers-vary") is not None)
    assert pattern.fullmatch(got), (
        f"{b.where}: `{cmd}` printed\n{got}--- the page shows ---\n" + "\n".join(expected))


def _pattern(expected: list[str], *, numbers_vary: bool) -> re.Pattern[str]:
    """Each shown line matches one printed line; `...` alone matches any lines."""
    parts: list[str] = []
    for line in expected:
        if line == "...":
            parts.append(r"(?:[^\n]*\n)*?")
            continue
        pieces = []
        for chunk in line.split("..."):
            if numbers_vary:  # any number, and columns that widen or narrow with it
                esc = [r" +".join(re.escape(w) for w in re.split(r" {2,}", piece))
                       for piece in _NUMBER.split(chunk)]
                pieces.append(r"-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?".join(esc))
            else:
                pieces.append(re.escape(chunk))
        parts.append(r"[^\n]*?".join(pieces) + r"\n")
    return re.compile("".join(parts))
