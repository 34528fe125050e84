"""Every user error is a diagnostic with an exact location and the right exit code.

Each file in tests/errors/ is a known-bad schedule; its `pipeirc check` output (exit code and
stderr) is golden in tests/golden/errors/. Exit 2 = syntax/semantic error, 1 = invalid schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import pipeir

ERRORS = Path(__file__).parent / "errors"
CASES = sorted(p.stem for p in ERRORS.glob("*.sched"))

# The exit code each case must give (1: the schedule is wrong; 2: the file is).
INVALID = {"deadlock", "deadlock_self", "duplicate", "macro_duplicate",
           "mb_range", "memory",
           "missing", "overlap_deadlock", "stage_range", "stage_range_each_rank", "tab_caret",
           "wrong_rank"}


@pytest.mark.parametrize("case", CASES)
def test_error_golden(case: str, cli: Callable[..., tuple[int, str, str]],
                      golden: Callable[[str, str], None],
                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ERRORS.parent.parent)
    code, out, err = cli("check", f"tests/errors/{case}.sched")
    assert code == (1 if case in INVALID else 2)
    assert out == ""
    assert "Traceback" not in err
    assert err.startswith((f"tests/errors/{case}.sched:", "<library>/", "error: tests/errors/"))
    golden(f"errors/{case}.expected", f"exit {code}\n{err}")


@pytest.mark.parametrize(("case", "line", "col", "check"), [
    ("deadlock", 6, 9, "deadlock"),
    ("deadlock_self", 4, 18, "deadlock"),
    ("duplicate", 6, 9, "duplicate"),
    ("wrong_rank", 3, 23, "placement"),
    ("stage_range", 5, 9, "range"),
])
def test_verify_errors_point_at_the_op(case: str, line: int, col: int, check: str) -> None:
    with pytest.raises(pipeir.VerifyError) as e:
        pipeir.verify(pipeir.parse(ERRORS / f"{case}.sched"))
    span = e.value.diagnostics[0].span
    assert e.value.check == check
    assert span is not None and (span.line, span.col) == (line, col)


@pytest.mark.parametrize(("case", "line", "col", "fragment"), [
    ("unknown_name", 5, 23, "unknown name 'warmpu'"),
    ("div_zero", 4, 31, "division by zero"),
    ("float_literal", 3, 9, "number 1e400 is beyond a 64-bit float"),
    ("float_overflow", 4, 9, "number overflow: 1e+300 * 1e+300 is beyond a 64-bit float"),
    ("reversed_range", 4, 18, "reversed range 4 .. 0"),
    ("empty_range", 4, 18, "empty range 3 .. 3"),
    ("arity", 4, 9, "F takes 2 arguments"),
    ("syntax_range", 4, 20, "unexpected 'to'"),
    ("syntax_eof", 4, 24, "a '{' is never closed"),
    ("unknown_setting", 3, 5, "unknown pipeline setting 'microbatch'"),
    ("shadow", 5, 13, "'i' is already defined"),
    ("condition_type", 4, 12, "must be true or false"),
])
def test_usage_errors_point_at_the_source(case: str, line: int, col: int, fragment: str) -> None:
    with pytest.raises(pipeir.UsageError) as e:
        pipeir.parse(ERRORS / f"{case}.sched")
    d = e.value.diagnostics[0]
    assert fragment in d.message
    assert d.span is not None and (d.span.line, d.span.col) == (line, col)
    assert e.value.exit_code == 2


@pytest.mark.parametrize(("case", "line", "col", "note"), [
    # the '}'s that follow close the `rank` and `schedule` blocks by count, but their
    # indentation shows the `for` on line 4 is the one left open, not the outer `schedule`
    ("syntax_eof", 3, 12, "this '{' has no matching '}'"),
    ("syntax_unclosed_inner", 4, 25,
     "this '{' has no matching '}' (the '}' on line 6 is indented for an outer block)"),
    ("syntax_unclosed_before", 1, 10,
     "this '{' is still open: its '}' belongs before 'schedule'"),
])
def test_an_unclosed_brace_is_the_one_pointed_at(case: str, line: int, col: int,
                                                 note: str) -> None:
    with pytest.raises(pipeir.UsageError) as e:
        pipeir.parse(ERRORS / f"{case}.sched")
    notes = e.value.diagnostics[0].notes
    assert [n.message for n in notes] == [note]
    assert notes[0].span is not None and (notes[0].span.line, notes[0].span.col) == (line, col)


@pytest.mark.parametrize("end", ["\n", "\r\n", "\r"])
def test_errors_point_at_the_line_whatever_ends_the_lines(
        end: str, tmp_path: Path, cli: Callable[..., tuple[int, str, str]]) -> None:
    # old Mac files end lines with a lone "\r", which Lark does not count: every error of
    # such a file was reported on line 1
    text = end.join(["pipeline {", "    ranks = 2", "    microbatches = 4", "}",
                     "schedule s {", "    rank r { F(r, 0) B(r, 0) x }", "}", ""])
    with pytest.raises(pipeir.UsageError) as e:
        pipeir.parse(text)
    d = e.value.diagnostics[0]
    assert d.span is not None and (d.span.line, d.span.col) == (6, 32)
    path = tmp_path / "s.sched"
    path.write_bytes(text.encode())
    code, _, err = cli("check", str(path))
    assert code == 2 and err.startswith(f"{path}:6:32: error: unexpected '}}'"), err
    assert err.splitlines()[1].strip() == "rank r { F(r, 0) B(r, 0) x }"


def test_did_you_mean_notes() -> None:
    with pytest.raises(pipeir.UsageError) as e:
        pipeir.parse(ERRORS / "unknown_name.sched")
    assert [n.message for n in e.value.diagnostics[0].notes] == ["did you mean 'warmup'?"]


def test_memory_limit_names_rank_and_op(cli: Callable[..., tuple[int, str, str]]) -> None:
    code, _, err = cli("check", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8",
                       "--memory-limit", "2")
    assert code == 1
    assert "memory limit exceeded on rank 0: F(0,2) makes 3 activations in flight" in err
    assert "rank 1: F(1,2)" in err and "rank 2" not in err


def test_only_errors_inside_a_library_schedule_name_the_call(
        cli: Callable[..., tuple[int, str, str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A library schedule's own pipeline block (stages = ranks * v) is checked with the file's
    settings; its errors point into the library and name the user's call (the golden
    library_stages), while a bad --set is the user's alone and names no call."""
    monkeypatch.chdir(ERRORS.parent.parent)
    code, out, err = cli("check", "examples/interleaved.sched", "--set", "ranks=0")
    assert (code, out, err) == (2, "", "error: ranks must be a positive integer, got 0\n")
    code, _, err = cli("check", "examples/interleaved.sched", "--set", "v=0")
    assert code == 2
    assert err.startswith("<library>/interleaved-1f1b.sched:7:9: error: stages must be a "
                          "positive integer, got 0\n")
    assert "examples/interleaved.sched:7:1: note: in library schedule 'interleaved-1f1b', " \
           "used here" in err
