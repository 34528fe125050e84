"""Find the fastest schedule for a model on a machine: search library schedules × chunks per
rank × micro-batch counts × passes in the simulator, under a memory limit.

The cost model describes the model cut into `ranks` stages, one micro-batch of a step split
into the first micro-batch count given (`microbatches[0]`, the reference). Two rescalings make
candidates comparable:

* Interleaving with v chunks per rank cuts every stage into v virtual stages: virtual stage s'
  is the s' % v-th chunk of physical stage s' // v, and costs 1/v of its time and activation
  memory; its output crosses a link like the stage's did (same bytes, same latency), which is
  why interleaving multiplies the messages, and the latency paid, by v.
* Another micro-batch count M splits the *same global batch*: op times, activation bytes and
  memory scale by M_ref / M, latency does not. More micro-batches shrink the bubble and pay
  more messages. With per-micro-batch costs (lengths), only the reference count is searched.

Memory is counted in activations per rank, as `check` counts them (`pipeir.memunit`: one per
stage, or chunk, and micro-batch; where the costs give `memory_w_bytes`, what W keeps after
I counts as that fraction of one, and the written file's costs block says so), so that every
schedule tune writes passes `check` with the same `--memory-limit`; `memory_limit` is in
that unit, `memory_bytes` in bytes. With v chunks the same bytes are v
times the count (and with M micro-batches, M_ref / M times the bytes each): bytes
(`peak bytes`, from the costs' `memory_bytes`) are what compares across v and M.
The `overlap` backend pass corresponds to the simulator's comm model: "overlapped" with the
pass, "blocking" without (see pipeir.sim.engine).

Data parallelism (`dp` > 1 in the costs, or `search(dp=D)`): every candidate gets the
`dp-reduce` pass last, so its step time includes the gradient all-reduces that the schedule
does not hide. A chunk holds 1/v of its stage's parameters (`param_bytes`); the micro-batch
count does not change them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pipeir import driver, library, limits
from pipeir.diagnostics import PipeirError, UsageError
from pipeir.driver import infer_ranks
from pipeir.memunit import UNIT
from pipeir.passes import Pipeline
from pipeir.passes.base import Pass
from pipeir.passes.reorder import Reorder
from pipeir.passes.split_backward import SplitBackward
from pipeir.schedule import Schedule
from pipeir.sim import COMM_MODELS, CostModel, simulate
from pipeir.sim.chunks import rescale
from pipeir.sim.costs import expect_costs
from pipeir.verify import fits_in, show_bytes

SPLITS = (None, "h1", "h2")


def expect_list(where: str, name: str, given: object,
                allowed: Sequence[str | None] | None = None) -> None:
    """`given` is a non-empty list (of `allowed`, or of micro-batch counts): a string or an
    int was read letter by letter, or failed deep inside, and an empty list searched nothing
    (tune's search, and plan's, which goes through it)."""
    if isinstance(given, str | int) or not isinstance(given, Sequence) or not given or (
            allowed is not None and any(x not in allowed for x in given)):
        raise UsageError(f"{where}({name}=...): a list" + (
            f" of {', '.join(map(str, allowed))}" if allowed is not None else
            " of micro-batch counts") + f", got {given!r}")


@dataclass(frozen=True)
class Candidate:
    """One point of the search space, and what the simulator says about it."""

    schedule: Schedule
    costs: CostModel
    family: str
    v: int
    microbatches: int
    passes: str  # the pass pipeline applied to the library schedule ("" for none)
    comm: str
    step_time: float
    bubble: float
    peak_memory: float  # activations held at once (`pipeir.memunit`), max over ranks
    peak_bytes: float | None
    messages: int
    exposed_reduction: float = 0.0  # step time spent only on gradient all-reduces (dp > 1)

    def fits(self, memory_limit: float | None, memory_bytes: float | None = None) -> bool:
        """Whether the candidate keeps within `memory_limit` activations and `memory_bytes`
        bytes (None: no limit)."""
        return (memory_limit is None or fits_in(self.peak_memory, memory_limit)) and \
            (memory_bytes is None or fits_in(self.peak_bytes or 0.0, memory_bytes))

    @property
    def overlap(self) -> bool:
        return self.comm == "overlapped"

    def sort_key(self) -> tuple[float, int, float, str]:
        return (self.step_time, self.messages, self.peak_memory, self.label)

    @property
    def label(self) -> str:
        return f"{self.family} v={self.v} m={self.microbatches} {self.passes} {self.comm}"


@dataclass(frozen=True)
class TuneResult:
    ranked: list[Candidate]  # within the memory limit, fastest first
    over_limit: list[Candidate]
    cut: bool = False  # the deadline stopped the search before every candidate was simulated

    @property
    def best(self) -> Candidate:
        return self.ranked[0]


#: The most chunks per rank tune interleaves. NOTE: --max-v 4096 on two ranks took 37 s and
#: 1.5 GB for candidates no model has layers for; 2^20 ran out of memory.
MAX_V = 64


def search(costs: CostModel, ranks: int, microbatches: Sequence[int],
           memory_limit: float | None = None, max_v: int = 8,
           comms: Sequence[str] = ("overlapped", "blocking"),
           splits: Sequence[str | None] = SPLITS, reorder: bool | None = None,
           dp: int | None = None, progress: Callable[[str], None] | None = None,
           deadline: float | None = None, memory_bytes: float | None = None) -> TuneResult:
    """Simulate every candidate; rank those within `memory_limit` (activations, counted with
    the costs' split: `pipeir.memunit`) and `memory_bytes` (peak bytes, which need the costs'
    `memory_bytes`) by predicted step time (then fewer messages, then less memory).
    `reorder` (default: when micro-batches differ in cost) adds the `reorder` pass to every
    candidate; `dp` (default: the costs' `dp`) replicates the pipeline and adds `dp-reduce`.
    `progress` hears of each candidate before it is simulated (`pipeir.progress`).

    Every candidate is kept (its schedule too), so the ops of all of them must fit pipeir's
    memory budget (`pipeir.limits`): past it the search is refused before any candidate is
    simulated. With a `deadline` (a `time.perf_counter()` value; synth's warm start, which
    must not outlast synth's time limit) the search is the plan's longest prefix that fits
    the budget and starts before the deadline, always at least one candidate: the plan runs
    from 1F1B and the zero-bubble V schedules to GPipe and the interleaved ones
    (`_families`)."""
    costs = expect_costs(costs, "tune's search(costs=...)") or CostModel()
    expect_list("tune's search", "microbatches", microbatches)
    expect_list("tune's search", "comms", comms, COMM_MODELS)
    expect_list("tune's search", "splits", splits, SPLITS)
    if dp is not None:
        if type(dp) is not int or dp < 1:
            raise UsageError(f"--dp {dp!r}: need at least 1 replica")
        costs = replace(costs, dp=dp)
    if ranks < 1:
        raise UsageError(f"--ranks {ranks}: need at least 1 rank")
    if memory_bytes is not None and not costs.knows_memory:
        raise UsageError("--memory-limit in bytes needs activation sizes: give memory_bytes "
                         "in the costs")
    if not 1 <= max_v <= MAX_V or max_v & (max_v - 1):
        raise UsageError(f"--max-v {max_v}: expected a power of 2 from 1 to {MAX_V} (the most "
                         "chunks per rank tune tries)")
    if not microbatches or min(microbatches) < 1:
        raise UsageError("--microbatches: need positive micro-batch counts")
    known = infer_ranks(costs)
    if known is not None and known > ranks:
        raise UsageError(f"the costs describe {known} stages (stage.{known - 1}.* is set) but "
                         f"--ranks is {ranks}; tune searches one model stage per rank")
    varied = bool(costs.mb or costs.stage_mb)
    if varied and len(set(microbatches)) > 1:
        raise UsageError("the costs give per-micro-batch times (lengths or mb.M.K), which fix "
                         "the number of micro-batches; give one --microbatches value")
    do_reorder = varied if reorder is None else reorder
    ref = microbatches[0]
    ranked: list[Candidate] = []
    over: list[Candidate] = []
    plan: list[tuple[Schedule, CostModel, str, int, int, str | None, str]] = []
    refused: list[str] = []
    specs = [(m, family, v) for m in dict.fromkeys(microbatches)
             for family, v in _families(ranks, m, max_v)]
    # NOTE (what is held): every library schedule of the plan, and each candidate's own
    # schedule where passes made one (a split, reorder or dp-reduce); a candidate with no
    # passes is the library schedule itself (`PassManager.run` returns its input)
    passes = do_reorder or costs.dp > 1  # (costs has dp by now)
    held = 0
    cut = False
    for n, (m, family, v) in enumerate(specs):
        if plan and deadline is not None and time.perf_counter() > deadline:
            cut = True
            break
        try:
            base = library.get(family, ranks=ranks, microbatches=m,
                               **({"v": v} if family == "interleaved-1f1b" else {}))
        except PipeirError as e:  # e.g. interleaved 1F1B needs m to be a multiple of
            refused.append(e.diagnostics[0].message)  # its rounds; or a size limit
            continue
        backwards = sum(op.kind == "B" for op in base)
        own = [(split, comm, _own_ops(len(base), backwards, split, passes))
               for split, comm in _variants(family, splits, comms)]
        if deadline is not None:  # what fits (the first library schedule always does)
            if held + len(base) > limits.max_ops():
                continue
            held += len(base)
            kept = []
            for x in own:
                if held + x[2] <= limits.max_ops():
                    kept.append(x)
                    held += x[2]
            own = kept
        else:
            held += len(base) + sum(x[2] for x in own)
            if held > limits.max_ops():
                later = sum(_planned(ranks, f, w, k, _variants(f, splits, comms), passes)
                            for k, f, w in specs[n + 1:])
                limits.check_ops(f"tune's search ({ranks} ranks, every candidate kept for the "
                                 "ranking)", held + later)
        chunk_costs = rescale(costs, ranks, v, ref / m)
        plan += [(base, chunk_costs, family, v, m, split, comm) for split, comm, _ in own]
    for i, (base, chunk_costs, family, v, m, split, comm) in enumerate(plan, 1):
        if i > 1 and deadline is not None and time.perf_counter() > deadline:
            cut = True
            break
        if progress is not None:
            progress(f"candidate {i}/{len(plan)}: {family} v={v} m={m}"
                     + (f" split {split}" if split else "") + f" {comm}")
        cand = _evaluate(base, chunk_costs, family, v, m, split, comm, do_reorder)
        (ranked if cand.fits(memory_limit, memory_bytes) else over).append(cand)
    ranked.sort(key=Candidate.sort_key)
    over.sort(key=Candidate.sort_key)
    if not ranked and not over:
        raise UsageError(f"no library schedule admits {ranks} ranks with "
                         f"{', '.join(map(str, microbatches))} micro-batches"
                         + (f" (the first refusal: {refused[0]})" if refused else ""))
    if not ranked and memory_bytes is not None and memory_limit is None:
        least = min((c.peak_bytes or 0.0 for c in over), default=0.0)
        raise UsageError(f"no schedule fits --memory-limit {show_bytes(memory_bytes)} bytes: "
                         f"the least memory any candidate needs is {show_bytes(least)} bytes "
                         "of saved activations per rank")
    if not ranked:
        least = min((c.peak_memory for c in over), default=0.0)
        raise UsageError(f"no schedule fits --memory-limit {memory_limit:g}: the least "
                         f"memory any candidate needs is --memory-limit {least:g} ({UNIT})")
    return TuneResult(ranked, over, cut)


#: Library schedules that already split their backwards (I + W): split-backward adds nothing.
PRESPLIT = ("zb-v", "dualpipe-v")


def _planned(ranks: int, family: str, v: int, m: int,
             variants: Sequence[tuple[str | None, str]], passes: bool) -> int:
    """The ops one library schedule and its candidates hold (see `search`'s NOTE), before
    building it: F and B (or F, I and W) for every chunk and micro-batch."""
    ops = ranks * v * m * (3 if family in PRESPLIT else 2)
    return ops + sum(_own_ops(ops, ranks * v * m, split, passes) for split, _ in variants)


def _own_ops(ops: int, backwards: int, split: str | None, passes: bool) -> int:
    """The ops a candidate holds besides its library schedule of `ops` ops: its own copy,
    with an I and a W for each of the `backwards` Bs when split, where passes made one."""
    return ops + backwards if split else ops if passes else 0


def _variants(family: str, splits: Sequence[str | None], comms: Sequence[str]
              ) -> list[tuple[str | None, str]]:
    """The (split-backward mode, comm model) pairs tried on one library schedule."""
    return [(split, comm) for split in ([None] if family in PRESPLIT else splits)
            for comm in comms]


def _families(ranks: int, m: int, max_v: int) -> list[tuple[str, int]]:
    """The library schedules tried, 1F1B first: a search cut short by a deadline (synth's
    warm start) has at least the schedule that fits 1F1B's memory; then the zero-bubble V
    schedules, which win most often at that memory (synth must not lose tune's best to its
    deadline: on h100-llama at p = 8, m = 16, K = 16 a 2 s cut left out ZB-V, 7 % faster
    than what was left), then GPipe and interleaving."""
    out = [("1f1b", 1)]
    if ranks > 1 and max_v >= 2:
        out.extend((name, 2) for name in PRESPLIT)  # V placement, two chunks per rank
    out.append(("gpipe", 1))
    v = 2
    while v <= max_v and ranks > 1:
        out.append(("interleaved-1f1b", v))
        v *= 2
    return out


def _evaluate(base: Schedule, costs: CostModel, family: str, v: int, m: int,
              split: str | None, comm: str, reorder: bool) -> Candidate:

    passes: list[Pass] = [] if split is None else [SplitBackward(mode=split)]  # type: ignore[arg-type]
    if reorder:
        # bounded by evaluations, not time: the table must not depend on machine load
        passes.append(Reorder(budget_ms=10**9, evals=100))
    # the costs' dp (set by `search`): dp-reduce last, as `pipeirc compile` would add it
    rep = driver.data_parallel(Pipeline.of(passes), base, costs)
    s = driver.optimize(base, rep.pipeline, rep.costs,
                        comm="blocking" if comm == "blocking" else "overlapped",
                        verify_each=False).schedule
    r = simulate(s, costs, comm=comm)
    return Candidate(schedule=s, costs=costs, family=family, v=v, microbatches=m,
                     passes=",".join(f"{p.name}{{mode={split}}}"
                                     if isinstance(p, SplitBackward) else p.name
                                     for p in rep.pipeline.passes),
                     comm=comm, step_time=r.makespan,
                     bubble=r.bubble, peak_memory=max(r.peak_activations, default=0),
                     peak_bytes=None if r.peak_bytes is None else max(r.peak_bytes, default=0.0),
                     messages=len(r.transfers), exposed_reduction=r.exposed_reduction)


def table(result: TuneResult, top: int | None = None) -> str:
    """The ranked candidates as an aligned text table (the best first)."""
    unit = result.best.costs.unit
    head = ["#", "schedule", "v", "m", "passes", "overlap",
            f"step{f' ({unit})' if unit else ''}", "bubble", "peak act", "messages"]
    with_bytes = result.best.peak_bytes is not None
    if with_bytes:
        head.append("peak bytes")
    rows = [head]
    for i, c in enumerate(result.ranked[:top] if top else result.ranked, 1):
        row = [str(i), c.family, str(c.v), str(c.microbatches), c.passes or "-",
               "yes" if c.overlap else "no", f"{c.step_time:.6g}", f"{c.bubble:.1%}",
               f"{c.peak_memory:.3g}", str(c.messages)]
        if with_bytes:
            row.append(_bytes(c.peak_bytes or 0.0))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    left = {1, 4}
    return "\n".join("  ".join(cell.ljust(w) if i in left else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
                     for row in rows) + "\n"


def _bytes(b: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b:.0f} B"


def evaluate(base: Schedule, costs: CostModel, family: str, v: int, microbatches: int,
             split: str | None, comm: str) -> Candidate:
    """One candidate outside `search`: the library schedule `base` (family, v chunks per
    rank) through split-backward `split`, simulated under `costs` that already describe each
    of its `ranks * v` virtual stages (no rescaling: a planner's unequal chunks)."""
    return _evaluate(base, costs, family, v, microbatches, split, comm, False)


def variants(family: str, splits: Sequence[str | None], comms: Sequence[str]
             ) -> list[tuple[str | None, str]]:
    """The (split-backward mode, comm model) pairs `search` tries on a library schedule."""
    return _variants(family, splits, comms)
