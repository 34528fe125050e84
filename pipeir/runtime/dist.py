"""Process groups and devices: gloo on CPU, nccl on CUDA, chosen automatically."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeir.runtime import devices
from pipeir.runtime.pipes import Pipes

# NOTE (point-to-point on NCCL): NCCL runs the operations of one communicator on one stream,
# in the order they were posted, and a receive holds that stream until its data arrives. The
# programs post receives early (the `overlap` pass; `lower`'s early `irecv`), which gloo
# allows: on one communicator, rank 0's early receive of a gradient would hold its send of
# the activation that gradient needs, and both ranks would wait forever. So on NCCL every
# directed channel (sender, receiver) gets a communicator of its own (a two-rank group): it
# carries one direction only, its sends and receives run in posting order, which is the
# per-channel FIFO order the communication proof matches transfers in (`commcheck`), and
# channels do not wait on each other. A batch is posted a transfer at a time there
# (`Context.batch`: NCCL would run it as one kernel that ends with its last transfer). gloo
# keeps one group; `PIPEIR_P2P_GROUPS=channel` makes it take this path, and
# tests/nccl_emulation.py (NCCL's launch order emulated on gloo) shows one group deadlocking
# and a group per channel training as one process.
P2P_GROUPS = "PIPEIR_P2P_GROUPS"
#: (global sender, global receiver) -> the group of that channel
_channels: dict[tuple[int, int], Any] = {}
#: CPU ranks on one host send pipeline transfers through pipes (`pipeir.runtime.pipes`);
#: `PIPEIR_P2P_PIPES=off` sends them through gloo
P2P_PIPES = "PIPEIR_P2P_PIPES"
_pipes: Pipes | None = None
_piped: set[tuple[int, int]] = set()  # the channels set up for pipes, on every rank alike
_one_host: bool | None = None  # (asked once per process group)
_timeout_s = 1800.0


def device_kind(local_world: int | None, fallback: bool = True) -> tuple[str, str | None]:
    """Where ranks run on this host, and why not on CUDA where it has some
    (`pipeir.runtime.devices.choose`)."""
    requested = devices.mode()
    if requested == "cpu":  # (no CUDA query at all: it can take seconds on a large host)
        return "cpu", None
    # device_count asks NVML where it can, without initializing CUDA in this process
    return devices.choose(requested, torch.cuda.device_count(), local_world, fallback)


def torchrun_device_kind() -> str:
    """`device_kind` for a rank torchrun (or another env:// launcher) started: counted with
    LOCAL_WORLD_SIZE where set, never a fallback (other hosts may choose CUDA). An error is
    a ValueError: callers check it before the process group, to say it once."""
    return device_kind(devices.local_world(os.environ), fallback=False)[0]


def pick_device(kind: str, index: int) -> torch.device:
    """The device of `device_kind`'s choice for the rank with local index `index`: its
    local rank under torchrun, else its rank (a LOCAL_RANK the launcher's ranks inherit from
    the shell that started `pipeirc` would put them all on one device)."""
    if kind == "cuda":
        local = index % torch.cuda.device_count()
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init(rank: int, world: int, init_method: str, timeout_s: float,
         device: torch.device) -> None:
    """Join the process group; `timeout_s` bounds every collective and point-to-point op."""
    global _timeout_s
    _timeout_s = timeout_s
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    # NCCL: the first call on a group must involve every rank before batched p2p may
    # involve a subset (batch_isend_irecv); a barrier is that call, and cheap on gloo.
    dist.barrier()


def per_channel(device: torch.device) -> bool:
    """Whether point-to-point runs one group per directed channel (the NOTE above)."""
    mode = devices.env_choice(P2P_GROUPS, ("auto", "channel", "default"))
    return mode == "channel" or (mode == "auto" and device.type == "cuda")


def use_pipes(device: torch.device) -> bool:
    """Whether CPU ranks on one host may send through pipes (`pipeir.runtime.pipes`)."""
    on = devices.env_choice(P2P_PIPES, ("auto", "off")) == "auto"
    return on and device.type == "cpu" and sys.platform.startswith("linux")


def open_channels(pairs: Iterable[tuple[int, int]], device: torch.device) -> None:
    """Make what every directed channel in `pairs` (global ranks) needs and does not have
    yet: a group of its own (NCCL, see the NOTE) or a pipe (CPU ranks on one host). Every
    rank calls this with the same pairs (both are collective), and each group's first
    operation (its communicator's set-up) runs here, in one order on every rank, rather
    than at a first transfer whose peer may be busy elsewhere."""
    if not per_channel(device):
        if use_pipes(device):
            _open_pipes(sorted(set(pairs) - _piped))
        return
    fresh = sorted(set(pairs) - set(_channels))
    for src, dst in fresh:
        _channels[src, dst] = dist.new_group([src, dst])
    me = dist.get_rank()
    for src, dst in fresh:
        if me in (src, dst):
            dist.barrier(group=_channels[src, dst])


def _open_pipes(fresh: list[tuple[int, int]]) -> None:
    """Pipes for the channels `fresh`, where all ranks share this host; a rank that cannot
    make or open one leaves those channels to gloo on every rank."""
    global _pipes, _one_host
    if not fresh:
        return
    me, world = dist.get_rank(), dist.get_world_size()
    if _one_host is None:
        hosts: list[Any] = [None] * world
        dist.all_gather_object(hosts, _host())
        _one_host = len(set(hosts)) == 1
    if not _one_host:
        return
    where: list[Any] = [None]
    if me == 0:
        with contextlib.suppress(OSError):  # (no temporary directory: gloo carries all)
            where[0] = tempfile.mkdtemp(prefix="pipeir-p2p-")
    dist.broadcast_object_list(where, src=0)
    if where[0] is None:
        return
    pipes = _pipes = _pipes or Pipes(me, _timeout_s)
    path = Path(where[0])

    def everywhere(step: Callable[[int, int], None], mine: Callable[[int, int], bool]) -> bool:
        ok = True
        for s, d in fresh:
            if ok and mine(s, d):
                try:
                    step(s, d)
                except OSError:
                    ok = False
        flag = torch.tensor([0 if ok else 1])
        dist.all_reduce(flag)
        return int(flag.item()) == 0

    try:
        opened = (everywhere(lambda s, d: pipes.make_in(s, str(path / f"{s}-{d}")),
                             lambda s, d: d == me)
                  and everywhere(lambda s, d: pipes.open_out(d, str(path / f"{s}-{d}")),
                                 lambda s, d: s == me))
    finally:  # every end that will ever open is open: the names can go
        if me == 0:
            shutil.rmtree(path, ignore_errors=True)
    if opened:
        _piped.update(fresh)
        return
    for s, d in fresh:
        if me in (s, d):
            pipes.drop(s, d)


def _host() -> str:
    """This host, as ranks that can share a pipe by name tell it."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{socket.gethostname()} {boot}"


def pipes() -> Pipes | None:
    """This rank's pipes (None: none were opened)."""
    return _pipes


def channel(src: int, dst: int) -> Any:
    """The group of the channel from global rank `src` to `dst` (None: the default group)."""
    return _channels.get((src, dst))


def shutdown() -> None:
    global _pipes, _one_host
    _channels.clear()
    if _pipes is not None:
        _pipes.close()
    _pipes, _one_host = None, None
    _piped.clear()
    if dist.is_initialized():
        dist.destroy_process_group()

