"""pipeir: a compiler for pipeline-parallel training schedules.

    >>> import pipeir
    >>> s = pipeir.library.get("1f1b", ranks=4, microbatches=8)
    >>> pipeir.verify(s).peak_activations
    (4, 3, 2, 1)
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeir import library
    from pipeir.api import compile, load, parse
    from pipeir.config import PipelineConfig
    from pipeir.diagnostics import Diagnostic, PipeirError, UsageError, VerifyError
    from pipeir.ops import B, F, I, Op, R, W
    from pipeir.printer import print_schedule
    from pipeir.schedule import EdgeKind, Schedule, ScheduleBuilder
    from pipeir.sim import CostModel, SimResult, simulate
    from pipeir.verify import VerifyReport, verify

# NOTE (start-up): the names above load on first use (PEP 562), not with the package: a
# training rank imports `pipeir.runtime.worker`, which needs none of them, and importing them
# all (the parser, networkx, the schedule library) cost each rank's fork server a second.
_LAZY = {
    "library": "pipeir", "compile": "pipeir.api", "load": "pipeir.api", "parse": "pipeir.api",
    "PipelineConfig": "pipeir.config", "Diagnostic": "pipeir.diagnostics",
    "PipeirError": "pipeir.diagnostics", "UsageError": "pipeir.diagnostics",
    "VerifyError": "pipeir.diagnostics", "B": "pipeir.ops", "F": "pipeir.ops",
    "I": "pipeir.ops", "Op": "pipeir.ops", "R": "pipeir.ops", "W": "pipeir.ops",
    "print_schedule": "pipeir.printer", "EdgeKind": "pipeir.schedule",
    "Schedule": "pipeir.schedule", "ScheduleBuilder": "pipeir.schedule",
    "CostModel": "pipeir.sim", "SimResult": "pipeir.sim", "simulate": "pipeir.sim",
    "VerifyReport": "pipeir.verify", "verify": "pipeir.verify",
}


def __getattr__(name: str) -> Any:
    home = _LAZY.get(name)
    if home is None:
        raise AttributeError(f"module 'pipeir' has no attribute '{name}'")
    value = importlib.import_module(f"pipeir.{name}") if home == "pipeir" else \
        getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


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
