"""pipeir: a compiler for pipeline-parallel training schedules.

    >>> import pipeir
    >>> s = pipeir.library.get("1f1b", ranks=4, microbatches=8)
    >>> pipeir.verify(s).peak_activations
    (4, 3, 2, 1)
"""

import sys
from importlib import import_module
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeir import library
    from pipeir.api import compile, load, parse, simulate
    from pipeir.config import PipelineConfig
    from pipeir.diagnostics import Diagnostic, PipeirError, UsageError, VerifyError
    from pipeir.ops import B, F, I, Op, R, W
    from pipeir.printer import print_schedule
    from pipeir.schedule import EdgeKind, Schedule, ScheduleBuilder
    from pipeir.sim import CostModel, SimResult
    from pipeir.verify import VerifyReport, verify

#: NOTE (start-up): the public names load on first use (PEP 562), so that importing any
#: `pipeir.x` runs no compiler import: `pipeirc run` starts its ranks' fork server first of all
#: (`pipeir.cli.main`), and the fork server imports only what a rank needs
#: (`pipeir.runtime.worker`), not the frontend, networkx and the library. name -> its module.
_LAZY = {
    "library": "pipeir.library",
    **dict.fromkeys(("compile", "load", "parse", "simulate"), "pipeir.api"),
    "PipelineConfig": "pipeir.config",
    **dict.fromkeys(("Diagnostic", "PipeirError", "UsageError", "VerifyError"),
                    "pipeir.diagnostics"),
    **dict.fromkeys(("B", "F", "I", "Op", "R", "W"), "pipeir.ops"),
    "print_schedule": "pipeir.printer",
    **dict.fromkeys(("EdgeKind", "Schedule", "ScheduleBuilder"), "pipeir.schedule"),
    **dict.fromkeys(("CostModel", "SimResult"), "pipeir.sim"),
    **dict.fromkeys(("VerifyReport", "verify"), "pipeir.verify"),
}


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'pipeir' has no attribute '{name}'")
    module = import_module(where)
    value = module if name == "library" else getattr(module, name)  # (pipeir.verify: a function)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


class _Package(ModuleType):
    """The import system binds each loaded submodule as an attribute of its package; for
    `pipeir.verify` that would hide the function `pipeir.verify` whenever anything imports
    the module first (eager imports bound the function last; lazy ones must say so)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "verify" and isinstance(value, ModuleType):
            value = value.verify
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


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
