"""pipeirc tune: interleaving when compute dominates, not when communication does; the file it
writes verifies and is the fastest row of the table it printed; the memory limit holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipeir
from pipeir.search.tune import search
from pipeir.sim import CostModel, simulate
from pipeir.sim.chunks import rescale
from pipeir.verify import verify

REPO = Path(__file__).parent.parent
COMPUTE = REPO / "examples" / "costs" / "compute-bound.toml"
COMM = REPO / "examples" / "costs" / "comm-bound.toml"


def rows(out: str) -> list[list[str]]:
    """The table's data rows, split on runs of two or more spaces."""
    return [re.split(r"\s{2,}", line.strip()) for line in out.splitlines()
            if re.match(r"^\s*\d+\s", line)]


def check_written(path: Path, out: str, comm: str = "overlapped") -> float:
    """The written file verifies and simulates, with its own costs, to the table's minimum."""
    elab = pipeir.load(path)
    verify(elab.schedule)
    got = simulate(elab.schedule, CostModel.from_settings(elab.costs), comm=comm).makespan
    steps = [float(r[6]) for r in rows(out)]
    assert got == pytest.approx(min(steps), rel=1e-5)
    assert float(rows(out)[0][6]) == min(steps)
    return got


def test_compute_bound_picks_interleaving_or_zero_bubble(cli, tmp_path: Path) -> None:
    out_file = tmp_path / "best.sched"
    code, out, err = cli("tune", "--costs", str(COMPUTE), "-o", str(out_file))
    assert code == 0, err
    best = rows(out)[0]
    assert best[1] == "interleaved-1f1b" or "split-backward" in best[4]
    check_written(out_file, out)


def test_comm_bound_does_not_pick_high_v(cli, tmp_path: Path) -> None:
    out_file = tmp_path / "best.sched"
    code, out, err = cli("tune", "--costs", str(COMM), "-o", str(out_file))
    assert code == 0, err
    table = rows(out)
    assert int(table[0][2]) <= 2
    high = [float(r[6]) for r in table if int(r[2]) >= 4]
    assert high and min(high) > float(table[0][6])  # high v was tried and lost
    check_written(out_file, out)


def test_memory_limit_holds_and_too_small_a_limit_is_an_error(cli, tmp_path: Path) -> None:
    code, out, _ = cli("tune", "--costs", str(COMM), "--memory-limit", "4")
    assert code == 0
    assert all(float(r[8]) <= 4 for r in rows(out))
    assert "over --memory-limit 4 left out" in out
    code, _, err = cli("tune", "--costs", str(COMM), "--memory-limit", "0.1")
    assert code == 2 and "no schedule fits --memory-limit 0.1" in err


def test_lengths_turn_on_reorder_and_fix_the_microbatch_count(cli, tmp_path: Path) -> None:
    out_file = tmp_path / "best.sched"
    lengths = "2048,128,256,1024,64,512,4096,300"
    code, out, err = cli("tune", "--costs", str(COMPUTE), "--lengths", lengths, "--max-v", "2",
                         "--comm", "overlapped", "-o", str(out_file))
    assert code == 0, err
    assert all("reorder" in r[4] and r[3] == "8" for r in rows(out))
    check_written(out_file, out)
    code, _, err = cli("tune", "--costs", str(COMPUTE), "--lengths", lengths,
                       "--microbatches", "16")
    assert code == 2 and "8 micro-batch lengths but the schedule has 16" in err


@pytest.mark.parametrize("extra, message", [
    (["--microbatches", "8,x"], "--microbatches 8,x: expected positive integers"),
    (["--ranks", "2"], "the costs describe 4 stages"),
    (["--max-v", "0"], "--max-v 0: expected a power of 2 from 1 to 64"),
    (["--max-v", "3"], "--max-v 3: expected a power of 2 from 1 to 64"),
    (["--max-v", "99999999999"], "--max-v 99999999999: expected a power of 2"),
    (["--lengths", "5,-1"], "lengths must be positive"),
    (["--microbatches", ""], "--microbatches '': expected positive integers"),  # not 2P,4P
    (["--dp", "3000000000"], "processes; torch.distributed numbers them with 32-bit integers"),
])
def test_bad_usage(cli, extra: list[str], message: str) -> None:
    code, _, err = cli("tune", "--costs", str(COMPUTE), *extra)
    assert code == 2 and message in err and "Traceback" not in err


def test_ranks_are_needed_without_per_stage_costs(cli, tmp_path: Path) -> None:
    f = tmp_path / "flat.json"
    f.write_text('{"F": 1, "B": 2}')
    code, _, err = cli("tune", "--costs", str(f))
    assert code == 2 and "give --ranks P" in err
    code, out, _ = cli("tune", "--costs", str(f), "--ranks", "2", "--max-v", "2")
    assert code == 0 and rows(out)


def test_per_micro_batch_costs_past_the_micro_batches_are_refused(cli, tmp_path: Path
                                                                 ) -> None:
    """Ignored, they made the micro-batches look unequal: every candidate got `reorder`."""
    f = tmp_path / "mb.toml"
    f.write_text("F = 1\n[mb.100]\nF = 2\n")
    code, _, err = cli("tune", "--costs", str(f), "--ranks", "2", "--microbatches", "4,200")
    assert code == 2 and err.strip() == ("error: the costs give per-micro-batch times for 101 "
                                         "micro-batches but --microbatches is 4")


def test_rescale_cuts_stages_into_chunks() -> None:
    c = CostModel.from_settings({"F": 2.0, "B": 4.0, "stage.1.F": 6.0, "memory_bytes": 8.0,
                                 "activation_bytes": 10.0})
    r = rescale(c, ranks=2, v=2, scale=0.5)
    from pipeir.ops import Op

    assert r.cost(Op("F", 0, 0)) == 0.5 and r.cost(Op("F", 2, 0)) == 1.5
    assert r.cost(Op("F", 3, 0)) == 1.5 and r.cost(Op("B", 3, 0)) == 1.0
    assert r.activation_memory(1) == 2.0 and r.boundary_bytes(0) == 5.0


@settings(max_examples=8, deadline=None)
@given(F=st.floats(0.1, 5), I=st.floats(0.1, 5), W=st.floats(0.1, 5),
       latency=st.sampled_from([0.0, 0.01, 1.0]), ranks=st.integers(1, 3))
def test_search_finds_the_fastest_of_an_independent_enumeration(
        F: float, I: float, W: float, latency: float, ranks: int) -> None:  # noqa: E741
    """The candidates are rebuilt here, without tune: library schedules, the passes applied
    through the pass manager, and uniform costs scaled by hand (a chunk of v costs 1/v; m
    micro-batches of the same batch cost ref/m each). tune's best must be the minimum, and
    1F1B's row must match the closed form (m + p - 1)(F + B) when links are free."""
    from pipeir.passes import PassManager, parse_pipeline

    mbs = [2 * ranks, 4 * ranks]
    result = search(CostModel(F=F, I=I, W=W, latency=latency), ranks, mbs, max_v=2)
    want = float("inf")
    for m in mbs:
        scale = mbs[0] / m
        for family, v in [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-v", 2),
                          ("dualpipe-v", 2)]:
            if v > 1 and ranks == 1:
                continue
            try:
                base = pipeir.library.get(family, ranks, m, **({"v": v} if family ==
                                                               "interleaved-1f1b" else {}))
            except pipeir.PipeirError:
                continue
            t = scale / v
            costs = CostModel(F=F * t, I=I * t, W=W * t, latency=latency)
            splits = [""] if family in ("zb-v", "dualpipe-v") else \
                ["", "split-backward{mode=h1}", "split-backward{mode=h2}"]
            for split in splits:
                s = PassManager(parse_pipeline(split)).run(base) if split else base
                for comm in ("overlapped", "blocking"):
                    want = min(want, simulate(s, costs, comm).makespan)
            if family == "1f1b" and latency == 0.0:
                row = next(c for c in result.ranked if c.family == "1f1b" and c.microbatches
                           == m and not c.passes and c.comm == "overlapped")
                assert row.step_time == pytest.approx((m + ranks - 1) * (F + I + W) * scale)
    assert result.best.step_time == pytest.approx(want, rel=1e-12)
    verify(result.best.schedule)


def test_tight_memory_is_counted_as_check_counts(cli, tmp_path: Path) -> None:
    # the limit counts activations as `check` does (one per chunk and micro-batch: V chunks
    # of 1F1B's memory are P x V), so whatever wins passes check at the same limit
    out_file = tmp_path / "best.sched"
    code, out, err = cli("tune", "--costs", str(COMPUTE), "--memory-limit", "4", "-o",
                         str(out_file))
    assert code == 0, err
    assert all(float(r[8]) <= 4 for r in rows(out))
    check_written(out_file, out)
    assert cli("check", out_file, "--memory-limit", "4")[0] == 0


def test_chunks_of_stage_0_after_the_first_have_an_input_gradient() -> None:
    """A profiled stage 0 has I = 0 (its input needs no gradient); interleaved, only its
    first chunk is the first stage: the others get W x the other stages' I/W (issue 11)."""
    costs = CostModel.from_settings({"F": 1.0, "B": 2.0, "stage.0.I": 0.0, "stage.0.W": 1.5,
                                     "stage.0.B": 1.5, "stage.1.I": 1.2, "stage.1.W": 0.8,
                                     "stage.1.B": 2.0})
    chunks = rescale(costs, 2, 2).stage
    assert chunks[0] == {"I": 0.0, "W": 0.75, "B": 0.75}
    assert chunks[1]["I"] == pytest.approx(0.75 * 1.5)
    assert chunks[1]["B"] == pytest.approx(0.75 * 2.5)
    assert chunks[2] == chunks[3] == pytest.approx({"I": 0.6, "W": 0.4, "B": 1.0})


def test_simulate_with_costs_over_tunes_file_warns(cli, tmp_path: Path) -> None:
    best = tmp_path / "best.sched"
    code, _, err = cli("tune", "--costs", COMPUTE, "--max-v", "2", "-o", best)
    assert code == 0, err
    code, _, err = cli("simulate", best, "--costs", COMPUTE)
    assert code == 0
    assert f"warning: --costs {COMPUTE} replaces the schedule file's own costs block" in err
    if "stages = 8" in best.read_text():
        assert "describes 4 stages but the schedule has 8" in err
    code, _, err = cli("simulate", best)
    assert code == 0 and "warning" not in err
