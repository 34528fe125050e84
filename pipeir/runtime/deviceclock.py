"""When instructions ran on a CUDA device, on the host clock.

NOTE (why events). CUDA kernels run asynchronously: an instruction's host time is when its
work was queued, which on a busy device can be long before it runs (the measured bubble
would be the launch gaps, not the idle device). So on CUDA the runtime records an event on
the current stream where an instruction starts and ends (`mark`), and after the step (the
worker has synchronized) reads each event's time since the step's first one (`resolve`). That
first event is recorded when the device is idle (the previous step was synchronized), so it
runs at once and its host time anchors the rest on `time.perf_counter`'s clock, which every
rank of a host shares. Communication waits appear as the compute stream waiting for the
communication stream, which is what the bubble measures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

_now = time.perf_counter


class DeviceClock:
    """Events on a device's current stream, turned into host-clock seconds after a step.
    `event` makes a timing event (`torch.cuda.Event`; a test gives a stand-in)."""

    def __init__(self, event: Callable[[], Any]):
        self._event = event
        self._pool: list[Any] = []  # events are reused from step to step
        self._used = 0
        self._origin: Any = None
        self._origin_host = 0.0

    def begin(self) -> None:
        """Start a step: the device is idle (the worker synchronized after the last one)."""
        self._used = 0
        self._origin_host = _now()
        self._origin = self.mark()

    def mark(self) -> int:
        """Record an event now, in stream order; its number for `resolve`."""
        k = self._used
        if k == len(self._pool):
            self._pool.append(self._event())
        self._pool[k].record()
        self._used = k + 1
        return k

    def resolve(self, times: Sequence[tuple[int, float, float]]
                ) -> list[tuple[int, float, float]]:
        """(pc, start mark, end mark) as (pc, start, end) in host-clock seconds, once every
        event has run (after the device was synchronized)."""
        origin = self._pool[self._origin]
        at = [self._origin_host + origin.elapsed_time(e) / 1e3
              for e in self._pool[:self._used]]
        return [(pc, at[int(a)], at[int(b)]) for pc, a, b in times]


def cuda_event() -> Any:
    """A CUDA event that can time (the default stand-in of `DeviceClock`)."""
    import torch

    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
