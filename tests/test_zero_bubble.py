"""The zero-bubble family in the library (zb-h1, zb-h2, zb-v, dualpipe-v) and looped BFS:
valid, at the published bubble and memory figures, equal to the split-backward pass where the
paper says so, no slower than torch's own orders, and training with correct gradients."""

from __future__ import annotations

import math
import warnings

import pytest

import pipeir
from pipeir import library
from pipeir.config import named_placement
from pipeir.passes import PassManager, parse_pipeline
from pipeir.sim import CostModel, SimResult, simulate
from pipeir.sim.analytic import analytic, zb_idle

NEW = ("zb-h1", "zb-h2", "zb-v", "dualpipe-v", "looped-bfs")
UNIT = CostModel(F=1, I=1, W=1)
GRID = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 4, 7, 8, 16, 32)]


def _admits(name: str, p: int, m: int) -> bool:
    if name == "zb-h2":
        return m >= 2 * p - 1
    if name == "dualpipe-v":
        return m >= 2 * p
    return True


def _gap(result: SimResult) -> float:
    """The papers' bubble time: the most idle time any rank has between its first op and
    its last."""
    worst = 0.0
    for r, prog in enumerate(result.schedule.programs):
        span = max(result.end[o] for o in prog) - min(result.start[o] for o in prog)
        worst = max(worst, span - result.busy[r])
    return worst


@pytest.mark.parametrize("name", NEW)
def test_every_new_schedule_verifies_where_it_applies(name: str) -> None:
    built = 0
    for p, m in GRID:
        if not _admits(name, p, m):
            with pytest.raises(pipeir.UsageError, match="requirement failed"):
                library.get(name, p, m)
            continue
        s = library.get(name, p, m)
        pipeir.verify(s)
        c = s.config
        assert c.stages == (p if name.startswith("zb-h") else 2 * p)
        shape = "loop" if name in ("zb-h1", "zb-h2", "looped-bfs") else "vshape"
        assert c.placement == named_placement(shape, c.stages, p)
        assert all(o.kind != "B" for o in s) == name.startswith("zb-")
        built += 1
    assert built >= 15


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_zb_h1_and_zb_h2_are_the_split_backward_pass_on_1f1b(p: int, m: int) -> None:
    one = library.get("1f1b", p, m)
    h1 = PassManager(parse_pipeline("split-backward{mode=h1}")).run(one)
    assert library.get("zb-h1", p, m) == h1
    if m >= 2 * p - 1:
        h2 = PassManager(parse_pipeline("split-backward{mode=h2}")).run(one)
        assert library.get("zb-h2", p, m) == h2


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m", [8, 16, 32])
def test_published_bubble_times_and_memory(p: int, m: int) -> None:
    """Qi et al. (2024), F = I = W: 1F1B idles (p-1)(F+I+W) per rank, ZB-H1 (p-1)(F+I-W) at
    1F1B's peak of p micro-batches, ZB-H2 (p-1)(F+I-2W) = 0 at up to 2p - 1, ZB-V 0 at p stages'
    worth (2p chunks). The ramp before the last rank's first op is the same for all of them."""
    for name, peak in (("1f1b", p), ("zb-h1", p), ("zb-h2", 2 * p - 1), ("zb-v", 2 * p)):
        if not _admits(name, p, m) or (name == "zb-v" and m < 2 * p - 1):
            continue  # ZB-V's figure needs m >= 2p - 1 too (torch pads to that many)
        r = simulate(library.get(name, p, m), UNIT)
        assert _gap(r) == zb_idle(name, p), name
        assert max(r.peak_activations) == peak, name
    # ZB-H1 holds exactly p on every rank: the later ranks pay for the shorter cool-down
    assert pipeir.verify(library.get("zb-h1", p, m)).peak_activations == (p,) * p


def test_zb_h1_bubble_follows_f_plus_i_minus_w_for_other_costs() -> None:
    for F, I, W in ((2.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.5, 1.5, 1.0)):  # noqa: E741
        r = simulate(library.get("zb-h1", 4, 16), CostModel(F=F, I=I, W=W))
        assert math.isclose(_gap(r), 3 * (F + I - W)), (F, I, W)
        one = simulate(library.get("1f1b", 4, 16), CostModel(F=F, I=I, W=W))
        assert r.makespan < one.makespan


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zb-v", "looped-bfs"])
def test_analytic_bubble_matches_the_simulator(name: str) -> None:
    for p in (2, 4, 8):
        for m in (8, 16, 32):
            theory = analytic(name, p, m, 2)
            if theory.bubble is None:
                continue
            kw = {"v": 2} if name == "looped-bfs" else {}
            costs = CostModel(F=0.5, B=1.0) if kw else CostModel(F=1.0, B=2.0)
            r = simulate(library.get(name, p, m, **kw), costs)
            assert math.isclose(r.bubble, theory.bubble, rel_tol=1e-9), (name, p, m)
            assert max(r.peak_activations) == theory.peak_activations


def _torch_schedule(name: str, p: int, m: int) -> pipeir.Schedule | None:
    from pipeir.interop import from_torch_actions

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

        try:
            ops = get_schedule_ops(name, p, m)
        except (ValueError, AssertionError, RuntimeError):
            return None
    return from_torch_actions(ops, microbatches=m).schedule


@pytest.mark.parametrize(("ours", "theirs"), [("zb-v", "ZBVZeroBubble"),
                                               ("dualpipe-v", "DualPipeV"),
                                               ("looped-bfs", "LoopedBFS")])
def test_no_slower_than_torchs_own_order(ours: str, theirs: str) -> None:
    compared = 0
    for p in (2, 4, 8):
        for m in (4, 8, 16, 32):
            t = _torch_schedule(theirs, p, m)
            if t is None or not _admits(ours, p, m):
                continue
            mine = simulate(library.get(ours, p, m), UNIT)
            assert mine.bubble <= simulate(t, UNIT).bubble + 1e-12, (ours, p, m)
            compared += 1
    assert compared >= 8


def test_zb_v_beats_1f1b_at_the_same_memory() -> None:
    """ZB-V's point: 1F1B's memory (p stages' worth of activations), a fraction of its bubble."""
    for p, m in ((4, 8), (8, 32)):
        zbv = simulate(library.get("zb-v", p, m), CostModel(F=0.5, B=1.0))
        one = simulate(library.get("1f1b", p, m), CostModel(F=1.0, B=2.0))
        assert max(zbv.peak_activations) / 2 == max(one.peak_activations)
        assert zbv.bubble < one.bubble / 4


def test_dualpipe_v_pairs_forwards_with_backwards() -> None:
    p, m = 4, 12
    s = library.get("dualpipe-v", p, m)
    # rank r pairs twice per round of the main phase (m - 2p + r + 1 rounds; the last rank
    # runs its first F0 and B1 apart), then once per round of the next (p - r - 1 rounds)
    want = sum(2 * (m - 2 * p + r + 1) - (r == p - 1) + (p - r - 1) for r in range(p))
    assert len(s.pairs) == want
    for a, b in s.pairs:
        assert (a.kind, b.kind) == ("F", "B") and s.rank_of(a) == s.rank_of(b)
        assert a.stage != b.stage


@pytest.mark.parametrize(("name", "message"), [
    ("zb-h2", "zb-h2 needs microbatches >= 2 * ranks - 1"),
    ("dualpipe-v", "at least as many micro-batches as stages"),
])
def test_requirements_are_explained(cli, name: str, message: str) -> None:
    code, _, err = cli("check", "--schedule", name, "--ranks", "4", "--microbatches", "4")
    assert code == 2 and message in err


def test_bubble_command_has_rows_for_the_new_schedules(cli) -> None:
    code, out, err = cli("bubble", "--ranks", "4", "--microbatches", "8", "--markdown")
    assert code == 0, err
    assert "| zb-h1 | 4 | 8 | - | 11.11% | 11.11% | 4 (4) | yes |" in out
    assert "| zb-h2 | 4 | 8 | - | 11.11% | 11.11% | 7 (7) | yes |" in out
    assert "| zb-v | 4 | 8 | - | 5.88% | 5.88% | 8 (8) | yes |" in out
    assert "| looped-bfs | 4 | 8 | 2 | 15.79% | 15.79% | 16 (16) | yes |" in out
    # a pair starts when both of its ops' inputs are there, so with free communication (where
    # DualPipe's overlap hides nothing) DualPipeV idles more than ZB-V
    assert "| dualpipe-v | 4 | 8 | - | n/a | 11.11% | 9 | - |" in out


@pytest.mark.mp
def test_zero_bubble_schedules_train_like_single_process() -> None:
    """Through pipeir's own backend (lowering, codegen, gloo runtime), reusing the runtime
    tests' helpers: parameters and gradients equal single-process training."""
    from runtime_helpers import TIMEOUT, assert_matches_reference, lib, runtime_job

    from pipeir.runtime.launch import launch

    jobs = [runtime_job(lib("zb-h1", 2, 4), None, 2), runtime_job(lib("zb-h2", 2, 4), "overlap", 2),
            runtime_job(lib("zb-v", 2, 4), None, 2), runtime_job(lib("dualpipe-v", 2, 4), None, 2),
            runtime_job(lib("looped-bfs", 2, 4), "overlap", 2)]
    result = launch(jobs, 2, timeout_s=TIMEOUT)
    assert_matches_reference(jobs, result)


@pytest.mark.mp
def test_run_command_trains_zb_v(cli) -> None:
    code, out, err = cli("run", "--schedule", "zb-v", "--ranks", "2", "--microbatches", "4",
                         "--model", "mlp", "--steps", "2")
    assert code == 0, err
    assert "step    2/2" in out
