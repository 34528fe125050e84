"""The runtime trains for real: pipelined parameters equal single-process training.

Multi-process tests are few and batched: one group of processes runs many compiled schedules
one after another (`launch` takes a list of jobs), with explicit timeouts.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_helpers import EXAMPLES, MLP, TIMEOUT, assert_matches_reference, lib, runtime_job

import pipeir
from pipeir.backend.codegen import rank_source
from pipeir.models import resolve
from pipeir.runtime.launch import free_port, launch
from pipeir.runtime.worker import Job
from pipeir.schedule import Schedule
from pipeir.testing import configs, schedules


def _example(name: str, **overrides: int) -> Schedule:
    return pipeir.parse(EXAMPLES / name, overrides=overrides)


PAIRED_1F1B = (Path(__file__).parent.parent / "examples" / "paired-1f1b.sched").read_text()


@pytest.mark.mp
@pytest.mark.smoke
def test_smoke_two_ranks_train_like_single_process() -> None:
    """The default run's check of the runtime: two gloo ranks train 1F1B with overlapped
    communication exactly as one process does (the marked suite runs every kind)."""
    jobs = [runtime_job(lib("1f1b", 2, 4), "overlap", 2)]
    result = launch(jobs, 2, timeout_s=TIMEOUT)
    assert_matches_reference(jobs, result)


@pytest.mark.mp
def test_two_ranks_every_schedule_kind_matches_single_process() -> None:
    jobs = [
        runtime_job(lib("gpipe", 2, 4), None, 1),
        runtime_job(lib("1f1b", 2, 4), None, 1),
        runtime_job(lib("gpipe", 2, 4), None, 3),
        runtime_job(lib("1f1b", 2, 4), None, 3),
        runtime_job(lib("1f1b", 2, 4), "overlap", 3),
        runtime_job(lib("interleaved-1f1b", 2, 4, v=2), None, 3),
        runtime_job(lib("interleaved-1f1b", 2, 4, v=2), "overlap{max_posted=1}", 3),
        runtime_job(_example("defer-w.sched", ranks=2, microbatches=4), None, 3),  # split I/W
        runtime_job(_example("defer-w.sched", ranks=2, microbatches=4, lag=2), "overlap", 3),
        runtime_job(lib("1f1b", 2, 4), "split-backward", 2),  # I/W from the pass
        runtime_job(lib("interleaved-1f1b", 2, 4, v=2), "split-backward{mode=h2},overlap", 2),
        runtime_job(_example("1f1b.sched", ranks=2, microbatches=4, accumulate=2), None, 2),
        runtime_job(_example("1f1b.sched", ranks=2, microbatches=2, accumulate=2), "overlap", 2),
        runtime_job(_example("vshape.sched", ranks=2, microbatches=2), None, 2),  # local hand-offs
        # uneven micro-batches (16 samples in 3) through a transformer: per-mb shape plans
        runtime_job(lib("1f1b", 2, 3), "overlap", 2, model="transformer"),
        # overlapped pairs, alone and with V placement (local hand-offs) and split I/W
        runtime_job(pipeir.parse(PAIRED_1F1B), None, 2),
        runtime_job(pipeir.parse(PAIRED_1F1B), "overlap{max_posted=1}", 2),
        runtime_job(lib("dualpipe-v", 2, 4), None, 2),
        runtime_job(lib("dualpipe-v", 2, 4), "overlap", 2, model="transformer"),
        runtime_job(lib("zb-v", 2, 4), None, 2),
    ]
    paired = [i for p in jobs[-5].lowered.programs for i in p if i.paired]
    assert paired, "the paired schedule lowers with back-to-back pairs"
    result = launch(jobs, 2, timeout_s=TIMEOUT)
    assert_matches_reference(jobs, result)
    losses = [result.steps[(0, 0)].loss]
    assert losses[0] is not None and losses[0] > 0


@pytest.mark.mp
def test_four_ranks_match_single_process() -> None:
    jobs = [
        runtime_job(lib("1f1b", 4, 8), "overlap", 2),
        runtime_job(lib("interleaved-1f1b", 4, 8, v=2), None, 2),
        runtime_job(_example("defer-w.sched", ranks=4, microbatches=4), "overlap{max_posted=2}", 2),
    ]
    result = launch(jobs, 4, timeout_s=TIMEOUT)
    assert_matches_reference(jobs, result)


ZOO = Path(__file__).parent / "zoo.py"
STRUCTURED = f"{ZOO}:structured"  # nested hand-offs, parameterless and partly frozen stages
ADAM = f"{ZOO}:structured_adam"  # Adam + StepLR + clipping by the global norm
GPT = f"{EXAMPLES / 'gpt.py'}:tiny"  # tied embedding/head, AdamW + cosine + clipping
GPT_BF16 = f"{EXAMPLES / 'gpt.py'}:tiny_bf16"
FP16 = f"{ZOO}:structured_fp16"  # fp16 loss scaling: the first two steps overflow and skip
CONVERTED = f"{ZOO}:converted"  # stages built with .to(...) / .double(): traced for real


@pytest.mark.mp
def test_real_models_two_ranks_match_single_process() -> None:
    """Structured activations, any stage, the training loop, tied weights and bf16 across
    1F1B, interleaved, zb-h1 (split I/W) and dualpipe-v (V placement: local hand-offs, and
    the gpt's tied embedding and head on one rank), with and without overlap."""
    jobs = [
        runtime_job(lib("1f1b", 2, 4), None, 3, STRUCTURED),
        runtime_job(lib("1f1b", 2, 3), "overlap", 3, STRUCTURED),  # uneven micro-batches
        runtime_job(lib("interleaved-1f1b", 2, 4, v=2), None, 2, STRUCTURED),
        runtime_job(lib("interleaved-1f1b", 2, 4, v=2), "overlap", 2, STRUCTURED),
        runtime_job(lib("zb-h1", 2, 4), None, 2, STRUCTURED),
        runtime_job(lib("zb-h1", 2, 4), "overlap", 2, STRUCTURED),
        runtime_job(lib("dualpipe-v", 2, 4), None, 2, STRUCTURED),
        runtime_job(lib("dualpipe-v", 2, 4), "overlap", 2, STRUCTURED),
        runtime_job(lib("1f1b", 2, 4), None, 3, ADAM),
        runtime_job(lib("zb-v", 2, 4), "overlap", 3, ADAM),
        runtime_job(lib("1f1b", 2, 4), "overlap", 3, GPT),
        runtime_job(lib("interleaved-1f1b", 2, 4, v=2), None, 2, GPT),
        runtime_job(lib("zb-h1", 2, 4), "overlap", 2, GPT),
        runtime_job(lib("dualpipe-v", 2, 4), None, 2, GPT),
        runtime_job(lib("1f1b", 2, 4), None, 2, GPT_BF16),
        runtime_job(lib("dualpipe-v", 2, 4), "overlap", 2, GPT_BF16),
        runtime_job(lib("zb-h1", 2, 4), "overlap", 4, FP16),
        runtime_job(lib("1f1b", 2, 4), "split-backward", 2, CONVERTED),
    ]
    result = launch(jobs, 2, timeout_s=TIMEOUT)
    assert_matches_reference(jobs, result)
    # the features are really exercised: clipping clips, the gpt counts tokens, its tied
    # copies on two ranks (interleaved) are equal, the frozen weights did not move
    adam = result.steps[(8, 2)].info
    assert adam["grad_norm"] > 0.05 and adam["lr"] == pytest.approx(0.01 * 0.5**2)
    gpt = result.steps[(11, 1)].info
    assert 0 < gpt["tokens"] < 8 * 8 and gpt["samples"] == 8
    emb, head = result.params[11][0]["tok.weight"], result.params[11][3]["head.weight"]
    assert (emb == head).all()
    from pipeir.models import build_stage

    frozen = build_stage(resolve(STRUCTURED), 2, 4)
    assert torch.equal(torch.from_numpy(result.params[2][2]["frozen.weight"]),
                       frozen.get_parameter("frozen.weight").detach())
    assert "frozen.weight" not in result.grads[2][2] and "unused.weight" not in result.grads[2][2]
    assert [result.steps[(16, k)].info["skipped"] for k in range(4)] == [True, True, False, False]


@pytest.mark.mp
def test_real_models_four_ranks_and_resume_on_two(tmp_path: Path) -> None:
    """4 ranks; then a checkpoint saved by 1F1B on 4 ranks resumes as interleaved (v=2) on 2
    ranks and ends where uninterrupted single-process training ends."""
    ck = str(tmp_path / "ck")
    jobs = [
        runtime_job(lib("1f1b", 4, 4), "overlap", 2, STRUCTURED),
        runtime_job(lib("interleaved-1f1b", 4, 4, v=2), None, 2, STRUCTURED),  # 8 stages
        runtime_job(lib("zb-h1", 4, 4), "overlap", 2, GPT),
        runtime_job(lib("dualpipe-v", 4, 8), None, 2, GPT_BF16),
        runtime_job(lib("1f1b", 4, 4), "overlap", 3, FP16),
        runtime_job(lib("1f1b", 4, 4), None, 2, GPT, save=ck, save_every=1),
    ]
    result = launch(jobs, 4, timeout_s=TIMEOUT)
    assert_matches_reference(jobs[:-1], result)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["latest", "step-1",
                                                                    "step-2"]  # keep 2
    resumed = [runtime_job(lib("interleaved-1f1b", 2, 4, v=2), "overlap", 4, GPT, resume=ck),
               runtime_job(lib("zb-v", 2, 4), None, 3, GPT, resume=ck)]
    after = launch(resumed, 2, timeout_s=TIMEOUT)
    assert sorted(s for j, s in after.steps if j == 0) == [2, 3]  # steps 1, 2 were loaded
    assert_matches_reference(resumed, after)


class _Tied(torch.nn.Module):
    """The same Linear twice: one parameter reached from two places in the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x))) + x


def _watch(root: torch.autograd.graph.Node) -> tuple[list[object], list[object]]:
    """Prehooks on every node under `root`: the list of nodes that run (appended to as they
    run), and the hook handles."""
    ran: list[object] = []
    handles = []
    todo, seen = [root], {root}
    while todo:
        node = todo.pop()
        handles.append(node.register_prehook(lambda g, n=node: ran.append(n)))
        for fn, _ in node.next_functions:
            if fn is not None and fn not in seen:
                seen.add(fn)
                todo.append(fn)
    return ran, handles


@pytest.mark.parametrize("model", ["mlp", "transformer", "tied"])
@pytest.mark.parametrize("stage", [1, 3])
def test_split_backward_equals_full_backward_and_w_skips_the_input_path(
        model: str, stage: int) -> None:
    from pipeir.models import build_stage
    from pipeir.runtime import splitgrad

    torch.manual_seed(0)
    if model == "tied":
        mod: torch.nn.Module = _Tied()
        x0 = torch.randn(4, 8)
    else:
        spec = resolve(MLP if model == "mlp" else model)
        mod = build_stage(spec, stage, 4)
        x0 = spec.batch(0)[0][:4]
        with torch.no_grad():
            for s in range(stage):
                x0 = build_stage(spec, s, 4)(x0)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        x = x0.detach().requires_grad_()
        return x, mod(x).square().mean()  # a scalar, like the last stage's loss

    x, out = run()
    out.backward()
    want = {k: p.grad.clone() for k, p in mod.named_parameters()}
    mod.zero_grad(set_to_none=True)
    x2, out2 = run()
    ran, handles = _watch(out2.grad_fn)
    gx, work = splitgrad.backward_input(out2, None, x2)
    torch.testing.assert_close(gx, x.grad)
    assert all(p.grad is None for p in mod.parameters())  # I leaves the weights alone
    in_i = set(ran)
    ran.clear()
    needs = set(splitgrad.weight_nodes(work) or ())  # what the memory release keeps for W
    splitgrad.backward_weight(work)
    for h in handles:
        h.remove()
    # exactly what W ran, by torch's engine (the parameters' AccumulateGrad nodes, which
    # autograd.grad reads without running, besides)
    assert set(ran) <= needs
    assert {n.name() for n in needs - set(ran)} <= {"torch::autograd::AccumulateGrad"}
    for k, p in mod.named_parameters():
        torch.testing.assert_close(p.grad, want[k], msg=k)
    assert ran
    if model != "tied":  # (tied weights recompute the path between the two uses)
        # W reruns a node that I ran only to take its side branch to the weights: none of
        # the activation-gradient path (residual adds, activations, the loss) runs twice.
        again = [n for n in ran if n in in_i]
        assert all(any(fn is not None and fn not in in_i for fn, _ in n.next_functions)
                   for n in again), [n.name() for n in again]


@st.composite
def _same_rank_schedules(draw: st.DrawFn) -> list[Schedule]:
    p = draw(st.integers(2, 3))
    cfg = configs(min_ranks=p, max_ranks=p, max_microbatches=4, max_chunks=2,
                  placements=("loop", "vshape", "random"))
    return draw(st.lists(schedules(cfg), min_size=3, max_size=3))


@pytest.mark.mp
@settings(max_examples=2, deadline=None)
@given(_same_rank_schedules(), st.lists(st.booleans(), min_size=3, max_size=3))
def test_random_schedules_train_like_single_process(group: list[Schedule],
                                                    overlap: list[bool]) -> None:
    jobs = [runtime_job(s, "overlap" if o else None, 2) for s, o in zip(group, overlap)]
    result = launch(jobs, group[0].config.ranks, timeout_s=TIMEOUT)
    assert_matches_reference(jobs, result)


# ---- `pipeirc run` -----------------------------------------------------------------------------

@pytest.mark.mp
def test_run_trains_and_reports_bubble_and_trace(cli, tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    code, out, err = cli("run", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "4",
                         "--steps", "3", "--passes", "overlap", "--trace", trace)
    assert code == 0, err
    losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0]  # it trains
    assert "rank  measured  simulated" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert len(rows) == 2 and all(r[1].endswith("%") for r in rows)
    import json

    assert "ms per transfer (overlapped communication)" in out
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"F0", "B3"} <= names  # measured ops, named like `simulate --trace`
    assert {e["ph"] for e in events} >= {"X", "M", "s", "f"}
    steps = [e["args"]["step"] for e in events if e["ph"] == "X" and e["name"] == "F0"]
    assert sorted(steps) == [1, 1, 2, 2, 3, 3]  # every step, on both ranks' stage
    flows = [e["id"] for e in events if e["ph"] == "s"]
    assert len(flows) == len(set(flows)) == 3 * 8  # 4 activations, 4 gradients a step
    starts = sorted(e["ts"] for e in events if e["ph"] == "X" and e["name"] == "F0")
    assert starts[0] >= 0 and starts[-1] > starts[0]  # one time line for all steps


@pytest.mark.mp
def test_run_progress_is_one_line_on_a_terminal(cli, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    code, out, err = cli("run", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2",
                         "--steps", "3", "--model", MLP, "--device", "cpu")
    assert code == 0, err
    lines = out.split("\n")
    progress = lines[1]  # after the "training ..." line: each step rewrites it in place
    assert progress.count("\r") == 3 and progress.endswith("\x1b[K")
    assert [p.split()[1] for p in progress.split("\r")[1:]] == ["1/3", "2/3", "3/3"]
    assert lines[2] == "" and lines[3].startswith("median step time")
    assert " step(s) on CPU (gloo); simulated " in lines[3]  # where the ranks ran


@pytest.mark.parametrize(("args", "message"), [
    (("--model", "nosuchmodel"), "--model 'nosuchmodel': cannot import nosuchmodel"),
    (("--model", "missing.py"), "no such file missing.py"),
    (("--model", "pipeir.models.mlp:nope"), "has no function 'nope'"),
    (("--nproc", "3"), "--nproc 3: the schedule runs on 2 ranks"),
    (("--steps", "0"), "--steps must be at least 1"),
    (("--microbatches", "257"),
     "--model mlp: a batch of 256 samples cannot be split into 257 micro-batches"),
    (("--passes", "overlap{max_posted=-1}"), "max_posted must be a non-negative integer"),
    (("--trace", "/nonexistent/dir/t.json"), "directory /nonexistent/dir does not exist"),
    (("--model", f"{ZOO}:broken_stage"),
     "broken_stage: building stage 1 failed: ValueError: no such layer"),
    (("--model", f"{ZOO}:tied_twice"),
     "stage 0 parameter 'weight' is twice in tied group 0; list each parameter once"),
    (("--model", f"{ZOO}:tied_overlapping"),
     "stage 1 parameter 'weight' is in tied group 0 and tied group 1; list each parameter once"),
    (("--model", f"{ZOO}:tied_none"), "tied(2) must give groups of (stage, parameter name) "
                                      "pairs: TypeError: 'NoneType' object is not iterable"),
    (("--model", f"{ZOO}:eighteen_samples", "--dp", "2"),
     "a batch of 18 samples does not split evenly over 2 data-parallel replicas of 2 "
     "micro-batches (microbatches x accumulate); use a batch that is a multiple of 4"),
    (("--model", f"{ZOO}:two_lists", "--dp", "2"),
     "the batch gives 2 micro-batches; with 2 data-parallel replicas it must give 4"),
    (("--trace", "same.json", "--metrics", "same.json"),
     "--trace and --metrics both name same.json"),
    (("--tolerance", "0.5"), "--tolerance goes with --check"),
    (("--save", "ck", "--save-every", "-1"),
     "--save-every must be 0 (save after the last step only) or more"),
])
def test_run_rejects_bad_input(cli, args: tuple[str, ...], message: str, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    mbs = () if "--microbatches" in args else ("--microbatches", "2")  # (each given once)
    code, _, err = cli("run", "--schedule", "1f1b", "--ranks", "2", *mbs, *args)
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing written


FAILING_MODEL = '''
import os, signal, time
import torch
from torch import nn
from pipeir.models import ModelSpec
from pipeir.models.mlp import small as mlp

class Bomb(nn.Module):
    """Stage 1 fails on its third forward (step 2, micro-batch 0)."""
    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0
    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            {action}
        return self.inner(x)

def spec():
    base = mlp()
    def stage(s, n):
        m = base.stage(s, n)
        return Bomb(m) if s == 1 else m
    return ModelSpec(stage=stage, loss=base.loss, batch=base.batch)
'''


@pytest.mark.mp
@pytest.mark.parametrize(("action", "expected"), [
    ("raise RuntimeError('shape mismatch in my layer')",
     "rank 1 failed at instruction #3 `forward stage=1 mb=0` (F(1,0), "),
    ("os.kill(os.getpid(), signal.SIGKILL)",
     "rank 1 died (killed by signal 9) at instruction #3 `forward stage=1 mb=0` (F(1,0), "),
    # a hang: rank 0's send times out after --timeout; the headline names rank 1, not rank 0
    ("time.sleep(60)",
     "error: rank 1 hung at instruction #3 `forward stage=1 mb=0` (F(1,0), "),
])
def test_a_failing_rank_stops_every_rank_with_one_clear_message(
        cli, tmp_path: Path, action: str, expected: str) -> None:
    model = tmp_path / "bomb.py"
    model.write_text(FAILING_MODEL.replace("{action}", action))
    code, out, err = cli("run", EXAMPLES / "1f1b.sched", "--set", "ranks=2", "--set",
                         "microbatches=2", "--model", f"{model}:spec", "--steps", "5",
                         "--timeout", "3")
    assert code == 1
    assert expected in err
    assert "1f1b.sched:13" in err  # the .sched line of F(1,0)
    assert "stopped all 2 ranks" in err
    assert "Traceback" not in err
    assert "step    2/5" not in out
    if "SIGKILL" not in action:  # a killed rank may take its last, unflushed step report along
        assert "step    1/5" in out


@pytest.mark.mp
def test_generated_program_runs_under_torchrun(tmp_path: Path) -> None:
    import subprocess
    import sys

    from pipeir.cli import main

    assert main(["compile", str(EXAMPLES / "1f1b.sched"), "--set", "ranks=2", "--set",
                 "microbatches=2", "--overlap", "-o", str(tmp_path / "gen")]) == 0
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(tmp_path / "gen" / "main.py"),
         "--steps", "2", "--model", "transformer"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step 2/2  loss " in proc.stdout


@pytest.mark.mp
def test_generated_program_with_a_bad_model_says_so_once(tmp_path: Path) -> None:
    """A bad --model under torchrun: one error line (global rank 0's), not one per rank, and
    no traceback from pipeir (torchrun's own report of the exit codes follows it)."""
    import subprocess
    import sys

    from pipeir.cli import main

    assert main(["compile", str(EXAMPLES / "1f1b.sched"), "--set", "ranks=2", "--set",
                 "microbatches=2", "-o", str(tmp_path / "gen")]) == 0
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(tmp_path / "gen" / "main.py"),
         "--steps", "1", "--model", "no_such_module"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    # rank 0's line, and again at the end of torchrun's report (its root cause)
    assert proc.stderr.count("--model 'no_such_module'") == 2, proc.stderr
    assert "main.py: error: --model 'no_such_module': cannot import" in proc.stderr
    assert [ln for ln in proc.stderr.splitlines() if ln.strip("=")][-1].startswith(
        "  traceback : main.py: error: --model 'no_such_module': cannot import")
    assert "pipeir/runtime" not in proc.stderr  # no frame of ours


@pytest.mark.mp
def test_generated_program_runs_only_what_check_lowered_verified(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`check --lowered` proves lowered.json and the rank files interpret its table: main.py
    refuses, before any process group, a lowered.json that check refuses (with check's own
    line and exit code) and a rank file edited apart from it."""
    import json

    from pipeir.cli import main
    from pipeir.runtime.torchrun import main as torchrun_main

    gen = tmp_path / "gen"
    assert main(["compile", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2",
                 "--blocking", "-o", str(gen)]) == 0
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    rank1 = gen / "rank1.py"
    rank1.write_text(rank1.read_text() + "# edited\n")
    capsys.readouterr()
    assert torchrun_main(gen, ["--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"main.py: error: {rank1}: not what lowered.json lowers "
                          "to (one of them was edited after `pipeirc compile`)"), err

    assert main(["compile", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2",
                 "--blocking", "-o", str(gen)]) == 0
    lowered = json.loads((gen / "lowered.json").read_text())
    table = lowered["programs"][1]["table"]
    lowered["programs"][1]["table"] = [row for row in table if row[0] != "zero-grad"]
    (gen / "lowered.json").write_text(json.dumps(lowered))
    capsys.readouterr()
    assert main(["check", "--lowered", str(gen / "lowered.json")]) == 1
    want = capsys.readouterr().err.splitlines()[0]
    assert "rank 1's program has no `zero-grad`" in want
    assert torchrun_main(gen, ["--steps", "1"]) == 1
    assert capsys.readouterr().err.splitlines()[0] == f"main.py: {want}"


@pytest.mark.parametrize(("text", "message"), [
    ("[" * 100_000, "malformed lowered-program JSON file: nested too deeply"),
    ('{"format": "pipeir-lowered", "version": 2, "version": 2}',
     "field 'version' is given twice in one object (JSON would keep the last without a word)"),
    ('{"format": "pipeir-lowered", "version": 2, "name": "x", "ranks": "2"}',
     'missing field "stages"'),
], ids=["deep", "duplicate-key", "missing-field"])
def test_generated_program_reads_lowered_json_as_check_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        text: str, message: str) -> None:
    """main.py refuses a lowered.json `check --lowered` refuses, with the same one line: it
    read the file with `json.loads`, so a deep one was a RecursionError traceback and a key
    given twice ran the last one's value."""
    from pipeir.cli import main
    from pipeir.runtime.torchrun import main as torchrun_main

    gen = tmp_path / "gen"
    assert main(["compile", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2",
                 "--blocking", "-o", str(gen)]) == 0
    (gen / "lowered.json").write_text(text)
    capsys.readouterr()
    assert main(["check", "--lowered", str(gen / "lowered.json")]) == 2
    checked = capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert torchrun_main(gen, ["--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"main.py: {checked.splitlines()[0]}"), (err, checked)
    assert message in err and "Traceback" not in err, err


def test_generated_program_refuses_a_lowered_json_that_would_deadlock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The rank files interpret lowered.json's table, so an edit of a tag or a peer leaves them
    as they were: main.py ran a program `check --lowered` refuses and hung in gloo until the
    timeout. It proves lowered.json first and reports the finding as check does."""
    import json

    from pipeir.cli import main
    from pipeir.runtime.torchrun import main as torchrun_main

    gen = tmp_path / "gen"
    assert main(["compile", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2",
                 "--blocking", "-o", str(gen)]) == 0
    lowered = json.loads((gen / "lowered.json").read_text())
    send = next(row for row in lowered["programs"][0]["table"] if row[0] == "send")
    tag = lowered["columns"]["send"].index("tag") + 2  # (after the mnemonic and the origin)
    send[tag] += 5
    (gen / "lowered.json").write_text(json.dumps(lowered))
    capsys.readouterr()
    assert main(["check", "--lowered", str(gen / "lowered.json")]) == 1
    checked = capsys.readouterr().err.splitlines()[0]
    assert f"but rank 0 sends it with tag {send[tag]}" in checked, checked
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert torchrun_main(gen, ["--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"main.py: {checked}\n"), (err, checked)
    assert "rank 0/2" not in err and "Traceback" not in err


def test_generated_program_proves_a_lowered_json_edited_under_its_recorded_digest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """compile records a digest of what it proved in lowered.json's trailer, and main.py skips
    the proof only for exactly that text: a tag edited in place (the trailer and its digest
    untouched) is proved again and refused with check's own line and exit code."""
    import json

    from pipeir.cli import main
    from pipeir.runtime.torchrun import main as torchrun_main

    gen = tmp_path / "gen"
    assert main(["compile", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2",
                 "--blocking", "-o", str(gen)]) == 0
    path = gen / "lowered.json"
    text = path.read_text()
    assert '"proved": "sha256:' in text.splitlines()[-2]
    line = next(ln for ln in text.splitlines() if ln.lstrip().startswith('["send", '))
    row = json.loads(line.strip().rstrip(","))
    tag = row[-1]  # (a send's last column)
    path.write_text(text.replace(line, line.replace(f", {tag}]", f", {tag + 7}]"), 1))
    capsys.readouterr()
    assert main(["check", "--lowered", str(path)]) == 1
    checked = capsys.readouterr().err.splitlines()[0]
    assert f"but rank 0 sends it with tag {tag + 7}" in checked, checked
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert torchrun_main(gen, ["--steps", "1"]) == 1
    assert capsys.readouterr().err.startswith(f"main.py: {checked}\n")


def test_recorded_proof_is_trusted_only_for_the_text_and_rules_it_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`prove_file` (main.py's proof) runs the rules unless the file is byte for byte what
    compile proved under the same rules; `check --lowered` always proves."""
    from pipeir.backend import commcheck
    from pipeir.backend.program_io import is_proved
    from pipeir.backend.program_read import load
    from pipeir.cli import main

    gen = tmp_path / "gen"
    assert main(["compile", "--schedule", "interleaved-1f1b", "--ranks", "2", "--v", "2",
                 "--microbatches", "4", "-o", str(gen)]) == 0
    lowered, source = load(str(gen / "lowered.json"))
    rules = commcheck.rules_id()
    assert is_proved(source.text, rules)
    assert not is_proved(source.text, rules + " (other rules)")
    assert not is_proved(source.text.replace('"grad", ', '"act", ', 1), rules)
    assert not is_proved(source.text.replace('"name": "', '"name": "x', 1), rules)
    proved: list[int] = []
    monkeypatch.setattr(commcheck, "check_comm",
                        lambda low, loc=None: proved.append(len(low.programs)))
    commcheck.prove_file(lowered, source)
    assert proved == []  # unedited: the recorded proof stands
    edited = type(source)(source.name, source.text.replace("\n", "\n ", 3))  # layout only
    commcheck.prove_file(lowered, edited)
    assert proved == [2]


def test_metrics_file_is_opened_at_the_first_step(tmp_path: Path) -> None:
    """A run that fails before its first step leaves an existing --metrics file alone."""
    from pipeir.runtime.metrics import MetricsFile

    old = tmp_path / "m.jsonl"
    old.write_text('{"old": 1}\n')
    MetricsFile(str(old)).close()
    assert old.read_text() == '{"old": 1}\n'
    new = tmp_path / "new.jsonl"
    MetricsFile(str(new)).close()
    assert not new.exists()
    log = MetricsFile(str(new))
    log.write({"step": 1})
    log.close()
    assert new.read_text() == '{"step": 1}\n'


# ---- the run report ------------------------------------------------------------------------
REPORT_PASSES = ["split-backward", "split-backward{mode=h2},overlap", "interleave", "reorder"]


@pytest.mark.mp
def test_run_report_measures_and_simulates_the_compiled_schedule() -> None:
    """For every pass combination the report is built from the schedule that ran (after its
    passes): each rank's measured busy time is the sum of its compute instructions' measured
    times, and the simulated column simulates the compiled schedule with the measured costs."""
    from pipeir.backend.instructions import (
        Backward,
        BackwardInput,
        BackwardWeight,
        Forward,
        Load,
        Loss,
    )
    from pipeir.runtime.measure import run_report
    from pipeir.sim import CostModel, simulate

    compute = (Load, Forward, Loss, Backward, BackwardInput, BackwardWeight)
    skewed = CostModel.from_settings({"lengths": [900, 10, 20, 800]})  # reorder relabels
    compiled = [pipeir.compile(lib("1f1b", 2, 4), p, costs=skewed) for p in REPORT_PASSES]
    assert compiled[3].schedule != lib("1f1b", 2, 4)  # reorder did change the schedule
    jobs = [Job(c.lowered, tuple(rank_source(c.lowered, r) for r in range(2)), MLP, 3)
            for c in compiled]
    result = launch(jobs, 2, timeout_s=TIMEOUT)
    for j, c in enumerate(compiled):
        times = {s: {r: result.times[(j, r, s)] for r in range(2)} for s in range(3)}
        rep = run_report(c.lowered, c.schedule, times,
                         {s: result.steps[(j, s)].time for s in range(3)})
        assert rep.steps == (0, 1, 2) and len(rep.measured) == 2
        for m, s in zip(rep.measured, (1, 2)):
            assert set(m.start) == set(c.schedule), REPORT_PASSES[j]  # every op measured
            for r in range(2):
                prog = c.lowered.program(r)
                want = sum(t1 - t0 for pc, t0, t1 in times[s][r]
                           if isinstance(prog[pc], compute))
                assert m.busy[r] == pytest.approx(want, rel=1e-9), (REPORT_PASSES[j], r)
        assert rep.predicted.schedule == c.schedule
        again = simulate(c.schedule, rep.predicted.costs, rep.predicted.comm)
        assert rep.predicted.makespan == again.makespan
        assert rep.predicted.comm == ("overlapped" if c.lowered.overlap else "blocking")
        kinds = {op.kind for op in c.schedule}
        assert {op.kind for op in rep.predicted.start} == kinds  # I and W where split


@pytest.mark.mp
def test_run_with_a_pass_reports_and_traces_the_ops_the_pass_made(cli, tmp_path: Path) -> None:
    """`run --passes split-backward` once built its report from the schedule before the pass
    (every I and W unknown: a measured bubble of 89% against a simulated 50%, and a KeyError
    with --trace); the trace now holds the I and W the ranks ran."""
    import json

    trace = tmp_path / "t.json"
    code, out, err = cli("run", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "4",
                         "--model", MLP, "--steps", "3", "--passes", "split-backward",
                         "--trace", trace)
    assert code == 0, err
    names = {e["name"][0] for e in json.loads(trace.read_text())["traceEvents"]
             if e["ph"] == "X"}
    assert {"F", "I", "W"} <= names and "B" not in names
    assert "\n   all" in out


# ---- `pipeirc run` with real models: --check, --metrics, checkpoints, bad input -----------------

@pytest.mark.mp
def test_run_check_and_metrics(cli, tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    code, out, err = cli("run", EXAMPLES / "1f1b.sched", "--set", "ranks=2", "--model", GPT,
                         "--steps", "3", "--check", "--metrics", metrics)
    assert code == 0, err
    assert "all stages within 1e-05 of single-process training" in out
    rows = [line.split() for line in out.split("check:")[1].splitlines()[2:4]]
    assert [r[0] for r in rows] == ["0", "1"] and all(float(x) < 1e-5 for r in rows
                                                      for x in r[1:])
    import json

    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert all(m["tokens_per_s"] > 0 and m["samples_per_s"] > 0 and m["grad_norm"] > 0
               for m in lines)
    assert "tokens/s" in out and "samples/s" in out
    # dropout: the pipelined run draws other random numbers than one process: --check says so
    code, out, err = cli("run", EXAMPLES / "1f1b.sched", "--set", "ranks=2", "--model",
                         f"{ZOO}:noisy", "--steps", "1", "--check")
    assert code == 1 and "--check: stage " in err and "differs from single-process" in err
    assert "Traceback" not in err
    # NaN gradients in the pipelined run only: NaN compares false, so this used to pass
    code, out, err = cli("run", EXAMPLES / "1f1b.sched", "--set", "ranks=2", "--model",
                         f"{ZOO}:nan_grads_when_pipelined", "--steps", "1", "--check")
    assert code == 1, out + err
    assert ("--check: stage 0 differs from single-process training by inf (a NaN or an "
            "infinity single-process training does not have, or a tensor on one side only) "
            "in '") in err
    for bad in ("nan", "inf", "-1"):
        code, _, err = cli("run", EXAMPLES / "1f1b.sched", "--check", "--tolerance", bad)
        assert code == 2 and f"--tolerance: expected a positive number, got {bad}" in err


KILLED_AT_STEP_3 = '''
import os, signal
from examples_gpt import tiny

def spec():
    base = tiny()
    def stage(s, n):
        m = base.stage(s, n)
        if s == 1:
            calls = [0]
            def hook(module, args):
                calls[0] += 1
                if calls[0] == 2 * 2 + 1:  # step 3 (2 micro-batches a step)
                    os.kill(os.getpid(), signal.SIGKILL)
            m.register_forward_pre_hook(hook)
        return m
    return type(base)(**{**base.__dict__, "stage": stage})
'''


@pytest.mark.mp
def test_save_kill_resume_elsewhere_equals_uninterrupted_and_bad_input(
        cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    (tmp_path / "examples_gpt.py").write_text((EXAMPLES / "gpt.py").read_text())
    (tmp_path / "killed.py").write_text(KILLED_AT_STEP_3)
    monkeypatch.syspath_prepend(str(tmp_path))
    ck = tmp_path / "ck"
    common = ("--set", "ranks=2", "--set", "microbatches=2", "--steps", "5")
    code, out, err = cli("run", EXAMPLES / "interleaved.sched", *common, "--model",
                         f"{tmp_path / 'killed.py'}:spec", "--save", ck, "--save-every", "1")
    assert code == 1 and "killed by signal 9" in err
    assert (ck / "latest").read_text() == "step-2"
    (ck / ".step-3.tmp").mkdir()  # a save cut short: ignored
    (ck / ".step-3.tmp" / "stage-0.pt").write_bytes(b"garbage")
    # resume with zb-v (V placement) and check against 5 uninterrupted single-process steps
    code, out, err = cli("run", "--schedule", "zb-v", "--ranks", "2", "--microbatches", "2",
                         "--steps", "5", "--model", GPT, "--resume", ck, "--save", ck, "--check")
    assert code == 0, err
    assert "step    3/5" in out and "step    2/5" not in out
    assert "all stages within 1e-05" in out
    assert (ck / "latest").read_text() == "step-5"
    # bad input: one message naming stage and parameter, exit 2, nothing overwritten
    shutil.copytree(ck, tmp_path / "other")
    before = {p: p.read_bytes() for p in (tmp_path / "other").rglob("*") if p.is_file()}
    for args, message in [
        (("--model", f"{ZOO}:structured", "--resume", tmp_path / "other"),
         "stage 0: the checkpoint has no 'lin.weight' (a checkpoint of another model?)"),
        (("--model", GPT, "--resume", tmp_path / "other", "--set", "v=1"),
         "the checkpoint has 4 stages, the schedule runs 2"),
        (("--model", GPT, "--save", tmp_path / "other"), "already holds a checkpoint (step-5)"),
        (("--model", GPT, "--resume", tmp_path / "other"),
         "the checkpoint is at step 5; --steps 5 leaves nothing to train"),
        (("--model", f"{ZOO}:mismatched"),
         "stage 1 cannot take stage 0's output (float32[4x4x6] (grad), {'mask': bool[4x4], "),
        (("--model", f"{ZOO}:bad_tied"), "tied group 0: stage 3 has no parameter 'lin.wieght'"),
    ]:
        code, out, err = cli("run", EXAMPLES / "interleaved.sched", *common, *args)
        assert code == 2 and message in err, err
        assert "Traceback" not in err
    assert before == {p: p.read_bytes() for p in (tmp_path / "other").rglob("*") if p.is_file()}


def test_profile_takes_structured_activations_and_parameterless_stages() -> None:
    from pipeir.runtime.profile import profile_stages

    times = profile_stages(resolve(STRUCTURED), 4, 2, warmup=0, iters=1)
    # 4 samples x 4 positions: hidden, skip, raw (6 float32 each) and the bool mask
    assert [t.activation_bytes for t in times] == [4 * 4 * (6 * 4 * 3 + 1)] * 3 + [0.0]
    assert times[1].W == 0.0 and times[2].W > 0 and times[1].I > 0


@pytest.mark.mp
def test_check_compares_float64_models_in_float64(cli) -> None:
    """One rank runs what one process runs, bit for bit; --check used to round both sides to
    float32 first, so a float64 model could not be checked below ~5e-8."""
    code, out, err = cli("run", "--schedule", "1f1b", "--ranks", "1", "--microbatches", "4",
                         "--model", CONVERTED, "--steps", "2", "--check", "--tolerance", "1e-13")
    assert code == 0, err
    assert "all stages within 1e-13 of single-process training" in out


@pytest.mark.mp
def test_check_with_replicas_leaves_their_own_buffers_out(cli) -> None:
    """Each replica keeps its own BatchNorm statistics (DDP without SyncBatchNorm); the
    gradients and parameters still equal one process over every replica's micro-batches, and
    the bias before each BatchNorm (zero gradient in exact arithmetic) is judged against its
    stage's scale, not its own rounding noise."""
    code, out, err = cli("run", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2",
                         "--dp", "2", "--model", f"{ZOO}:batchnorm", "--steps", "2", "--check")
    assert code == 0, err
    assert "all stages within 1e-05 of single-process training" in out


@pytest.mark.parametrize("model", ["mlp", "transformer", f"{EXAMPLES}/gpt.py:spec"])
def test_the_shape_plan_is_what_the_stages_hand_on_when_they_run(model: str) -> None:
    """The plan traced without running anything (meta, or fake tensors under gpt.py's bf16
    autocast) equals the layouts the real stages produce under autograd, and survives the
    trip to a rank (pickled, then preset: the rank traces nothing)."""
    import pickle

    from pipeir.models.spec import autocast_dtype, build_stage
    from pipeir.runtime.shapes import Layout, ShapePlan
    from pipeir.runtime.worker import split_batch

    spec = resolve(model)
    x = split_batch(spec.batch(0), 4)[0][0]
    plan = ShapePlan(spec, 4)
    traced = plan.trace(x)
    dtype = autocast_dtype(spec)
    real, h = [], x
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        for s in range(4):
            h = build_stage(spec, s, 4)(*h) if isinstance(h, tuple) else \
                build_stage(spec, s, 4)(h)
            real.append(Layout.of(h))
    assert traced == real
    rank = ShapePlan(spec, 4)
    rank.preset(pickle.loads(pickle.dumps(plan.layouts)))
    rank.plan([x])
    assert [rank.act(s, 0) for s in range(4)] == real and rank._tracer is None


def test_a_rank_imports_neither_pipelining_nor_dynamo_and_the_launcher_starts_light() -> None:
    """Start-up: the worker does not import torch.distributed.pipelining (torch._dynamo comes
    from the fork server's preload, once), and `pipeirc run` can start the fork server before
    it imports torch."""
    import subprocess
    import sys

    code = ("import sys; import pipeir.cli; a = 'torch' in sys.modules; "
            "c = 'networkx' in sys.modules or 'lark' in sys.modules; "
            "import pipeir.runtime.worker; "
            "print(a, c, 'networkx' in sys.modules, 'torch.distributed.pipelining' in "
            "sys.modules, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    # neither the command line's entry (which starts the fork server) nor a rank imports the
    # compiler (networkx, lark): `import pipeir` loads its public names on first use
    assert out == ["False", "False", "False", "False", "False"]


NCCL_EMULATION = Path(__file__).parent / "nccl_emulation.py"


def _run_emulated(groups: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`pipeirc run ARGS --check` on gloo with NCCL's launch order emulated
    (tests/nccl_emulation.py) and point-to-point through `groups`."""
    import os
    import sys

    env = {**os.environ, "PIPEIR_P2P_GROUPS": groups, "PIPEIR_P2P_PIPES": "off",
           "EMULATED_NCCL_TIMEOUT": "10"}
    return subprocess.run(
        [sys.executable, "-m", "pipeir", "run", *args, "--microbatches", "4", "--steps", "2",
         "--model", str(NCCL_EMULATION), "--check"],
        capture_output=True, text=True, timeout=240, env=env)


@pytest.mark.mp
@pytest.mark.parametrize("schedule", [
    ("--schedule", "interleaved-1f1b", "--ranks", "2", "--v", "2"),
    ("--schedule", "zb-v", "--ranks", "2", "--blocking"),
    ("--schedule", "1f1b", "--ranks", "2", "--dp", "2"),
], ids=["interleaved-overlap", "zbv-blocking", "1f1b-dp2"])
def test_a_group_per_channel_trains_under_nccls_launch_order(schedule: tuple[str, ...]
                                                             ) -> None:
    """The point-to-point path pipeir takes on NCCL (`pipeir.runtime.dist`'s NOTE: a
    two-rank group per directed channel, batches posted one transfer at a time), run on gloo
    with NCCL's one-launch-at-a-time order per communicator emulated: gradients equal
    single-process training's (`--check`)."""
    proc = _run_emulated("channel", *schedule)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "of single-process training" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.mp
def test_one_group_deadlocks_under_nccls_launch_order() -> None:
    """What the channel groups are for, and that the emulation can tell: with one group, rank
    0's early-posted receive of a gradient holds the send of the activation that gradient
    needs, and the ranks stop (one line naming the emulated deadlock, non-zero exit)."""
    proc = _run_emulated("default", "--schedule", "1f1b", "--ranks", "2", "--blocking")
    assert proc.returncode != 0
    assert "emulated NCCL" in proc.stderr and "deadlock" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_the_channels_a_job_opens_are_its_transfers_directed_in_every_replica(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`worker.channels`: every (sender, receiver) some transfer of the programs uses, counted
    from the schedule's own data edges across ranks (the oracle), per replica in global
    ranks; and the choice of groups: one per channel on CUDA, gloo's one group otherwise,
    `PIPEIR_P2P_GROUPS` overriding, a bad value a clear error."""
    from types import SimpleNamespace

    from pipeir.backend.lower import lower
    from pipeir.passes.overlap import Overlap
    from pipeir.runtime import dist as pdist
    from pipeir.runtime.meshshape import MeshShape
    from pipeir.runtime.worker import channels

    for name, p in (("interleaved-1f1b", 4), ("zb-v", 2), ("dualpipe-v", 4)):
        s = pipeir.library.get(name, p, 2 * p)
        want = {(s.rank_of(a), s.rank_of(b)) for a, b in s.data_edges()
                if s.rank_of(a) != s.rank_of(b)}
        for low in (lower(s), Overlap().run(lower(s))):
            assert channels(low, None) == want, name
            shape = MeshShape(p, 2)
            mesh = SimpleNamespace(shape=shape)
            assert channels(low, mesh) == {  # type: ignore[arg-type]
                (shape.rank(a, d), shape.rank(b, d)) for a, b in want for d in (0, 1)}
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.delenv("PIPEIR_P2P_GROUPS", raising=False)
    assert (pdist.per_channel(cpu), pdist.per_channel(cuda)) == (False, True)
    monkeypatch.setenv("PIPEIR_P2P_GROUPS", "channel")
    assert pdist.per_channel(cpu)
    monkeypatch.setenv("PIPEIR_P2P_GROUPS", "default")
    assert not pdist.per_channel(cuda)
    monkeypatch.setenv("PIPEIR_P2P_GROUPS", "chanel")
    with pytest.raises(ValueError, match="PIPEIR_P2P_GROUPS='chanel': expected auto, "
                                         "channel or default"):
        pdist.per_channel(cpu)
