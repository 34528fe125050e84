"""`synthesize` and `synth` as a whole: warm starts, progress, seeds, time limits, memory
budgets, the rounds over shapes and the decomposition of large problems."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from synth_fixtures import HETERO, REPO, Clock

from pipeir.search.synth import EXACT_OPS, Problem, make_problem, search_shapes, synth, synthesize
from pipeir.search.synth.decompose import extend, short_problem
from pipeir.search.synth.warmstart import Start, library, sequential, starts
from pipeir.sim import CostModel, simulate
from pipeir.verify import verify


def test_progress_reports_each_improvement_with_its_bound() -> None:
    problem = make_problem(HETERO, 3, 6, split=True, memory_limit=3)
    seen: list[tuple[float, float, float]] = []
    got = synthesize(problem, time_limit=20, progress=lambda *x: seen.append(x))
    assert seen, "the warm start is improved on here"
    assert all(bound <= best + 1e-9 for _, best, bound in seen)
    assert [best for _, best, _ in seen] == sorted((b for _, b, _ in seen), reverse=True)
    assert seen[-1][1] >= got.step - 1e-9  # the model's objective, >= the simulated step


def test_same_seed_same_schedule_with_one_worker() -> None:
    problem = make_problem(HETERO, 3, 5, split=True, memory_limit=3)
    a = synthesize(problem, time_limit=30, workers=1, seed=7)
    b = synthesize(problem, time_limit=30, workers=1, seed=7)
    assert a.schedule.programs == b.schedule.programs and a.step == b.step


def test_memory_budget_between_the_least_and_1f1b_holds() -> None:
    problem = make_problem(HETERO, 3, 6, memory_limit=2)
    got = synthesize(problem, time_limit=20)
    assert max(verify(got.schedule).peak_activations) <= 2
    assert got.step <= simulate(sequential(problem), HETERO).makespan


def test_too_short_a_time_limit_returns_the_warm_start_with_its_gap() -> None:
    problem = make_problem(HETERO, 4, 8, split=True, memory_limit=2)
    got = synthesize(problem, time_limit=1e-3)
    assert got.step == got.warm.step and got.gap > 0 and not got.optimal
    verify(got.schedule)


def test_synth_never_returns_a_slower_schedule_than_its_warm_start() -> None:
    """Here the two-chunk V's warm start (26.88) is the fastest and meets its own bound,
    while the four-chunk shapes have lower bounds but slower starts: with no time to search
    them, the result is still the fastest start (it once was the four-chunk V's 27.39)."""
    costs = CostModel.from_settings({"F": (1.0, None), "I": (1.0, None), "W": (1.0, None),
                                     "latency": (0.01, None), "bandwidth": (1e7, None),
                                     "activation_bytes": (1e5, None),
                                     "stage.1.F": (1.2, None)})
    got = synth(costs, 2, 8, memory_limit="1f1b", time_limit=1e-9, split=False)
    starts_ = [synthesize(make_problem(costs, 2, 8, v, shape, memory_limit="1f1b"),
                          tune_costs=costs, time_limit=1e-9).warm.step
               for v, shape in ((1, "loop"), (2, "loop"), (2, "vshape"), (4, "loop"),
                                (4, "vshape"))]
    assert got.step <= got.warm.step == min(starts_)
    assert simulate(got.schedule, got.problem.costs).makespan == got.step


def test_decomposition_repeats_a_steady_round() -> None:
    problem = make_problem(CostModel(), 3, 12, split=True, memory_limit=3)
    small = short_problem(problem, 6)
    short = synthesize(small, time_limit=20).schedule
    grown = extend(problem, short)
    assert grown is not None and grown.rounds == 6
    verify(grown.schedule)
    assert problem.fits(grown.schedule)
    assert grown.step == 3 * 12 + 2  # still ZB-H1's closed form


@pytest.mark.solver
def test_rounds_drop_shapes_that_cannot_win_and_continue_the_fastest_open_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Shape by shape (a stand-in solver): the first, fastest warm start (two chunks in a V,
    20.0), is closed at 19.3; the four-chunk loop's bound (19.625) cannot beat that, so it is
    never searched; the second round goes to the fastest shape still open (four chunks in a
    V, bound 18.875), not to the closed one, then (the stand-in returns at once) to the
    two-chunk loop, whose bound, 19.25, is still below 19.3; the bound reported is the open
    shapes' least."""
    import pipeir.search.synth as synth_module

    calls: list[tuple[tuple[int, str], float]] = []

    def fake(problem: Problem, *, warm: Start, full_share: float = synth_module.FULL_SHARE,
             **_: object) -> synth_module.SynthResult:
        c = problem.config
        calls.append(((c.stages // c.ranks, c.placement_name), full_share))
        if len(calls) == 1:
            return synth_module.SynthResult(problem, warm.schedule, 19.3, 19.3, warm, "", True,
                                            0.0)
        return synth_module.SynthResult(problem, warm.schedule, warm.step,
                                        problem.lower_bound(), warm, "", False, 0.0)

    monkeypatch.setattr(synth_module, "synthesize", fake)
    got = synth_module.synth(HETERO, 2, 4, split=True, memory_limit="1f1b", time_limit=30)
    first_round = [shape for shape, share in calls if share != 0.0]
    assert first_round == [(2, "vshape"), (4, "vshape"), (2, "loop")]
    assert [shape for shape, share in calls if share == 0.0] == [(4, "vshape"), (2, "loop")]
    assert got.step == 19.3 and got.bound == pytest.approx(18.875) and not got.optimal


@pytest.mark.solver
def test_second_round_goes_on_to_the_next_open_shape_when_its_lead_closes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Shape by shape (a stand-in solver that never gains in the first round): the second
    round's lead, two chunks in a V (20.0, bound 19.0), closes at its bound; the time left
    goes to the four-chunk V, whose bound (18.875) is below that, and no further (the loops'
    bounds, 19.25 and 19.625, are not). Once it spent 32 s idle on compute-bound."""
    import pipeir.search.synth as synth_module

    second: list[tuple[int, str]] = []
    limits: list[float] = []
    given_bounds: list[float | None] = []

    def fake(problem: Problem, *, warm: Start, time_limit: float,
             full_share: float = synth_module.FULL_SHARE, bound: float | None = None,
             **_: object) -> synth_module.SynthResult:
        c = problem.config
        own = problem.lower_bound()
        if full_share == 0.0:
            second.append((c.stages // c.ranks, c.placement_name))
            limits.append(time_limit)
            given_bounds.append(bound)
            if len(second) == 1:
                clock.spent += 0.2  # closes, having used some of the time
                return synth_module.SynthResult(problem, warm.schedule, own, own, warm, "",
                                                True, 0.0)
        return synth_module.SynthResult(problem, warm.schedule, warm.step, own, warm, "",
                                        False, 0.0)

    clock = Clock()
    monkeypatch.setattr(synth_module, "synthesize", fake)
    monkeypatch.setattr(synth_module, "time", clock)
    got = synth_module.synth(HETERO, 2, 4, split=True, memory_limit="1f1b", time_limit=30)
    assert second == [(2, "vshape"), (4, "vshape")]
    assert limits[1] <= limits[0] - 0.2  # what the first left
    assert given_bounds == pytest.approx([19.0, 18.875])  # each starts from its own bound
    assert got.step == pytest.approx(19.0) and got.bound == pytest.approx(18.875)
    assert not got.optimal


@pytest.mark.solver
def test_large_problems_are_decomposed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Into a short pipeline of max(2 x stages, EXACT_OPS / ops per micro-batch) micro-batches
    (6 here), grown back; not where that is more than half of them (10 micro-batches: the
    short problem would be most of the long one)."""
    import pipeir.search.synth as synth

    problem = make_problem(HETERO, 3, 16, split=True, memory_limit=3)
    assert len(problem.ops) > 60
    monkeypatch.setattr(synth, "EXACT_OPS", 60)
    got = synth.synthesize(problem, time_limit=10)
    assert got.method.startswith("decomposed: solved 6 micro-batches")
    assert got.step <= got.warm.step and got.bound <= got.step
    verify(got.schedule)
    assert EXACT_OPS > 60
    ten = make_problem(HETERO, 3, 10, split=True, memory_limit=3)
    assert not synth.synthesize(ten, time_limit=2).method.startswith("decomposed")


def test_above_full_ops_the_full_model_gets_its_large_share(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    import pipeir.search.synth as synth

    problem = make_problem(HETERO, 3, 8, split=True, memory_limit=3)
    limits: list[float] = []
    real = synth.solve

    def spy(*args: object, **kwargs: object) -> object:
        limits.append(kwargs["time_limit"])  # type: ignore[arg-type]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(synth, "FULL_OPS", 10)
    monkeypatch.setattr(synth, "solve", spy)
    seq = sequential(problem)
    got = synth.synthesize(problem, warm=Start("seq", seq, problem.step_time(seq)),
                           time_limit=10)
    assert len(limits) == 1 and 1.5 < limits[0] <= 10 * synth.LARGE_SHARE
    verify(got.schedule)
    assert problem.fits(got.schedule) and problem.step_time(got.schedule) == got.step
    assert got.step < problem.step_time(seq)


def test_window_search_alone_improves_from_the_warm_start(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    import pipeir.search.synth as synth

    problem = make_problem(HETERO, 3, 8, split=True, memory_limit=3)
    monkeypatch.setattr(synth, "FULL_OPS", 10)
    monkeypatch.setattr(synth, "LARGE_SHARE", 0.0)
    monkeypatch.setattr(synth, "solve", None)  # the full model must not run
    seq = sequential(problem)
    got = synth.synthesize(problem, warm=Start("seq", seq, problem.step_time(seq)),
                           time_limit=10, work_limit=3.0)
    assert got.method.startswith("the warm start, then ") and got.step < got.warm.step
    # a window proves nothing: the bound is the problem's own, optimal only where it is met
    assert got.bound == problem.lower_bound()
    assert got.optimal == (got.step <= got.bound * (1 + 1e-9))
    verify(got.schedule)
    assert problem.fits(got.schedule) and problem.step_time(got.schedule) == got.step


@pytest.mark.solver
def test_warm_start_labels_say_what_the_order_is() -> None:
    """A B-only problem takes tune's split candidates with their backwards merged, and says
    so: the order is not what split-backward{mode=h1} alone would run."""
    costs = CostModel.load(REPO / "examples" / "costs" / "heavy-ends.toml")
    problem = make_problem(costs, 4, 8, 2, "vshape", split=False, memory_limit=8)
    found = starts(problem, library(costs, 4, 8, "overlapped", 2))
    zbv = [st for st in found if st.label.startswith("zb-v")]
    assert [st.label for st in zbv] == ["zb-v v=2, backwards merged"]
    assert {op.kind for op in zbv[0].schedule} == {"F", "B"}
    split = make_problem(costs, 4, 8, 2, "vshape", split=True, memory_limit=8)
    assert "zb-v v=2" in [st.label for st in starts(split, library(costs, 4, 8, "overlapped",
                                                                   2))]


@pytest.mark.solver
def test_a_warm_start_at_the_bound_is_not_decomposed(monkeypatch: pytest.MonkeyPatch) -> None:
    """1F1B meets the bound of uniform costs with one stage per rank: nothing to decompose
    (at p = 64, m = 256 that was 6 s of a 10 s limit)."""
    import pipeir.search.synth as synth

    costs = CostModel.load(REPO / "examples" / "costs" / "uniform.toml")
    problem = make_problem(costs, 8, 128, memory_limit=8)
    assert len(problem.ops) > EXACT_OPS
    monkeypatch.setattr(synth, "_decompose", None)  # must not be called
    got = synth.synthesize(problem, tune_costs=costs, time_limit=20)
    assert got.optimal and got.step == got.warm.step == problem.lower_bound()
    assert got.method == "the warm start meets the lower bound"


def test_the_library_search_and_the_bounds_stay_within_the_time(
        monkeypatch: pytest.MonkeyPatch, cli, tmp_path: Path) -> None:
    """tune's search gets a deadline of a third of the time limit; shapes whose bound is not
    reached by half of it are left out, and the output says so (a shape's bound took 5 s at
    p = 64, m = 256; simulated here by a slow bound). tune's best shape is bounded first, so
    its answer is never lost. Both wait for `FLOOR` seconds at least, so small problems do
    not depend on the machine's speed."""
    import pipeir.search.synth as synth
    import pipeir.search.tune

    deadlines: list[float] = []
    real_search, real_bound = pipeir.search.tune.search, Problem.lower_bound
    clock = Clock()

    def search(*args: object, deadline: float, **kwargs: object) -> object:
        # the deadline synth sets is recorded, not enforced: where tune's search stops is
        # the machine's speed (tests/test_limits.py checks what a deadline keeps)
        assert clock.first is not None
        deadlines.append(deadline - clock.first)
        return real_search(*args, **kwargs)  # type: ignore[arg-type]

    def slow(self: Problem) -> float:
        clock.spent += 0.5
        return real_bound(self)

    monkeypatch.setattr(pipeir.search.tune, "search", search)
    monkeypatch.setattr(Problem, "lower_bound", slow)
    monkeypatch.setattr(synth, "FLOOR", 0.0)  # (2 s, which small problems never reach)
    monkeypatch.setattr(synth, "time", clock)
    got = synth.synth(HETERO, 2, 4, split=True, time_limit=0.8)
    assert deadlines == [pytest.approx(0.8 / 3)]  # from synth's start
    tuned = real_search(HETERO, 2, [4], comms=("overlapped",), dp=1).best
    own = f"v={tuned.v} {tuned.schedule.config.placement_name or 'loop'} I + W"
    assert got.shapes == (own,) and got.bound <= got.step <= tuned.step_time
    every = tuple(f"{x} I + W" for x in ("v=1 loop", "v=2 loop", "v=2 vshape", "v=4 loop",
                                           "v=4 vshape"))
    assert got.unsearched == tuple(x for x in every if x != own)
    costs = tmp_path / "costs.toml"
    costs.write_text("F = 1.0\nI = 1.5\nW = 0.5\nlatency = 0.25\n")
    code, out, err = cli("synth", "--costs", costs, "--ranks", 2, "--microbatches", 4,
                         "--split-backward", "--time-limit", 0.8)
    assert code == 0, err
    assert re.search(r"\nshapes searched: v=\d \w+ I \+ W; not reached within --time-limit "
                     r"0\.8: v=\d \w+ I \+ W(, v=\d \w+ I \+ W){3} \(the bound does not "
                     r"cover them\)\n", out), out
    assert "(optimal)" not in out  # at most "optimal in the shapes searched"


def test_a_deadline_that_cuts_tunes_search_says_so() -> None:
    """A deadline already past keeps the first candidate only, and the result says it was cut
    (synth's warm starts then may lack tune's answer); without one nothing is cut."""
    import pipeir.search.tune as tune

    whole = tune.search(HETERO, 2, [4], comms=("overlapped",), dp=1)
    cut = tune.search(HETERO, 2, [4], comms=("overlapped",), dp=1, deadline=0.0)
    assert not whole.cut and cut.cut
    assert len(cut.ranked) + len(cut.over_limit) == 1 < len(whole.ranked) + len(whole.over_limit)


def test_synth_tells_when_its_time_limit_cut_tunes_search(
        monkeypatch: pytest.MonkeyPatch, cli, tmp_path: Path) -> None:
    """Where tune's own search does not fit in synth's share of the time (19 s at p = 32,
    m = 128), synth may end slower than `pipeirc tune`: the run says so on stderr. A deadline
    already past stands in for a large problem."""
    import pipeir.search.tune

    costs = tmp_path / "costs.toml"
    costs.write_text("F = 1.0\nI = 1.5\nW = 0.5\nlatency = 0.25\n")
    args = ("synth", "--costs", costs, "--ranks", 2, "--microbatches", 4, "--split-backward",
            "--v", 1, "--time-limit", 1)
    code, _, err = cli(*args)
    assert (code, err) == (0, "")
    real_search = pipeir.search.tune.search

    def past(*a: object, deadline: float | None = None, **kw: object) -> object:
        return real_search(*a, deadline=0.0, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeir.search.tune, "search", past)
    code, out, err = cli(*args)
    assert code == 0, err
    assert err == ("note: --time-limit 1 cut tune's library search short, so tune's best "
                   "schedule may be missing from the warm starts and synth can end slower "
                   "than `pipeirc tune`; a longer limit keeps it at least as fast\n")
    assert out.startswith("synth: 2 ranks")


def test_shapes_add_the_other_placement_of_tunes_v_while_it_is_small() -> None:
    """At compute-bound's 64 activations (eight whole stages' memory at eight chunks) tune's
    best is an eight-chunk loop; synth also searches the eight-chunk V (where the bound is
    met), but not where the model would be too large to solve, and never a placement the
    user excluded."""
    costs = CostModel.load(REPO / "examples/costs/compute-bound.toml")
    candidates = library(costs, 4, 8, "overlapped", 8)
    shapes = search_shapes(candidates, 4, None, "search", 64, 96)
    assert {(8, "loop"), (8, "vshape"), (4, "vshape")} <= set(shapes)
    assert all(shape == "loop" for _, shape in search_shapes(candidates, 4, None, "loop", 64, 96))
    assert search_shapes(candidates, 4, None, "search", 64, EXACT_OPS) == \
        [(1, "loop"), (2, "loop"), (2, "vshape"), (8, "loop")]
