"""The prepared GPU check: every CUDA path of the runtime, run once through `pipeirc` (issue 39).

    python bench/gpu_check.py              # on a machine with CUDA: about 2-4 minutes
    python bench/gpu_check.py --dry-run    # print the commands it would run, run nothing

Each check is one `pipeirc` command, run as a user runs it, so the report is what a user sees:
  runtime   1F1B on CUDA tensors with `--check` against single-process training: NCCL across
            the GPUs where there are two or more (up to 4), else one rank on the one GPU, plus
            the same run on gloo (CPU, `CUDA_VISIBLE_DEVICES=`) for comparison
  blocking  the same with `--blocking` communication (the runtime check above runs the
            default, asynchronous communication on the NCCL comm stream)
  offload   GPipe with `offload{budget=2}`: the copy stream and pinned host memory; measured
            vs simulated peak of saved activations, gradients checked
  fp16      fp16 autocast with dynamic loss scaling, `--check` against torch.amp.GradScaler
  recompute `recompute{all=true}` on a model with dropout: the replayed forward must draw the
            same CUDA random numbers, so every step's loss and gradient norm equal those of
            the same run without recompute (`--check` cannot judge dropout: its single
            process draws from the CPU generator)
  profile   `pipeirc profile` times the stages on the GPU (transfers over NCCL with two or more)
            and writes a cost file; `pipeirc run --costs` prints the measured bubble (from
            CUDA events) vs the simulated one from it

Every CUDA run asks for CUDA (`--device cuda`) and must report its steps `on CUDA (nccl)`.
Without CUDA it prints a note and exits 0 (nothing to check). Any failing check (a non-zero
exit, a traceback, a run over its time limit, a run that says it ran elsewhere) prints one
line `gpu_check: error: ...` at the end and the script exits 1: a CUDA path that misbehaves
never passes silently.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from pipeir.models import ModelSpec
from pipeir.models.spec import resolve

HERE = Path(__file__).resolve()
STEPS = 6
MICROBATCHES = 8
#: seconds one check may take; the whole script stays under 5 minutes with all of them
CHECK_TIMEOUT_S = 150
TOTAL_BUDGET_S = 290


# ---- models (resolved by `pipeirc --model bench/gpu_check.py:NAME` in every rank) -------------
def fp16_spec() -> ModelSpec:
    """The built-in MLP under fp16 autocast: GradScaler-style dynamic loss scaling."""
    spec = resolve("mlp")
    return ModelSpec(stage=spec.stage, loss=spec.loss, batch=spec.batch, autocast="fp16")


def _dropout_stage(s: int, stages: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.3), nn.Tanh())


def _dropout_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)


def dropout_spec() -> ModelSpec:
    """Dropout in every stage: a recomputed forward is right only with the first forward's
    RNG state (CUDA's, on a GPU)."""
    return ModelSpec(stage=_dropout_stage, loss=nn.functional.mse_loss, batch=_dropout_batch)


# ---- the plan ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Check:
    """One command of the check, and the environment it adds (gloo: CUDA hidden)."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    #: report lines worth quoting start with one of these (the rest goes to the log)
    keep: tuple[str, ...] = ("median step", "bubble", "peak", "check", "stage", "rank",
                             "    ", "largest", "wrote", "loss scale", "skipped")
    #: the name of an earlier check whose steps' losses and gradient norms this one's must
    #: equal (its `step` lines, as printed)
    same_steps_as: str | None = None
    #: what the output must say (a run: where its ranks ran), so that a run that quietly
    #: ran elsewhere fails
    expect: str | None = None


@dataclass(frozen=True)
class Plan:
    """What the check runs on this machine."""

    gpus: int
    backend: str  # of the CUDA runs: "nccl" (also for one rank) ...
    ranks: int  # pipeline ranks of the CUDA runs: one per GPU, at most 4
    gloo_ranks: int  # ranks of the CPU comparison run (0: none)
    checks: tuple[Check, ...]


def make_plan(gpus: int, costs: str) -> Plan:
    """The checks for a machine with `gpus` CUDA devices (`pipeirc run` puts rank r on cuda:r
    with NCCL where there is a device per rank, `pipeir.runtime.devices`; NCCL cannot put two
    ranks on one device, so ranks <= GPUs)."""
    if gpus < 1:
        raise ValueError("no CUDA device: nothing to plan")
    ranks = min(gpus, 4)
    gloo_ranks = 2 if gpus == 1 else 0
    pipe = ("--schedule", "1f1b", "--ranks", str(ranks), "--microbatches", str(MICROBATCHES),
            "--steps", str(STEPS), "--timeout", "60")
    gpipe = ("--schedule", "gpipe", "--ranks", str(ranks), "--microbatches",
             str(MICROBATCHES), "--steps", str(STEPS), "--timeout", "60")
    run = ("pipeirc", "run", "--device", "cuda")  # (never a quiet fallback to the CPU)
    on_cuda = "on CUDA (nccl)"
    checks = [
        Check("runtime", (*run, *pipe, "--model", "mlp", "--check"), expect=on_cuda),
        Check("blocking", (*run, *pipe, "--model", "mlp", "--blocking", "--check"),
              expect=on_cuda),
        Check("offload", (*run, *gpipe, "--model", "mlp", "--passes", "offload{budget=2}",
                          "--check"), expect=on_cuda),
        Check("fp16", (*run, *pipe, "--model", f"{HERE}:fp16_spec", "--check"),
              expect=on_cuda),
        Check("dropout", (*run, *gpipe, "--model", f"{HERE}:dropout_spec"), expect=on_cuda),
        Check("recompute", (*run, *gpipe, "--model", f"{HERE}:dropout_spec", "--passes",
                            "recompute{all=true}"), same_steps_as="dropout", expect=on_cuda),
        Check("profile", ("pipeirc", "profile", "--device", "cuda", "--model", "mlp", "--nproc",
                          str(ranks), "--microbatches", str(MICROBATCHES), "-o", costs)),
        Check("profiled-run", (*run, *pipe, "--model", "mlp", "--costs", costs),
              expect=on_cuda),
    ]
    if gloo_ranks:
        gloo = ("--schedule", "1f1b", "--ranks", str(gloo_ranks), "--microbatches",
                str(MICROBATCHES), "--steps", str(STEPS), "--timeout", "60")
        checks.insert(1, Check("runtime-gloo", ("pipeirc", "run", "--device", "cpu", *gloo,
                                                "--model", "mlp", "--check"),
                               {"CUDA_VISIBLE_DEVICES": ""}, expect="on CPU (gloo)"))
    return Plan(gpus, "nccl", ranks, gloo_ranks, tuple(checks))


# ---- running it -------------------------------------------------------------------------------
class CheckFailed(RuntimeError):
    """A check exited non-zero, ran over its time, or the total ran over budget."""


@dataclass(frozen=True)
class Outcome:
    check: Check
    seconds: float
    output: str


Runner = Callable[[Check, float], tuple[int, str]]


def run_command(check: Check, timeout_s: float) -> tuple[int, str]:
    """Run one check's command; (exit status, stdout and stderr). 124: over `timeout_s`."""
    env = {**os.environ, **check.env}
    argv = check.argv  # `pipeirc` where it is on PATH, else this Python's `-m pipeir`
    if shutil.which(argv[0]) is None:
        argv = (sys.executable, "-m", "pipeir", *argv[1:])
    try:
        p = subprocess.run(argv, env=env, capture_output=True, text=True,
                           timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:  # (the ranks' errors are on stderr)
        out = "".join(x if isinstance(x, str) else (x or b"").decode()
                      for x in (e.stdout, e.stderr))
        return 124, out
    return p.returncode, p.stdout + p.stderr


def run_plan(plan: Plan, runner: Runner = run_command, log: Callable[[str], None] = print
             ) -> list[Outcome]:
    """Run every check in order; raise CheckFailed at the first that fails (its output is
    logged first)."""
    outcomes = []
    start = time.perf_counter()
    for c in plan.checks:
        left = TOTAL_BUDGET_S - (time.perf_counter() - start)
        if left <= 0:
            raise CheckFailed(f"out of the {TOTAL_BUDGET_S} s budget before '{c.name}'")
        t0 = time.perf_counter()
        rc, out = runner(c, min(CHECK_TIMEOUT_S, left))
        took = time.perf_counter() - t0
        env = " ".join(f"{k}={v}" for k, v in c.env.items())
        log(f"== {c.name} ({took:.1f} s): {env + ' ' if env else ''}{shlex.join(c.argv)}")
        lines = out.splitlines()
        if rc != 0 or "Traceback (most recent call last)" in out:
            for line in lines[-40:]:
                log(f"   {line}")
            last = next((x for x in reversed(lines) if x.strip()), "no output")
            why = "timed out" if rc == 124 else f"exit {rc}"
            raise CheckFailed(f"check '{c.name}' failed ({why}): {last.strip()}")
        for line in lines:
            if line.strip() and line.lstrip().startswith(c.keep):
                log(f"   {line}")
        if c.expect is not None and c.expect not in out:
            raise CheckFailed(f"check '{c.name}': its output does not say '{c.expect}'")
        if c.same_steps_as is not None:
            want = steps(next(o.output for o in outcomes if o.check.name == c.same_steps_as))
            got = steps(out)
            log(f"   steps (loss, gradient norm): {got}")
            if not got or got != want:
                raise CheckFailed(f"check '{c.name}': steps {got or 'not found'} differ from "
                                  f"'{c.same_steps_as}''s {want}")
        outcomes.append(Outcome(c, took, out))
    return outcomes


def steps(output: str) -> list[tuple[str, str]]:
    """Each `step` line's loss and gradient norm, as printed."""
    found = []
    for line in output.splitlines():
        words = line.split()
        if words[:1] == ["step"] and "loss" in words and "norm" in words:
            found.append((words[words.index("loss") + 1], words[words.index("norm") + 1]))
    return found


def describe(plan: Plan) -> str:
    gloo = f", plus {plan.gloo_ranks} gloo ranks on CPU to compare" if plan.gloo_ranks else ""
    return (f"{plan.gpus} CUDA device(s) ({torch.cuda.get_device_name(0)}): "
            f"{plan.ranks} rank(s) on {plan.backend}{gloo}; torch {torch.__version__}")


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing "
              "to check; run it on a machine with a GPU")
        return 0
    with tempfile.TemporaryDirectory(prefix="pipeir-gpu-check-") as tmp:
        plan = make_plan(torch.cuda.device_count(), str(Path(tmp) / "costs.json"))
        print(f"gpu_check: {describe(plan)}")
        if args.dry_run:
            for c in plan.checks:
                env = " ".join(f"{k}={v}" for k, v in c.env.items())
                print(f"  {c.name}: {env + ' ' if env else ''}{shlex.join(c.argv)}")
            return 0
        t0 = time.perf_counter()
        try:
            done = run_plan(plan, run_command)
        except CheckFailed as e:
            print(f"gpu_check: error: {e}", file=sys.stderr)
            return 1
    print(f"gpu_check: all {len(done)} checks passed in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
