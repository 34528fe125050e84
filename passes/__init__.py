"""Passes over the schedule IR and the infrastructure that runs them.

    >>> import pipeir
    >>> from pipeir.passes import PassManager, parse_pipeline
    >>> s = pipeir.library.get("1f1b", ranks=4, microbatches=8)
    >>> out = PassManager(parse_pipeline("interleave{v=2},split-backward")).run(s)
    >>> out.config.stages
    8

Built-in passes live one per module (`interleave`, `split_backward`, ...) and load lazily
through `pipeir.passes.registry`; import a pass class from its module for the Python API,
e.g. `from pipeir.passes.interleave import Interleave`.
"""

from pipeir.passes.base import LoweredPass, OptionError, Pass, PassBase
from pipeir.passes.context import PassContext
from pipeir.passes.manager import (
    Compiled,
    DumpDir,
    Instrument,
    Optimized,
    PassManager,
    Phases,
    PrintAfter,
    TimePasses,
)
from pipeir.passes.pipeline import Pipeline, parse_pipeline
from pipeir.passes.registry import get, load_plugin, names

__all__ = [
    "Compiled",
    "DumpDir",
    "Instrument",
    "LoweredPass",
    "Optimized",
    "OptionError",
    "Pass",
    "PassBase",
    "PassContext",
    "PassManager",
    "Phases",
    "Pipeline",
    "PrintAfter",
    "TimePasses",
    "get",
    "load_plugin",
    "names",
    "parse_pipeline",
]
