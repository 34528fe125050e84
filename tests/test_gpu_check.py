"""bench/gpu_check.py (issue 39) without a GPU: it says so and exits 0 on CPU; with CUDA faked
it plans NCCL with one rank per GPU (plus a gloo comparison on one GPU) and fails loudly, one
line and exit 1, when a check misbehaves; its commands are real `pipeirc` commands (the gloo
one is run)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
import torch

REPO = Path(__file__).parent.parent
SCRIPT = REPO / "bench/gpu_check.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pipeir_gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def gc() -> ModuleType:
    return _load()


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, gpus: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")


def test_without_cuda_it_says_so_and_exits_0() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                       timeout=300, env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert "no CUDA device here" in r.stdout and "Traceback" not in r.stderr


@pytest.mark.parametrize("gpus, ranks, gloo", [(1, 1, 2), (2, 2, 0), (4, 4, 0), (8, 4, 0)])
def test_plan_nccl_one_rank_per_gpu(gc: ModuleType, gpus: int, ranks: int, gloo: int) -> None:
    plan = gc.make_plan(gpus, "costs.json")
    assert (plan.backend, plan.ranks, plan.gloo_ranks) == ("nccl", ranks, gloo)
    names = [c.name for c in plan.checks]
    assert {"runtime", "blocking", "offload", "fp16", "recompute", "profile",
            "profiled-run"} <= set(names)
    assert ("runtime-gloo" in names) == (gloo > 0)
    for c in plan.checks:
        cuda_hidden = c.env.get("CUDA_VISIBLE_DEVICES") == ""
        assert cuda_hidden == (c.name == "runtime-gloo")
        if c.argv[1] == "run":
            want = gloo if cuda_hidden else ranks
            assert c.argv[c.argv.index("--ranks") + 1] == str(want)
            assert ("--check" in c.argv) == (c.name not in ("profiled-run", "dropout",
                                                            "recompute"))
    assert names.index("profile") < names.index("profiled-run")
    recompute = plan.checks[names.index("recompute")]
    assert recompute.same_steps_as == "dropout" and names.index("dropout") < names.index(
        "recompute")
    profiled = plan.checks[names.index("profiled-run")]
    assert profiled.argv[profiled.argv.index("--costs") + 1] == "costs.json"
    with pytest.raises(ValueError):
        gc.make_plan(0, "costs.json")


def test_dry_run_with_fake_cuda_prints_the_plan(gc: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    _fake_cuda(monkeypatch, 2)
    assert gc.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "2 CUDA device(s) (Fake GPU): 2 rank(s) on nccl" in out
    assert "offload: pipeirc run --device cuda --schedule gpipe --ranks 2" in out
    assert "CUDA_VISIBLE_DEVICES" not in out


def test_a_failing_check_fails_loudly(gc: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    _fake_cuda(monkeypatch, 1)
    ran: list[str] = []

    def runner(check: object, timeout_s: float) -> tuple[int, str]:
        name = check.name  # type: ignore[attr-defined]
        ran.append(name)
        if name == "offload":
            return 1, ("Traceback (most recent call last):\n  ...\n"
                       "RuntimeError: CUDA error: an illegal memory access was encountered\n")
        return 0, _said(check)

    monkeypatch.setattr(gc, "run_command", runner)
    assert gc.main([]) == 1
    out, err = capsys.readouterr()
    assert ran == ["runtime", "runtime-gloo", "blocking", "offload"]  # stops at the failure
    assert err.strip().splitlines() == [
        "gpu_check: error: check 'offload' failed (exit 1): RuntimeError: CUDA error: an "
        "illegal memory access was encountered"]
    assert "== runtime" in out and "median step time 1.0 ms" in out


def _said(check: object) -> str:
    """A run's report line, on the devices the check expects."""
    where = check.expect or ""  # type: ignore[attr-defined]
    return f"median step time 1.0 ms over 5 step(s) {where}; simulated 1.0 ms\n"


def test_a_run_that_ran_elsewhere_fails(gc: ModuleType) -> None:
    """Every CUDA run asks for CUDA and must say it ran there: a run on the CPU (a quiet
    fallback) fails the check, as does a gloo comparison that ran on CUDA."""
    plan = gc.make_plan(1, "costs.json")
    for c in plan.checks:
        if c.argv[1] == "run":
            device = c.argv[c.argv.index("--device") + 1]
            assert device == ("cpu" if c.name == "runtime-gloo" else "cuda")
            assert c.expect == ("on CPU (gloo)" if device == "cpu" else "on CUDA (nccl)")
    with pytest.raises(gc.CheckFailed, match="check 'runtime': its output does not say "
                                             "'on CUDA \\(nccl\\)'"):
        gc.run_plan(plan, lambda c, t: (0, "median step time 1.0 ms over 5 step(s) on CPU "
                                           "(gloo); simulated 1.0 ms\n"), log=lambda line: None)


def test_a_traceback_with_exit_0_or_a_timeout_fails(gc: ModuleType) -> None:
    plan = gc.make_plan(2, "costs.json")
    with pytest.raises(gc.CheckFailed, match="check 'runtime' failed \\(exit 0\\): boom"):
        gc.run_plan(plan, lambda c, t: (0, "Traceback (most recent call last):\nboom\n"),
                    log=lambda line: None)
    with pytest.raises(gc.CheckFailed, match="check 'runtime' failed \\(timed out\\)"):
        gc.run_plan(plan, lambda c, t: (124, "step 1/6\n"), log=lambda line: None)


@pytest.mark.mp
def test_the_gloo_comparison_runs_on_cpu(gc: ModuleType) -> None:
    """The one check a CPU machine can run: the commands are real and pass `--check`."""
    plan = gc.make_plan(1, "costs.json")
    gloo = next(c for c in plan.checks if c.name == "runtime-gloo")
    rc, out = gc.run_command(gloo, 240)
    assert rc == 0, out
    assert "median step time" in out and "Traceback" not in out


def test_recompute_fails_when_its_steps_differ_from_the_run_without_it(gc: ModuleType) -> None:
    plan = gc.make_plan(2, "costs.json")
    line = "step    {}/6  loss {}  5.7 ms  11307.8 samples/s  lr 0.05  grad norm 0.202\n"

    def runner(c: object, t: float) -> tuple[int, str]:
        loss = "1.06958" if c.name == "recompute" else "1.06957"  # type: ignore[attr-defined]
        return 0, "".join(line.format(k, loss) for k in range(1, 3)) + _said(c)
    with pytest.raises(gc.CheckFailed, match=r"check 'recompute': steps .* differ from "
                                             r"'dropout''s"):
        gc.run_plan(plan, runner, log=lambda line: None)
    same = gc.run_plan(plan, lambda c, t: (0, line.format(1, "1.0") + _said(c)),
                       log=lambda line: None)
    assert [o.check.name for o in same][-2:] == ["profile", "profiled-run"]


@pytest.mark.mp
def test_recompute_with_dropout_steps_as_the_run_without_it_on_cpu(gc: ModuleType) -> None:
    """The recompute pair of checks, run on CPU: the oracle is the same run without
    recompute (the replayed forwards draw the same dropout masks)."""
    plan = gc.make_plan(1, "costs.json")
    pair = [replace(c, argv=tuple("cpu" if a == "cuda" else a for a in c.argv),
                    env={"CUDA_VISIBLE_DEVICES": ""}, expect="on CPU (gloo)")
            for c in plan.checks if c.name in ("dropout", "recompute")]
    done = gc.run_plan(replace(plan, checks=tuple(pair)), gc.run_command, log=lambda x: None)
    assert len(gc.steps(done[1].output)) == 6
