"""Synthesised schedules train: on 2 ranks (one and two chunks each, B or I + W, with and
without the overlap pass) the pipelined parameters and gradients equal single-process
training, like every library schedule in test_runtime."""

from __future__ import annotations

import pytest
from runtime_helpers import TIMEOUT, assert_matches_reference, runtime_job

from pipeir.runtime.launch import launch
from pipeir.search.synth import make_problem, synthesize
from pipeir.sim import CostModel

pytestmark = pytest.mark.mp

# heavy last stage, W < I, a non-free link: the solver's order is not a library one
COSTS = CostModel.from_settings({"F": 1.0, "I": 1.2, "W": 0.6, "stage.1.F": 1.6,
                                 "stage.1.I": 1.8, "latency": 0.3})


def test_synthesised_schedules_match_single_process() -> None:
    found = [synthesize(make_problem(COSTS, 2, 4, v=v, placement=placement, split=split,
                                     memory_limit=2), time_limit=10).schedule
             for v, placement, split in ((1, "loop", False), (1, "loop", True),
                                         (2, "vshape", True), (2, "loop", False))]
    jobs = [runtime_job(s, passes, 2)
            for s, passes in zip(found, (None, "overlap", None, "overlap"))]
    result = launch(jobs, 2, timeout_s=TIMEOUT)
    assert_matches_reference(jobs, result)
