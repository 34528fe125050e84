"""pipeir: a compiler for pipeline-parallel training schedules.

    >>> import pipeir
    >>> s = pipeir.library.get("1f1b", ranks=4, microbatches=8)
    >>> pipeir.verify(s).peak_activations
    (4, 3, 2, 1)
"""

from pipeir import library
from pipeir.api import compile, load, parse
from pipeir.config import PipelineConfig
from pipeir.diagnostics import Diagnostic, PipeirError, UsageError, VerifyError
from pipeir.ops import B, F, I, Op, W
from pipeir.printer import print_schedule
from pipeir.schedule import EdgeKind, Schedule, ScheduleBuilder
from pipeir.sim import CostModel, SimResult, simulate
from pipeir.verify import VerifyReport, verify

__version__ = "0.1.0"

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
    "verify",
]
