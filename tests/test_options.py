"""Command-line options that used to slip through (issue 11): non-finite and negative numbers,
zero widths, negative lists, plugins named like built-ins, torch CSVs given to the wrong
command, --version, and the numpy dependency torch needs to import quietly."""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from pipeir.passes import registry

REPO = Path(__file__).parent.parent
LIB = ("--schedule", "1f1b", "--ranks", "2", "--microbatches", "2")
COSTS = str(REPO / "examples/costs/compute-bound.toml")
Cli = Callable[..., tuple[int, str, str]]


@pytest.mark.parametrize(("args", "fragment"), [
    (("run", *LIB, "--timeout", "nan"), "--timeout: expected a positive number, got nan"),
    (("run", *LIB, "--timeout", "0"), "expected a positive number, got 0"),
    (("run", *LIB, "--timeout", "-1"), "expected a positive number, got -1"),
    (("run", *LIB, "--timeout", "inf"), "expected a positive number, got inf"),
    (("run", *LIB, "--timeout", "1e300"), "at most 1e+07 seconds"),
    (("profile", "--model", "mlp", "-o", "x.json", "--timeout", "nan"),
     "expected a positive number"),
    (("tune", "--costs", COSTS, "--memory-limit", "nan"), "--memory-limit: expected a positive"),
    (("tune", "--costs", COSTS, "--memory-limit", "-1"), "expected a positive number, got -1"),
    (("tune", "--costs", COSTS, "--lengths", "-1,0"), "--lengths -1,0: lengths must be positive"),
    (("tune", "--costs", COSTS, "--lengths", "4,0"), "lengths must be positive, got '0'"),
    (("show", *LIB, "--width", "0"), "--width: expected 10 to 10,000 columns, got 0"),
    (("simulate", *LIB, "--width", "100000000"), "--width: expected 10 to 10,000 columns"),
    (("show", *LIB, "--width", "-5"), "expected 10 to 10,000 columns, got -5"),
    (("print", *LIB, "-o", ""), "-o: empty path"),
    (("export-torch", *LIB, "-o", ""), "-o: empty path"),
    (("tune", "--costs", COSTS, "-o", ""), "-o: empty path"),
    (("simulate", *LIB, "--trace", ""), "--trace: empty path"),
    (("opt", *LIB, "--passes", "verify", "--dump-dir", ""), "--dump-dir: empty path"),
    (("compile", *LIB, "-o", "", "--emit", "json"), "-o: empty path"),
    (("run", *LIB, "--save", ""), "--save: empty path"),
    (("run", *LIB, "--save", COSTS), "compute-bound.toml: exists and is not a directory"),
    (("run", *LIB, "--save", f"{COSTS}/ckpt"), "compute-bound.toml is not a directory"),
    (("simulate", "x.csv"), "x.csv: this is a torch schedule CSV: use `pipeirc import-torch"),
    (("compile", "x.csv", "-o", "out"), "this is a torch schedule CSV"),
    (("check", *LIB, "--set", "memory_limit=none"),
     "memory_limit must be a positive integer, got 'none' (a string)"),
    (("check", *LIB, "--set", "accumulate=[1,2]"),
     "accumulate must be a positive integer, got [1, 2] (a list)"),
    # one stage or count under another spelling: Python's int() reads both, the language not
    (("check", str(REPO / "examples/1f1b.sched"), "--set", "microbatches=\u0663"),
     "--set microbatches=\u0663: write the number in ASCII digits, as a .sched file does"),
    (("simulate", *LIB, "--set", "stage.01.F=2"),
     "--set: cost 'stage.01.F': write it as 'stage.1.F' (indices in plain digits, without a "
     "leading zero"),
    (("check", "costs.json"), "costs.json: check reads .sched files and torch .csv files; a "
                              ".json is a compiled program (check it with --lowered) or a cost "
                              "file (give it to --costs)"),
    (("opt", *LIB, "--passes", "verify", "--print-after", ""),
     "--print-after: an empty pass name; give NAME[,NAME...] or all"),
    (("simulate", *LIB, "--set", "version=2"),
     "--set version: 'version' describes a cost file, it is not a cost"),
    (("compile", *LIB, "--force", "--emit", "lowered"),
     "--force goes with -o DIR (it lets a compile replace DIR's files)"),
    # an option that takes one value, given twice: the first was dropped without a word
    (("opt", *LIB, "--passes", "interleave{v=2}", "--passes", "split-backward"),
     "argument --passes: given twice; give it once"),
    (("simulate", "--schedule", "1f1b", *LIB), "argument --schedule: given twice"),
    (("simulate", *LIB, "--costs", COSTS, "--costs", COSTS), "argument --costs: given twice"),
])
def test_bad_options_are_usage_errors(args: tuple[str, ...], fragment: str, cli: Cli) -> None:
    code, out, err = cli(*args)
    assert (code, out) == (2, ""), err
    assert fragment in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1


def test_version(cli: Cli, capsys: pytest.CaptureFixture[str]) -> None:
    from pipeir import __version__

    code, out, _ = cli("--version")
    assert code == 0 and out.strip() == f"pipeirc {__version__}"


def test_a_pass_plugin_named_like_a_built_in_is_an_error(cli: Cli, tmp_path: Path) -> None:
    plugin = tmp_path / "fake.py"
    plugin.write_text(
        "from dataclasses import dataclass\n"
        "from typing import ClassVar\n"
        "from pipeir.passes import Pass\n"
        "@dataclass(frozen=True)\n"
        "class Fake(Pass):\n"
        "    name: ClassVar[str] = 'interleave'\n"
        "    summary: ClassVar[str] = 'not the real one'\n"
        "    def run(self, schedule, context):\n"
        "        return schedule\n")
    for cmd in (("opt", *LIB, "--passes", "interleave{v=2}"), ("passes",)):
        code, out, err = cli(*cmd, "--pass-plugin", f"{plugin}:Fake")
        assert code == 2 and out == "", err
        assert "calls itself 'interleave', the name of a built-in pass" in err


def test_an_installed_plugin_named_like_a_built_in_is_ignored_with_a_warning(
        cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = EntryPoint("interleave", "somepkg.mod:Fake", registry.ENTRY_POINT_GROUP)
    real = registry.entry_points

    def eps(group: str) -> list[EntryPoint]:
        return [*real(group=group), fake]

    monkeypatch.setattr(registry, "entry_points", eps)
    code, out, err = cli("opt", *LIB, "--passes", "interleave{v=2}")
    assert code == 0 and "stages = 4" in out  # the built-in ran
    assert "warning: installed pass 'interleave' (somepkg.mod:Fake) has the name of a " \
           "built-in pass and is ignored" in err
    code, out, err = cli("passes")
    assert code == 0 and "warning: installed pass 'interleave'" in err
    assert registry.get("interleave").__module__ == "pipeir.passes.interleave"


def test_numpy_is_a_dependency() -> None:
    """torch warns "Failed to initialize NumPy" at import when numpy is missing, and it does
    not depend on numpy itself, so a bare `pip install -e .` must bring it."""
    if sys.version_info < (3, 11):
        pytest.skip("tomllib")
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "numpy" for d in deps)


@pytest.mark.parametrize(("text", "fragment"), [
    ("F = 1.0\n[stage.0]\nF = 2.0\n[stage.99]\nF = 3.0\n",
     "per-stage costs for stages 0, 99 only, yet the highest, stage.99, would make the "
     "search cover 100 ranks; a typo? give --ranks P"),
    ("F = 1e308\n[stage.0]\nF = 1.0\n", "cost 'F' = 1e+308 is out of range: it must be at most"),
    ("F = " + "9" * 5000 + "\n", "a number has too many digits to read"),
])
def test_tune_refuses_bad_cost_files_before_the_search(text: str, fragment: str, cli: Cli,
                                                       tmp_path: Path) -> None:
    costs = tmp_path / "costs.toml"
    costs.write_text(text)
    code, out, err = cli("tune", "--costs", costs)
    assert (code, out) == (2, "") and fragment in err and "Traceback" not in err


@pytest.mark.parametrize("setting", ["F=1e308", "B=1e300", "bandwidth=1e-300",
                                     "activation_bytes=" + "9" * 400, "latency=1e16"])
def test_costs_that_would_overflow_are_refused(setting: str, cli: Cli, tmp_path: Path) -> None:
    for cmd in (("simulate", *LIB), ("plot", *LIB, "-o", tmp_path / "x.png")):
        code, out, err = cli(*cmd, "--set", setting)
        assert (code, out) == (2, ""), err
        assert "is out of range" in err and "Traceback" not in err
    big = tmp_path / "big.json"
    big.write_text('{"F": ' + "9" * 5000 + "}")
    code, _, err = cli("simulate", *LIB, "--costs", big)
    assert code == 2 and "too many digits" in err


def test_one_parser_parses_again_and_again_without_a_stale_record() -> None:
    """`_Once` records the options a parse has seen on that parse's namespace, which keeps
    none of it: a parser used again (a test, a tool) must not find an option given twice."""
    from pipeir.cli import build_parser

    parser = build_parser()
    for _ in range(5):
        args = parser.parse_args(["check", "x.sched", "--costs", "a.json"])
        assert args.costs == "a.json" and not any(k.startswith("_pipeir") for k in vars(args))


def test_check_says_a_time_cost_changes_nothing(cli: Cli) -> None:
    """check counts memory; `--set latency=2` was taken without a word (sizes are used)."""
    code, out, err = cli("check", str(REPO / "examples/1f1b.sched"), "--set", "latency=2")
    assert code == 0 and "ok:" in out
    assert err.splitlines() == ["warning: --set latency: check counts memory, not time: this "
                                "cost changes nothing here (sizes such as memory_bytes do)"]
    code, out, err = cli("check", str(REPO / "examples/1f1b.sched"), "--set", "memory_bytes=2")
    assert code == 0 and err == "" and "peak bytes per rank: 8 6 4 2" in out
