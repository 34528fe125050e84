"""Cost model and discrete-event simulator: bubble, memory and timelines.

    >>> import pipeir
    >>> from pipeir.sim import simulate
    >>> r = simulate(pipeir.library.get("1f1b", ranks=4, microbatches=8))
    >>> round(r.bubble, 3), r.makespan
    (0.273, 33.0)
"""

from pipeir.sim.costs import CostModel
from pipeir.sim.engine import COMM_MODELS, simulate
from pipeir.sim.result import SimResult, Transfer

__all__ = ["COMM_MODELS", "CostModel", "SimResult", "Transfer", "simulate"]
