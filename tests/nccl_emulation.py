"""NCCL's point-to-point ordering, emulated on gloo: a model file (`--model
tests/nccl_emulation.py`) that, imported in every rank, makes each process group run its
point-to-point launches one after another, as NCCL runs the operations of one communicator
on one stream: a launch (one isend or irecv, or one batch_isend_irecv, which NCCL runs as one
grouped kernel) starts when the group's previous launch has completed, and completes when
all of its transfers have. A transfer that waits longer than EMULATED_NCCL_TIMEOUT seconds
(default 20) is a RuntimeError naming the emulated deadlock.

It is the oracle for `pipeir.runtime.dist`'s NOTE, from outside the runtime: with one group
(`PIPEIR_P2P_GROUPS=default`) an early-posted receive holds the send its own data needs and
the ranks stop; with a group per directed channel (`PIPEIR_P2P_GROUPS=channel`, NCCL's
default in pipeir) they train. The model is the built-in MLP.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, NamedTuple

import torch.distributed as dist

from pipeir.models import ModelSpec
from pipeir.models.spec import resolve

_TIMEOUT_S = float(os.environ.get("EMULATED_NCCL_TIMEOUT", "20"))
_isend, _irecv, _batch, _P2POp = dist.isend, dist.irecv, dist.batch_isend_irecv, dist.P2POp


class _Op(NamedTuple):
    send: bool
    tensor: Any
    peer: int
    group: Any
    tag: int


class _Lane:
    """One communicator's stream: its launches, run in order by one thread."""

    def __init__(self) -> None:
        self.launches: queue.Queue[tuple[list[_Op], threading.Event]] = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            ops, done = self.launches.get()
            real = [_P2POp(_isend if o.send else _irecv, o.tensor, o.peer, o.group, o.tag)
                    for o in ops]
            for work in _batch(real):
                work.wait()
            done.set()


_lanes: dict[int, _Lane] = {}
_lock = threading.Lock()


def _launch(ops: list[_Op]) -> _Work:
    with _lock:
        lane = _lanes.setdefault(id(ops[0].group), _Lane())
    done = threading.Event()
    lane.launches.put((ops, done))
    return _Work(done)


class _Work:
    def __init__(self, done: threading.Event) -> None:
        self.done = done

    def wait(self, timeout: Any = None) -> bool:
        if not self.done.wait(_TIMEOUT_S):
            raise RuntimeError(f"emulated NCCL: a transfer waited {_TIMEOUT_S:.0f} s: the "
                               "ranks deadlock on one communicator's launch order")
        return True


def _isend_emulated(tensor: Any, dst: int, group: Any = None, tag: int = 0) -> _Work:
    return _launch([_Op(True, tensor, dst, group, tag)])


def _irecv_emulated(tensor: Any, src: int, group: Any = None, tag: int = 0) -> _Work:
    return _launch([_Op(False, tensor, src, group, tag)])


def _p2pop_emulated(op: Any, tensor: Any, peer: int, group: Any = None, tag: int = 0) -> _Op:
    return _Op(op is _isend_emulated, tensor, peer, group, tag)


def _batch_emulated(ops: list[_Op]) -> list[_Work]:
    return [_launch(list(ops))]  # NCCL: one grouped launch, one work for all of it


dist.isend, dist.irecv = _isend_emulated, _irecv_emulated  # type: ignore[assignment]
dist.P2POp, dist.batch_isend_irecv = _p2pop_emulated, _batch_emulated  # type: ignore[assignment, misc]


def spec() -> ModelSpec:
    return resolve("mlp")
