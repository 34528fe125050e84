"""When instructions ran on a CUDA device, on the host clock.

NOTE (why events). CUDA kernels run asynchronously: an instruction's host time is when its
work was queued, which on a busy device can be long before it runs (the measured bubble
would be the launch gaps, not the idle device). So on CUDA the runtime records an event on
the current stream where an instruction starts and ends (`mark`), and after the step (the
worker has synchronized) reads each event's time since the step's first one (`resolve`).
That first one is recorded on an idle stream (`begin` waits for it), so it runs at once and
its host time anchors the rest on `time.perf_counter`'s clock, which every rank of a host
shares. A wait for a transfer makes the current stream wait for the communication's work,
so the time an instruction spends waiting for data is in its span, as on CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

_now = time.perf_counter


class DeviceClock:
    """Events on a device's current stream, turned into host-clock seconds after a step.
    `event` makes a timing event and `stream` gives the current stream
    (`torch.cuda.Event`, `torch.cuda.current_stream`; a test gives stand-ins)."""

    def __init__(self, event: Callable[[], Any], stream: Callable[[], Any]):
        self._event = event
        self._current = stream
        self._stream: Any = None
        self._pool: list[Any] = []  # events are reused from step to step
        self._used = 0
        self._origin = 0
        self._origin_host = 0.0

    def begin(self) -> None:
        """Start a step: wait until the stream is idle (the worker synchronized after the
        last step, but a batch may have queued work since), then anchor."""
        self._stream = self._current()  # (looked up once: each lookup makes an object)
        self._stream.synchronize()
        self._used = 0
        self._origin_host = _now()
        self._origin = self.mark()

    def mark(self) -> int:
        """Record an event now, in stream order; its number for `resolve`."""
        k = self._used
        if k == len(self._pool):
            self._pool.append(self._event())
        self._pool[k].record(self._stream)
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


def cuda_clock() -> DeviceClock:
    """A `DeviceClock` of CUDA events on the current CUDA device."""
    import torch

    return DeviceClock(lambda: torch.cuda.Event(enable_timing=True),  # type: ignore[no-untyped-call]
                       torch.cuda.current_stream)
