"""Planning a pipeline: where to cut a model and which schedule to run, from per-piece costs
(`pipeirc plan`). Pure functions of the costs; the profiling that measures them lives in
`pipeir.runtime.profile`, the plan file in `pipeir.plan.planfile`."""

from pipeir.memunit import MemoryLimit
from pipeir.plan.layers import LayerCost, Link
from pipeir.plan.search import Choice, Plan, plan

__all__ = ["Choice", "LayerCost", "Link", "MemoryLimit", "Plan", "plan"]
