"""`pipeirc synth`: the schedule it writes simulates to the step it reports, what it says
about optimality, and one clear line for each bad input."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from synth_fixtures import HETERO, REPO

import pipeir
from pipeir.search.synth import make_problem
from pipeir.search.synth.warmstart import starts
from pipeir.sim import CostModel
from pipeir.verify import verify


def test_cli_writes_a_schedule_that_simulates_to_the_reported_step(cli, tmp_path: Path) -> None:
    costs = tmp_path / "c.toml"
    costs.write_text('F = 1.0\nI = 1.5\nW = 0.5\nlatency = 0.25\nunit = "ms"\n'
                     '[stage.0]\nF = 1.5\n[stage.2]\nF = 2.0\n')
    out = tmp_path / "best.sched"
    code, text, err = cli("synth", "--costs", costs, "--ranks", 3, "--microbatches", 6,
                          "--split-backward", "--time-limit", 5, "--workers", 1, "-o", out)
    assert code == 0, err
    step = re.search(r"best: step (\S+) ms", text)
    bound = re.search(r"lower bound: (\S+) ms; gap (\S+)%", text)
    assert step and bound, text
    code, sim, err = cli("simulate", out)
    assert code == 0, err
    assert re.search(r"makespan (\S+) ms", sim).group(1) == step.group(1)  # type: ignore[union-attr]
    elab = pipeir.load(out)
    verify(elab.schedule)
    v = elab.schedule.config.stages // 3
    assert max(verify(elab.schedule).peak_activations) <= 3 * v  # the default budget: 1F1B's


def test_one_rank_is_one_shape_and_said_in_the_singular(cli, tmp_path: Path) -> None:
    """On one rank a V of chunks is the loop: one shape, solved once (it was listed and
    solved twice)."""
    costs = tmp_path / "c.toml"
    costs.write_text("F = 1.0\nB = 2.0\n")
    code, out, err = cli("synth", "--costs", costs, "--ranks", 1, "--microbatches", 1,
                         "--v", 4, "--time-limit", 1)
    assert code == 0, err
    assert out.startswith("synth: 1 rank, 1 micro-batch, v=4 (loop placement)"), out
    assert "shapes searched" not in out and "(optimal for v=4 loop)" in out


@pytest.mark.solver
def test_tune_and_synth_infer_ranks_alike(cli, tmp_path: Path) -> None:
    """Without --ranks both read P off the highest stage with its own costs, and both refuse
    a file whose few named stages lie far apart (a typo such as [stage.99])."""
    sparse = tmp_path / "sparse.toml"
    sparse.write_text("F = 1.0\nB = 2.0\n[stage.0]\nF = 2.0\n[stage.7]\nB = 3.0\n")
    message = (f"error: {sparse}: per-stage costs for stages 0, 7 only, yet the highest, "
               "stage.7, would make the search cover 8 ranks; a typo? give --ranks P to "
               "search P ranks\n")
    assert cli("tune", "--costs", sparse)[1:] == ("", message)
    assert cli("synth", "--costs", sparse, "--microbatches", 8)[1:] == ("", message)
    code, out, err = cli("synth", "--costs", sparse, "--ranks", 8, "--microbatches", 8,
                         "--v", 1, "--time-limit", 1)
    assert code == 0 and out.startswith("synth: 8 ranks") and err == "", err
    # more ranks than the file describes: its last stage (often the LM head) becomes a middle
    # one, which both commands say
    warn = (f"warning: {sparse} describes 8 stages (stage.7.* is the last set) but --ranks is "
            "10: stages 8 to 9 take the file's defaults\n")
    assert cli("synth", "--costs", sparse, "--ranks", 10, "--microbatches", 10, "--v", 1,
               "--time-limit", 1)[2] == warn
    assert cli("tune", "--costs", sparse, "--ranks", 10, "--microbatches", 20, "--max-v", 1,
               "--top", 1)[2] == warn


def test_large_shapes_start_from_the_list_scheduler_while_time_allows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Above EXACT_OPS the list scheduler runs only before a deadline, its variants until
    then (at 8,192 ops it took one micro-batch at a time, 1,536, for the list scheduler's
    256)."""
    import pipeir.search.synth.warmstart as warmstart

    problem = make_problem(HETERO, 3, 8, split=True, memory_limit=3)
    monkeypatch.setattr(warmstart, "EXACT_OPS", 10)
    labels = [st.label for st in starts(problem)]
    assert not any(x.startswith("list scheduler") for x in labels)
    past = [st.label for st in starts(problem, deadline=time.perf_counter() - 1)]
    assert not any(x.startswith("list scheduler") for x in past)
    later = starts(problem, deadline=time.perf_counter() + 60)
    assert len([x for x in later if x.label.startswith("list scheduler")]) > 1
    assert later[0].step < min(st.step for st in later if st.label.startswith("one micro"))


def test_cli_says_what_optimal_covers(cli, tmp_path: Path) -> None:
    """Optimal is over the shapes searched: one shape names it; the default search (1, 2, 4
    chunks and tune's v) does not claim every v, since more chunks per rank can be faster
    within the same budget."""
    costs = tmp_path / "uniform.toml"
    costs.write_text("F = 1.0\nB = 2.0\n")
    code, out, err = cli("synth", "--costs", costs, "--ranks", 2, "--microbatches", 4, "--v",
                         1, "--time-limit", 5, "--backward", "whole")
    assert code == 0, err
    assert "lower bound: 15; gap 0.0% (optimal for v=1 loop);" in out, out
    code, out, err = cli("synth", "--costs", costs, "--ranks", 2, "--microbatches", 4,
                         "--time-limit", 5)
    assert code == 0, err
    assert "(optimal in the shapes searched)" in out and "(optimal)" not in out, out
    assert re.search(r"\nshapes searched: v=\d \w+( I \+ W)?(, v=\d \w+( I \+ W)?)+\n", out), out


@pytest.mark.parametrize(("args", "message"), [
    (("--memory-limit", "0.5"), "smallest feasible limit is --memory-limit 1"),
    (("--memory-limit", "0.75", "--v", "2"), "smallest feasible limit is --memory-limit 2"),
    (("--memory-bytes", "1e9"), "needs activation sizes in the cost file"),
    (("--time-limit", "0"), "argument --time-limit: expected a positive number, got 0"),
    (("--time-limit", "nan"), "argument --time-limit: expected a positive number, got nan"),
    (("--ranks", "2"), "the costs describe 4 stages"),
    (("--v", "0"), "argument --v: expected a positive integer, got 0"),
    (("--workers", "x"), "argument --workers: expected a positive integer, got 'x'"),
    (("-o", "/nonexistent/dir/out.sched"), "-o /nonexistent/dir/out.sched: directory"),
    (("-o", ""), "error: -o: empty path"),
    (("--seed", "2147483648"), "the seed must be a 32-bit integer (at most 2,147,483,647)"),
    (("--workers", "99999999999"), "workers must be 1 to 256, got 99999999999"),
    (("--ranks", "1000000"), "8,000,000 ops (F and B) need 14.9 GiB"),
    (("--v", "10000000"), "--v 10000000: synth cuts a stage into at most 64 chunks"),
    (("--microbatches", "10000000"), "80,000,000 ops (F and B) need 149 GiB"),  # at once
    # bytes with a unit, as check, tune and plan take them (it was "expected a number")
    (("--v", "1", "--placement", "vshape"), "--placement vshape needs --v 2 or more"),
    (("--memory-limit", "1GB"), "--memory-limit 1e+09 needs activation sizes in the cost file"),
    (("--memory-bytes", "1GiB"), "--memory-bytes 1073741824 needs activation sizes in the cost "
                                 "file"),
])
def test_cli_errors_are_clear(cli, args: tuple[str, ...], message: str) -> None:
    mbs = () if "--microbatches" in args else ("--microbatches", 4)  # (each given once)
    code, _out, err = cli("synth", "--costs", REPO / "examples/costs/compute-bound.toml",
                         *mbs, *args)
    assert code == 2 and message in err, err
    assert "Traceback" not in err


def test_cli_bytes_budget_names_the_least_bytes(cli, tmp_path: Path) -> None:
    costs = tmp_path / "c.toml"
    costs.write_text("memory_bytes = 1000\n[stage.1]\nF = 2.0\n")
    code, _, err = cli("synth", "--costs", costs, "--microbatches", 4, "--memory-bytes", 999)
    assert code == 2 and "smallest feasible limit is --memory-bytes 1000" in err, err
    code, _out, err = cli("synth", "--costs", costs, "--microbatches", 4, "--memory-bytes",
                         1000, "--time-limit", 5)
    assert code == 0, err


def test_cli_bytes_budget_searches_the_shapes_it_fits(cli, tmp_path: Path) -> None:
    """With bytes, chunks change what a rank must hold: a budget one stage per rank cannot
    meet is met by two chunks per rank, so synth searches those instead of refusing; the
    least it names is the least over every shape, and is itself feasible when written out."""
    costs = tmp_path / "c.toml"
    costs.write_text("F = 1.0\nB = 2.0\nmemory_bytes = 1e9\n[stage.0]\nmemory_bytes = 4e9\n"
                     "[stage.1]\nF = 1.0\n")
    out = tmp_path / "out.sched"
    code, text, err = cli("synth", "--costs", costs, "--microbatches", 4, "--memory-bytes",
                          3e9, "--time-limit", 2, "--workers", 1, "--backward", "whole",
                          "-o", out)
    assert code == 0, err
    assert "v=1" not in text
    elab = pipeir.load(out)
    size = CostModel.from_settings(elab.costs).activation_memory
    for prog in elab.schedule.programs:  # bytes held, counted by hand: F holds, B frees
        held = peak = 0.0
        for op in prog:
            held += (size(op.stage) or 0.0) * {"F": 1, "B": -1}[op.kind]
            peak = max(peak, held)
        assert peak <= 3e9
    code, _, err = cli("synth", "--costs", costs, "--microbatches", 4, "--memory-bytes", 1e9)
    assert code == 2 and "smallest feasible limit is --memory-bytes 2.5e+09" in err, err
    odd = tmp_path / "odd.toml"
    odd.write_text("memory_bytes = 1234561234\n[stage.1]\nF = 1.0\n")
    code, _, err = cli("synth", "--costs", odd, "--microbatches", 4, "--v", 1,
                       "--memory-bytes", 1e9)
    assert code == 2 and "smallest feasible limit is --memory-bytes 1234561234" in err, err
    code, _, err = cli("synth", "--costs", odd, "--microbatches", 4, "--v", 1,
                       "--memory-bytes", 1234561234, "--time-limit", 1)
    assert code == 0, err
    # one byte short: refused, and printed so that it differs from the least (synth's slack
    # of 1e-9 let it through, and the schedule it wrote then failed `check`)
    code, _, err = cli("synth", "--costs", odd, "--microbatches", 4, "--v", 1,
                       "--memory-bytes", 1234561233, "--time-limit", 1)
    assert code == 2 and ("--memory-bytes 1234561233: no schedule fits; the smallest feasible "
                          "limit is --memory-bytes 1234561234") in err, err
    code, _, err = cli("check", REPO / "examples/1f1b.sched", "--costs", odd, "--memory-limit",
                       "4938244935B")
    assert code == 1 and ("makes 4,938,244,936 bytes of activations (memory_limit = "
                          "4,938,244,935 bytes; this rank peaks at 4,938,244,936)") in err, err


def test_cli_lengths_must_match_the_micro_batches(cli, tmp_path: Path) -> None:
    out = tmp_path / "out.sched"
    code, _, err = cli("synth", "--costs", REPO / "examples/costs/lengths.toml", "--ranks", 2,
                       "--microbatches", 10, "-o", out)
    assert code == 2 and not out.exists()
    assert "lengths.toml:12:1: error: lengths gives 8 micro-batch lengths but the schedule " \
        "has 10 micro-batches" in err, err


def test_cli_refuses_data_parallel_costs_before_searching(cli, tmp_path: Path) -> None:
    costs = tmp_path / "c.toml"
    costs.write_text("F = 1.0\ndp = 2\n")
    out = tmp_path / "out.sched"
    code, _out, err = cli("synth", "--costs", costs, "--ranks", 2, "--microbatches", 4,
                          "-o", out)
    assert code == 2 and "does not model gradient all-reduces" in err, err
    assert err.count("\n") <= 2 and not out.exists()


def test_cli_bad_cost_file_gets_the_cost_file_error(cli, tmp_path: Path) -> None:
    costs = tmp_path / "c.toml"
    costs.write_text("F = 1.0\nQ = 2\n")
    code, _out, err = cli("synth", "--costs", costs, "--ranks", 2, "--microbatches", 4)
    assert code == 2 and "unknown cost 'Q'" in err and "c.toml:2:1" in err, err
