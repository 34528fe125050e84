"""Variable-length micro-batches and `reorder{by=cost}`: lengths become per-micro-batch costs,
the specialised evaluator agrees with the simulator, and reordering keeps the work and the
memory and never lengthens the step."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipeir
from pipeir.diagnostics import UsageError
from pipeir.ops import Op
from pipeir.passes import PassContext, PassManager, parse_pipeline
from pipeir.passes.reorder import (
    Reorder,
    SlotSimulator,
    candidates,
    plan_order,
    relabel,
)
from pipeir.schedule import Schedule
from pipeir.sim import CostModel, simulate
from pipeir.sim.lengths import LengthCost, lognormal_lengths, parse_lengths
from pipeir.testing import configs, schedules
from pipeir.verify import verify

LIBRARY = [("gpipe", {}), ("1f1b", {}), ("interleaved-1f1b", {"v": 2})]


def costs_for(lengths: list[int] | tuple[int, ...], **extra: object) -> CostModel:
    return CostModel.from_settings({"F": 1.0, "B": 2.0, "lengths": tuple(lengths), **extra})


# ---- lengths -> costs ------------------------------------------------------------------------
def test_lengths_scale_every_kind_relative_to_the_mean_length() -> None:
    c = costs_for([100, 300])  # mean 200: factors 0.5 and 1.5
    assert [c.cost(Op("F", 0, m)) for m in range(2)] == [0.5, 1.5]
    assert [c.cost(Op("B", 3, m)) for m in range(2)] == [1.0, 3.0]
    assert c.cost(Op("I", 0, 1)) == pytest.approx(1.5)


def test_length_cost_coefficients_and_reference() -> None:
    c = CostModel.from_settings({"F": 2.0, "lengths": (10, 20), "length_cost": (1, 0, 1),
                                 "length_ref": 10})
    # shape(len) = 1 + len^2; ref 10 -> 101
    assert c.cost(Op("F", 0, 0)) == pytest.approx(2.0)
    assert c.cost(Op("F", 0, 1)) == pytest.approx(2.0 * 401 / 101)


def test_given_costs_win_over_derived_ones_and_stage_costs_are_scaled() -> None:
    c = CostModel.from_settings({"F": 1.0, "B": 2.0, "stage.1.F": 3.0, "mb.1.B": 9.0,
                                 "lengths": (100, 300)})
    assert c.cost(Op("F", 1, 1)) == pytest.approx(4.5)  # stage cost x 1.5
    assert c.cost(Op("B", 1, 1)) == 9.0  # given directly
    assert c.cost(Op("B", 0, 0)) == pytest.approx(1.0)


def test_a_sched_costs_block_with_lengths_simulates(tmp_path: Path, cli) -> None:
    head = "pipeline {\n ranks = 2\n microbatches = 3\n}\ncosts {\n F = 1.0\n B = 2.0\n"
    by_length, by_hand = tmp_path / "l.sched", tmp_path / "h.sched"
    by_length.write_text(head + " lengths = [100, 200, 300]\n}\nschedule = 1f1b\n")
    by_hand.write_text(head + " mb.0.F = 0.5\n mb.0.B = 1.0\n mb.2.F = 1.5\n mb.2.B = 3.0\n"
                       "}\nschedule = 1f1b\n")
    results = []
    for f in (by_length, by_hand):
        code, out, err = cli("simulate", str(f), "--json")
        assert code == 0, err
        results.append(json.loads(out)["makespan"])
    assert results[0] == results[1] > 9  # the uniform step is 9


@pytest.mark.parametrize("settings_, message", [
    ({"lengths": (100, -5)}, "positive"),
    ({"lengths": "long"}, "must be a number or a list of numbers"),
    ({"lengths": (1, 2), "length_cost": (1, 2, 3, 4)}, "1 to 3 coefficients"),
    ({"length_cost": (0, 1)}, "'length_cost' needs 'lengths'"),
    ({"lengths": (1, 2), "length_cost": (0, 0)}, "not all zero"),
])
def test_bad_length_settings_are_usage_errors(settings_: dict[str, object],
                                              message: str) -> None:
    with pytest.raises(UsageError, match=message):
        CostModel.from_settings(settings_)


def test_bad_lengths_in_a_cost_file_point_at_the_line(tmp_path: Path, cli) -> None:
    f = tmp_path / "c.toml"
    f.write_text("F = 1.0\nlengths = [10, 0]\n")
    code, _, err = cli("simulate", "--schedule", "1f1b", "--ranks", "2", "--microbatches",
                       "2", "--costs", str(f))
    assert code == 2
    assert "c.toml:2:" in err and "positive" in err and "Traceback" not in err


def test_parse_lengths_flag() -> None:
    assert parse_lengths("512, 128,2048") == (512.0, 128.0, 2048.0)
    with pytest.raises(UsageError, match="--lengths 5,x"):
        parse_lengths("5,x")
    with pytest.raises(UsageError, match="positive"):
        parse_lengths("5,0")


def test_lognormal_lengths_are_reproducible_and_bounded() -> None:
    a = lognormal_lengths(64, seed=3)
    assert a == lognormal_lengths(64, seed=3) != lognormal_lengths(64, seed=4)
    assert all(16 <= x <= 8192 for x in a) and len(set(a)) > 10
    with pytest.raises(ValueError):
        LengthCost(())


# ---- the evaluator ---------------------------------------------------------------------------
def _perm(draw: st.DrawFn, m: int) -> list[int]:
    return draw(st.permutations(list(range(m))))


@st.composite
def library_case(draw: st.DrawFn) -> tuple[Schedule, CostModel, str, list[int]]:
    name, params = draw(st.sampled_from(LIBRARY))
    p = draw(st.integers(1, 5))
    m = draw(st.integers(1, 10))
    if name == "interleaved-1f1b" and m % max(1, m // p):
        m = p
    s = pipeir.library.get(name, ranks=p, microbatches=m, **params)
    lengths = draw(st.lists(st.integers(1, 4096), min_size=m, max_size=m))
    latency = draw(st.sampled_from([0.0, 0.05, 0.7]))
    comm = draw(st.sampled_from(["overlapped", "blocking"]))
    return s, costs_for(lengths, latency=latency), comm, _perm(draw, m)


@settings(max_examples=60, deadline=None)
@given(library_case())
def test_slot_simulator_is_the_simulator(case: tuple[Schedule, CostModel, str, list[int]]
                                         ) -> None:
    s, costs, comm, perm = case
    sim = SlotSimulator(s, costs, comm)
    assert sim.makespan(range(s.config.microbatches)) == simulate(s, costs, comm).makespan
    assert sim.makespan(perm) == simulate(relabel(s, perm), costs, comm).makespan


# ---- the pass --------------------------------------------------------------------------------
def work(s: Schedule) -> Counter[tuple[str, int, int]]:
    """What a schedule computes, a B counted as its halves I + W (random schedules mix the
    two, and relabelling moves a split from one micro-batch to another)."""
    out: Counter[tuple[str, int, int]] = Counter()
    for op in s:
        for kind in ("I", "W") if op.kind == "B" else (op.kind,):
            out[kind, op.stage, op.mb] += 1
    return out


def peaks(s: Schedule) -> tuple[int, ...]:
    return verify(s).peak_activations


def check_reorder(s: Schedule, costs: CostModel, comm: str) -> Schedule:
    out = PassManager([Reorder(budget_ms=5, evals=60)],
                      context=PassContext(costs, comm)).run(s)
    assert work(out) == work(s)  # the same work
    assert peaks(out) == peaks(s)  # the same per-rank memory
    assert simulate(out, costs, comm).makespan <= simulate(s, costs, comm).makespan
    return out


@settings(max_examples=40, deadline=None)
@given(library_case())
def test_reorder_on_library_schedules(case: tuple[Schedule, CostModel, str, list[int]]) -> None:
    s, costs, comm, _ = case
    check_reorder(s, costs, comm)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_reorder_on_random_valid_schedules(data: st.DataObject) -> None:
    s = data.draw(schedules(configs(max_ranks=4, max_microbatches=8, max_chunks=2)))
    m = s.config.microbatches
    lengths = data.draw(st.lists(st.integers(1, 1000), min_size=m, max_size=m))
    check_reorder(s, costs_for(lengths, latency=0.1), data.draw(
        st.sampled_from(["overlapped", "blocking"])))


def test_reorder_shortens_1f1b_with_skewed_lengths() -> None:
    s = pipeir.library.get("1f1b", ranks=4, microbatches=16)
    costs = costs_for(lognormal_lengths(16, seed=0))
    plan = plan_order(s, costs, budget_s=1.0, evals=50)
    assert plan.improved and plan.reduction > 0.15
    assert plan.evaluations == 50
    out = check_reorder(s, costs, "overlapped")
    assert out != s


def test_reorder_without_costs_or_with_equal_costs_returns_the_input() -> None:
    s = pipeir.library.get("1f1b", ranks=3, microbatches=6)
    with pytest.warns(UserWarning, match=r"reorder plans by cost, and there are no costs"):
        assert PassManager(parse_pipeline("reorder")).run(s) == s
    assert PassManager(parse_pipeline("reorder{budget_ms=5}"),
                       context=PassContext(CostModel())).run(s) == s


def test_reorder_run_directly_without_a_context_warns_at_the_callers_line() -> None:
    """`Reorder().run(s)` plans for unit costs just as a PassManager without costs does, and
    says so the same way, pointing at the line that called it; a context with costs (even
    the defaults spelt out) is silent."""
    s = pipeir.library.get("1f1b", ranks=3, microbatches=6)
    with pytest.warns(UserWarning, match=r"^reorder plans by cost, and there are no costs "
                      r"\(give run\(\) a PassContext with costs") as caught:
        assert Reorder(budget_ms=5).run(s) == s
    assert [Path(w.filename).name for w in caught] == [Path(__file__).name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Reorder(budget_ms=5).run(s, PassContext(CostModel())) == s
        with pytest.warns(UserWarning) as once:  # the manager warns once, not per pass run
            warnings.simplefilter("always")
            PassManager(parse_pipeline("reorder{budget_ms=5}")).run(s)
        assert len(once) == 1


def test_candidates_include_the_input_order_and_bookend() -> None:
    cands = candidates([5.0, 1.0, 3.0, 2.0, 4.0])
    assert cands[0] == (0, 1, 2, 3, 4)
    assert (0, 4, 2, 3, 1) in cands  # longest first
    # bookend: shortest at both ends, longest in the middle
    assert (1, 2, 0, 4, 3) in cands


def test_relabel_rejects_a_non_permutation() -> None:
    s = pipeir.library.get("gpipe", ranks=2, microbatches=3)
    with pytest.raises(ValueError, match="permutation"):
        relabel(s, [0, 0, 1])


@pytest.mark.parametrize("spec, message", [
    ("reorder{budget_ms=-1}", "budget_ms must be >= 0"),
    ("reorder{evals=0}", "evals must be >= 1"),
    ("reorder{by=time}", "by"),
])
def test_bad_reorder_options(spec: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_pipeline(spec)


def test_opt_reorders_with_the_files_costs(tmp_path: Path, cli) -> None:
    f = tmp_path / "v.sched"
    f.write_text("pipeline {\n ranks = 4\n microbatches = 8\n}\ncosts {\n F = 1.0\n B = 2.0\n"
                 " lengths = [2048, 128, 256, 1024, 64, 512, 4096, 300]\n}\nschedule = 1f1b\n")
    out_file = tmp_path / "out.sched"
    code, _, err = cli("opt", str(f), "--passes", "reorder,verify", "-o", str(out_file))
    assert code == 0, err
    before, after = pipeir.load(f), pipeir.load(out_file)
    costs = CostModel.from_settings(before.costs)
    assert CostModel.from_settings(after.costs) == costs
    assert simulate(after.schedule, costs).makespan < simulate(before.schedule, costs).makespan
    assert peaks(after.schedule) == peaks(before.schedule)


# ---- the runtime's per-step plan -------------------------------------------------------------
VARLEN_MODEL = '''
import torch
from torch import nn
from pipeir.models import ModelSpec

LENGTHS = [[3, 9, 1, 6], [7, 2, 8, 1]]  # sequence lengths of each step's micro-batches


def _stage(s, stages):
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh())


def _batch(step):
    g = torch.Generator().manual_seed(step)
    xs = [torch.randn(2, n, 8, generator=g) for n in LENGTHS[step % 2]]
    ys = [torch.randn(2, n, 8, generator=g) for n in LENGTHS[step % 2]]
    return xs, ys  # lists: the micro-batches themselves, of different lengths


def spec():
    return ModelSpec(stage=_stage, loss=nn.functional.mse_loss, batch=_batch)
'''


@pytest.mark.mp
def test_variable_length_microbatches_reordered_every_step_train_like_one_process(
        tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from pipeir.backend.codegen import rank_source
    from pipeir.models import resolve
    from pipeir.passes.reorder import StepPlanner
    from pipeir.runtime.launch import launch
    from pipeir.runtime.reference import train_reference
    from pipeir.runtime.worker import Job, split_batch

    model = tmp_path / "varlen.py"
    model.write_text(VARLEN_MODEL)
    ref = f"{model}:spec"
    s = pipeir.library.get("1f1b", ranks=2, microbatches=4)
    planner = StepPlanner.of(s, {"F": 1.0, "B": 2.0}, comm="blocking")
    spec = resolve(ref)
    for step in range(2):  # the plan really permutes, and differently per step
        xs, _ = split_batch(spec.batch(step), 4)
        assert planner.order([x.numel() for x in xs]) != (0, 1, 2, 3)
    low = pipeir.compile(s).lowered
    job = Job(low, tuple(rank_source(low, r) for r in range(2)), ref, 2, collect=True,
              plan=planner)
    result = launch([job], 2, timeout_s=60.0)
    want, want_grads = train_reference(spec, 2, 4, 1, 2)
    for st_ in range(2):
        for mine, exp in ((result.params[0][st_], want[st_]),
                          (result.grads[0][st_], want_grads[st_])):
            assert sorted(mine) == sorted(exp)
            for k, v in exp.items():
                torch.testing.assert_close(torch.from_numpy(mine[k]), v, rtol=1e-5, atol=1e-7)


def test_run_reorder_usage_errors(cli, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    bad = tmp_path / "bad.toml"
    bad.write_text("Q = 1\n")
    base = ("run", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "4")
    for extra in ((), ("--reorder",)):  # costs place communication even without --reorder
        code, _, err = cli(*base, *extra, "--costs", str(bad))
        assert code == 2 and "unknown cost 'Q'" in err
    code, _, err = cli(*base, "--reorder", "--set", "accumulate=2")
    assert code == 2 and "accumulate = 1" in err
