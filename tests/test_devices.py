"""Where ranks run (`pipeir.runtime.devices`, `--device`) and when their instructions ran on a
CUDA device (`pipeir.runtime.deviceclock`), checked without a GPU: the choice for every count
of devices, the errors through the CLI, and the event arithmetic against a stand-in device
whose kernels run later than they are queued."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeir.runtime import devices
from pipeir.runtime.deviceclock import DeviceClock

REPO = Path(__file__).parent.parent


@pytest.mark.parametrize("requested, gpus, ranks, want", [
    ("auto", 0, 2, "cpu"), ("auto", 1, 1, "cuda"), ("auto", 2, 2, "cuda"), ("auto", 8, 4, "cuda"),
    ("auto", 1, 2, "cpu"), ("auto", 3, 4, "cpu"),
    ("cpu", 8, 2, "cpu"), ("cpu", 0, 2, "cpu"),
    ("cuda", 2, 2, "cuda"), ("cuda", 1, 2, None), ("cuda", 0, 1, None),
    # not counted here (torchrun): CUDA wherever there is some, as each process may see its own
    ("auto", 1, None, "cuda"), ("auto", 0, None, "cpu"), ("cuda", 1, None, "cuda"),
    ("cuda", 0, None, None), ("cpu", 8, None, "cpu"),
])
def test_cuda_needs_a_device_per_rank(requested: str, gpus: int, ranks: int | None,
                                      want: str | None) -> None:
    """NCCL cannot put two ranks on one device: where `pipeirc run` starts the ranks, `auto`
    falls back to the CPU with a note naming the counts (only where CUDA is there at all),
    `cuda` refuses. Under torchrun (ranks not counted) CUDA is used wherever there is some."""
    if want is None:
        need = "a CUDA device" if ranks is None else f"as many CUDA devices as its {ranks}"
        with pytest.raises(ValueError, match=f"this host needs {need}.*; {gpus} visible"):
            devices.choose(requested, gpus, ranks)
        return
    kind, note = devices.choose(requested, gpus, ranks)
    assert kind == want
    fell_back = requested == "auto" and ranks is not None and 0 < gpus < ranks
    assert (note is not None) == fell_back
    if note is not None:
        assert note.startswith(f"{ranks} ranks on this host and {gpus} CUDA device(s): running "
                               "on CPU with gloo")


def test_the_mode_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(devices.ENV, raising=False)
    assert devices.mode() == "auto"
    monkeypatch.setenv(devices.ENV, "cpu")
    assert devices.mode() == "cpu"
    monkeypatch.setenv(devices.ENV, "")
    assert devices.mode() == "auto"  # (empty is unset, as for most tools)
    monkeypatch.setenv(devices.ENV, "gpu")
    with pytest.raises(ValueError, match="PIPEIR_DEVICE='gpu': expected auto, cpu or cuda"):
        devices.mode()


def test_the_ranks_ask_this_hosts_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """`dist.device_kind` counts the CUDA devices torch sees (faked here), and asks nothing
    of CUDA when the CPU is asked for."""
    from pipeir.runtime import dist as pdist

    monkeypatch.delenv(devices.ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    kind, note = pdist.device_kind(2)
    assert kind == "cpu" and note is not None and "1 CUDA device(s)" in note
    assert pdist.device_kind(None) == ("cuda", None)  # torchrun: LOCAL_RANK's device

    def no_query() -> int:
        raise AssertionError("CUDA queried")
    monkeypatch.setattr(torch.cuda, "device_count", no_query)
    monkeypatch.setenv(devices.ENV, "cpu")
    assert pdist.device_kind(2) == ("cpu", None)


class _Stream:
    """A device whose queued work runs late: each event runs at max(queued + lag, the last
    event's time + work), as a busy stream would."""

    def __init__(self) -> None:
        self.host = 100.0  # seconds, the host clock
        self.device = 0.0  # seconds, when the stream last finished something
        self.made = 0
        self.synced = 0

    def current(self) -> _Stream:
        return self

    def synchronize(self) -> None:  # the host waits until the stream is idle
        self.synced += 1
        self.host = max(self.host, self.device)

    def event(self) -> _Event:
        self.made += 1
        return _Event(self)


class _Event:
    def __init__(self, stream: _Stream) -> None:
        self.stream = stream
        self.at = 0.0

    def record(self, stream: _Stream) -> None:
        assert stream is self.stream
        s = self.stream
        s.device = max(s.host + 0.5, s.device + 0.25)  # 0.5 s lag, 0.25 s per instruction
        self.at = s.device

    def elapsed_time(self, end: _Event) -> float:
        return (end.at - self.at) * 1e3  # ms, as torch.cuda.Event's


def test_device_clock_reads_when_work_ran_not_when_it_was_queued(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Instructions queued 0.01 s apart on the host ran 0.25 s apart on the stand-in device:
    the resolved times are the device's, anchored at the step's first event (recorded once
    the stream is idle, so it ran when the host says), and events are reused from step to
    step."""
    from pipeir.runtime import deviceclock

    stream = _Stream()
    monkeypatch.setattr(deviceclock, "_now", lambda: stream.host)
    clock = DeviceClock(stream.event, stream.current)
    for step in range(2):
        stream.host += 10.0
        stream.device = stream.host + 3.0  # work queued between steps: the anchor waits
        clock.begin()  # synchronizes (host = device), then its event runs 0.5 s later
        start_host = stream.host
        assert start_host == stream.device - 0.5  # the anchor, after the queued work ran
        times = []
        for pc in range(3):
            a = clock.mark()
            stream.host += 0.01
            b = clock.mark()
            times.append((pc, float(a), float(b)))
        got = clock.resolve(times)
        # device: anchor, then events every 0.25 s: instruction pc starts at 0.25 (2 pc + 1)
        # after the anchor and ends 0.25 s later
        want = [(pc, start_host + 0.25 * (2 * pc + 1), start_host + 0.25 * (2 * pc + 2))
                for pc in range(3)]
        assert [pc for pc, _, _ in got] == [0, 1, 2]
        assert [t for _, *ab in got for t in ab] == pytest.approx(
            [t for _, *ab in want for t in ab]), step
    assert stream.made == 7  # one anchor and six marks, made in the first step only
    assert stream.synced == 2  # once per step


def test_a_context_on_a_device_clock_reports_the_devices_times(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime's `Context` with the stand-in device's clock (as on CUDA): a step's
    instruction times are the device's after `end_step`, in host seconds, and the host clock
    is back between steps."""
    from pipeir.models import resolve
    from pipeir.models.spec import build_stage
    from pipeir.runtime import deviceclock
    from pipeir.runtime.context import Context
    from pipeir.runtime.optim import Optim
    from pipeir.runtime.shapes import ShapePlan
    from pipeir.runtime.worker import split_batch

    stream = _Stream()
    monkeypatch.setattr(deviceclock, "_now", lambda: stream.host)
    spec = resolve("mlp")
    modules = {0: build_stage(spec, 0, 1)}
    optim = Optim(spec, modules, 1, (0,), 0, distributed=False)
    ctx = Context(spec, modules, 1, torch.device("cpu"), ShapePlan(spec, 1), optim)
    ctx.clock = DeviceClock(stream.event, stream.current)
    xs, ys = split_batch(spec.batch(0), 2)
    for _ in range(2):
        ctx.begin_step(xs, ys)
        anchor = stream.host
        ctx.zero_grad()
        for mb in range(2):
            ctx.load(mb, "input")
            ctx.load(mb, "target")
            ctx.forward(0, mb)
            ctx.loss(0, mb, 0.5)
            ctx.backward(0, mb)
        ctx.step()
        ctx.end_step()
        assert [pc for pc, _, _ in ctx.times] == list(range(12))
        # every instruction took the stand-in device's 0.25 s, one after another
        assert [(round(a - anchor, 6), round(b - anchor, 6)) for _, a, b in ctx.times] == [
            (0.25 * (2 * k + 1), 0.25 * (2 * k + 2)) for k in range(12)]
        assert ctx._now is time.perf_counter  # the host clock between steps


def _pipeirc(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "pipeir", *argv], capture_output=True,
                          text=True, timeout=240, cwd=REPO, env={**os.environ, **(env or {})})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_asked_for_without_devices_is_one_clear_error(tmp_path: Path) -> None:
    """Before any rank starts (`run`), before any measurement (`profile`): one line, exit 2,
    nothing written; a bad PIPEIR_DEVICE likewise."""
    r = _pipeirc("run", "examples/1f1b.sched", "--model", "mlp", "--steps", "1",
                 "--device", "cuda")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: CUDA asked for (--device cuda or PIPEIR_DEVICE=cuda), but this host needs as "
        "many CUDA devices as its 4 rank(s) (NCCL puts one rank on each); 0 visible"], r.stderr
    out = tmp_path / "costs.json"
    r = _pipeirc("profile", "--model", "mlp", "--device", "cuda", "-o", str(out))
    assert r.returncode == 2 and "0 visible" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()
    r = _pipeirc("run", "examples/1f1b.sched", "--model", "mlp", "--steps", "1",
                 env={"PIPEIR_DEVICE": "gpu"})
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: PIPEIR_DEVICE='gpu': expected auto, cpu or cuda"], r.stderr


@pytest.mark.parametrize("requested, gpus, ranks, want", [
    ("auto", 8, 8, "cuda"), ("auto", 8, None, "cuda"), ("auto", 0, 8, "cpu"),
    ("auto", 4, 8, None), ("cuda", 4, 8, None), ("cpu", 4, 8, "cpu"),
])
def test_under_torchrun_too_few_devices_is_an_error_not_a_fallback(
        requested: str, gpus: int, ranks: int | None, want: str | None) -> None:
    """Other hosts of a torchrun world may have a device per rank and choose CUDA: a host
    that fell back to gloo would mix backends and hang, so there it is one clear error."""
    if want is None:
        with pytest.raises(ValueError, match=r"NCCL needs a device per rank|CUDA asked for"):
            devices.choose(requested, gpus, ranks, fallback=False)
    else:
        assert devices.choose(requested, gpus, ranks, fallback=False) == (want, None)
    assert devices.local_world({"LOCAL_WORLD_SIZE": "8"}) == 8
    assert devices.local_world({}) is None
    assert devices.local_world({"LOCAL_WORLD_SIZE": "x"}) is None


@pytest.mark.mp
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_under_torchrun_cuda_without_devices_is_said_once_before_anything(
        tmp_path: Path) -> None:
    """main.py and `pipeirc run` under torchrun check the device before the process group
    and the save directory's lock: one `error:` line, no Python exception name, no directory
    left behind."""
    import os

    from pipeir.runtime.launch import free_port

    assert _pipeirc("compile", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2",
                    "-o", str(tmp_path / "gen")).returncode == 0
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    for value, said in (("cuda", "CUDA asked for"), ("bogus", "PIPEIR_DEVICE='bogus'")):
        env = {**os.environ, "PIPEIR_DEVICE": value}
        r = subprocess.run([*torchrun, "--master-port", str(free_port()),
                            str(tmp_path / "gen" / "main.py"), "--model", "mlp", "--steps",
                            "1"], capture_output=True, text=True, timeout=180, env=env)
        assert r.returncode != 0
        ours = [ln for ln in r.stderr.splitlines() if ln.startswith("main.py:")]
        assert len(ours) == 1 and ours[0].startswith(f"main.py: error: {said}"), r.stderr
        assert "ValueError" not in r.stderr
    save = tmp_path / "ck"
    r = subprocess.run([*torchrun, "--master-port", str(free_port()), "-m", "pipeir", "run",
                        "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--steps",
                        "1", "--device", "cuda", "--save", str(save)],
                       capture_output=True, text=True, timeout=180, cwd=REPO)
    assert r.returncode != 0 and "error: CUDA asked for" in r.stderr, r.stderr
    assert "ValueError" not in r.stderr and not save.exists()
