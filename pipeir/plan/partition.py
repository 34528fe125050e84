"""Choosing where to cut: a dynamic program over contiguous ranges of pieces (Alpa's stage
construction, torchgpipe's balance-by-time), and the lower bound a split's step cannot beat.

NOTE (the dynamic program). A split of n pieces into P stages is scored by its worst stage,
`max_k cost(lo_k, hi_k, k)`, where `cost` may depend on the stage's range and its position
(the memory a stage holds depends on how many micro-batches are in flight there, which
depends on k). `best[j][k]` keeps the `keep` best splits of the first j pieces into k stages.
Keeping the best few rather than one is exact: `max(a, c)` never decreases as `a` grows, so
the `keep` best splits of pieces [0, j) that end with the stage [i, j) extend `keep` best
splits of [0, i). O(n^2 * P * keep) evaluations; `cost` returning None marks a stage that
cannot be (over the memory budget), and no split uses it.

NOTE (the lower bound of a split, for schedules with one stage per rank). With stages
k = 0..P-1, the hand-off after stage t taking c_t (`Link.transfer` of its bytes), and M
micro-batches:

    head_k = sum_{t<k} (F_t + c_t)       micro-batch 0 reaches stage k no earlier
    tail_k = sum_{0<t<k} (c_t + I_t) + c_0 + W_0
                                          the last input gradient stage k computes must
                                          still cross every earlier stage, and stage 0's
                                          backward (W_0, its whole backward) ends the step
    step >= head_k + M (F_k + I_k + W_k)                 stage k's work, after head_k
    step >= head_k + M (F_k + I_k) + tail_k   (k > 0)    its last I, then the way back

each term a time no schedule can overlap (one rank does one op at a time; a stage's ops wait
for their inputs). A schedule without split backwards runs B in one op instead of I then W,
so the bound takes the smaller of B and I + W for a backward, of B and I for an input
gradient. The bound is the largest over k. It ignores memory: a budget can only raise
the best step, so the distance from the bound includes what the budget costs. Minimised
over all splits (the same dynamic program with this per-stage score, transfers dropped, since
the hand-offs depend on where the earlier cuts fall) it bounds every split with one stage per
rank; interleaving shortens the fill, so what bounds every split and schedule is only
`universal_bound`, M times the larger of a balanced rank's work and the heaviest piece's.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator, Sequence

from pipeir.plan.layers import Cut, LayerCost, Link, bounds, stage_cost, stages_of

#: A stage's score: (first piece, end piece, stage index) -> score, or None if infeasible.
StageScore = Callable[[int, int, int], float | None]


def best_splits(pieces: int, stages: int, score: StageScore, keep: int = 1
                ) -> list[tuple[float, Cut]]:
    """The `keep` splits of `pieces` pieces into `stages` non-empty contiguous stages with
    the smallest worst-stage score, best first (ties in cut order); [] if none is feasible."""
    if not 1 <= stages <= pieces:
        return []
    # best[k][j]: the `keep` best (score, cut) of pieces [0, j) in k stages
    best: list[dict[int, list[tuple[float, Cut]]]] = [{0: [(float("-inf"), ())]}]
    for k in range(stages):
        layer: dict[int, list[tuple[float, Cut]]] = {}
        last = k == stages - 1
        ends = [pieces] if last else range(k + 1, pieces - (stages - k - 1) + 1)
        for j in ends:
            found: list[tuple[float, Cut]] = []
            for i, prefix in best[k].items():
                if i >= j:
                    continue
                s = score(i, j, k)
                if s is None:
                    continue
                found += [(max(v, s), cut + ((i,) if k else ())) for v, cut in prefix]
            if found:
                layer[j] = heapq.nsmallest(keep, found)
        best.append(layer)
    return best[stages].get(pieces, [])


def work_score(layers: Sequence[LayerCost]) -> StageScore:
    """A stage's compute per micro-batch (torchgpipe's balance by time)."""
    pre = _prefix([x.work for x in layers])
    return lambda lo, hi, k: pre[hi] - pre[lo]


def bound_score(layers: Sequence[LayerCost], microbatches: int) -> StageScore:
    """A stage's term of the lower bound (module NOTE) with free transfers; stage 0's extent
    is not known to one stage's score, so its tail counts every piece's I after the first
    and the first piece's backward only (smaller than the true tail: still a bound)."""
    f = _prefix([x.F for x in layers])
    i_ = _prefix([_input(x) for x in layers])
    first = _backward(stage_cost(layers, 0, 1, True))

    def score(lo: int, hi: int, k: int) -> float:
        s = stage_cost(layers, lo, hi, k == 0)
        out = f[lo] + microbatches * (s.F + _backward(s))
        if k:
            out = max(out, f[lo] + microbatches * (s.F + _input(s)) + i_[lo] - i_[1] + first)
        return out

    return score


def lower_bound(layers: Sequence[LayerCost], cut: Cut, microbatches: int, link: Link,
                placement: Sequence[int] | None = None) -> float:
    """The bound of the module NOTE for this split (transfers included). With `placement`
    (virtual stage -> rank: interleaved or V-shaped schedules) a rank holding several stages
    does all their work after the earliest of their heads, and its last input gradient is
    followed by the shortest of their tails; a hand-off between stages of one rank is free."""
    st = stages_of(layers, cut)
    place = list(placement) if placement is not None else list(range(len(st)))
    heads, tails = [0.0], [0.0]
    for k in range(1, len(st)):
        c = 0.0 if place[k] == place[k - 1] else link.transfer(st[k - 1].activation_bytes)
        heads.append(heads[-1] + st[k - 1].F + c)
        tails.append(tails[-1] + c + (_input(st[k - 1]) if k > 1 else _backward(st[0])))
    out = 0.0
    for rank in sorted(set(place)):
        mine = [k for k in range(len(st)) if place[k] == rank]
        head = min(heads[k] for k in mine)
        out = max(out, head + microbatches * sum(st[k].F + _backward(st[k]) for k in mine),
                  head + microbatches * sum(st[k].F + _input(st[k]) for k in mine)
                  + min(tails[k] for k in mine))
    return out


def universal_bound(layers: Sequence[LayerCost], ranks: int, microbatches: int) -> float:
    """No split and no schedule beats this: M times the larger of a perfectly balanced
    rank's work and the heaviest piece's (a piece is never cut)."""
    works = [least_work(x) for x in layers]
    return microbatches * max(sum(works) / ranks, max(works))


def count_chunkings(pieces: int, ranks: int) -> int:
    """How many (split, placement) pairs `chunkings` yields: per chunk count k, the splits
    C(pieces - 1, k - 1) times the placements of a path of k chunks on named-in-order ranks
    with neighbours apart."""
    total = 0
    for k in range(1, pieces + 1):
        # colourings of a k-path with neighbours apart, first use in order, <= ranks colours
        ways = [0, 1] + [0] * (ranks - 1)  # ways[u]: of those using u ranks
        for _ in range(k - 1):
            ways = [(ways[u] * (u - 1) if u else 0) + (ways[u - 1] if u else 0)
                    for u in range(ranks + 1)]
        total += math.comb(pieces - 1, k - 1) * sum(ways)
    return total


def chunkings(pieces: int, ranks: int) -> Iterator[tuple[Cut, list[int]]]:
    """Every split of `pieces` into contiguous chunks with every placement of the chunks on
    up to `ranks` ranks (one stage per rank, interleaved, V-shaped or any other order), up to
    what cannot change a step: neighbouring chunks on one rank are one chunk (the hand-off
    between them is free), and ranks are named in the order they are first used (a
    relabelling). Their number grows as ranks ** pieces (`count_chunkings`)."""
    def grow(start: int, cut: list[int], place: list[int], used: int
             ) -> Iterator[tuple[Cut, list[int]]]:
        for end in range(start + 1, pieces + 1):
            for rank in range(min(used + 1, ranks)):
                if place and rank == place[-1]:
                    continue
                place.append(rank)
                if end == pieces:
                    yield tuple(cut), list(place)
                else:
                    cut.append(end)
                    yield from grow(end, cut, place, max(used, rank + 1))
                    cut.pop()
                place.pop()

    yield from grow(0, [], [], 0)


def least_work(x: LayerCost) -> float:
    """A piece's least work for one micro-batch on its rank: its forward and its backward
    (`_backward`), whatever the schedule."""
    return x.F + _backward(x)


def _backward(s: LayerCost) -> float:
    """A backward's least time: B, or I then W where the schedule splits it (a profile
    measures both, and either may be the smaller)."""
    return min(s.B, s.I + s.W)


def _input(s: LayerCost) -> float:
    """The least time before a backward has the input gradient: I, or B unsplit."""
    return min(s.I, s.B)


def uniform_cut(pieces: int, stages: int) -> Cut:
    """`pipeir.models.splittable.uniform_points` as piece indices."""
    middle = pieces - 2
    if middle >= stages:
        return tuple(1 + s * middle // stages for s in range(1, stages))
    return tuple(s * pieces // stages for s in range(1, stages))


def _prefix(xs: Sequence[float]) -> list[float]:
    out = [0.0]
    for x in xs:
        out.append(out[-1] + x)
    return out


__all__ = ["StageScore", "best_splits", "bound_score", "bounds", "chunkings", "count_chunkings",
           "least_work", "lower_bound", "uniform_cut", "universal_bound", "work_score"]
