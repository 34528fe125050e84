"""Sizes the exact model cannot close: solve a short pipeline, then repeat its steady state.

A schedule in which every micro-batch costs the same is, per rank, a word over a few tokens
(kind, stage): the model takes each token's ops in micro-batch order (see `model`), so the
word says everything. In the steady state of a good schedule a window of the word holds each
of the rank's tokens exactly once (ZB-H1's `F I W`, 1F1B's `F B`): one *round*, one more
micro-batch through the rank. So synthesis at M micro-batches

1. solves the same problem at M0 < M micro-batches (warm-up, steady state, cool-down, all
   found by the solver),
2. picks on every rank the round around the same micro-batch (near the middle, so warm-up and
   cool-down stay as solved) and repeats it M - M0 times in place,
3. keeps the extended schedule if it is valid and within the memory limit (a round holds as
   much as it frees, so the peak is the short schedule's), trying a few anchor micro-batches
   and keeping the fastest.

This is the repeating-block idea of Tessel (Lin et al., 2024) and of the controllable-memory
building blocks (Qi et al., 2024), with the block read off a solved short pipeline rather than
searched on its own. The result then warm-starts the full model for the time that is left, and
the bound reported is the full problem's (`Problem.lower_bound` or the solver's).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeir.ops import Kind, Op
from pipeir.schedule import Schedule
from pipeir.search.synth.problem import Problem
from pipeir.sim.engine import Timing

Token = tuple[Kind, int]


@dataclass(frozen=True)
class Extended:
    """A schedule grown from a short one: how (for the report) and what."""

    schedule: Schedule
    step: float
    short_microbatches: int
    rounds: int
    anchor: int

    def describe(self) -> str:
        return (f"solved {self.short_microbatches} micro-batches, repeated the steady round "
                f"around micro-batch {self.anchor} {self.rounds} more times")


def short_problem(problem: Problem, microbatches: int) -> Problem:
    """The same problem with fewer micro-batches."""
    return replace(problem, config=replace(problem.config, microbatches=microbatches))


def extend(problem: Problem, short: Schedule, anchors: int = 8) -> Extended | None:
    """`short` (a schedule of `short_problem(problem, M0)`) grown to the problem's
    micro-batches by repeating one steady round per rank; None when no anchor gives a valid
    schedule within the limit."""
    m0, m = short.config.microbatches, problem.config.microbatches
    words = [[(op.kind, op.stage) for op in prog] for prog in short.programs]
    best: Extended | None = None
    for c in sorted(range(m0), key=lambda k: (abs(2 * k - m0), k))[:anchors]:
        grown = []
        for r, word in enumerate(words):
            window = _round_at(problem, r, word, short.programs[r], c)
            if window is None:
                break
            i, n = window
            grown.append(word[:i + n] + word[i:i + n] * (m - m0) + word[i + n:])
        if len(grown) < len(words):
            continue
        sched = problem.build([_ops(w) for w in grown], short.name)
        if not Timing(sched, problem.costs, problem.comm).complete or not problem.fits(sched):
            continue
        step = problem.step_time(sched)
        if best is None or step < best.step:
            best = Extended(sched, step, m0, m - m0, c)
    return best


def _round_at(problem: Problem, rank: int, word: list[Token], prog: tuple[Op, ...],
              mb: int) -> tuple[int, int] | None:
    """A window (start, length) of `word` that holds each of the rank's tokens once and
    covers the F of micro-batch `mb` on the rank's first stage."""
    stages = problem.config.stages_of(rank)
    kinds = ("F", "I", "W") if problem.split else ("F", "B")
    n = len(stages) * len(kinds)
    pos = prog.index(Op("F", stages[0], mb))
    for i in range(max(0, pos - n + 1), min(pos, len(word) - n) + 1):
        if len(set(word[i:i + n])) == n:
            return i, n
    return None


def _ops(word: list[Token]) -> list[Op]:
    """A token word as ops: each token's k-th occurrence is micro-batch k."""
    seen: dict[Token, int] = {}
    out = []
    for tok in word:
        k = seen.get(tok, 0)
        seen[tok] = k + 1
        out.append(Op(tok[0], tok[1], k))
    return out
