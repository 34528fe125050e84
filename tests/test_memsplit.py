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

from pathlib import Path

import pytest

from pipeir import library
from pipeir.diagnostics import UsageError, VerifyError
from pipeir.memmodel import WHOLE, StageMemory, live_memory
from pipeir.ops import Op
from pipeir.sim import CostModel, simulate
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
