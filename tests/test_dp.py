"""Pipeline x data parallelism: the R op, dp-reduce, the all-reduce cost and its channel in the
simulator, tune --dp, lowering, and training on pp x dp ranks (single-process oracle)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import pipeir
from pipeir import R
from pipeir.diagnostics import UsageError, VerifyError
from pipeir.ops import NO_MB, Op
from pipeir.passes import PassContext, PassManager, parse_pipeline
from pipeir.schedule import Schedule
from pipeir.sim import CostModel, simulate

EXAMPLES = Path(__file__).parent.parent / "examples"
ZOO = Path(__file__).parent / "zoo.py"

TWO = """
pipeline { ranks = 2  microbatches = 2 }
schedule s {
    rank 0 { F(0,0) F(0,1) B(0,0) B(0,1) R(0) }
    rank 1 { F(1,0) B(1,0) F(1,1) B(1,1) R(1) }
}
"""


def _opt(schedule: Schedule, spec: str) -> Schedule:
    return PassManager(parse_pipeline(spec), context=PassContext(CostModel())).run(schedule)


# ---- IR, language, verifier ----------------------------------------------------------------
def test_reduction_op_parses_prints_and_round_trips() -> None:
    s = pipeir.parse(TWO)
    assert R(1) == Op("R", 1, NO_MB) and str(R(1)) == "R(1)"
    assert s.program(1)[-1] == R(1)
    assert {p for p, _ in s.graph.in_edges(R(0))} == {Op("B", 0, 0), Op("B", 0, 1)}
    assert not list(s.graph.successors(R(0)))  # only the optimizer step waits for it
    text = pipeir.print_schedule(s)
    assert "B(0,1) R(0)" in text
    assert pipeir.print_schedule(pipeir.parse(text)) == text
    pipeir.verify(s)


@pytest.mark.parametrize(("text", "check", "message"), [
    (TWO.replace("B(0,0) B(0,1) R(0)", "B(0,0) R(0) B(0,1)"), "reduction",
     "R(0) comes before B(0,1) on rank 0: a reduction must follow every weight gradient"),
    (TWO.replace(" R(1) }", " }"), "reduction",
     "stage 1 never reduces its gradients (no R(1)) while R(0) does"),
    (TWO.replace("R(0) }", "R(0) R(0) }"), "duplicate", "duplicate op R(0)"),
    (TWO.replace("R(1) }", "R(x) }").replace("R(0) }", "R(1) }").replace("R(x)", "R(0)"),
     "placement", "R(1) runs on rank 0, but stage 1 lives"),
    (TWO.replace("R(1) }", "R(1) R(2) }"), "range", "R(2): stage 2 is out of range"),
], ids=["order", "missing", "duplicate", "placement", "range"])
def test_verifier_rejects_misplaced_reductions(text: str, check: str, message: str) -> None:
    with pytest.raises(VerifyError) as e:
        pipeir.verify(pipeir.parse(text))
    assert e.value.check == check
    assert message in str(e.value)


@pytest.mark.parametrize(("text", "message"), [
    (TWO.replace("R(0) }", "R(0, 1) }"), "R takes 1 argument (stage, micro-batch), got 2"),
    (TWO.replace("F(0,0) F(0,1)", "overlap { F(0,0) R(0) } F(0,1)"), "'R' is not one of them"),
], ids=["arity", "overlap"])
def test_language_rejects_bad_reductions(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pipeir.parse(text)


@pytest.mark.parametrize(("name", "passes"), [
    ("1f1b", ""), ("1f1b", "split-backward,"), ("1f1b", "interleave{v=2},split-backward,"),
    ("zb-v", ""), ("dualpipe-v", ""), ("gpipe", "split-backward{mode=h2},"),
])
def test_dp_reduce_puts_each_reduction_right_after_its_stages_last_weight_gradient(
        name: str, passes: str) -> None:
    base = _opt(pipeir.library.get(name, 2, 4), passes.rstrip(",")) if passes else \
        pipeir.library.get(name, 2, 4)
    s = _opt(base, "dp-reduce")
    for r, prog in enumerate(s.programs):
        stripped = [op for op in prog if op.kind != "R"]
        assert stripped == list(base.program(r))  # nothing else moves
        for stage in s.config.stages_of(r):
            i = prog.index(R(stage))
            last = max(k for k, op in enumerate(prog) if op.stage == stage and op.kind in "BW")
            prev = prog[i - 1]
            assert last < i  # after every weight gradient of its stage ...
            # ... and right after the last one (or its overlapped partner, or another R)
            assert prev == prog[last] or s.pair_of(prog[last]) == prev or prev.kind == "R"
    assert _opt(s, "dp-reduce") == s  # placing again changes nothing
    end = _opt(base, "dp-reduce{at=end}")
    assert all(all(op.kind == "R" for op in prog[len(prog) - len(s.config.stages_of(r)):])
               for r, prog in enumerate(end.programs))
    for out in (s, end):
        text = pipeir.print_schedule(out)
        assert pipeir.print_schedule(pipeir.parse(text)) == text


def test_passes_that_move_backwards_ask_for_dp_reduce_after_them() -> None:
    s = _opt(pipeir.library.get("1f1b", 2, 4), "dp-reduce")
    for spec in ("split-backward", "interleave{v=2}"):
        with pytest.raises(UsageError, match=f"run dp-reduce after it: '{spec.split('{')[0]},"):
            _opt(s, spec)
    assert len(_opt(s, "merge-backward,reorder")) == len(s)  # these keep R ops


# ---- costs and the simulator ---------------------------------------------------------------
@pytest.mark.parametrize("d", [1, 2, 3, 4, 8])
def test_allreduce_cost_is_the_ring_formula(d: int) -> None:
    c = CostModel.from_settings({"dp": d, "dp_latency": 0.25, "dp_bandwidth": 4.0,
                                 "param_bytes": 100.0, "stage.1.param_bytes": 36.0})
    for stage, size in ((0, 100.0), (1, 36.0)):
        want = 2 * (d - 1) * 0.25 + 2 * (d - 1) / d * size / 4.0
        assert c.allreduce_time(stage) == pytest.approx(want)
        assert c.cost(R(stage)) == pytest.approx(want)
    # the dp link defaults to the pipeline link
    c = CostModel(dp=d, latency=0.5, bandwidth=2.0, param_bytes=10.0)
    assert c.allreduce_time(0) == pytest.approx(2 * (d - 1) * 0.5 + 2 * (d - 1) / d * 5.0)


@pytest.mark.parametrize(("settings", "message"), [
    ({"dp": 1.5}, "'dp' (data-parallel replicas) must be a positive integer"),
    ({"dp": 0}, "cost 'dp' must be positive"),
    ({"dp_bandwidth": 0}, "cost 'dp_bandwidth' must be positive"),
    ({"stage.0.param_bytes": -1}, "cost 'stage.0.param_bytes' must be non-negative"),
])
def test_bad_dp_costs_are_usage_errors(settings: dict[str, float], message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CostModel.from_settings(settings)


def test_reductions_run_on_their_own_channel() -> None:
    """They never delay compute, they queue behind each other on their rank, and the step
    ends when the last one does."""
    plain = pipeir.library.get("interleaved-1f1b", 2, 4, v=2)
    s = _opt(plain, "dp-reduce")
    costs = CostModel(dp=2, dp_latency=1.5)  # each all-reduce takes 2 * 1 * 1.5 = 3
    r, base = simulate(s, costs), simulate(plain, costs)
    for op in plain:
        assert (r.start[op], r.end[op]) == (base.start[op], base.end[op])
    assert r.compute_makespan == base.makespan
    for rank, prog in enumerate(s.programs):
        reds = [op for op in prog if op.kind == "R"]
        for a, b in itertools.pairwise(reds):
            assert r.start[b] >= r.end[a]
        for red in reds:
            issued = max(r.end[op] for op in prog[:prog.index(red)] if op.kind != "R")
            assert r.end[red] - r.start[red] == pytest.approx(3.0)
            assert r.start[red] == max([issued, *(r.end[x] for x in reds[:reds.index(red)])])
        assert r.reducing[rank] == pytest.approx(3.0 * len(reds))
    assert r.makespan == max(r.end.values())
    assert r.exposed_reduction == pytest.approx(r.makespan - base.makespan)
    assert 0 < r.hidden_reduction < 1
    assert r.busy == base.busy  # reductions are not compute


@pytest.mark.parametrize(("name", "passes"), [
    ("1f1b", "split-backward,"), ("interleaved-1f1b", ""), ("zb-v", ""), ("dualpipe-v", ""),
])
def test_reductions_placed_by_the_pass_never_lose_to_reductions_at_the_end(
        name: str, passes: str) -> None:
    base = pipeir.library.get(name, 4, 8, **({"v": 2} if name == "interleaved-1f1b" else {}))
    costs = CostModel(F=1, I=1, W=1, dp=4, dp_latency=0.1, dp_bandwidth=1.0, param_bytes=4.0)
    last = simulate(_opt(base, f"{passes}dp-reduce"), costs)
    end = simulate(_opt(base, f"{passes}dp-reduce{{at=end}}"), costs)
    assert last.makespan <= end.makespan + 1e-9
    assert last.exposed_reduction <= end.exposed_reduction + 1e-9
    if name != "1f1b":  # several stages per rank (or late W ops): something is hidden
        assert last.hidden_reduction > end.hidden_reduction


#: one rank holding two stages (F = 1, B = 2): its compute ends at 12, the last weight
#: gradient of stage 1 ends at 10 (B(1,1)), that of stage 0 at 12 (B(0,1))
ONE_RANK_TWO_STAGES = """
pipeline { ranks = 1  microbatches = 2  stages = 2 }
schedule s {
    rank 0 { F(0,0) F(1,0) F(0,1) F(1,1) B(1,0) B(0,0) B(1,1) B(0,1) }
}
"""


@pytest.mark.parametrize("d", [0.5, 2.0, 3.0, 5.0])
def test_exposed_reduction_is_the_closed_form(d: float) -> None:
    """All-reduces of d each, on one channel. By the pass: R(1) runs from 10 to 10 + d,
    R(0) from max(12, 10 + d) for d, so d + max(0, d - 2) is exposed; at the end both run
    after 12: 2d."""
    s = pipeir.parse(ONE_RANK_TWO_STAGES)
    costs = CostModel(F=1, B=2, dp=2, dp_latency=d / 2)  # ring: 2 (D - 1) x latency = d
    last = simulate(_opt(s, "dp-reduce"), costs)
    end = simulate(_opt(s, "dp-reduce{at=end}"), costs)
    assert last.compute_makespan == end.compute_makespan == 12
    assert last.exposed_reduction == pytest.approx(d + max(0.0, d - 2))
    assert end.exposed_reduction == pytest.approx(2 * d)
    assert last.hidden_reduction == pytest.approx(1 - (d + max(0.0, d - 2)) / (2 * d))


def test_run_measurements_read_a_timeline_as_the_simulator_writes_it() -> None:
    """Instruction times laid out as the simulator times the ops, on two identical replicas:
    `allreduce_seconds` gives back each all-reduce's time (R(0) queued behind R(1)) and
    `exposed_reduction` the simulator's exposed time, with or without the finish times."""
    from pipeir.backend.instructions import Backward, Forward, ReduceGrad, WaitReduce
    from pipeir.runtime.measure import allreduce_seconds, exposed_reduction

    compiled = pipeir.compile(pipeir.parse(ONE_RANK_TWO_STAGES), "dp-reduce")
    sim = simulate(compiled.schedule, CostModel(F=1, B=2, dp=2, dp_latency=1.5))  # d = 3
    times: list[tuple[int, float, float]] = []
    done: list[tuple[int, float]] = []
    clock = 0.0
    for pc, ins in enumerate(compiled.lowered.program(0)):
        t0 = clock
        if isinstance(ins, Forward | Backward):
            op = Op("F" if isinstance(ins, Forward) else "B", ins.stage, ins.mb)
            t0, clock = sim.start[op], sim.end[op]
        elif isinstance(ins, ReduceGrad):
            done.append((ins.stage, sim.end[R(ins.stage)]))
        elif isinstance(ins, WaitReduce):
            clock = max(clock, sim.end[R(ins.stage)])
        times.append((pc, t0, clock))
    every, reduced = {0: times, 1: times}, {0: done, 1: done}
    low = compiled.lowered
    assert allreduce_seconds(low, [every], [reduced], 2) == {0: 3.0, 1: 3.0}
    assert exposed_reduction(low, every, 2, reduced) == sim.exposed_reduction == 4.0
    assert exposed_reduction(low, every, 2) == 4.0  # the waits end at the finishes


def test_simulate_shows_reductions_on_the_timeline_trace_and_json(cli, tmp_path: Path) -> None:
    sched = tmp_path / "dp.sched"
    assert cli("opt", "--schedule", "interleaved-1f1b", "--ranks", "2", "--microbatches", "4",
               "--v", "2", "--passes", "dp-reduce", "-o", sched)[0] == 0
    sets = ("--set", "dp=2", "--set", "param_bytes=4", "--set", "dp_bandwidth=2")
    code, out, _ = cli("simulate", sched, *sets, "--width", "60", "--trace",
                       tmp_path / "t.json")
    assert code == 0
    assert "gradient all-reduce (dp = 2): 4 on the busiest rank" in out
    assert "with reductions vs" in out
    assert out.count("| all-reduce") == 2 and "R gradient all-reduce" in out
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert sum(e.get("cat") == "R" for e in trace) == 4
    code, out, _ = cli("simulate", sched, *sets, "--json")
    red = json.loads(out)["reduction"]
    assert red["time"] == 4 and red["per_rank"] == [4, 4]


def test_tune_with_dp_adds_the_reductions_to_every_candidate(cli) -> None:
    from pipeir.search.tune import search

    costs = CostModel(F=4, I=4, W=4, latency=0.005, param_bytes=4e8, dp_bandwidth=2.5e7,
                      stage={3: {"F": 4.4}})
    plain = search(costs, 4, [8])
    dp = search(costs, 4, [8], dp=4)
    assert all(c.passes.endswith("dp-reduce") for c in dp.ranked)
    assert all(any(op.kind == "R" for op in c.schedule) for c in dp.ranked)
    assert dp.best.step_time > plain.best.step_time
    assert dp.best.exposed_reduction > 0
    assert search(costs, 4, [8], dp=1).best.step_time == plain.best.step_time


# ---- lowering --------------------------------------------------------------------------------
@pytest.mark.mp
def test_gradient_all_reduces_run_on_one_gloo_thread() -> None:
    """The simulator's reduction channel runs a rank's all-reduces one after another. torch
    builds a gloo group of `new_group` (and `init_device_mesh`) with its default two threads
    whatever options it is given, so the mesh builds its own backend with one."""
    from pipeir.runtime.launch import free_port

    code = f"""
import torch, torch.distributed as dist
from pipeir.runtime.mesh import MeshShape, _serial_gloo
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
mine = _serial_gloo(MeshShape(1, 1), 0, 30.0)
theirs = dist.new_group([0], backend="gloo")._get_backend(torch.device("cpu"))
t = torch.ones(3)
mine.allreduce([t]).wait()
print(mine.options._threads, theirs.options._threads, t.tolist())
dist.destroy_process_group()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.split("\n")[-2] == "1 2 [1.0, 1.0, 1.0]"


def test_lowering_posts_reductions_in_the_last_round_and_waits_before_the_step() -> None:
    from pipeir.backend.instructions import OptimizerStep, ReduceGrad, WaitReduce

    s = pipeir.parse(EXAMPLES / "1f1b.sched", overrides={"ranks": 2, "microbatches": 2,
                                                         "accumulate": 2})
    low = pipeir.compile(s, "split-backward,dp-reduce{at=last},overlap").lowered
    for prog in low.programs:
        kinds = [type(i).__name__ for i in prog]
        assert kinds.count("ReduceGrad") == 1 and kinds.count("WaitReduce") == 1
        post = next(k for k, i in enumerate(prog) if isinstance(i, ReduceGrad))
        last_w = max(k for k, i in enumerate(prog) if i.mnemonic == "backward-weight")
        assert post == last_w + 1  # right after the final round's last W, not in round 0
        assert isinstance(prog[-1], OptimizerStep)
        wait = next(k for k, i in enumerate(prog) if isinstance(i, WaitReduce))
        assert [i.mnemonic for i in prog[wait + 1:-1]] in ([], ["wait-sends"])  # (overlap's)


# ---- runtime -----------------------------------------------------------------------------------
MLP = "pipeir.models.mlp:small"


@pytest.mark.mp
def test_pp2_x_dp2_trains_like_single_process_on_the_global_batch(tmp_path: Path) -> None:
    """... and saves a complete checkpoint (replica 0 writes it: its barrier once waited for
    replicas that never came, and `run --dp --save` always failed with a half-written one)."""
    import torch

    from pipeir.backend.codegen import rank_source
    from pipeir.models import resolve
    from pipeir.runtime.launch import launch
    from pipeir.runtime.reference import train_reference
    from pipeir.runtime.worker import Job

    def job(s: Schedule, passes: str, steps: int = 2, model: str = MLP,
            save: str | None = None) -> Job:
        low = pipeir.compile(s, passes).lowered
        return Job(low, tuple(rank_source(low, r) for r in range(low.ranks)), model, steps,
                   collect=True, dp=2, save=save, save_every=1 if save else 0)

    one = pipeir.library.get("1f1b", 2, 4)
    inter = pipeir.library.get("interleaved-1f1b", 2, 4, v=2)
    split = pipeir.parse(EXAMPLES / "defer-w.sched", overrides={"ranks": 2, "microbatches": 4})
    acc = pipeir.parse(EXAMPLES / "1f1b.sched", overrides={"ranks": 2, "microbatches": 2,
                                                           "accumulate": 2})
    saved = tmp_path / "ck"
    jobs = [job(one, "dp-reduce", save=str(saved)), job(one, "dp-reduce,overlap"),
            job(inter, "dp-reduce"), job(inter, "dp-reduce,overlap{max_posted=1}"),
            job(split, "dp-reduce"), job(split, "dp-reduce,overlap"),
            job(one, "split-backward,dp-reduce{at=end},overlap"),
            job(acc, "dp-reduce,overlap"),
            # dict batches, Adam with clipping by the global norm (of each replica's pipeline)
            job(one, "dp-reduce,overlap", model=f"{ZOO}:structured_adam"),
            # tied embedding/head across ranks, AdamW, clipping
            job(inter, "dp-reduce", model=f"{EXAMPLES / 'gpt.py'}:tiny")]
    result = launch(jobs, 4, timeout_s=60.0)
    for j, jb in enumerate(jobs):
        low = jb.lowered
        want, want_grads = train_reference(resolve(jb.model), low.stages, low.microbatches * 2,
                                           low.accumulate, jb.steps)
        what = f"job {j} {low.name} overlap={low.overlap}"
        assert sorted(result.by_rank[j]) == [0, 1, 2, 3]
        for rank, (params, grads) in result.by_rank[j].items():  # every replica
            for s in params:
                for mine, ref in ((params[s], want[s]), (grads[s], want_grads[s])):
                    assert sorted(mine) == sorted(ref), what
                    for k, r in ref.items():
                        # atol: rtol of the tensor's largest value (the all-reduce sums in
                        # another order than one process, which is large relative to the
                        # elements near zero), as tests/test_runtime.py compares
                        scale = float(r.abs().max()) if r.numel() else 0.0
                        torch.testing.assert_close(
                            torch.from_numpy(mine[k]), r, rtol=1e-5, atol=max(1e-8, 1e-5 * scale),
                            msg=lambda m, w=f"{what} rank {rank} stage {s} {k}": f"{w}: {m}")
        assert result.steps[(j, 0)].loss is not None
    assert sorted(p.name for p in saved.iterdir()) == ["latest", "step-1", "step-2"]  # keep 2
    assert sorted(p.name for p in (saved / "step-2").iterdir()) == [
        "manifest.json", "stage-0.pt", "stage-1.pt"]


DYING_MODEL = '''
import os, signal
import torch.distributed as dist
from torch import nn
from pipeir.models import ModelSpec
from pipeir.models.mlp import small as mlp

class Bomb(nn.Module):
    """Global rank 3 (pp 1, dp 1) dies on its third forward."""
    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0
    def forward(self, x):
        self.calls += 1
        if self.calls == 3 and dist.get_rank() == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner(x)

def spec():
    base = mlp()
    def stage(s, n):
        m = base.stage(s, n)
        return Bomb(m) if s == 1 else m
    return ModelSpec(stage=stage, loss=base.loss, batch=base.batch)
'''


def test_bad_dp_input_is_one_clear_message(cli) -> None:
    code, _, err = cli("run", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2",
                       "--model", MLP, "--dp", "3")
    assert code == 2
    assert ("a batch of 64 samples does not split evenly over 3 data-parallel replicas of 2 "
            "micro-batches (microbatches x accumulate); use a batch that is a multiple of 6") in err
    code, _, err = cli("run", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2",
                       "--dp", "2", "--nproc", "2")
    assert code == 2 and err.strip().endswith("; use --nproc 4 or --set ranks=1")  # 1 x 2
    code, _, err = cli("run", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2",
                       "--dp", "2", "--nproc", "3")
    assert code == 2 and err.strip().endswith("; use --nproc 4")  # no ranks give 3 = P x 2


def test_a_world_past_32_bit_ranks_is_refused_before_anything_is_written(cli, tmp_path: Path
                                                                         ) -> None:
    out = tmp_path / "gen"
    code, _, err = cli("compile", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "4",
                       "--dp", str(2**29), "-o", out)
    assert code == 2 and not out.exists()
    assert err == (f"error: --dp {2**29}: 4 ranks x 536,870,912 replicas is 2,147,483,648 "
                   "processes; torch.distributed numbers them with 32-bit integers (at most "
                   "2,147,483,647)\n")
    code, _, err = cli("compile", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "4",
                       "--dp", str(2**29 - 1), "-o", out)
    assert code == 0, err


@pytest.mark.mp
def test_a_lost_rank_names_its_groups_and_stops_every_rank(cli, tmp_path: Path) -> None:
    """Replica 1's pipeline rank 1 (global rank 3) is killed mid-step: one message naming it,
    its pipeline and data-parallel groups, every process stopped, exit 1."""
    model = tmp_path / "bomb.py"
    model.write_text(DYING_MODEL)
    code, _, err = cli("run", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2",
                       "--model", f"{model}:spec", "--steps", "5", "--timeout", "5",
                       "--dp", "2")
    assert code == 1
    assert "rank 3 (pp 1, dp 1) died (killed by signal 9) at instruction" in err
    assert "pipeline group ranks 1, 3; data-parallel group ranks 2, 3" in err
    assert "stopped all 4 ranks" in err and "Traceback" not in err


def _torchrun(gen: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *extra, str(gen / "main.py"),
            "--steps", "2", "--model", MLP, "--timeout", "30"]


@pytest.mark.mp
def test_two_torchrun_nodes_on_localhost_train_pp2_x_dp2(tmp_path: Path) -> None:
    """`compile -o DIR` output launched unchanged as two torchrun "nodes" of two processes
    (c10d rendezvous on 127.0.0.1), and a world that is not P x D under plain env://."""
    from pipeir.cli import main
    from pipeir.runtime.launch import free_port

    gen = tmp_path / "gen"
    assert main(["compile", "--schedule", "interleaved-1f1b", "--ranks", "2",
                 "--microbatches", "4", "--v", "2", "--dp", "2", "--overlap",
                 "-o", str(gen)]) == 0
    assert "reduce_grad" in (gen / "rank0.py").read_text()
    port = free_port()
    node = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "pipeir-dp-test"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(_torchrun(gen, port, *node), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    text = "".join(outs)
    for g, (pp, dp) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        assert f"rank {g}/4 = pp {pp} of 2, dp {dp} of 2" in text
    assert "step 2/2  loss " in text

    # plain env://, 3 processes for a 2-rank pipeline: every one says why and exits non-zero
    port = free_port()
    bad = []
    for r in range(3):
        e = {**env, "RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        bad.append(subprocess.Popen([sys.executable, str(gen / "main.py"), "--dp", "2"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=e))
    for r, p in enumerate(bad):
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2
        assert f"main.py: rank {r}: world size 3 is not P x D = 2 x 2 = 4" in err


def test_torch_csv_carries_reduce_grad(cli, tmp_path: Path) -> None:
    s = _opt(pipeir.library.get("zb-v", 2, 4), "dp-reduce{at=end}")
    sched, csv = tmp_path / "s.sched", tmp_path / "s.csv"
    sched.write_text(pipeir.print_schedule(s))
    assert cli("export-torch", sched, "-o", csv)[0] == 0
    rows = csv.read_text().splitlines()
    assert rows[0].rstrip(",").endswith("0W3,3REDUCE_GRAD,0REDUCE_GRAD")
    code, printed, _ = cli("import-torch", csv)
    assert code == 0 and pipeir.parse(printed).programs == s.programs


@pytest.mark.mp
def test_replicas_of_a_program_without_reductions_are_refused(tmp_path: Path) -> None:
    """A program compiled without --dp, started on P x 2 processes, used to train two
    replicas apart without a word (each on its shard, never all-reduced). main.py refuses it
    before the process group starts; `Job` refuses it for the Python API."""
    from pipeir.cli import main
    from pipeir.runtime.worker import Job

    gen = tmp_path / "gen"
    assert main(["compile", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "4",
                 "-o", str(gen)]) == 0
    e = {**os.environ, "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # no process group is started
    p = subprocess.run([sys.executable, str(gen / "main.py")], capture_output=True, text=True,
                       env=e, timeout=120)
    assert p.returncode == 2
    assert p.stderr == ("main.py: rank 1: 2 data-parallel replicas, but the program never "
                        "all-reduces the gradients of any stage (no `reduce-grad`): the "
                        "replicas would train apart; lower a schedule with R ops (`pipeirc "
                        "compile --dp 2` adds them with dp-reduce), or run 2 processes\n")
    half = pipeir.compile(pipeir.library.get("1f1b", 2, 4), "dp-reduce").lowered
    progs = (tuple(i for i in half.programs[0] if type(i).__name__ != "ReduceGrad"),
             half.programs[1])
    with pytest.raises(ValueError, match=r"never all-reduces the gradients of stage 0 "):
        Job(replace(half, programs=progs), ("", ""), "mlp", 1, dp=3)
    Job(half, ("", ""), "mlp", 1, dp=3)


@pytest.mark.mp
@pytest.mark.parametrize(("env", "args", "message"), [
    ({"RANK": "0", "WORLD_SIZE": "0"}, [], "RANK=0 is not a rank of a world of WORLD_SIZE=0"),
    ({"RANK": "abc", "WORLD_SIZE": "2"}, [], "RANK='abc' and WORLD_SIZE='2' must be integers"),
    ({"RANK": "5", "WORLD_SIZE": "4"}, [], "RANK=5 is not a rank of a world of WORLD_SIZE=4"),
    ({"RANK": "0", "WORLD_SIZE": "4"}, ["--timeout", "nan"],
     "argument --timeout: expected a positive number, got nan"),
    ({"RANK": "0", "WORLD_SIZE": "4"}, ["--steps", "0"],
     "argument --steps: expected a positive integer, got 0"),
])
def test_main_py_refuses_a_bad_environment_before_any_rendezvous(
        tmp_path: Path, env: dict[str, str], args: list[str], message: str) -> None:
    """A rank outside the world waited out the rendezvous, then died in torch's C++; a
    non-integer RANK or WORLD_SIZE=0 was a Python traceback. One line and exit 2 now."""
    from pipeir.cli import main

    gen = tmp_path / "gen"
    assert main(["compile", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2",
                 "--dp", "2", "-o", str(gen)]) == 0
    e = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", **env}
    p = subprocess.run([sys.executable, str(gen / "main.py"), *args], capture_output=True,
                       text=True, env=e, timeout=60)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr
    if env["WORLD_SIZE"] == "0":  # once: an unreadable lowered.json is one line too
        (gen / "lowered.json").write_text('{"format":')
        p = subprocess.run([sys.executable, str(gen / "main.py")], capture_output=True,
                           text=True, env={**e, "RANK": "0", "WORLD_SIZE": "2"}, timeout=60)
        assert p.returncode == 2 and "lowered.json:1:11: error: malformed" in p.stderr


def test_compile_takes_its_replicas_from_the_costs_dp(cli, tmp_path: Path) -> None:
    """`dp = 2` in the costs (or --set dp=2) built one replica without reductions, without a
    word; compile now reads it as tune does, and --dp still decides when given."""
    code, out, err = cli("compile", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2",
                         "--set", "dp=2", "-o", tmp_path / "a")
    assert code == 0, err
    assert "torchrun --nproc-per-node 4 " in out and "(pipeline x 2 data-parallel replicas)" in out
    assert '["reduce-grad", ' in (tmp_path / "a" / "lowered.json").read_text()
    code, out, err = cli("compile", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2",
                         "--set", "dp=2", "--dp", "1", "-o", tmp_path / "b")
    assert code == 0 and "torchrun --nproc-per-node 2 " in out, err
    assert '["reduce-grad", ' not in (tmp_path / "b" / "lowered.json").read_text()
