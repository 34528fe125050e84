"""The `synth` pass: never slower than its input, keeps its memory, refuses what it cannot
search, and its option errors point into the pipeline string."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
from synth_fixtures import HETERO, REPO

import pipeir
from pipeir.sim import CostModel, simulate
from pipeir.verify import verify


def test_cost_driven_passes_without_costs_warn(cli, tmp_path: Path) -> None:
    """With no --costs, no costs block and no cost in --set, synth and reorder plan for the
    default unit costs: opt and compile say so on stderr and still run."""
    warn = ("warning: {} plans by cost, and there are no costs (give --costs FILE or a costs "
            "block): it plans for the defaults, F = 1, B = 2 and free links\n")
    out = tmp_path / "o.sched"
    code, _, err = cli("opt", "--schedule", "1f1b", "--ranks", 2, "--microbatches", 2,
                       "--passes", "reorder,synth{time_limit=1}", "-o", out)
    assert code == 0 and err == warn.format("reorder") + warn.format("synth")
    code, _, err = cli("compile", "--schedule", "1f1b", "--ranks", 2, "--microbatches", 2,
                       "--passes", "synth{time_limit=1}", "-o", tmp_path / "gen")
    assert code == 0 and err == warn.format("synth")
    for costs in (["--costs", REPO / "examples" / "costs" / "uniform.toml"], ["--set", "F=2"]):
        code, _, err = cli("opt", "--schedule", "1f1b", "--ranks", 2, "--microbatches", 2,
                           "--passes", "synth{time_limit=1}", *costs, "-o", out)
        assert code == 0 and "warning" not in err, err
    code, _, err = cli("opt", "--schedule", "1f1b", "--ranks", 2, "--microbatches", 2,
                       "--passes", "split-backward", "-o", out)
    assert code == 0 and err == ""


def test_pass_is_never_slower_and_keeps_the_inputs_memory() -> None:
    costs = HETERO
    s = pipeir.compile(pipeir.library.get("1f1b", 2, 4), "split-backward").schedule
    before = simulate(s, costs).makespan
    out = pipeir.compile(s, "synth{time_limit=5},verify", costs=costs,
                         comm="overlapped").schedule
    assert simulate(out, costs).makespan <= before
    roomy = pipeir.compile(s, "synth{time_limit=5,memory_limit=4}", costs=costs).schedule
    assert simulate(roomy, costs).makespan < before
    assert max(verify(out).peak_activations) <= max(verify(s).peak_activations)
    assert out.name == s.name


@pytest.mark.parametrize(("spec", "column", "message"), [
    ("synth{time_limit=0}", 18,
     "synth: time_limit must be a finite number of seconds > 0, got 0"),
    ("synth{time_limit=nan}", 18,
     "option 'time_limit' of pass 'synth' must be a finite number, got 'nan'"),
    ("synth{time_limit=inf}", 18,
     "option 'time_limit' of pass 'synth' must be a finite number, got 'inf'"),
    ("synth{seed=2147483648}", 12, "synth: the seed must be a 32-bit integer"),
    ("synth{workers=0}", 15, "synth: workers must be 1 to 256, got 0"),
    ("synth{workers=99999999999}", 15, "synth: workers must be 1 to 256, got 99999999999"),
])
def test_pass_option_errors(spec: str, column: int, message: str) -> None:
    """Refused as the pipeline is read, at the option, not by the solver after the search."""
    with pytest.raises(pipeir.UsageError) as e:
        pipeir.compile(pipeir.library.get("1f1b", 2, 4), spec)
    assert e.value.render().startswith(f"<passes>:1:{column}: error: {message}"), \
        e.value.render()


@pytest.mark.parametrize(("before", "message"), [
    ("recompute{all=true}", "synth works on F/B/I/W schedules, but this one has FC"),
    ("dp-reduce", "the input has gradient reductions (R ops)"),
])
def test_pass_refuses_memory_ops_and_reductions(before: str, message: str) -> None:
    """The model orders F/B/I/W; memory ops and R ops are placed after it, never dropped."""
    s = pipeir.compile(pipeir.library.get("1f1b", 2, 4), before).schedule
    with pytest.raises(pipeir.UsageError, match=re.escape(message)):
        pipeir.compile(s, "synth{time_limit=1}", costs=CostModel())
    out = pipeir.compile(pipeir.library.get("1f1b", 2, 4),
                         f"synth{{time_limit=1}},{before}", costs=CostModel()).schedule
    assert any(op.kind in ("FC", "R") for op in out)


def test_pass_refuses_a_mix_of_whole_and_split_backwards() -> None:
    """Its model has one kind of backward; it once split every B of such an input, changing
    the ops a pass that reorders must keep."""
    s = pipeir.compile(pipeir.library.get("1f1b", 2, 4),
                       "split-backward,merge-backward{adjacent_only=true}").schedule
    assert {op.kind for op in s} == {"F", "B", "I", "W"}
    with pytest.raises(pipeir.UsageError, match=r"both whole backwards \(B\(0,0\)\) and split"):
        pipeir.compile(s, "synth{time_limit=1}", costs=CostModel())


def test_the_python_api_warns_when_synth_has_no_costs() -> None:
    """Without costs the pass plans for unit costs; the CLI says so on stderr, and the Python
    API with a UserWarning. Costs given (even the defaults, spelt out) silence it."""
    s = pipeir.library.get("1f1b", 2, 4)
    with pytest.warns(UserWarning, match=r"^synth plans by cost, and there are no costs"):
        pipeir.compile(s, "synth{time_limit=1}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipeir.compile(s, "synth{time_limit=1}", costs=CostModel())
        pipeir.compile(s, "split-backward")
