"""synth's objectives and defaults: the steady step (steps back to back) optimal against the
brute force over every order timed step after step by the fixtures' own simulator; whole and
split backwards searched by default and never slower than tune at the same memory; what synth
writes passes `check` with the same memory flag."""

from __future__ import annotations

from pathlib import Path

import pytest
from synth_fixtures import HETERO, REPO, brute_force

from pipeir.config import PipelineConfig
from pipeir.search.synth import Problem, make_problem, synth, synthesize
from pipeir.search.tune import search
from pipeir.sim import CostModel
from pipeir.sim.steady import steady_state
from pipeir.verify import verify


@pytest.mark.parametrize(("m", "split", "limit", "comm"), [
    (2, False, None, "overlapped"), (3, False, 1, "overlapped"), (3, False, 2, "blocking"),
    (2, True, None, "overlapped"), (2, True, 1, "blocking"),
])
def test_steady_objective_is_optimal_on_every_order_of_two_ranks(
        m: int, split: bool, limit: int | None, comm: str) -> None:
    problem = Problem(PipelineConfig.make(2, m), HETERO, split, comm,  # type: ignore[arg-type]
                      None if limit is None else float(limit), objective="steady")
    want = brute_force(problem)  # every order, many steps back to back, timed in the fixture
    assert problem.lower_bound() <= want + 1e-9
    got = synthesize(problem, time_limit=20, workers=1)
    assert got.optimal and got.gap == 0
    assert got.step == pytest.approx(want, abs=1e-9)
    assert got.step == pytest.approx(steady_state(got.schedule, HETERO, comm).step)
    verify(got.schedule)
    assert problem.fits(got.schedule)
    # the makespan objective's best is never better back to back (and usually worse there)
    one = Problem(problem.config, HETERO, split, comm,  # type: ignore[arg-type]
                  problem.memory_limit)
    assert steady_state(synthesize(one, time_limit=20, workers=1).schedule, HETERO,
                        comm).step >= want - 1e-9


def _cost_files() -> list[Path]:
    return sorted(p for p in (REPO / "examples" / "costs").iterdir()
                  if p.suffix in (".toml", ".json"))


@pytest.mark.solver
@pytest.mark.parametrize("path", _cost_files(), ids=lambda p: p.name)
def test_default_synth_is_never_slower_than_tune_at_the_same_memory(path: Path) -> None:
    """With no backward or shape flags, synth searches B and I + W over its shapes and starts
    from tune's candidates: at tune's own budget it can only match or beat tune's best."""
    costs = CostModel.load(path)
    ranks = 4
    m = len(costs.mb) if costs.mb else 8
    if costs.stage and max(costs.stage) >= ranks:
        ranks = max(costs.stage) + 1
        m = 2 * ranks
    for limit in (float(ranks), 2.0 * ranks):
        tuned = search(costs, ranks, [m], memory_limit=limit, comms=("overlapped",))
        got = synth(costs, ranks, m, memory_limit=limit, time_limit=4, workers=1)
        assert got.step <= tuned.best.step_time * (1 + 1e-9), (limit, got.method)
        verify(got.schedule)
        assert got.problem.fits(got.schedule)


@pytest.mark.solver
@pytest.mark.parametrize("objective", ["makespan", "steady"])
@pytest.mark.parametrize("limit", ["4", "6"])
def test_what_synth_writes_passes_check_with_the_same_flag(
        cli, tmp_path: Path, objective: str, limit: str) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "s.sched"
    code, text, err = cli("synth", "--costs", REPO / "examples/costs/heavy-ends.toml",
                          "--ranks", 4, "--microbatches", 8, "--memory-limit", limit,
                          "--objective", objective, "--time-limit", 3, "--workers", 1,
                          "-o", out)
    assert code == 0, err
    assert cli("check", out, "--memory-limit", limit)[0] == 0
    best = float(text.split("best: step ")[1].split()[0])
    code, sim, _ = cli("simulate", out)  # (the file's costs: the chunks synth cut)
    want = (f"makespan {best:g}" if objective == "makespan"
            else f"steps back to back: {best:g}")
    assert code == 0 and want in sim, (want, sim)


def test_steady_bound_is_the_busiest_rank() -> None:
    """Back to back, a rank runs all of its ops once per step: with uniform costs and no
    links, P ranks of m micro-batches of F + B each need m (F + B) per step, and ZB-H2 (the
    library) meets it, which synth's warm start finds and proves optimal at once."""
    costs = CostModel(F=1.0, I=1.0, W=1.0)
    got = synth(costs, 4, 8, v=1, split=True, memory_limit=7.0, time_limit=5, workers=1,
                objective="steady")
    assert got.problem.lower_bound() == 24.0
    assert got.step == 24.0 and got.optimal


@pytest.mark.solver
def test_default_shapes_keep_the_zero_bubble_start_of_one_stage_per_rank() -> None:
    """The paper's ZB-2p setting at p = 8 (T_F = T_B = T_W, m = 3p, twice 1F1B's memory): its
    bubble is 0, a steady step of m (F + I + W) = 72 (the authors' closed form). With the
    default shapes, tune's best by makespan has many chunks (thousands of ops, whose list
    scheduler could take the warm-start time) while one stage per rank has 1F1B split h2
    (ZB-H2) among its library starts; synth must not lose it to the clock."""
    costs = CostModel(F=1.0, I=1.0, W=1.0, memory_bytes=1.0)
    got = synth(costs, 8, 24, memory_bytes=16.0, time_limit=10, workers=1, objective="steady")
    assert steady_state(got.schedule, got.problem.costs).step == pytest.approx(72.0)
    assert got.step == pytest.approx(72.0) and got.optimal
    assert got.problem.fits(got.schedule)
    verify(got.schedule)


#: HETERO with activation sizes, of which W keeps a quarter after I (the paper's M_W = M_B / 3)
SPLIT_MEMORY = CostModel.from_settings({**HETERO.settings(), "memory_bytes": 1000.0,
                                        "memory_w_bytes": 250.0})


@pytest.mark.parametrize(("m", "budget", "unit"), [(3, 1500.0, "bytes"), (3, 1.5, "counted"),
                                                   (2, 1250.0, "bytes")])
def test_partial_release_is_optimal_against_the_brute_force(m: int, budget: float,
                                                            unit: str) -> None:
    """An I frees three quarters of its activation: the model's two intervals per activation
    (F to I, F to W) find the best order of every one that fits by the fixture's own count,
    which more memory-hungry orders need (the whole-release count would refuse them)."""
    by_bytes = unit == "bytes"
    problem = make_problem(SPLIT_MEMORY, 2, m, split=True,
                           **({"memory_bytes": budget} if by_bytes else
                              {"memory_limit": budget}))  # type: ignore[arg-type]
    want = brute_force(problem)
    whole = CostModel.from_settings({**HETERO.settings(), "memory_bytes": 1000.0})
    held_whole = brute_force(make_problem(whole, 2, m, split=True,
                                          **({"memory_bytes": budget} if by_bytes else
                                             {"memory_limit": budget})))  # type: ignore[arg-type]
    assert want < held_whole  # partial release admits faster orders
    got = synthesize(problem, time_limit=20, workers=1)
    assert got.optimal and got.step == pytest.approx(want, abs=1e-9)
    assert problem.fits(got.schedule)


@pytest.mark.solver
def test_split_memory_schedules_pass_check_at_the_same_flag(cli, tmp_path: Path
                                                            ) -> None:  # type: ignore[no-untyped-def]
    costs = tmp_path / "c.toml"
    costs.write_text("F = 1.0\nI = 1.0\nW = 1.0\nmemory_bytes = 1000.0\n"
                     "memory_w_bytes = 250.0\n")
    for flag in (["--memory-limit", "3"], ["--memory-bytes", "2500"]):
        out = tmp_path / "s.sched"
        code, _, err = cli("synth", "--costs", costs, "--ranks", 4, "--microbatches", 8,
                           *flag, "--time-limit", 3, "--workers", 1, "-o", out)
        assert code == 0, err
        check = ["--memory-limit", flag[1] if flag[0] == "--memory-limit" else "2500B"]
        code, _, err = cli("check", out, *check)  # (the file's costs: its chunks)
        assert code == 0, err
