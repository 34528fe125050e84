"""The built-in passes: interleave reproduces the library's interleaved 1F1B, split-backward
reproduces the Zero Bubble paper's figures in the simulator, merge-backward inverts it, and
every pass keeps random valid schedules valid and their work the same."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipeir
from pipeir.ops import Op
from pipeir.passes import PassManager, parse_pipeline
from pipeir.passes.interleave import Interleave
from pipeir.passes.merge_backward import MergeBackward
from pipeir.passes.split_backward import SplitBackward
from pipeir.passes.verify import Verify
from pipeir.schedule import Schedule
from pipeir.sim import CostModel, simulate
from pipeir.testing import configs, schedules
from pipeir.verify import memory_report

REPO = Path(__file__).parent.parent
UNIT = CostModel(F=1, B=2, I=1, W=1)


def work(s: Schedule) -> Counter[tuple[str, int, int]]:
    """What a schedule computes, with B counted as its two halves I + W."""
    out: Counter[tuple[str, int, int]] = Counter()
    for op in s:
        for kind in ("I", "W") if op.kind == "B" else (op.kind,):
            out[kind, op.stage, op.mb] += 1
    return out


def span_idle(s: Schedule) -> list[float]:
    """Per rank: idle time between its first op's start and its last op's end."""
    r = simulate(s, UNIT)
    return [max(r.end[o] for o in prog) - min(r.start[o] for o in prog) - r.busy[i]
            for i, prog in enumerate(s.programs)]


# ---- interleave ------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_interleave_of_1f1b_is_the_library_interleaved_1f1b(p: int) -> None:
    for m in range(1, 3 * p + 2):
        s = pipeir.library.get("1f1b", p, m)
        for v in (1, 2, 3):
            try:
                want: Schedule | None = pipeir.library.get("interleaved-1f1b", p, m, v=v)
            except pipeir.PipeirError:
                want = None
            if want is None:  # the library and the pass reject the same (m, p)
                with pytest.raises(pipeir.UsageError, match="rounds"):
                    Interleave(v=v).run(s)
            else:
                assert Interleave(v=v).run(s) == want, (p, m, v)


def test_interleave_says_which_rule_fails_and_what_would_work() -> None:
    s = pipeir.library.get("1f1b", 2, 5)
    with pytest.raises(pipeir.UsageError) as e:
        Interleave(v=2).run(s)
    assert "2 rounds, and 5 is not a multiple of 2" in e.value.message
    assert e.value.diagnostics[0].notes[0].message.startswith("m = 4 or 6 would work")


def test_interleave_rejects_schedules_without_a_1f1b_shape() -> None:
    defer_w = pipeir.parse(REPO / "examples" / "defer-w.sched")
    with pytest.raises(pipeir.UsageError, match="interleave first, then split"):
        Interleave().run(defer_w)
    c = pipeir.PipelineConfig.make(2, 2)
    odd = Schedule.from_programs(c, [
        [pipeir.F(0, 1), pipeir.F(0, 0), pipeir.B(0, 0), pipeir.B(0, 1)],
        [pipeir.F(1, 1), pipeir.B(1, 1), pipeir.F(1, 0), pipeir.B(1, 0)]])
    pipeir.verify(odd)
    with pytest.raises(pipeir.UsageError) as e:
        Interleave().run(odd)
    assert e.value.message == ("interleave: rank 0's program is not 1F1B-shaped: op 1 is "
                               "F(0,1) where F(0,0) was expected")
    with pytest.raises(pipeir.UsageError, match="one stage per rank"):
        Interleave().run(pipeir.library.get("interleaved-1f1b", 2, 4))


@pytest.mark.parametrize(("p", "m", "v", "step"), [(4, 8, 2, 32.5), (8, 32, 2, 115.0),
                                                  (4, 8, 4, 30.5), (8, 8, 2, 38.0)])
def test_interleave_on_a_v_runs_a_list_order_within_the_loops_memory(
        p: int, m: int, v: int, step: float) -> None:
    """Megatron's depth-first order is for a loop: on a V it left rank 0 waiting for its
    second chunk (48 and 474 at the first two sizes). The V's order beats plain 1F1B there,
    holds no more than the loop's order, and runs under any costs."""
    base = pipeir.library.get("1f1b", p, m)
    chunk = CostModel(F=1 / v, B=2 / v)
    vee = Interleave(v=v, placement="vshape").run(base)
    loop = Interleave(v=v).run(base)
    pipeir.verify(vee)
    assert simulate(vee, chunk).makespan == pytest.approx(step)
    assert step < simulate(base).makespan
    assert max(memory_report(vee).peak_activations) == \
        max(memory_report(loop).peak_activations)
    lopsided = CostModel.from_settings({"F": 0.1, "B": 3.0, "stage.0.F": 5.0, "latency": 2.0})
    # (simulate raises on a deadlock) no rank finishes before its own work is done
    work = [sum(lopsided.cost(op) for op in prog) for prog in vee.programs]
    assert simulate(vee, lopsided).makespan >= max(work) > 0
    # one chunk: a V is the loop, and the input stands (not a warm-up of 2w and twice the
    # memory)
    assert Interleave(v=1, placement="vshape").run(base) is base


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (3, 6, 2), (4, 8, 2), (4, 4, 3)])
def test_interleave_vshape_and_gpipe(p: int, m: int, v: int) -> None:
    out = Interleave(v=v, placement="vshape").run(pipeir.library.get("1f1b", p, m))
    pipeir.verify(out)
    assert out.config.placement_name == "vshape"
    assert work(out) == work(Interleave(v=v).run(pipeir.library.get("1f1b", p, m)))
    g = Interleave(v=v).run(pipeir.library.get("gpipe", p, m))
    for prog in g.programs:  # GPipe stays GPipe: every forward before any backward
        kinds = "".join(op.kind for op in prog)
        assert kinds == "F" * (m * v) + "B" * (m * v)
    # the interleaved order beats the plain one under chunk costs of 1/v
    chunk = CostModel(F=1 / v, B=2 / v)
    assert simulate(Interleave(v=v).run(pipeir.library.get("1f1b", p, m)), chunk).makespan < \
        simulate(pipeir.library.get("1f1b", p, m)).makespan


def test_interleave_scales_the_memory_limit() -> None:
    s = pipeir.library.get("1f1b", 2, 4, memory_limit=4)
    out = Interleave(v=3).run(s)
    assert out.config.memory_limit == 12
    assert max(pipeir.verify(out).peak_activations) <= 12
    with pytest.raises(pipeir.UsageError, match="more than memory_limit x v = 2 x 3 = 6") as e:
        Interleave(v=3).run(pipeir.library.get("1f1b", 2, 4, memory_limit=2))
    assert "raise memory_limit to 3" in e.value.render()


def test_interleave_v1_is_plain_1f1b() -> None:
    s = pipeir.library.get("1f1b", 4, 8)
    assert Interleave(v=1).run(s) == s == pipeir.library.get("interleaved-1f1b", 4, 8, v=1)


def test_split_backward_h2_respects_the_memory_limit() -> None:
    s = pipeir.library.get("1f1b", 4, 8, memory_limit=4)
    out = SplitBackward("h2").run(s)
    assert max(pipeir.verify(out).peak_activations) <= 4


# ---- split-backward: the published numbers ---------------------------------------------------
@pytest.mark.parametrize("p", range(1, 9))
def test_zb_h1_bubble_is_a_third_of_1f1b_at_the_same_peak_memory(p: int) -> None:
    for m in (p, p + 1, 2 * p, 3 * p + 1):
        base = pipeir.library.get("1f1b", p, m)
        out = SplitBackward("h1").run(base)
        before, after = simulate(base, UNIT), simulate(out, UNIT)
        # every rank is busy 3m; idle time = makespan - busy
        assert before.idle == pytest.approx([3 * (p - 1)] * p)  # (p-1)(F+I+W)
        assert after.idle == pytest.approx([p - 1] * p)  # (p-1)(F+I-W)
        assert max(pipeir.verify(out).peak_activations) == max(
            pipeir.verify(base).peak_activations) == min(p, m)
        assert after.makespan == 3 * m + p - 1


@pytest.mark.parametrize("p", range(1, 9))
def test_zb_h2_has_no_bubble_inside_any_rank_from_2p_minus_1_microbatches(p: int) -> None:
    for m in range(p, 3 * p + 1):
        out = SplitBackward("h2").run(pipeir.library.get("1f1b", p, m))
        idle = span_idle(out)
        # (p-1)(F+I-2W) = 0 once rank 0 can run 2p-1 forwards before its first backward;
        # with fewer micro-batches rank 0 waits 2p-1-m
        assert max(idle) == (0 if m >= 2 * p - 1 else 2 * p - 1 - m), (p, m)
        assert max(pipeir.verify(out).peak_activations) <= 2 * p - 1
        assert simulate(out, UNIT).makespan == 3 * m + p - 1


@pytest.mark.parametrize(("f", "i", "w"), [(1, 1.2, 0.8), (2, 1, 1), (1, 1.5, 0.5)])
def test_zb_figures_hold_for_unequal_costs(f: float, i: float, w: float) -> None:
    costs = CostModel(F=f, I=i, W=w)
    for p in range(2, 7):
        for m in (2 * p - 1, 3 * p):
            s = pipeir.library.get("1f1b", p, m)
            h1 = simulate(SplitBackward("h1").run(s), costs)
            assert max(h1.idle) == pytest.approx((p - 1) * (f + i - w))
            h2 = SplitBackward("h2").run(s)
            r = simulate(h2, costs)
            inside = max(max(r.end[o] for o in prog) - min(r.start[o] for o in prog) - r.busy[k]
                         for k, prog in enumerate(h2.programs))
            assert inside == pytest.approx((p - 1) * (f + i - 2 * w))


def test_split_backward_modes_on_the_cli(cli) -> None:
    args = ("--schedule", "1f1b", "--ranks", "4", "--microbatches", "8")
    code, h1, _ = cli("opt", *args, "--passes", "split-backward")
    assert code == 0 and "I(0,0)" in h1 and "B(" not in h1
    code, h2, _ = cli("opt", *args, "--passes", "split-backward{mode=h2}")
    assert code == 0 and h1 != h2
    assert pipeir.verify(pipeir.parse(h2)).peak_activations[0] == 7


# ---- merge-backward --------------------------------------------------------------------------
def test_merge_undoes_split() -> None:
    s = pipeir.library.get("1f1b", 4, 8)
    assert MergeBackward().run(SplitBackward("h1").run(s)) == s
    h2 = MergeBackward().run(SplitBackward("h2").run(s))
    assert [sorted(p) for p in h2.programs] == [sorted(p) for p in s.programs]
    pipeir.verify(h2)


def test_merge_adjacent_only_leaves_separated_pairs_split() -> None:
    defer_w = pipeir.parse(REPO / "examples" / "defer-w.sched", overrides={"lag": 0})
    assert all(op.kind in "FB" for op in MergeBackward(adjacent_only=True).run(defer_w))
    F, W, B = pipeir.F, pipeir.W, pipeir.B
    I = pipeir.I  # noqa: E741 - the paper's name for the op
    c = pipeir.PipelineConfig.make(1, 2)
    s = Schedule.from_programs(c, [[F(0, 0), I(0, 0), F(0, 1), W(0, 0), I(0, 1), W(0, 1)]])
    assert MergeBackward(adjacent_only=True).run(s).program(0) == (
        F(0, 0), I(0, 0), F(0, 1), W(0, 0), B(0, 1))
    assert MergeBackward().run(s).program(0) == (F(0, 0), B(0, 0), F(0, 1), B(0, 1))


# ---- verify ----------------------------------------------------------------------------------
def test_verify_pass_checks_memory_and_returns_its_input() -> None:
    s = pipeir.library.get("1f1b", 4, 8)
    assert Verify().run(s) is s
    with pytest.raises(pipeir.VerifyError) as e:
        PassManager(parse_pipeline("split-backward{mode=h2},verify{memory_limit=4}")).run(s)
    assert e.value.check == "memory"
    assert e.value.message.startswith("verify{memory_limit=4} after split-backward{mode=h2}: "
                                      "memory limit exceeded on rank 0")


# ---- properties over random valid schedules --------------------------------------------------
SMALL = configs(max_ranks=4, max_microbatches=6, max_chunks=2)


@settings(max_examples=60)
@given(schedules(SMALL), st.sampled_from(["h1", "h2"]))
def test_split_backward_keeps_any_schedule_valid_with_the_same_work(s: Schedule,
                                                                    mode: str) -> None:
    out = SplitBackward(mode).run(s)  # type: ignore[arg-type]
    pipeir.verify(out)
    assert work(out) == work(s)
    assert all(op.kind != "B" for op in out)
    # never slower with the default costs, and h1 never above the input's peak memory
    assert simulate(out).makespan <= simulate(s).makespan + 1e-9
    if mode == "h1":
        assert max(pipeir.verify(out).peak_activations) <= max(
            pipeir.verify(s).peak_activations)
    back = MergeBackward().run(out)
    pipeir.verify(back)
    assert [sorted(p) for p in back.programs] == [sorted(
        Op("B", o.stage, o.mb) if o.kind == "I" else o for o in p if o.kind != "W")
        for p in s.programs]


@settings(max_examples=40)
@given(schedules(SMALL), st.booleans())
def test_merge_backward_keeps_any_schedule_valid(s: Schedule, adjacent_only: bool) -> None:
    out = MergeBackward(adjacent_only).run(s)
    pipeir.verify(out)
    assert work(out) == work(s)


@settings(max_examples=40)
@given(schedules(configs(max_ranks=4, max_microbatches=8)), st.integers(1, 3),
       st.sampled_from(["loop", "vshape"]))
def test_interleave_is_valid_or_rejected_with_a_reason(s: Schedule, v: int,
                                                       placement: str) -> None:
    try:
        out = Interleave(v, placement).run(s)  # type: ignore[arg-type]
    except pipeir.UsageError as e:
        assert e.message.startswith("interleave: ")
        return
    pipeir.verify(out)
    # the same work, chunk by chunk: F(s, mb) of the input is F of each of its chunks
    assert Counter((op.kind, op.mb) for op in out) == Counter(
        (op.kind, op.mb) for op in s for _ in range(v))


@settings(max_examples=25)
@given(st.integers(1, 5), st.integers(1, 10), st.integers(1, 3),
       st.sampled_from(["loop", "vshape"]), st.sampled_from(["1f1b", "gpipe"]))
def test_interleave_of_library_schedules_verifies(p: int, m: int, v: int, placement: str,
                                                  name: str) -> None:
    s = pipeir.library.get(name, p, m)
    try:
        out = Interleave(v, placement).run(s)  # type: ignore[arg-type]
    except pipeir.UsageError as e:
        assert m % max(1, m // p) != 0 and "would work" in e.render()
        return
    pipeir.verify(out)
    assert Counter((op.kind, op.mb) for op in out) == Counter(
        (op.kind, op.mb) for op in s for _ in range(v))


# ---- goldens: opt output for each pass -------------------------------------------------------
GOLDENS = [
    ("interleave", ("--schedule", "1f1b", "--ranks", "2", "--microbatches", "4"),
     "interleave{v=2}"),
    ("interleave-vshape", ("--schedule", "1f1b", "--ranks", "2", "--microbatches", "4"),
     "interleave{v=2,placement=vshape}"),
    ("split-h1", ("--schedule", "1f1b", "--ranks", "3", "--microbatches", "4"),
     "split-backward"),
    ("split-h2", ("--schedule", "1f1b", "--ranks", "3", "--microbatches", "5"),
     "split-backward{mode=h2}"),
    ("merge", (str(REPO / "examples" / "defer-w.sched"), "--set", "ranks=2"),
     "merge-backward"),
    ("verify", ("--schedule", "gpipe", "--ranks", "2", "--microbatches", "2"), "verify"),
    ("zb-interleaved", ("--schedule", "1f1b", "--ranks", "2", "--microbatches", "4"),
     "interleave{v=2},split-backward{mode=h2},verify"),
]


@pytest.mark.parametrize(("name", "args", "spec"), GOLDENS, ids=[g[0] for g in GOLDENS])
def test_opt_goldens(cli, golden, name: str, args: tuple[str, ...], spec: str) -> None:
    code, out, err = cli("opt", *args, "--passes", spec)
    assert code == 0, err
    golden(f"passes/{name}.expected", out)
