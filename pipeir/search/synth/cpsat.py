"""OR-Tools' CP-SAT, the solver behind synth. It comes with the optional `synth` extra (it
and the pandas it pulls are ~160 MB that nothing else needs), so every use of it imports it
from here: without it, the first use says in one line what to install, whichever door it
came through (`pipeirc synth`, the `synth` pass, or the Python API)."""

from __future__ import annotations

from pipeir.diagnostics import UsageError

try:
    from ortools.sat.python import cp_model
except ImportError:
    raise UsageError("synthesis needs OR-Tools, which is not installed: "
                     "pip install 'pipeir[synth]'") from None

__all__ = ["cp_model"]
