"""A memory-aware list scheduler: a warm start for shapes no library schedule fits (say two
chunks per rank in loop placement under 1F1B's memory, where interleaved 1F1B needs more).

It runs the ranks forward in time with the problem's costs; whenever a rank is free it starts,
of the ops whose inputs have arrived, the first by a priority of kinds (e.g. I before F before
W: zero-bubble-like; I before W before F: 1F1B-like), micro-batches in order and deeper chunks
first. A micro-batch enters a rank (the F of its first chunk there) only while the memory it
will hold on every chunk of that rank fits beside what the micro-batches already in flight
reserve, so once in, it never waits for memory. Each rank takes micro-batches in order, and the
oldest in flight can always move, so the scheduler does not get stuck; the result is checked
anyway, and variants that fail are dropped.
"""

from __future__ import annotations

import random

from pipeir.ops import Op
from pipeir.schedule import Schedule
from pipeir.sim.engine import Timing
from pipeir.synth.problem import Problem

#: Kind priorities tried (earlier wins); B stands in for I when backwards are not split.
PRIORITIES = ("IFW", "IWF", "FIW")


def greedy(problem: Problem, seed: int = 0, work: int = 400_000) -> list[Schedule]:
    """The valid schedules of every priority variant (needs equal micro-batch costs), and of
    randomised ones: kind priorities jittered at every choice, as many runs as about `work`
    candidate looks allow (a GRASP-style restart; cheap next to the solver, and the solver
    starts from whichever is fastest)."""
    if not problem.mb_uniform:
        return []
    c = problem.config
    looks = len(problem.ops) * c.stages * (3 if problem.split else 2)
    rng = random.Random(seed)
    runs: list[tuple[str, random.Random | None]] = [(prio, None) for prio in PRIORITIES]
    runs += [(rng.choice(PRIORITIES), random.Random(rng.random()))
             for _ in range(min(40, work // max(1, looks)))]
    graph = _Graph(problem)
    out = []
    for prio, jitter in runs:
        progs = _run(problem, graph, prio, jitter)
        if progs is None:
            continue
        s = problem.build(progs, f"greedy_{prio.lower()}{'_random' if jitter else ''}")
        if Timing(s, problem.costs, problem.comm).complete and problem.fits(s):
            out.append(s)
    return out


class _Graph:
    """The problem's ops numbered once, with each op's inputs as (number, delay) and the
    numbers of each (kind, stage)'s ops by micro-batch. NOTE: the scheduler looks at every
    queue of every rank at each step; with `Op`s as keys (hashed and compared in Python) the
    looks took nine tenths of its time, 3.4 s for the 24 runs on 384 ops."""

    def __init__(self, problem: Problem):
        self.ops = ops = problem.ops
        at = {op: i for i, op in enumerate(ops)}
        delay = {(p, q): h for p, q, h in problem.edges}
        self.inputs = [[(at[p], delay[p, op]) for p in problem.preds[op]] for op in ops]
        self.by_key: dict[tuple[str, int], list[int]] = {}
        for i, op in enumerate(ops):
            self.by_key.setdefault((op.kind, op.stage), []).append(i)
        for nums in self.by_key.values():
            nums.sort(key=lambda i: ops[i].mb)


def _run(problem: Problem, graph: _Graph, prio: str, jitter: random.Random | None = None
         ) -> list[list[Op]] | None:
    c = problem.config
    occ = [problem.occupation[op] for op in graph.ops]
    inputs, by_key, ops = graph.inputs, graph.by_key, graph.ops
    kinds = ("F", "I", "W") if problem.split else ("F", "B")
    base = {k: float(i) for i, k in enumerate(prio.replace("I", "I" if problem.split else "B"))}
    order = dict(base)
    queues = [[(k, s) for s in reversed(c.stages_of(r)) for k in kinds] for r in range(c.ranks)]
    nxt = {(k, s): 0 for k in kinds for s in range(c.stages)}
    end = [-1.0] * len(ops)  # -1: not run yet
    free = [0.0] * c.ranks
    limit = problem.memory_limit if problem.memory_limit is not None else float("inf")
    whole = [sum(problem.weight(s) for s in c.stages_of(r)) for r in range(c.ranks)]
    first = [c.stages_of(r)[0] for r in range(c.ranks)]
    releases = {i for i, op in enumerate(ops) if op == problem.release_op(op.stage, op.mb)}
    reserved = [0.0] * c.ranks
    left = {}  # (rank, mb) -> release ops still to run there
    progs: list[list[Op]] = [[] for _ in range(c.ranks)]
    total = len(ops)

    def ready(k: str, s: int) -> tuple[int, float] | None:
        """The number of the next op of kind `k` on stage `s` and the earliest it can start,
        if its inputs have run and (for a micro-batch entering its rank) its memory fits."""
        mb = nxt[k, s]
        if mb >= c.microbatches:
            return None
        i = by_key[k, s][mb]
        r = c.placement[s]
        at = free[r]
        for j, h in inputs[i]:
            e = end[j]
            if e < 0:
                return None
            if e + h > at:
                at = e + h
        if k == "F" and s == first[r] and reserved[r] + whole[r] > limit * (1 + 1e-9):
            return None
        return i, at

    done = 0
    while done < total:
        if jitter is not None:
            order = {k: v + jitter.uniform(0, 1.5) for k, v in base.items()}
        best: tuple[float, float, int, int, int] | None = None
        for r in range(c.ranks):
            for k, s in queues[r]:
                found = ready(k, s)
                if found is None:
                    continue
                i, at = found
                key = (at, order[k], ops[i].mb, -s, i)
                # the earliest start over all ranks, then the rank's priority at that time
                if best is None or key[:4] < best[:4]:
                    best = key
        if best is None:
            return None
        t, _, _, _, i = best
        r = c.placement[ops[i].stage]
        # prefer, among ops of this rank ready by t, the highest priority one
        for k, s in sorted(queues[r], key=lambda q: order[q[0]]):
            found = ready(k, s)
            if found is not None and found[1] <= t:
                i = found[0]
                break
        op = ops[i]
        k, s, m = op.kind, op.stage, op.mb
        start = max([free[r], *(end[j] + h for j, h in inputs[i])])
        end[i] = free[r] = start + occ[i]
        nxt[k, s] += 1
        progs[r].append(op)
        done += 1
        if k == "F" and s == first[r]:
            reserved[r] += whole[r]
            left[r, m] = len(c.stages_of(r))
        if i in releases:
            left[r, m] -= 1
            if not left[r, m]:
                reserved[r] -= whole[r]
    return progs
