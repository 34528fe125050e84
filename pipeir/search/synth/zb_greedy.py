"""The Zero Bubble paper's automatic scheduler (Qi et al., ICLR 2024, sec. 3.1; the
`manual_order` heuristic of sail-sg/zero-bubble-pipeline-parallelism,
megatron/core/pipeline_parallel/auto_schedule.py), re-implemented as the external anchor synth
is compared against (bench/synth.py) and as one more warm start.

One stage per rank, backwards split into I ("B" in the paper) and W. Per rank it keeps how
far it has got (e), its live memory and its accumulated bubble; it warms up with as many
forwards as fit before the first I can arrive, then for each micro-batch places an F on every
rank (top down) and an I (bottom up), filling waits with pending W ops when that does not add
more bubble than the worst rank already has, and running W ops early when memory would
otherwise overflow. Eight settings of its three switches are tried and the best kept, as
`initial_solution` does. The paper's code then hands this to an ILP that ships disabled; we
hand it to `pipeir.search.synth.model` instead.

Differences from the original: costs and transfer times are pipeir's per stage and per
boundary instead of one communication cost, memory is pipeir's rule (F holds an activation,
I frees what W does not need, W the rest: `pipeir.memmodel`), and the result is timed by
pipeir's simulator.
"""

from __future__ import annotations

from itertools import product

from pipeir.ops import Op
from pipeir.schedule import Schedule
from pipeir.search.synth.problem import Problem


class _NoFit(Exception):
    """The heuristic ran out of memory to place the next op."""


def zb_greedy(problem: Problem) -> Schedule | None:
    """The best of the heuristic's eight variants (None: it needs a split, one stage per
    rank, equal micro-batches, or more memory than the limit)."""
    c = problem.config
    if not problem.split or c.stages != c.ranks or not problem.mb_uniform:
        return None
    best: tuple[float, Schedule] | None = None
    for flags in product((True, False), repeat=3):
        try:
            progs = _order(problem, *flags)
        except _NoFit:
            continue
        s = problem.build([progs[c.placement.index(r)] for r in range(c.ranks)], "zb_greedy")
        t = problem.step_time(s)
        if best is None or t < best[0]:
            best = (t, s)
    return None if best is None else best[1]


def _order(problem: Problem, allow_bubble_before_first_b: bool, prioritize_b: bool,
           no_bubble_greedy: bool) -> list[list[Op]]:
    """One run of `manual_order`: the op order of each stage."""
    n, nmb = problem.config.stages, problem.config.microbatches
    costs = problem.costs
    kinds = "FIW"
    cost = [[costs.cost(Op(k, s, 0)) for k in kinds] for s in range(n)]  # type: ignore[arg-type]
    mem = [problem.weight(s) for s in range(n)]
    kept = [problem.memory(s).kept_for_w for s in range(n)]  # (I frees the rest)
    inf = float("inf")
    max_mem = [problem.memory_limit if problem.memory_limit is not None else inf] * n

    def comm(a: int, b: int) -> float:
        return costs.transfer_time(a, b, problem.rank(Op("F", a, 0)) == problem.rank(Op("F", b, 0)))

    done = [[0] * n for _ in range(3)]  # F, I, W placed so far per stage
    end_t: dict[tuple[int, int, int], float] = {}
    e, m, bubble = [0.0] * n, [0.0] * n, [0.0] * n
    order: list[list[Op]] = [[] for _ in range(n)]

    def put(j: int, k: int) -> None:
        i = done[k][j]
        delta = mem[j] if k == 0 else (-kept[j] if k == 2 else kept[j] - mem[j])
        if m[j] + delta > max_mem[j] + 1e-9:
            raise _NoFit
        t = e[j] + cost[j][k]
        free = t
        if j > 0 and k == 0:
            t = max(t, end_t[0, j - 1, i] + comm(j - 1, j) + cost[j][k])
        if j < n - 1 and k == 1:
            t = max(t, end_t[1, j + 1, i] + comm(j, j + 1) + cost[j][k])
        if done[0][j] > 0:
            bubble[j] += t - free
        e[j] = t
        end_t[k, j, i] = t
        m[j] += delta
        done[k][j] += 1
        order[j].append(Op(kinds[k], j, i))  # type: ignore[arg-type]

    def fill_w_before(j: int, ready: float) -> None:
        """Run pending W ops while they fit before `ready`; then maybe one more."""
        _, b, w = done
        while w[j] < b[j] and e[j] + cost[j][2] <= ready:
            put(j, 2)
        if w[j] < b[j] and e[j] < ready:
            if ready - e[j] <= max(bubble) - bubble[j]:
                if no_bubble_greedy:
                    put(j, 2)
            else:
                put(j, 2)

    def free_memory(j: int, need: float) -> None:
        while m[j] + need > max_mem[j] + 1e-9:
            if done[2][j] >= done[1][j]:
                raise _NoFit
            put(j, 2)

    f, b, w = done
    for i in range(nmb):
        if i == 0:
            for j in range(n):
                put(j, 0)
            required = [0] * n
            last_t = 0.0
            for j in range(n - 1, -1, -1):
                if j == n - 1:
                    last_t = end_t[0, j, i] + cost[j][1]
                    continue
                cm = comm(j, j + 1)
                cur_m, cur_t = m[j], e[j]
                while f[j] + required[j] < nmb and cur_m + mem[j] <= max_mem[j] + 1e-9:
                    if allow_bubble_before_first_b:
                        if cur_t + cost[j][0] > last_t + cm:
                            break
                    elif cur_t >= last_t + cm:
                        break
                    cur_m += mem[j]
                    cur_t += cost[j][0]
                    required[j] += 1
                last_t = max(cur_t, last_t + cm) + cost[j][1]
            for j in range(n):
                while j > 0 and required[j] > 0 and required[j] >= required[j - 1] \
                        and f[j] + required[j] < nmb:
                    required[j] -= 1
                # NOTE: the loop above keeps a stage's count when it would finish every
                # micro-batch, which can be more forwards than the stage before runs (a
                # dearer first stage, tiny costs); a forward needs its input, so clamp
                if j > 0:
                    required[j] = min(required[j], f[j - 1] + required[j - 1] - f[j])
            for j in range(n):
                for _ in range(required[j]):
                    put(j, 0)
            for j in range(n - 1, -1, -1):
                put(j, 1)
            continue
        required = [0] * n
        for j in range(n):
            if f[j] >= nmb:
                continue
            if j + 1 < n and f[j] >= f[j + 1] + 2 and prioritize_b:
                nxt = e[j + 1] + cost[j + 1][0] + cost[j + 1][1] + comm(j, j + 1)
                if e[j] >= nxt:
                    continue
                w_cost, w_cnt, with_w = 0.0, 0, m[j] + mem[j]
                while with_w > max_mem[j] + 1e-9 and w[j] + w_cnt < b[j]:
                    w_cost += cost[j][2]
                    with_w -= mem[j]
                    w_cnt += 1
                if e[j] + cost[j][0] + w_cost <= nxt:
                    required[j] = 1
                    continue
                if nxt - e[j] <= max(bubble) - bubble[j]:
                    continue
            required[j] = 1
        for j in range(n - 2, -1, -1):
            required[j] = min(required[j], required[j + 1])
        for j in range(n):
            if not required[j]:
                continue
            free_memory(j, mem[j])
            if j > 0:
                fill_w_before(j, end_t[0, j - 1, f[j]] + comm(j - 1, j))
            put(j, 0)
        for j in range(n - 1, -1, -1):
            free_memory(j, 0.0)
            if j + 1 < n:
                fill_w_before(j, end_t[1, j + 1, i] + comm(j, j + 1))
            if j == 0 and f[j] == nmb:
                while w[j] < b[j]:
                    put(j, 2)
            put(j, 1)
    for j in range(n):
        while w[j] < nmb:
            put(j, 2)
    return order
