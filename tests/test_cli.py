"""pipeirc check / show / print: output goldens, exit codes, bad command lines."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import pipeir

REPO = Path(__file__).parent.parent
EXAMPLES = sorted(p.name for p in (REPO / "examples").glob("*.sched"))
Cli = Callable[..., tuple[int, str, str]]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)


@pytest.mark.parametrize("name", EXAMPLES)
def test_print_golden_and_round_trip(name: str, cli: Cli, golden: Callable[[str, str], None],
                                     tmp_path: Path) -> None:
    code, out, err = cli("print", f"examples/{name}")
    assert (code, err) == (0, "")
    golden(f"print/{name}.expected", out)
    again = tmp_path / "again.sched"
    again.write_text(out)
    code, out2, _ = cli("print", again)
    assert out2 == out
    assert pipeir.parse(again) == pipeir.parse(REPO / "examples" / name)


@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_check(name: str, cli: Cli) -> None:
    code, out, err = cli("check", f"examples/{name}")
    assert code == 0, err
    assert out.startswith(f"examples/{name}: ok: ")


@pytest.mark.parametrize(("args", "golden_name"), [
    (("examples/1f1b.sched", "--width", "100"), "1f1b_4x8"),
    (("examples/interleaved.sched", "--width", "100"), "interleaved_4x8_v2"),
    (("--schedule", "1f1b", "--ranks", "8", "--microbatches", "32", "--width", "120"),
     "1f1b_8x32"),
])
def test_show_golden(args: tuple[str, ...], golden_name: str, cli: Cli,
                     golden: Callable[[str, str], None]) -> None:
    code, out, err = cli("show", *args)
    assert (code, err) == (0, "")
    assert all(len(line) <= int(args[-1]) for line in out.splitlines()[1:])
    golden(f"show/{golden_name}.expected", out)


def test_check_many_files_exit_code_is_worst(cli: Cli) -> None:
    code, out, err = cli("check", "examples/1f1b.sched", "tests/errors/deadlock.sched",
                         "examples/gpipe.sched")
    assert code == 1
    assert out.count(": ok: ") == 2
    assert "deadlock" in err


def test_check_reports_every_file_even_after_a_bad_one(cli: Cli, tmp_path: Path) -> None:
    empty = tmp_path / "empty.sched"
    empty.write_text("# nothing here\n")
    code, out, err = cli("check", empty, "examples/1f1b.sched", "tests/errors/deadlock.sched")
    assert code == 2  # the worst of: usage error (2), invalid (1), ok (0)
    assert out.startswith("examples/1f1b.sched: ok: ")
    assert err.startswith(f"{empty}:1:1: error: no schedule") and "deadlock" in err


def test_check_library_schedule_and_set(cli: Cli) -> None:
    code, out, _ = cli("check", "--schedule", "interleaved-1f1b", "--ranks", "4",
                       "--microbatches", "8", "--v", "2")
    assert code == 0 and "8 stages" in out
    code, out, _ = cli("check", "examples/1f1b.sched", "--set", "ranks=2", "--set",
                       "microbatches=3")
    assert code == 0 and "2 ranks, 2 stages, 3 micro-batches" in out


@pytest.mark.parametrize(("args", "fragment"), [
    (("check",), "no schedule given"),
    (("check", "--schedule", "1f1b"), "--schedule needs --ranks P and --microbatches M"),
    (("check", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--v", "2"),
     "has no chunks parameter v"),
    (("check", "--schedule", "interleaved-1f1b", "--ranks", "4", "--microbatches", "8", "--v",
      "0"), "argument --v: expected a positive integer, got 0"),  # (not a <library> line)
    (("check", "examples/1f1b.sched", "--ranks", "2"), "--ranks goes with --schedule"),
    (("check", "examples/1f1b.sched", "--set", "rnaks=2"), "did you mean 'ranks'"),
    (("check", "examples/1f1b.sched", "--set", "ranks"), "expected NAME=VALUE"),
    (("check", "examples/1f1b.sched", "--set", "ranks=0"), "ranks must be a positive"),
    (("check", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--set", "ranks=3"),
     "disagree"),
    (("check", "examples/1f1b.sched", "--memory-limit", "0"), "expected a positive number, got 0"),
    (("check", "pipeir/library/gpipe.sched", "--set", "ranks=2"), "microbatches"),
    (("check", "no/such/file.sched"), "no such .sched file"),
    (("check", "examples"), "is a directory"),
    (("show", "--schedule", "1f1", "--ranks", "2", "--microbatches", "2"), "did you mean"),
    (("print", "examples/1f1b.sched", "-o", "no/such/dir/out.sched"), "does not exist"),
])
def test_usage_errors(args: tuple[str, ...], fragment: str, cli: Cli) -> None:
    code, out, err = cli(*args)
    assert (code, out) == (2, "")
    assert fragment in err
    assert "Traceback" not in err


def test_argparse_errors_exit_2(cli: Cli) -> None:
    assert cli("frobnicate")[0] == 2
    assert cli("check", "--ranks", "many")[0] == 2


def test_print_writes_atomically(cli: Cli, tmp_path: Path) -> None:
    out = tmp_path / "out.sched"
    assert cli("print", "examples/1f1b.sched", "-o", out)[0] == 0
    assert pipeir.parse(out) == pipeir.parse(REPO / "examples/1f1b.sched")
    bad = tmp_path / "bad.sched"
    assert cli("print", "tests/errors/div_zero.sched", "-o", bad)[0] == 2
    assert not bad.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out.sched"]


def test_show_refuses_a_deadlock(cli: Cli) -> None:
    code, out, err = cli("show", "tests/errors/deadlock.sched")
    assert code == 1 and out == "" and "deadlock" in err


def test_console_script_runs() -> None:
    r = subprocess.run([sys.executable, "-m", "pipeir", "check", "examples/gpipe.sched"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0 and ": ok: gpipe" in r.stdout


def test_show_width_is_what_it_says(cli: Cli) -> None:
    """--width 12 used to be raised to 40 without a word."""
    code, out, err = cli("show", "examples/1f1b.sched", "--width", "12")
    assert code == 0, err
    grid = [line for line in out.splitlines()[1:] if line]
    assert grid and max(map(len, grid)) <= 12, grid
    assert grid[1] == "r0 | F0 F1"  # two steps per block: (12 - 5) // 3


def test_print_takes_costs_and_show_says_it_uses_none(cli: Cli, tmp_path: Path) -> None:
    code, out, err = cli("print", "examples/1f1b.sched", "--set", "F=5", "--set", "stage.0.B=3")
    assert code == 0, err
    printed = tmp_path / "p.sched"
    printed.write_text(out)
    assert {k: v for k, (v, _) in pipeir.load(printed).costs.items()} == {"F": 5, "stage.0.B": 3}
    for command in ("show", "export-torch"):
        code, out, err = cli(command, "examples/1f1b.sched", "--set", "F=5")
        assert (code, out) == (2, "")
        assert err == ("error: --set F=5: 'F' is a cost, and this command uses none "
                       "(simulate, plot, check, print, opt, compile and run take costs)\n")


def test_bubble_refuses_what_it_cannot_tabulate(cli: Cli) -> None:
    assert cli("bubble", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8",
               "--v", "2") == (2, "", "error: --v: 1f1b takes no chunks parameter v\n")
    code, out, err = cli("bubble", "--schedule", "dualpipe-v", "--ranks", "2",
                         "--microbatches", "2")
    assert (code, out) == (2, "")
    assert err.startswith("error: nothing to tabulate: dualpipe-v p=2 m=2: not defined at "
                          "these sizes (requirement failed: dualpipe-v needs at least"), err


def test_simulate_with_every_cost_zero_has_no_bubble_to_report(cli: Cli, tmp_path: Path
                                                                ) -> None:
    f = tmp_path / "z.sched"
    f.write_text("pipeline { ranks = 2  microbatches = 2 }\ncosts { F = 0  B = 0 }\n"
                 "schedule = 1f1b\n")
    code, out, err = cli("simulate", f)
    assert code == 0, err
    assert out.splitlines()[1] == ("makespan 0; every op costs nothing here, so there is no "
                                   "bubble to measure")


def test_abs_takes_decimals_and_booleans_do_not_equal_numbers(tmp_path: Path) -> None:
    ok = pipeir.parse("pipeline { ranks = 1  microbatches = 1 }\n"
                      "schedule s { require abs(-1.5) == 1.5 and abs(-3) == 3\n"
                      "rank r { F(0, 0)  B(0, 0) } }")
    assert len(ok) == 2
    with pytest.raises(pipeir.UsageError, match=r"'!=' compares a boolean with an integer "
                                                r"\(false != 0\)"):
        pipeir.parse("pipeline { ranks = 1  microbatches = 1 }\n"
                     "schedule s { require false != 0\n rank r { F(0, 0)  B(0, 0) } }")


def test_check_help_names_its_files_in_plain_english(cli: Callable[..., tuple[int, str, str]]
                                                    ) -> None:
    """The positional help of a command taking several files read "a .sched files"."""
    code, out, _ = cli("check", "--help")
    assert code == 0
    assert re.search(r"^  FILE\s+\.sched files$", out, re.M), out
    assert "a .sched files" not in out
