"""Partial memory release (`pipeir.memmodel`): an I frees what W does not keep
(`memory_w_bytes`). The oracles are closed forms derived from the schedules' orders, not the
code's output:

ZB-H1 on p ranks (m >= p micro-batches, one stage per rank, every F saving M bytes of which
W keeps a fraction a after I). Rank i runs p - i forwards before its first I, then one F
per I, and defers each W by i ops, so that after each steady-state F it holds p - i forwards
not yet through I and i through I but not W: its peak is (p - i) M + i a M. With a = 1 (no
split, an old cost file) every rank holds p M, 1F1B's memory; with a < 1 rank 0 still holds
p M (its W follows its I at once) and the others less.

1F1B (whole B) on p ranks: rank i holds p - i forwards whatever the split, (p - i) M.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest

from pipeir import library
from pipeir.api import load
from pipeir.diagnostics import UsageError, VerifyError
from pipeir.memmodel import WHOLE, StageMemory, live_memory
from pipeir.ops import Op
from pipeir.sim import CostModel, simulate
from pipeir.sim.cost_files import flat_settings
from pipeir.verify import verify

P, M_MB = 4, 8
SAVED, ALPHA = 10.0, 0.3


def _zb_h1_peaks(alpha: float, saved: float = SAVED) -> list[float]:
    return [(P - i) * saved + i * alpha * saved for i in range(P)]


def _costs(**kw: float) -> CostModel:
    return CostModel.from_settings({"memory_bytes": SAVED, **kw})


def test_the_rule_per_op() -> None:
    m = StageMemory(10.0, 3.0, 2.0)
    assert [m.change(k) for k in ("F", "I", "W", "B", "FC", "RC", "OFF", "RELOAD")] == \
        [10.0, -7.0, -3.0, -10.0, 2.0, 10.0, -10.0, 10.0]
    assert m.change("W", checkpointed=True) == -5.0
    assert m.change("B", checkpointed=True) == -12.0
    assert WHOLE.freed_by_i == 0.0
    with pytest.raises(ValueError):
        StageMemory(1.0, 2.0)


def test_live_memory_along_a_program() -> None:
    prog = [Op("F", 0, 0), Op("F", 0, 1), Op("I", 0, 0), Op("I", 0, 1), Op("W", 0, 0),
            Op("W", 0, 1)]
    lives = [x for _, x in live_memory(prog, lambda op: StageMemory(10.0, 4.0))]
    assert lives == [10.0, 20.0, 14.0, 8.0, 4.0, 0.0]


@pytest.mark.parametrize("alpha", [0.0, ALPHA, 1.0])
def test_zb_h1_peak_bytes_closed_form(alpha: float) -> None:
    s = library.get("zb-h1", ranks=P, microbatches=M_MB)
    costs = _costs(memory_w_bytes=alpha * SAVED)
    expected = _zb_h1_peaks(alpha)
    assert verify(s, sizes=costs).peak_bytes == pytest.approx(expected)
    assert simulate(s, costs).peak_bytes == pytest.approx(expected)
    counted = verify(s, sizes=costs).peak_activations
    assert counted == pytest.approx([x / SAVED for x in expected])


def test_old_cost_files_hold_everything_until_w() -> None:
    s = library.get("zb-h1", ranks=P, microbatches=M_MB)
    assert verify(s, sizes=_costs()).peak_bytes == pytest.approx([P * SAVED] * P)
    assert verify(s).peak_activations == (P,) * P


def test_whole_backwards_ignore_the_split() -> None:
    s = library.get("1f1b", ranks=P, microbatches=M_MB)
    expected = [(P - i) * SAVED for i in range(P)]
    assert verify(s, sizes=_costs(memory_w_bytes=1.0)).peak_bytes == pytest.approx(expected)


def test_per_stage_split_overrides_the_default() -> None:
    s = library.get("zb-h1", ranks=P, microbatches=M_MB)
    # stage 3 keeps nothing for W, the others the default fraction
    costs = CostModel.from_settings({"memory_bytes": SAVED, "memory_w_bytes": ALPHA * SAVED,
                                     "stage.3.memory_w_bytes": 0.0})
    got = verify(s, sizes=costs).peak_bytes
    want = _zb_h1_peaks(ALPHA)
    want[3] = SAVED  # (p - 3) M + 3 * 0
    assert got == pytest.approx(want)


def test_counted_limit_with_the_split() -> None:
    s = library.get("zb-h1", ranks=P, microbatches=M_MB)
    costs = _costs(memory_w_bytes=ALPHA * SAVED)
    # rank 1 peaks at 3 + 0.3 activations; rank 0 at 4
    verify(s, memory_limit=4, sizes=costs)
    with pytest.raises(VerifyError, match=r"F\(0,3\) makes 4 activations in flight "
                                          r"\(memory_limit = 3.5"):
        verify(s, memory_limit=3.5, sizes=costs)
    with pytest.raises(VerifyError, match="rank 0") as e:
        verify(s, memory_limit=3.2, sizes=costs)
    # rank 1 (3.3) is over too, rank 2 (2.6) is not
    assert "rank 1: F(1,3) makes 3.3 activations" in str(e.value)
    assert "rank 2" not in str(e.value)
    with pytest.raises(VerifyError, match=r"makes 40 bytes of activations \(memory_limit = "
                                          r"39 bytes"):
        verify(s, sizes=costs, memory_limit_bytes=39.0)


@pytest.mark.parametrize(("settings", "message"), [
    ({"memory_w_bytes": 5.0}, "cost 'memory_w_bytes' needs memory_bytes"),
    ({"memory_bytes": 4.0, "memory_w_bytes": 5.0},
     "cost 'memory_w_bytes' = 5 is more than memory_bytes = 4"),
    ({"memory_bytes": 8.0, "memory_w_bytes": 5.0, "stage.1.memory_bytes": 4.0},
     "cost 'stage.1.memory_w_bytes' = 5 is more than stage.1.memory_bytes = 4"),
    ({"memory_w_bytes": -1.0, "memory_bytes": 4.0}, "must be non-negative"),
    ({"version": 3}, "version 3 is not supported"),
])
def test_bad_splits_are_one_clear_error(settings: dict[str, float], message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CostModel.from_settings(settings)


def test_cost_file_error_points_at_the_key(cli, tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("version = 2\nmemory_bytes = 4\n[stage.1]\nmemory_w_bytes = 5\n")
    code, _, err = cli("simulate", "--schedule", "zb-h1", "--ranks", 2, "--microbatches", 4,
                       "--costs", f)
    assert code == 2
    assert err.splitlines()[0] == (
        f"{f}:4:1: error: cost 'stage.1.memory_w_bytes' = 5 is more than "
        "stage.1.memory_bytes = 4: W keeps part of what its forward saved, never more")
    assert "Traceback" not in err


def test_settings_round_trip_the_split() -> None:
    costs = _costs(memory_w_bytes=3.0, **{"stage.1.memory_w_bytes": 1.0})
    again = CostModel.from_settings(costs.settings())
    assert again.stage_memory(0) == StageMemory(SAVED, 3.0, 0.0)
    assert again.stage_memory(1) == StageMemory(SAVED, 1.0, 0.0)
    assert again.counted_memory(1) == StageMemory(1.0, 0.1)
    assert again.splits_memory and not _costs().splits_memory


# ---- tune writes what check accepts at the same memory flag --------------------------------

SPLIT_COSTS = """version = 2
unit = "ms"
F = 1.0
I = 1.0
W = 1.0
memory_bytes = 1e9
memory_w_bytes = 2.5e8
"""


def _peaks(check_out: str) -> list[float]:
    line = check_out.split("peak in-flight activations per rank: ")[1]
    return [float(x) for x in line.split(";")[0].split()]


@pytest.mark.parametrize("limit", ["4", "6.5", "3GB", "5e9B"])
def test_tune_under_partial_release_writes_what_check_accepts(cli, tmp_path: Path,
                                                              limit: str) -> None:
    costs = tmp_path / "c.toml"
    costs.write_text(SPLIT_COSTS)
    out = tmp_path / "t.sched"
    code, text, err = cli("tune", "--costs", costs, "--ranks", 4, "--microbatches", "8,16",
                          "--max-v", 4, "--memory-limit", limit, "-o", out)
    assert code == 0, err
    code, text, err = cli("check", out, "--memory-limit", limit)
    assert code == 0, err
    # the oracle: the written file's peak by the closed rule, not tune's table. Counted,
    # the best fits the count; in bytes, the file's own costs block gives the sizes
    if not limit[-1].isalpha():
        assert max(_peaks(text)) <= float(limit) + 1e-9


def test_tune_counted_budget_counts_the_split(cli, tmp_path: Path) -> None:
    # zb-h1 on 4 ranks with a = 0.25: rank 0 holds 4, the others 3.25, 2.5, 1.75; whole
    # release would need 4 everywhere. A budget of 4 admits it; 3.9 admits nothing of the
    # zb-h1 family at v = 1 (rank 0's four forwards before any I).
    costs = tmp_path / "c.toml"
    costs.write_text(SPLIT_COSTS)
    out = tmp_path / "t.sched"
    code, text, err = cli("tune", "--costs", costs, "--ranks", 4, "--microbatches", 8,
                          "--max-v", 1, "--memory-limit", 4, "-o", out)
    assert code == 0, err
    assert "best: 1f1b, 8 micro-batches, split-backward{mode=h1}" in text  # ZB-H1
    code, text, err = cli("check", out)
    assert code == 0, err
    assert _peaks(text) == pytest.approx([4, 3.25, 2.5, 1.75])
    code, _, err = cli("tune", "--costs", costs, "--ranks", 4, "--microbatches", 8,
                       "--max-v", 1, "--memory-limit", 3.9)
    assert code == 2
    assert err.startswith("error: no schedule fits --memory-limit 3.9: the least memory any "
                          "candidate needs is --memory-limit 4 ")


def test_tune_byte_budget_needs_sizes_and_says_the_least(cli, tmp_path: Path) -> None:
    costs = tmp_path / "c.toml"
    costs.write_text(SPLIT_COSTS)
    code, _, err = cli("tune", "--costs", costs, "--ranks", 4, "--microbatches", 8,
                       "--max-v", 1, "--memory-limit", "1GB")
    assert code == 2
    # the least is zb-h1 / 1f1b's rank 0: four forwards of 1e9 bytes
    assert err == ("error: no schedule fits --memory-limit 1,000,000,000 bytes: the least "
                   "memory any candidate needs is 4,000,000,000 bytes of saved activations "
                   "per rank\n")
    plain = tmp_path / "p.toml"
    plain.write_text('version = 1\nF = 1.0\n')
    code, _, err = cli("tune", "--costs", plain, "--ranks", 4, "--microbatches", 8,
                       "--memory-limit", "1GB")
    assert code == 2
    assert err == ("error: --memory-limit in bytes needs activation sizes: give memory_bytes "
                   "in the costs\n")


def test_check_takes_fractional_counts(cli) -> None:
    code, _, err = cli("check", "--schedule", "zb-h1", "--ranks", 4, "--microbatches", 8,
                       "--set", "memory_bytes=10", "--set", "memory_w_bytes=3",
                       "--memory-limit", "3.9")
    assert code == 1
    assert "rank 0: F(0,3) makes 4 activations in flight (memory_limit = 3.9" in err
    code, out, err = cli("check", "--schedule", "zb-h1", "--ranks", 4, "--microbatches", 8,
                         "--set", "memory_bytes=10", "--set", "memory_w_bytes=3",
                         "--memory-limit", "4")
    assert code == 0, err
    assert _peaks(out) == [4, 3.3, 2.6, 1.9]
    code, _, err = cli("check", "--schedule", "zb-h1", "--ranks", 4, "--microbatches", 8,
                       "--memory-limit", "-1")
    assert code == 2 and "expected a positive number" in err and "Traceback" not in err


# ---- the runtime: I frees what W does not need ---------------------------------------------

def test_input_gradient_frees_what_the_weight_gradient_does_not_need() -> None:
    """Linear(8, 16) -> GELU -> Linear(16, 16) on a batch of 4 (float32) saves the first
    Linear's input x (4 x 8), GELU's input h (4 x 16) and the second Linear's input g(h)
    (4 x 16): 640 bytes. W needs the Linears' inputs (x and g(h): 384 bytes); I frees h.
    The gradients are torch's own backward's."""
    torch = pytest.importorskip("torch")
    from pipeir.runtime.memory import SavedActivations
    from pipeir.runtime.splitgrad import backward_input_many, backward_weight, weight_nodes

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))
    ref.load_state_dict(net.state_dict())
    x = torch.randn(4, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    grad = torch.randn(4, 16)
    # the tensors themselves, weakly: freeing must really drop them (torch's refcount)
    gelu_in: list[weakref.ref[torch.Tensor]] = []
    gelu_out: list[weakref.ref[torch.Tensor]] = []

    def hook(m: object, i: tuple[torch.Tensor], o: torch.Tensor) -> None:
        gelu_in.append(weakref.ref(i[0]))
        gelu_out.append(weakref.ref(o))
    net[1].register_forward_hook(hook)
    saved = SavedActivations(torch.device("cpu"), net.parameters())
    with saved.recording((1, 0)):
        out = net(x)
    assert saved.live == 640
    assert gelu_in[0]() is not None
    (gx,), work = backward_input_many([out], [grad], [x])
    saved.after_input((1, 0), weight_nodes(work))
    assert saved.live == 384 and saved.w_per_stage == {1: 384}
    assert gelu_in[0]() is None and gelu_out[0]() is not None
    backward_weight(work)
    saved.release((1, 0))
    del work
    assert saved.live == 0 and saved.peak == 640
    assert gelu_out[0]() is None
    ref(x_ref).backward(grad)
    assert torch.equal(gx, x_ref.grad)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-6)


def test_profile_measures_what_w_keeps() -> None:
    pytest.importorskip("torch")
    from pipeir.models import resolve
    from pipeir.runtime.profile import cost_settings, profile_stages

    stages = profile_stages(resolve("transformer"), 2, 4, 0, 1)
    got = cost_settings(stages, None, {})
    assert got["version"] == 2
    s0, s1 = got["stage"]["0"], got["stage"]["1"]
    # stage 0's input needs no gradient: W is its whole backward and keeps everything
    assert s0["memory_w_bytes"] == s0["memory_bytes"] > 0
    assert 0 < s1["memory_w_bytes"] < s1["memory_bytes"]
    assert CostModel.from_settings(flat_settings(got)).splits_memory


# ---- the oracle: the runtime's measured peak -----------------------------------------------

@pytest.mark.mp
def test_run_measured_peak_matches_the_profiled_split(cli, tmp_path: Path) -> None:
    """zb-h1 on 2 ranks of the built-in transformer with profiled costs: the runtime's
    measured peak per rank is what the split predicts within 10 %; rank 1 (which defers a
    W) is measurably below what holding everything until W predicts."""
    import json

    pytest.importorskip("torch")
    from pipeir.models import resolve
    from pipeir.runtime.profile import cost_settings, profile_stages

    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(cost_settings(profile_stages(resolve("transformer"), 2, 4, 0,
                                                             1), None, {})))
    code, out, err = cli("run", "--schedule", "zb-h1", "--ranks", 2, "--microbatches", 4,
                         "--model", "transformer", "--steps", 1, "--costs", costs)
    assert code == 0, err
    rows = out[out.index("peak saved activations (bytes)"):].splitlines()[1:3]
    for r, row in enumerate(rows):
        words = row.split()
        assert words[:2] == ["rank", f"{r}:"]
        value = {k: float(v.replace(",", "")) for k, v in zip(words[2::2], words[3::2])
                 if k in ("measured", "simulated", "whole", "costs")}
        assert abs(value["costs"] - value["measured"]) <= 0.10 * value["measured"], row
        if r == 1:
            assert value["whole"] > 1.10 * value["measured"], row


def test_recompute_fits_the_budget_counted_with_the_split() -> None:
    """recompute{budget=35} on ZB-H1 (p = 4, M = 10, a = 0.3): by the closed form ranks 1-3
    peak at 33, 26 and 19 and need nothing; rank 0 (40) does. Held until W every rank peaks
    at 40, and the last stage (which the pass never recomputes) cannot fit."""
    import pipeir

    s = library.get("zb-h1", ranks=P, microbatches=M_MB)
    split = CostModel.from_settings({"memory_bytes": SAVED, "memory_w_bytes": ALPHA * SAVED,
                                     "input_bytes": 1.0})
    out = pipeir.compile(s, "recompute{budget=35}", costs=split).schedule
    assert [any(op.kind == "FC" for op in prog) for prog in out.programs] == \
        [True, False, False, False]
    peaks = verify(out, sizes=split).peak_bytes
    assert peaks is not None and max(peaks) <= 35
    assert peaks[1:] == pytest.approx(_zb_h1_peaks(ALPHA)[1:])
    whole = CostModel.from_settings({"memory_bytes": SAVED, "input_bytes": 1.0})
    with pytest.raises(UsageError, match="cannot fit rank 3 into the budget of 35"):
        pipeir.compile(s, "recompute{budget=35}", costs=whole)


def test_plot_timeline_frees_at_i() -> None:
    """The memory plot's timeline peaks where the closed form says, and falls at each I."""
    from pipeir.views.plot import memory_over_time

    s = library.get("zb-h1", ranks=P, microbatches=M_MB)
    result = simulate(s, _costs(memory_w_bytes=ALPHA * SAVED))
    timeline = memory_over_time(result)
    assert [max(x for _, x in steps) for steps in timeline] == \
        pytest.approx(_zb_h1_peaks(ALPHA))
    # rank 3's first I ends with its one forward's memory down to the W-kept part, a M (the
    # next F may start at that very time: the step is one of the entries there)
    i_end = result.end[Op("I", P - 1, 0)]
    at = [x for t, x in timeline[P - 1] if t == i_end]
    assert any(x == pytest.approx(ALPHA * SAVED) for x in at), at


LAG_COSTS = """version = 2
memory_bytes = 10
memory_w_bytes = {w}
[stage.0]
F = 1
I = 1
W = 2
B = 3
[stage.1]
F = 2
I = 2
W = 1
B = 3
[stage.2]
F = 1
I = 1
W = 1
B = 2
"""


@pytest.mark.parametrize("w, programs, peaks, makespan", [
    # whole release: ZB-H1's lag P - peak[r] (1 on rank 1, 2 on rank 2), peaks 3 everywhere
    (10, ["F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3", "F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3",
          "F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3"], [3, 3, 3], 22),
    # a = 0.5: a W waiting after its I holds half an activation, so within memory_limit 3
    # rank 1 (2 forwards not through I + 2 halves after F(1,3)) and rank 2 (at most
    # 2 + 2 halves before its last I) defer every W to the end
    (5, ["F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3", "F0 F1 I0 F2 I1 F3 I2 I3 W0 W1 W2 W3",
         "F0 I0 F1 I1 F2 I2 F3 I3 W0 W1 W2 W3"], [3, 3, 2.5], 21),
])
def test_zb_h1_defers_w_further_with_the_split(cli, tmp_path: Path, w: int,
                                               programs: list[str], peaks: list[float],
                                               makespan: float) -> None:
    """split-backward{mode=h1} on 1F1B, p = 3, m = 4, memory_limit 3, costs per stage
    (F, I, W) = (1, 1, 2), (2, 2, 1), (1, 1, 1), free links. The makespans by hand: with
    the lag of whole release rank 1 waits for rank 2's W(2,0) before its F(1,3) reaches
    rank 2, and rank 0's I(0,3) starts at 19 and its W(0,3) ends at 22; with every W of
    ranks 1 and 2 deferred, rank 1's I(1,3) ends at 17 and its four W at 21 (rank 0 at 20)."""
    costs = tmp_path / "c.toml"
    costs.write_text(LAG_COSTS.format(w=w))
    out = tmp_path / "o.sched"
    code, _, err = cli("opt", "--schedule", "1f1b", "--ranks", 3, "--microbatches", 4,
                       "--set", "memory_limit=3", "--costs", costs, "--passes",
                       "split-backward", "-o", out)
    assert code == 0, err
    got = library_programs(out)
    assert got == programs
    code, text, err = cli("check", out, "--memory-limit", 3)
    assert code == 0, err
    assert _peaks(text) == pytest.approx(peaks)
    code, text, err = cli("simulate", out)
    assert code == 0, err
    assert f"makespan {makespan:g};" in text


def library_programs(path: Path) -> list[str]:
    """Each rank's program of a written schedule as `F0 I0 W0 ...` (kinds and micro-batches)."""
    return [" ".join(f"{op.kind}{op.mb}" for op in prog)
            for prog in load(path).schedule.programs]
