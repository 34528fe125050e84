"""pipeir: a compiler for pipeline-parallel training schedules.

    >>> import pipeir
    >>> s = pipeir.library.get("1f1b", ranks=4, microbatches=8)
    >>> pipeir.verify(s).peak_activations
    (4, 3, 2, 1)
"""

from typing import Any

from pipeir import library
from pipeir.api import compile, load, parse
from pipeir.config import PipelineConfig
from pipeir.diagnostics import Diagnostic, PipeirError, UsageError, VerifyError
from pipeir.ops import B, F, I, Op, R, W
from pipeir.printer import print_schedule
from pipeir.schedule import EdgeKind, Schedule, ScheduleBuilder
from pipeir.sim import CostModel, SimResult, simulate
from pipeir.verify import VerifyReport, verify

__version__ = "0.1.0"


def torch_schedule(stages: Any, schedule: Any, *, n_microbatches: int, loss_fn: Any = None,
                   **kwargs: Any) -> Any:
    """A torch.distributed.pipelining schedule object running a verified pipeir schedule (a
    library name, a `.sched` path or a `Schedule`) on this rank's `PipelineStage`s; see
    `pipeir.runtime.pipelining.torch_schedule`. Imports torch (only when called)."""
    from pipeir.runtime.pipelining import torch_schedule as build  # noqa: PLC0415 - torch

    return build(stages, schedule, n_microbatches=n_microbatches, loss_fn=loss_fn, **kwargs)


def split(module: Any, points: Any, example: Any = None) -> Any:
    """`module` (an nn.Module) cut into pipeline stages, stage k beginning at the module
    named `points[k - 1]`, keeping the module's parameter names and weights; see
    `pipeir.models.module.split`. Imports torch (only when called)."""
    from pipeir.models.module import split as cut  # noqa: PLC0415 - torch

    return cut(module, points, example)


__all__ = [
    "B",
    "CostModel",
    "Diagnostic",
    "EdgeKind",
    "F",
    "I",
    "Op",
    "PipeirError",
    "PipelineConfig",
    "R",
    "Schedule",
    "ScheduleBuilder",
    "SimResult",
    "UsageError",
    "VerifyError",
    "VerifyReport",
    "W",
    "compile",
    "library",
    "load",
    "parse",
    "print_schedule",
    "simulate",
    "split",
    "torch_schedule",
    "verify",
]
