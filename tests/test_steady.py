"""The steady state (`pipeir.sim.steady`): steps back to back, against closed forms (1F1B,
the Zero Bubble paper's ZB-H1 and ZB-H2) and against many steps timed here, op by op, with
the dependency rules written out in the test (not the simulator's)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import pipeir
from pipeir import library
from pipeir.ops import Op
from pipeir.sim import CostModel, simulate
from pipeir.sim.steady import cycle_time, steady, steady_state


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 32), (5, 7)])
@pytest.mark.parametrize("f, b", [(1.0, 2.0), (1.5, 1.0)])
def test_1f1b_runs_back_to_back_no_faster_than_one_step(p: int, m: int, f: float,
                                                        b: float) -> None:
    """1F1B's first rank is busy or waiting from its first forward to its last backward, so
    the next step cannot start there any sooner: (m + p - 1)(F + B) per step either way."""
    st = steady(simulate(library.get("1f1b", p, m), CostModel(F=f, B=b)))
    assert math.isclose(st.step, (m + p - 1) * (f + b))
    assert math.isclose(st.longest_span, st.step)
    assert math.isclose(st.bubble, (p - 1) / (m + p - 1))


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 32)])
def test_zero_bubble_paper_figures(p: int, m: int) -> None:
    """Qi et al. (2024), sec. 3: ZB-H1's bubble is (p - 1)(T_F + T_B - T_W), ZB-H2's is zero
    once steps overlap (its makespan still has the (p - 1) T_F ramp of the last rank)."""
    f, i, w = 1.0, 1.5, 0.75
    costs = CostModel(F=f, I=i, W=w)
    h1 = steady(simulate(library.get("zb-h1", p, m), costs))
    assert math.isclose(h1.longest_span, m * (f + i + w) + (p - 1) * (f + i - w))
    assert h1.step <= h1.longest_span + 1e-9
    if m >= 2 * p - 1:
        unit = CostModel(F=1, I=1, W=1)
        r = simulate(library.get("zb-h2", p, m), unit)
        h2 = steady(r)
        assert math.isclose(h2.step, 3 * m) and h2.bubble < 1e-12
        assert math.isclose(h2.longest_span, 3 * m) and h2.span_bubble < 1e-12
        assert r.makespan > h2.step  # the isolated step pays the ramp


def _inputs_rule(op: Op, stages: int, split: bool) -> list[Op]:
    """What `op` waits for, one stage per rank: a forward for the previous stage's forward;
    a backward (or I) for the next stage's backward (or I) and its own forward; W for its
    I."""
    back = "I" if split else "B"
    s, mb = op.stage, op.mb
    if op.kind == "F":
        return [Op("F", s - 1, mb)] if s > 0 else []
    if op.kind == back:
        return [Op("F", s, mb)] + ([Op(back, s + 1, mb)] if s + 1 < stages else [])
    return [Op("I", s, mb)]


def _many_steps(schedule: pipeir.Schedule, cost: dict[str, list[float]], hop: float,
                steps: int) -> float:
    """When `steps` steps run back to back end, timed op by op: each rank runs its program
    once per step; an op starts when its rank is free and its inputs of the same step have
    arrived (`hop` after a producer on another rank ends)."""
    progs = schedule.programs
    stages = schedule.config.stages
    split = any(op.kind == "I" for op in schedule)
    free = [0.0] * len(progs)
    for _ in range(steps):
        end: dict[Op, float] = {}
        pos = [0] * len(progs)
        left = sum(map(len, progs))
        while left:
            moved = False
            for r, prog in enumerate(progs):
                while pos[r] < len(prog):
                    op = prog[pos[r]]
                    need = _inputs_rule(op, stages, split)
                    if any(q not in end for q in need):
                        break
                    t = max([free[r], *(end[q] + hop for q in need if q.stage != op.stage),
                             *(end[q] for q in need if q.stage == op.stage)])
                    end[op] = free[r] = t + cost[op.kind][op.stage]
                    pos[r] += 1
                    left -= 1
                    moved = True
            assert moved, "deadlock"
    return max(free)


@pytest.mark.parametrize("name, p, m", [("1f1b", 3, 5), ("zb-h1", 4, 6), ("zb-h2", 3, 6),
                                        ("gpipe", 3, 4), ("zb-h1", 2, 3)])
def test_steady_step_is_the_limit_of_many_steps(name: str, p: int, m: int) -> None:
    # uneven stages and a transfer time, so ranks differ and the ramps do not cancel
    per_stage = {s: {"F": 1.0 + 0.3 * s, "I": 1.1 + 0.2 * (s % 2), "W": 0.7 + 0.1 * s}
                 for s in range(p)}
    hop = 0.25
    costs = CostModel(F=1.0, I=1.0, W=1.0, latency=hop, stage=per_stage)
    sched = library.get(name, p, m)
    if name in ("1f1b", "gpipe"):
        cost = {k: [per_stage[s]["I"] + per_stage[s]["W"] if k == "B" else per_stage[s][k]
                    for s in range(p)] for k in ("F", "B")}
    else:
        cost = {k: [per_stage[s][k] for s in range(p)] for k in ("F", "I", "W")}
    st = steady_state(sched, costs)
    # with cyclicity c the increments repeat every c steps; 60 covers c up to 6
    a, b = _many_steps(sched, cost, hop, 60), _many_steps(sched, cost, hop, 120)
    assert math.isclose(st.step, (b - a) / 60, rel_tol=1e-9)
    assert math.isclose(_many_steps(sched, cost, hop, 1), simulate(sched, costs).makespan)
    assert st.step <= st.longest_span + 1e-9 <= st.makespan + 2e-9


def test_a_heavy_last_stage_sets_the_pace_through_the_first_rank() -> None:
    """Two ranks, two micro-batches of 1F1B, the last stage three times as dear: rank 0 cannot
    start the next step before its last backward, which follows all of rank 1's work after
    its first forward: F0 + 2 (F1 + B1) + B0 = 14 per step, though rank 1 is busy only 12."""
    # rank 0: F(0,0) F(0,1) B(0,0) B(0,1); rank 1: F(1,0) B(1,0) F(1,1) B(1,1)
    sched = library.get("1f1b", 2, 2)
    costs = CostModel(F=1.0, B=1.0, stage={1: {"F": 3.0, "B": 3.0}})
    st = steady_state(sched, costs)
    cost = {"F": [1.0, 3.0], "B": [1.0, 3.0]}
    a, b = _many_steps(sched, cost, 0.0, 60), _many_steps(sched, cost, 0.0, 120)
    assert math.isclose(st.step, (b - a) / 60)
    assert math.isclose(st.step, 14.0) and st.spans == (14.0, 12.0)
    assert math.isclose(st.bubble, 1 - 16 / 28)


def test_cycle_time_closed_forms() -> None:
    inf = -math.inf
    assert cycle_time([]) == 0.0
    assert cycle_time([[5.0]]) == 5.0
    # the cycle 0 -> 1 -> 0 of weight 3 + 7 has mean 5, above either self-loop
    assert math.isclose(cycle_time([[4.0, 3.0], [7.0, 1.0]]), 5.0)
    assert cycle_time([[inf, 2.0], [inf, inf]]) == 0.0  # no cycle at all


def test_simulate_prints_and_reports_both_figures(tmp_path: Path) -> None:
    out = tmp_path / "h2.sched"
    (tmp_path / "h2.sched").write_text(pipeir.print_schedule(library.get("zb-h2", 4, 8)))
    run = subprocess.run([sys.executable, "-m", "pipeir", "simulate", str(out), "--set", "F=1",
                          "--set", "I=1", "--set", "W=1"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "makespan 27;" in run.stdout
    assert ("steps back to back: 24 per step, bubble 0.0%; longest rank span 24, bubble 0.0% "
            "(the Zero Bubble paper's figure)") in run.stdout
    js = subprocess.run([sys.executable, "-m", "pipeir", "simulate", str(out), "--json",
                         "--set", "F=1", "--set", "I=1", "--set", "W=1"], capture_output=True,
                        text=True, timeout=120)
    data = json.loads(js.stdout)
    assert data["makespan"] == 27 and data["steady"]["step"] == 24
    assert data["steady"]["spans"] == [24, 24, 24, 24]
