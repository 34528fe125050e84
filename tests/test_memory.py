"""Activation recomputation and offloading: the FC / RC / OFF / RELOAD ops in the language, the
verifier, the simulator (a copy channel beside compute), the recompute and offload passes, and
training with them (gloo) against single-process training.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import pipeir
from pipeir.diagnostics import VerifyError
from pipeir.ops import Op
from pipeir.printer import print_schedule
from pipeir.schedule import Schedule
from pipeir.sim import CostModel, simulate
from pipeir.verify import verify

EXAMPLES = Path(__file__).parent.parent / "examples"

HEAD = "pipeline { ranks = 2 microbatches = 2 }\nschedule s {\n"


def _src(rank0: str, rank1: str = "F(1,0) B(1,0) F(1,1) B(1,1)") -> str:
    return f"{HEAD}rank 0 {{ {rank0} }}\nrank 1 {{ {rank1} }}\n}}\n"


MIXED = _src("FC(0,0) F(0,1) OFF(0,1) RC(0,0) B(0,0) RELOAD(0,1) B(0,1)")


# ---- language, printer, verifier ----------------------------------------------------------
def test_memory_ops_round_trip_and_add_their_dependencies() -> None:
    s = pipeir.parse(MIXED)
    text = print_schedule(s)
    assert "FC(0,0) F(0,1) OFF(0,1) RC(0,0) B(0,0) RELOAD(0,1) B(0,1)" in text
    assert pipeir.parse(text) == s and print_schedule(pipeir.parse(text)) == text
    g = s.graph
    for u, v in [(Op("FC", 0, 0), Op("RC", 0, 0)), (Op("RC", 0, 0), Op("B", 0, 0)),
                 (Op("FC", 0, 0), Op("F", 1, 0)), (Op("F", 0, 1), Op("OFF", 0, 1)),
                 (Op("OFF", 0, 1), Op("RELOAD", 0, 1)), (Op("RELOAD", 0, 1), Op("B", 0, 1))]:
        assert g.has_edge(u, v), (u, v)
    example = pipeir.parse(EXAMPLES / "memory.sched")
    assert pipeir.parse(print_schedule(example)) == example
    assert verify(example).peak_activations == (1, 1, 1, 1)


@pytest.mark.parametrize("rank0, message, col", [
    ("FC(0,0) B(0,0) F(0,1) B(0,1)",
     "FC(0,0) keeps only its input, but the schedule never runs RC(0,0)", 10),
    ("F(0,0) RC(0,0) B(0,0) F(0,1) B(0,1)",
     "RC(0,0) recomputes a checkpointed forward, but stage 0, micro-batch 0 has no FC(0,0) "
     "(F(0,0) keeps its activations)", 17),
    ("F(0,0) OFF(0,0) B(0,0) F(0,1) B(0,1)",
     "OFF(0,0) moves activations to host memory, but the schedule never runs RELOAD(0,0)", 17),
    ("F(0,0) B(0,0) F(0,1) RELOAD(0,1) B(0,1)",
     "RELOAD(0,1) brings back activations that no OFF(0,1) offloaded", 31),
    ("FC(0,0) OFF(0,0) RC(0,0) RELOAD(0,0) B(0,0) F(0,1) B(0,1)",
     "OFF(0,0) offloads the activations F(0,0) keeps, but the schedule has no F(0,0)", 18),
])
def test_unpaired_memory_ops_are_errors_with_spans(rank0: str, message: str, col: int) -> None:
    with pytest.raises(VerifyError) as e:
        verify(pipeir.parse(_src(rank0)))
    assert e.value.check == "completeness"
    d = e.value.diagnostics[0]
    assert d.message.startswith(message)
    assert d.span is not None and (d.span.line, d.span.col) == (3, col)


def test_recompute_before_its_forward_or_last_stage_checkpoint_is_rejected() -> None:
    with pytest.raises(VerifyError) as e:
        verify(pipeir.parse(_src("RC(0,0) FC(0,0) B(0,0) F(0,1) B(0,1)")))
    assert e.value.check == "deadlock"
    assert "rank 0 runs RC(0,0) (line 3) before FC(0,0) (line 3)" in e.value.diagnostics[0].message
    with pytest.raises(VerifyError) as e:
        verify(pipeir.parse(_src("F(0,0) B(0,0) F(0,1) B(0,1)",
                                 "FC(1,0) RC(1,0) B(1,0) F(1,1) B(1,1)")))
    assert "the last stage's forward feeds the loss" in e.value.diagnostics[0].message


def test_peak_bytes_closed_forms_and_byte_limit(cli, tmp_path: Path) -> None:
    a, x = 100.0, 7.0  # activation and input bytes per stage and micro-batch
    costs = CostModel(memory_bytes=a, input_bytes=x)
    one = pipeir.library.get("1f1b", 4, 8)
    # 1F1B: rank r holds p - r micro-batches' activations
    assert verify(one, sizes=costs).peak_bytes == tuple((4 - r) * a for r in range(4))
    every = pipeir.compile(one, "recompute{all=true}").schedule
    # everything recomputed: one activation (RC .. B) and the inputs of the p - r forwards in
    # flight; the last stage keeps its F
    assert verify(every, sizes=costs).peak_bytes == (a + 4 * x, a + 3 * x, a + 2 * x, a)
    # the unit count: an FC holds nothing, the RC'd one 1
    assert verify(every).peak_activations == (1, 1, 1, 1)
    f = tmp_path / "m.sched"
    f.write_text(MIXED)
    c = tmp_path / "c.toml"
    c.write_text("memory_bytes = 100\nhost_bandwidth = 50\n")
    code, out, _ = cli("check", str(f), "--costs", str(c))
    assert code == 0 and "peak bytes per rank: 100 100" in out
    code, _, err = cli("check", str(f), "--costs", str(c), "--memory-limit", "99B")
    assert code == 1
    assert "m.sched:3:18: error: memory limit exceeded on rank 0: F(0,1) makes 100 bytes" in err
    assert cli("check", str(f), "--memory-limit", "1KB")[0] == 2  # bytes need sizes


# ---- simulation ----------------------------------------------------------------------------
def test_copies_run_beside_compute_and_serialise_on_the_copy_channel() -> None:
    s = pipeir.parse(MIXED)
    r = simulate(s, CostModel(memory_bytes=100, host_bandwidth=50))  # a copy takes 2
    st = {str(op): t for op, t in r.start.items()}
    # FC 0..1, F 1..2, OFF 2..4 beside RC 2..3 and B(0,0) (waits for the grad from rank 1)
    assert (st["OFF(0,1)"], st["RC(0,0)"]) == (2.0, 2.0)
    assert st["B(0,0)"] == 4.0 and st["RELOAD(0,1)"] == 6.0  # issued after B(0,0)
    assert st["B(0,1)"] == 8.0  # waits for the reload, not for nothing
    assert r.makespan == 10.0 and r.copying == (4.0, 0.0) and r.busy[0] == 7.0
    assert r.peak_bytes == (100.0, 100.0)
    # a second offload waits for the first on the channel
    two = pipeir.parse(_src("F(0,0) OFF(0,0) F(0,1) OFF(0,1) RELOAD(0,0) B(0,0) "
                            "RELOAD(0,1) B(0,1)"))
    r = simulate(two, CostModel(memory_bytes=100, host_bandwidth=50))
    st = {str(op): t for op, t in r.start.items()}
    assert (st["OFF(0,0)"], st["OFF(0,1)"], st["RELOAD(0,0)"]) == (1.0, 3.0, 5.0)


@pytest.mark.parametrize("kind,value", [("FC", 3.0), ("RC", 4.0), ("OFF", 5.0),
                                         ("RELOAD", 0.5)])
def test_a_memory_op_cost_set_once_means_it_on_every_stage(kind: str, value: float) -> None:
    # the oracle is the per-stage form, which always worked: `RC = 4` once must time the
    # schedule exactly as `stage.S.RC = 4` on each stage does (it was once accepted and dropped)
    base = {"memory_bytes": 100, "host_bandwidth": 50}
    once = CostModel.from_settings({**base, kind: value})
    each = CostModel.from_settings({**base, **{f"stage.{s}.{kind}": value for s in (0, 1)}})
    s = pipeir.parse(MIXED)
    assert simulate(s, once).start == simulate(s, each).start
    assert simulate(s, once).makespan != simulate(s, CostModel.from_settings(base)).makespan
    assert once.cost(Op(kind, 1, 0)) == value and once.settings()[kind] == value
    assert CostModel.from_settings(once.settings()).settings() == once.settings()
    assert once.scaled(0.5).cost(Op(kind, 0, 1)) == value / 2
    # per-micro-batch lengths scale it like any op time the costs give
    long = CostModel.from_settings({**base, kind: value, "lengths": [1, 3]})
    assert [long.cost(Op(kind, 0, m)) for m in (0, 1)] == [value / 2, value * 3 / 2]


def test_a_memory_op_cost_on_the_command_line_changes_the_step(
        tmp_path: Path, cli: Callable[..., tuple[int, str, str]]) -> None:
    f = tmp_path / "m.sched"
    f.write_text(MIXED)
    steps = []
    for extra in ([], ["--set", "RC=10"], ["--set", "stage.0.RC=10", "--set", "stage.1.RC=10"]):
        code, out, err = cli("simulate", str(f), "--json", *extra)
        assert code == 0, err
        steps.append(json.loads(out)["makespan"])
    assert steps[1] == steps[2] > steps[0]


def test_timeline_and_trace_show_the_copy_channel() -> None:
    from pipeir.views.timeline import render_timeline
    from pipeir.views.trace import chrome_trace

    r = simulate(pipeir.parse(MIXED), CostModel(memory_bytes=100, host_bandwidth=50))
    lines = render_timeline(r, 20).splitlines()
    assert lines[1].startswith("r0 |CC") and lines[2] == "   |....oooo....llll....| copies"
    assert "O offload" in lines[-1] and "X recompute" in lines[-1]
    tids = {e["args"]["op"]: e["tid"] for e in chrome_trace(r)["traceEvents"]
            if e.get("ph") == "X" and "op" in e.get("args", {})}
    assert tids["OFF(0,1)"] == tids["RELOAD(0,1)"] != tids["RC(0,0)"] == tids["FC(0,0)"]


# ---- passes --------------------------------------------------------------------------------
COSTS = CostModel(F=1, B=2, memory_bytes=100, input_bytes=10, host_bandwidth=100)


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b"])
def test_recompute_fits_the_budget_faster_than_recomputing_everything(name: str) -> None:
    s = _lib(name, 4, 8)
    peak = max(verify(s, sizes=COSTS).peak_bytes or (0,))
    budget = peak / 2
    chosen = pipeir.compile(s, f"recompute{{budget={budget}}}", costs=COSTS).schedule
    every = pipeir.compile(s, "recompute{all=true}", costs=COSTS).schedule
    assert max(verify(chosen, sizes=COSTS).peak_bytes or (0,)) <= budget
    assert simulate(chosen, COSTS).makespan < simulate(every, COSTS).makespan
    assert simulate(s, COSTS).makespan <= simulate(chosen, COSTS).makespan


def _full_scan(s: Schedule, costs: CostModel, budget: float, kind: str) -> Schedule:
    """The memory passes' greedy, written out plainly: every move simulated with
    `pipeir.simulate`, the least added time per unit of overflow removed wins, ties to the
    larger removal, then to the first found."""
    from pipeir.verify import live_activations

    def size(op: Op) -> float:
        return costs.activation_memory(op.stage) or 0.0

    def over(prog: list[Op] | tuple[Op, ...]) -> float:
        lives = live_activations(prog, size, lambda op: costs.input_memory(op.stage))
        return sum(max(0.0, live - budget) for _, live in lives)

    def moved(prog: tuple[Op, ...], f: Op, shift: int) -> list[Op] | None:
        out = list(prog)
        if kind == "recompute":
            out[out.index(f)] = Op("FC", f.stage, f.mb)
        else:
            out.insert(out.index(f) + 1, Op("OFF", f.stage, f.mb))
        at = next(i for i, op in enumerate(out) if (op.stage, op.mb) == (f.stage, f.mb)
                  and op.kind in ("B", "I")) - shift
        if at <= out.index(Op("FC" if kind == "recompute" else "OFF", f.stage, f.mb)):
            return None
        out.insert(at, Op("RC" if kind == "recompute" else "RELOAD", f.stage, f.mb))
        return out

    while max(map(over, s.programs)) > 0:
        r = max(range(len(s.programs)), key=lambda k: over(s.programs[k]))
        span = simulate(s, costs).makespan
        best: tuple[float, float] | None = None
        for f in s.programs[r]:
            if f.kind != "F" or Op("OFF", f.stage, f.mb) in s or (
                    kind == "recompute" and f.stage == s.config.stages - 1):
                continue
            for shift in range(5):
                prog = moved(s.programs[r], f, shift)
                if prog is None:
                    break
                gain = over(s.programs[r]) - over(prog)
                if gain <= 0:
                    continue
                cand = s.with_programs([prog if k == r else p
                                        for k, p in enumerate(s.programs)])
                cost = max(0.0, simulate(cand, costs).makespan - span) / gain
                if best is None or (cost, -gain) < best:
                    best, pick = (cost, -gain), cand
        assert best is not None
        s = pick
    return s


@pytest.mark.parametrize("kind", ["recompute", "offload"])
def test_memory_passes_pick_what_a_full_scan_picks(kind: str) -> None:
    """The passes stop a round at the first move that adds no time (largest removal first);
    the schedule must be the one simulating every move gives."""
    costs = CostModel.from_settings({"F": 1, "B": 2, "memory_bytes": 100,
                                     "host_bandwidth": 300, "stage.0.F": 1.5,
                                     "stage.2.B": 3})
    split = pipeir.compile(_lib("interleaved-1f1b", 3, 6), "split-backward").schedule
    for s, fractions in ((_lib("1f1b", 3, 6), (0.8, 0.7)),
                         (_lib("interleaved-1f1b", 3, 6), (0.8, 0.5)), (split, (0.8,))):
        peak = max(verify(s, sizes=costs).peak_bytes or (0,))
        for budget in (peak * f for f in fractions):
            got = pipeir.compile(s, f"{kind}{{budget={budget}}}", costs=costs).schedule
            assert got.programs == _full_scan(s, costs, budget, kind).programs, (s, budget)


def test_offload_fits_the_budget_and_hides_copies_in_compute() -> None:
    s = pipeir.library.get("1f1b", 4, 8)
    fast = CostModel(F=1, B=2, memory_bytes=100, host_bandwidth=1000)  # a copy: 0.1
    out = pipeir.compile(s, "offload{budget=200}", costs=fast).schedule
    assert max(verify(out, sizes=fast).peak_bytes or (0,)) <= 200
    assert any(op.kind == "OFF" for op in out)
    assert simulate(out, fast).makespan == simulate(s, fast).makespan


def test_memory_passes_reject_bad_options_and_impossible_budgets() -> None:
    with pytest.raises(pipeir.UsageError, match="a positive budget"):
        pipeir.compile(pipeir.library.get("1f1b", 2, 4), "recompute")
    with pytest.raises(pipeir.UsageError, match=r"cannot fit rank 0 into the budget of 0\.5"):
        pipeir.compile(pipeir.library.get("1f1b", 2, 4), "recompute{budget=0.5}")


def test_passes_that_rebuild_programs_and_torch_export_refuse_memory_ops() -> None:
    from pipeir.interop.writer import dumps_csv

    s = pipeir.library.get("1f1b", 4, 8)
    with pytest.raises(pipeir.UsageError, match="run recompute and offload after split-backward"):
        pipeir.compile(s, "offload{budget=2},split-backward")
    with pytest.raises(pipeir.UsageError, match="interleave works on F/B/I/W schedules"):
        pipeir.compile(s, "recompute{budget=2},interleave{v=2}")
    with pytest.raises(pipeir.UsageError, match="torch's schedule format has no OFF"):
        dumps_csv(pipeir.parse(EXAMPLES / "memory.sched"))


# ---- training ------------------------------------------------------------------------------
sys.path.insert(0, str(Path(__file__).parent))
from runtime_helpers import TIMEOUT, assert_matches_reference, runtime_job  # noqa: E402

NOISY = f"{Path(__file__).parent / 'zoo.py'}:noisy"
STRUCTURED = f"{Path(__file__).parent / 'zoo.py'}:structured"
BATCHNORM = f"{Path(__file__).parent / 'zoo.py'}:batchnorm"  # buffers: RC must not update twice
EMA = f"{Path(__file__).parent / 'zoo.py'}:reassigned_buffer"  # ... nor replace one
MLP = "pipeir.models.mlp:small"


def _lib(name: str, p: int, m: int) -> Schedule:
    return pipeir.library.get(name, p, m, **({"v": 2} if "interleaved" in name else {}))


def _memory_jobs(p: int, m: int) -> tuple[list[tuple[Schedule, str]], list[tuple[Schedule, str]]]:
    """(schedule, passes) with the memory ops on 1F1B, interleaved and split I/W; and the
    (plain, with memory ops) pairs for dropout."""
    one, inter = _lib("1f1b", p, m), _lib("interleaved-1f1b", p, m)
    split = 7 if p > 2 else 3  # a budget split-backward's interleaved schedule can fit
    jobs = [
        (one, "recompute{budget=1}"),
        (one, "offload{budget=2}" if p > 2 else ""),
        (pipeir.parse(EXAMPLES / "memory.sched", overrides={"ranks": p, "microbatches": m}), ""),
        (inter, "recompute{budget=3}"),
        (inter, "offload{budget=2}"),
        (one, "split-backward,recompute{all=true}"),
        (inter, f"split-backward,recompute{{budget={split}}}"),
        (inter, f"split-backward,offload{{budget={split}}}"),
    ]
    return jobs, [(one, "recompute{all=true}"), jobs[6], (inter, "offload{budget=2}")]


def _kinds(s: Schedule, passes: str) -> set[str]:
    return {op.kind for op in pipeir.compile(s, passes or None).schedule}


@pytest.mark.mp
@pytest.mark.parametrize("p", [2, 4])
def test_memory_ops_train_like_single_process_and_measure_the_simulated_peak(p: int) -> None:
    from pipeir.runtime.launch import launch
    from pipeir.runtime.profile import cost_settings, profile_stages

    m = 2 * p
    mlp, dropout = _memory_jobs(p, m)
    jobs = [runtime_job(s, ps, 2) for s, ps in mlp]
    jobs += [runtime_job(s, ps, 2, model=STRUCTURED) for s, ps in mlp[:1] + mlp[5:6]]
    jobs += [runtime_job(s, ps, 2, model=model) for s, ps in mlp[5:6] for model in (BATCHNORM, EMA)]
    noisy = [runtime_job(s, ps, 2, model=NOISY) for s, ps in dropout]
    plain = [runtime_job(s, ps.rpartition(",")[0] if "," in ps else None, 2, model=NOISY)
             for s, ps in dropout]
    kinds = set().union(*(_kinds(s, ps) for s, ps in mlp))
    assert {"FC", "RC", "OFF", "RELOAD", "I", "W"} <= kinds
    result = launch(jobs + noisy + plain, p, timeout_s=TIMEOUT * 2)
    assert_matches_reference(jobs, result)
    # dropout: with the forwards recomputed, the same masks as without (same RNG draws)
    n = len(jobs)
    for k in range(len(noisy)):
        for s in result.params[n + k]:
            for name, got in result.params[n + k][s].items():
                want = result.params[n + len(noisy) + k][s][name]
                assert (got == want).all(), f"dropout job {k}: stage {s} {name} differs"
    # measured peak saved-activation bytes vs the simulated peak from profiled sizes
    for j, (s, ps) in enumerate(mlp):
        sched = pipeir.compile(s, ps or None).schedule
        stages = sched.config.stages
        settings = cost_settings(profile_stages(pipeir.models.resolve(MLP), stages, m,
                                                warmup=0, iters=1), None, {})
        settings.pop("meta")
        sim = verify(sched, sizes=CostModel.from_settings(_flat(settings))).peak_bytes
        assert sim is not None
        for r in range(p):
            got = result.saved_peak[(j, r, 1)]
            assert abs(got - sim[r]) <= 0.1 * sim[r], (j, ps, r, got, sim[r])


def _flat(d: dict[str, object], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.mp
def test_run_reports_measured_and_simulated_peak_bytes_and_traces_copies(cli, tmp_path: Path
                                                                         ) -> None:
    import json

    trace = tmp_path / "t.json"
    code, out, err = cli("run", EXAMPLES / "memory.sched", "--set", "ranks=2", "--set",
                         "microbatches=4", "--steps", "2", "--trace", trace)
    assert code == 0, err
    head = out.index("peak saved activations (bytes): measured")
    rows = [line.split() for line in out[head:].splitlines()[1:3]]
    assert [r[:2] for r in rows] == [["rank", "0:"], ["rank", "1:"]]
    for *_, measured, _, simulated in rows:
        got, want = int(measured.replace(",", "")), int(simulated.replace(",", ""))
        assert got > 0 and abs(got - want) <= 0.1 * want
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"}
    assert {"FC1", "RC1", "OFF0", "RELOAD0"} <= names


def test_a_step_with_recorded_layouts_runs_without_hooks_and_reports_the_recorded_peak(
) -> None:
    """Saved activations are recorded on a step with micro-batch layouts not seen before;
    a step with the same layouts in the same order runs without the pack hooks (nothing is
    stashed) and reports the recorded step's peak; new layouts, or `every_step`, record."""
    import torch

    from pipeir.runtime.memory import SavedActivations

    lin = torch.nn.Linear(8, 8)

    def step(saved: SavedActivations, layouts: tuple[int, ...], rows: int) -> tuple[int, int]:
        saved.begin_step(layouts)
        with saved.recording((0, 0)):
            y = torch.tanh(lin(torch.ones(rows, 8)))
        stashed = sum(len(s.tensors) for s in saved._stash.values())
        y.sum().backward()
        saved.release((0, 0))
        saved.end_step()
        return saved.peak, stashed

    saved = SavedActivations(torch.device("cpu"), lin.parameters(), every_step=False)
    first, stashed = step(saved, (1,), 4)
    # tanh saves its output (4 x 8 floats), the linear its input (4 x 8): 256 bytes
    assert (first, stashed) == (256, 2)
    assert step(saved, (1,), 4) == (256, 0)  # not recorded, the recorded peak
    assert step(saved, (2,), 6) == (384, 2)  # new layouts: recorded
    always = SavedActivations(torch.device("cpu"), lin.parameters())
    assert [step(always, (1,), 4) for _ in range(2)] == [(256, 2), (256, 2)]
