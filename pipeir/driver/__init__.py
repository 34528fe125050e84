"""The one road from a named schedule to lowered programs: load → costs → passes →
data-parallel policy → lower.

`pipeirc` (every command), `pipeir.load` / `pipeir.compile`, tune and synth call these
functions, so the command line and the Python API cannot disagree about what a schedule
compiles to: with `dp = 2` in the costs both add the gradient reductions. Arguments are plain
values (paths, override mappings, a pass pipeline, dp), never an argparse namespace; results
are frozen dataclasses. Nothing here prints: a warning travels back as a
`Diagnostic(severity="warning")` in the result, and the caller shows it (the CLI on stderr,
the API through `warnings.warn`).
"""

from pipeir.driver.build import Build, compile_schedule, optimize, simulate, simulate_verified
from pipeir.driver.load import (
    COST_NAMES,
    Loaded,
    ScheduleRef,
    Settings,
    costs_for,
    infer_ranks,
    is_cost_setting,
    load_schedules,
    load_source,
    load_with_costs,
    override_text,
    read_source,
    source_of,
    split_costs,
    unused_costs,
    with_cost_names,
)
from pipeir.driver.plan import (
    MAX_WORLD,
    PassesArg,
    Planned,
    Replicated,
    check_replicas,
    costless,
    data_parallel,
    plan_pipeline,
    shadowed,
)
from pipeir.driver.search import SearchCosts, check_inferred, check_mb_costs, search_costs

__all__ = [
    "COST_NAMES",
    "MAX_WORLD",
    "Build",
    "Loaded",
    "PassesArg",
    "Planned",
    "Replicated",
    "ScheduleRef",
    "SearchCosts",
    "Settings",
    "check_inferred",
    "check_mb_costs",
    "check_replicas",
    "compile_schedule",
    "costless",
    "costs_for",
    "data_parallel",
    "infer_ranks",
    "is_cost_setting",
    "load_schedules",
    "load_source",
    "load_with_costs",
    "optimize",
    "override_text",
    "plan_pipeline",
    "read_source",
    "search_costs",
    "shadowed",
    "simulate",
    "simulate_verified",
    "source_of",
    "split_costs",
    "unused_costs",
    "with_cost_names",
]
