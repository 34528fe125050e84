"""A training job as the launcher hands it to its ranks: what to run, for how long, where to
save; it imports no torch, so that `pipeirc run`'s launcher need not (pipeir.runtime.forkserver's
NOTE)."""

from __future__ import annotations

import hashlib
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from pipeir.backend.instructions import Lowered

#: what a rank reports as its instruction while it saves or loads a checkpoint
SAVING_PC = -2
LOADING_PC = -3

#: checkpoints `--save` keeps by default: the newest and the one before it (a fallback if
#: the newest turns out damaged)
KEEP = 2


def new_run_id() -> str:
    """The suffix of this run's temporary directories: random, except under torchrun, where
    every rank computes its own and they must agree (from the rendezvous's address, id and
    restart count)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        key = "|".join(env.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT",
                                                 "TORCHELASTIC_RUN_ID",
                                                 "TORCHELASTIC_RESTART_COUNT"))
        return hashlib.sha256(key.encode()).hexdigest()[:12]
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class Job:
    """Train `model` for `steps` optimizer steps with one compiled schedule."""

    lowered: Lowered
    sources: tuple[str, ...]  # generated rank files, by rank
    model: str
    steps: int
    collect: bool = False  # report final parameters and last-step gradients (for tests)
    #: per-step plan (issue 7): a `pipeir.passes.reorder.StepPlanner`; each step, slot k
    #: runs micro-batch `plan.order(sizes)[k]`, the same order on every rank
    plan: Any = None
    save: str | None = None  # checkpoint directory (pipeir.runtime.checkpoint)
    save_every: int = 0  # save after every N steps (and after the last); 0: after the last
    keep: int = KEEP  # checkpoints kept in `save` (0: all)
    #: names this run's temporary checkpoint directories (new_run_id)
    run_id: str = field(default_factory=new_run_id)
    resume: str | None = None  # start from the newest checkpoint in this directory
    #: data-parallel replicas: the job runs on lowered.ranks x dp processes (pipeir.runtime.mesh)
    dp: int = 1
    #: a NaN or infinite loss only warns instead of stopping the run (runtime/guards.py)
    allow_nonfinite: bool = False
    #: the shape plan the launcher traced (`preflight`), pickled (unpickling it imports torch,
    #: which the launcher does not): input layout -> each stage's output layout; a rank traces
    #: only input layouts not in it. Empty: the ranks trace every layout.
    layouts: bytes = b""

    def __post_init__(self) -> None:
        """Replicas whose program never all-reduces a stage's gradients train apart without
        a word (each on its shard); refuse that before any process starts. (Where programs
        reduce at all, `commcheck` proved at compile time that they reduce every stage.)"""
        missing = sorted(set(range(self.lowered.stages)) - self.lowered.reduced_stages())
        if self.dp > 1 and missing:
            which = "any stage" if len(missing) == self.lowered.stages else \
                "stage" + "s" * (len(missing) > 1) + " " + ", ".join(map(str, missing))
            raise ValueError(f"{self.dp} data-parallel replicas, but the program never "
                             f"all-reduces the gradients of {which} (no `reduce-grad`): the "
                             f"replicas would train apart; lower a schedule with R ops "
                             f"(`pipeirc compile --dp {self.dp}` adds them with dp-reduce), "
                             f"or run {self.lowered.ranks} processes")


class Start(NamedTuple):
    """Where training starts: the step, and the checkpoint it resumes (None: from scratch);
    and the shape plan traced for batch(0), for the ranks (`Job.layouts`), pickled: the
    launcher passes it on unopened (unpickling it would import torch)."""

    step: int
    checkpoint: Path | None
    layouts: bytes
