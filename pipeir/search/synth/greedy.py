"""A memory-aware list scheduler: a warm start for shapes no library schedule fits (say two
chunks per rank in loop placement under 1F1B's memory, where interleaved 1F1B needs more).

It runs the ranks forward in time with the problem's costs; whenever a rank is free it starts,
of the ops whose inputs have arrived, the first by a priority of kinds (e.g. I before F before
W: zero-bubble-like; I before W before F: 1F1B-like), micro-batches in order and deeper chunks
first.

Memory: a forward runs only if, after it, the rank's micro-batches in flight can still all
finish in micro-batch order: the oldest's remaining forwards on the rank fit in what is free,
the next's in that plus what the oldest frees when it is done, and so on (the banker's test,
in a fixed order; a micro-batch frees nothing on a rank before its last forward there, since
every backward follows the last stage's forward). Then the oldest micro-batch not yet done can
always move on every rank (each rank admits micro-batches in order, so one where it has not
entered holds none younger), and the scheduler cannot get stuck; the result is checked
anyway, and variants that fail are dropped. How many micro-batches a rank lets in at once is
the variant's `caps`: as many as its memory holds whole (`reserve`, which never waits for
memory once in), or more on the earlier ranks (`waves`).

NOTE (why more than the memory holds whole). An early rank of a V waits longest for its first
backward, and a schedule that only lets in what its memory holds whole leaves it idle in that
wait. On compute-bound.toml cut into four chunks in a V at 1F1B's memory (p = 4, m = 8), the
optimum (101.075, found by the window search) starts rank 0 with six first-chunk forwards; the
list scheduler's best is 105.74 letting in 4 per rank, 105.19 letting in 6, 5, 5, 4, and the
solver from the latter reached 101.075 in 40 s in three seeds of three, from the former
101.36-101.56.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence

from pipeir.ops import Op
from pipeir.schedule import Schedule
from pipeir.search.synth.problem import Problem
from pipeir.sim.engine import Timing

#: Kind priorities tried (earlier wins); B stands in for I when backwards are not split.
PRIORITIES = ("IFW", "IWF", "FIW")

#: The most micro-batches beyond `reserve` that the first rank lets in (`waves`).
MOST_EXTRA = 3

Caps = tuple[float, ...]


def greedy(problem: Problem, seed: int = 0, work: int = 400_000,
           deadline: float | None = None) -> list[Schedule]:
    """The valid schedules of every variant (needs equal micro-batch costs): each priority
    with each of `waves`' caps, and randomised ones (caps drawn from them, kind priorities
    jittered at every choice) as many as about `work` candidate looks allow (a GRASP-style
    restart; cheap next to the solver, and the solver starts from whichever is fastest).
    With a `deadline` (a `time.perf_counter()` value), the variants that start before it, in
    that order, and at least until one is valid (0.5 s each at 8,192 ops)."""
    return list(each_greedy(problem, seed, work, deadline))


def each_greedy(problem: Problem, seed: int = 0, work: int = 400_000,
                deadline: float | None = None) -> Iterator[Schedule]:
    """`greedy`'s schedules one at a time, as each variant finishes (a caller that has what
    it needs stops running the rest)."""
    if not problem.mb_uniform:
        return
    graph = _Graph(problem)
    found = False
    for prio, caps, jitter in variants(problem, seed, work):
        if found and deadline is not None and time.perf_counter() > deadline:
            return
        progs = _run(problem, graph, prio, caps, jitter)
        if progs is None:
            continue
        s = problem.build(progs, f"greedy_{prio.lower()}{'_random' if jitter else ''}")
        if Timing(s, problem.costs, problem.comm).complete and problem.fits(s):
            found = True
            yield s


def variants(problem: Problem, seed: int = 0, work: int = 400_000
             ) -> list[tuple[str, Caps, random.Random | None]]:
    """(kind priority, caps, jitter) of every run `greedy` makes, deterministic first."""
    c = problem.config
    looks = len(problem.ops) * c.stages * (3 if problem.split else 2)
    rng = random.Random(seed)
    family = waves(problem)
    runs: list[tuple[str, Caps, random.Random | None]] = \
        [(prio, caps, None) for caps in family for prio in PRIORITIES]
    runs += [(rng.choice(PRIORITIES), rng.choice(family), random.Random(rng.random()))
             for _ in range(min(40, work // max(1, looks)))]
    return runs


def reserve(problem: Problem) -> Caps:
    """Per rank, how many micro-batches its memory holds whole (all its chunks' activations
    at once); unbounded without a limit, or where they weigh nothing."""
    c, inf = problem.config, float("inf")
    if problem.memory_limit is None:
        return (inf,) * c.ranks
    return tuple(problem.budget // problem.mb_memory(r) if problem.mb_memory(r) > 0 else inf
                 for r in range(c.ranks))


def waves(problem: Problem) -> list[Caps]:
    """`reserve`, then with 1 to `MOST_EXTRA` extra micro-batches on the first rank, tapering
    to none on the last (1F1B's warm-up shape: rank r waits for its first backward about
    p - 1 - r forwards longer than the last rank). Distinct tuples only; one without a
    limit, or with one rank."""
    c, base = problem.config, reserve(problem)
    out = [base]
    if problem.memory_limit is None or c.ranks == 1:
        return out
    for extra in range(1, MOST_EXTRA + 1):
        caps = tuple(b + round(extra * (c.ranks - 1 - r) / (c.ranks - 1))
                     for r, b in enumerate(base))
        if caps not in out:
            out.append(caps)
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


class _Memory:
    """Each rank's micro-batches in flight, oldest first (a rank lets them in in order): what
    each holds, what its forwards there will still take, and how many of its forwards and
    releases there are still to run (counted, not read off the sizes, which may be zero or
    not sum exactly). The banker's test of the module's docstring."""

    def __init__(self, problem: Problem, caps: Sequence[float]):
        c = problem.config
        self.caps, self.budget = caps, problem.budget
        self.whole = [problem.mb_memory(r) for r in range(c.ranks)]
        self.chunks = [len(c.stages_of(r)) for r in range(c.ranks)]
        self.held: list[dict[int, float]] = [{} for _ in range(c.ranks)]
        self.need: list[dict[int, float]] = [{} for _ in range(c.ranks)]
        self.ops_left: list[dict[int, list[int]]] = [{} for _ in range(c.ranks)]  # [F, release]
        self.total = [0.0] * c.ranks

    def admits(self, r: int, mb: int, size: float, first: bool) -> bool:
        """Whether a forward of `mb` holding `size` may run on rank `r` now."""
        held, need = self.held[r], self.need[r]
        if first and len(held) >= self.caps[r]:
            return False
        free = self.budget - self.total[r] - size
        for m in held:  # oldest first
            still = need[m] - (size if m == mb else 0.0)
            if still > free:
                return False
            free += held[m] + (size if m == mb else 0.0)
        return not first or self.whole[r] - size <= free

    def forward(self, r: int, mb: int, size: float) -> None:
        """A forward of `mb` holding `size` has run on rank `r` (`admits` said yes)."""
        if mb not in self.held[r]:
            self.held[r][mb], self.need[r][mb] = 0.0, self.whole[r]
            self.ops_left[r][mb] = [self.chunks[r], self.chunks[r]]
        self.held[r][mb] += size
        self.need[r][mb] -= size
        self.total[r] += size
        left = self.ops_left[r][mb]
        left[0] -= 1
        if not left[0]:
            self.need[r][mb] = 0.0

    def release(self, r: int, mb: int, size: float) -> None:
        """The op freeing `mb`'s activation of `size` has run on rank `r`."""
        self.held[r][mb] -= size
        self.total[r] -= size
        left = self.ops_left[r][mb]
        left[1] -= 1
        if not left[1]:
            del self.held[r][mb], self.need[r][mb], self.ops_left[r][mb]


def _run(problem: Problem, graph: _Graph, prio: str, caps: Caps,
         jitter: random.Random | None = None) -> list[list[Op]] | None:
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
    first = [c.stages_of(r)[0] for r in range(c.ranks)]
    releases = {i for i, op in enumerate(ops) if op == problem.release_op(op.stage, op.mb)}
    size = [problem.weight(s) for s in range(c.stages)]
    memory = _Memory(problem, caps)
    progs: list[list[Op]] = [[] for _ in range(c.ranks)]
    total = len(ops)

    def ready(k: str, s: int) -> tuple[int, float] | None:
        """The number of the next op of kind `k` on stage `s` and the earliest it can start,
        if its inputs have run and (for a forward) its memory is safe to take."""
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
        if k == "F" and not memory.admits(r, mb, size[s], s == first[r]):
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
        if k == "F":
            memory.forward(r, m, size[s])
        if i in releases:
            memory.release(r, m, size[s])
    return progs
