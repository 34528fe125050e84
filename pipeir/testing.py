"""Hypothesis strategies for pipeir: random pipeline configs, random *valid* schedules, and
mutations that break them in one known way each.

They exist so that anyone writing a pass, a simulator or a backend can test it against every
shape of schedule, not only the three in the library: "for every valid schedule my pass keeps
it valid", "every broken schedule is rejected with the right check".

This module imports hypothesis at the top level: it is only for tests, and hypothesis comes
with pipeir's ``test`` extra (``pip install pipeir[test]``). Nothing else in pipeir imports it.

    from hypothesis import given
    from pipeir import verify
    from pipeir.testing import configs, schedules

    @given(schedules(configs(max_ranks=4, max_chunks=2)))
    def test_my_pass_keeps_schedules_valid(s):
        verify(my_pass(s))

NOTE: a schedule is generated as a random linear extension of the whole dependency DAG (pick
any ready op, repeat), projected onto ranks. Any linear extension projected per rank is
deadlock-free, so every output verifies by construction, and every deadlock-free schedule can
come out. All randomness past the config comes from one drawn seed, so large schedules (16
ranks x 64 micro-batches) cost one draw, not one per op; hypothesis still shrinks the config.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from hypothesis import reject
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from pipeir.config import PipelineConfig, named_placement
from pipeir.diagnostics import VerifyError
from pipeir.ops import REDUCE, Op
from pipeir.schedule import Schedule, data_predecessors, expect_schedule
from pipeir.verify import VerifyReport, verify

__all__ = [
    "MUTATION_KINDS",
    "PLACEMENT_KINDS",
    "Mutation",
    "applicable_kinds",
    "build",
    "configs",
    "expected_check",
    "mutations",
    "random_schedule",
    "schedules",
]

#: Placements `configs` can draw: the two named ones, and "random" (an explicit list in which
#: every rank owns at least one stage).
PLACEMENT_KINDS: Final = ("loop", "vshape", "random")

MutationKind = Literal["drop", "duplicate", "move-rank", "reorder-cycle"]

#: Every way `mutations` breaks a schedule, and the `VerifyError.check` each one must cause.
_EXPECTED: Final[dict[str, str]] = {
    "drop": "completeness",
    "duplicate": "duplicate",
    "move-rank": "placement",
    "reorder-cycle": "deadlock",
}
MUTATION_KINDS: Final[tuple[MutationKind, ...]] = ("drop", "duplicate", "move-rank",
                                                   "reorder-cycle")

Programs = tuple[tuple[Op, ...], ...]


# ---- configs -----------------------------------------------------------------------------------
@st.composite
def configs(draw: st.DrawFn, max_ranks: int = 8, max_microbatches: int = 16,
            max_chunks: int = 1, placements: Sequence[str] = PLACEMENT_KINDS,
            min_ranks: int = 1, min_microbatches: int = 1) -> PipelineConfig:
    """Pipeline configs with `min_ranks..max_ranks` ranks, `min_microbatches..max_microbatches`
    micro-batches and `1..max_chunks` stages per rank (stages = ranks * chunks).

    `placements` picks from "loop", "vshape" and "random". No memory limit is set: a random
    schedule may hold every micro-batch at once.
    """
    for what, n in (("max_ranks", max_ranks), ("max_microbatches", max_microbatches),
                    ("max_chunks", max_chunks), ("min_ranks", min_ranks),
                    ("min_microbatches", min_microbatches)):
        if type(n) is not int:
            raise InvalidArgument(f"configs({what}=...): an integer, got {n!r}")
    unknown = [p for p in placements if p not in PLACEMENT_KINDS]
    if unknown or not placements:
        raise InvalidArgument(f"placements must be a non-empty subset of {PLACEMENT_KINDS}, "
                              f"got {tuple(placements)!r}")
    if not 1 <= min_ranks <= max_ranks or not 1 <= min_microbatches <= max_microbatches \
            or max_chunks < 1:
        raise InvalidArgument("need 1 <= min_ranks <= max_ranks, "
                              "1 <= min_microbatches <= max_microbatches and max_chunks >= 1")
    ranks = draw(st.integers(min_ranks, max_ranks))
    microbatches = draw(st.integers(min_microbatches, max_microbatches))
    chunks = draw(st.integers(1, max_chunks))
    stages = ranks * chunks
    kind = draw(st.sampled_from(tuple(placements)))
    if kind == "random":
        # Every rank owns one stage (a shuffled 0..p-1), the rest go anywhere.
        extra = draw(st.lists(st.integers(0, ranks - 1), min_size=stages - ranks,
                              max_size=stages - ranks))
        placement = draw(st.permutations(list(range(ranks)) + extra))
        return PipelineConfig(ranks, microbatches, stages, tuple(placement))
    return PipelineConfig(ranks, microbatches, stages, named_placement(kind, stages, ranks))


# ---- valid schedules ---------------------------------------------------------------------------
def random_schedule(config: PipelineConfig, rnd: random.Random,
                    split_backward: bool | None = None, name: str = "random") -> Schedule:
    """One random valid schedule for `config`, from `rnd` (the engine behind `schedules`).

    `split_backward`: False = every backward is one B, True = every backward is I + W, None =
    `rnd` picks one of: all B, all I + W, or a coin flip per (stage, micro-batch).
    If the config has a `memory_limit`, forwards that would exceed it wait while other ops are
    ready; ValueError if the generator gets stuck (a limit below what the placement needs).
    """
    if not isinstance(config, PipelineConfig):
        raise TypeError(f"random_schedule: expected a PipelineConfig, got "
                        f"{type(config).__name__}")
    if not isinstance(rnd, random.Random):
        raise TypeError(f"random_schedule: expected a random.Random (random.Random(seed)), got "
                        f"{type(rnd).__name__} {rnd!r}")
    if split_backward is not None and type(split_backward) is not bool:
        raise TypeError(f"random_schedule(split_backward=...): True, False or None, got "
                        f"{split_backward!r}")
    split = _split_table(config, rnd, split_backward)
    ops: list[Op] = []
    for s in range(config.stages):
        for m in range(config.microbatches):
            ops.append(Op("F", s, m))
            ops.extend((Op("I", s, m), Op("W", s, m)) if split[s][m] else (Op("B", s, m),))
    present = set(ops)
    missing: dict[Op, int] = {}
    succs: dict[Op, list[Op]] = {op: [] for op in ops}
    for op in ops:
        preds = data_predecessors(op, present, config.stages)
        missing[op] = len(preds)
        for p in preds:
            succs[p].append(op)
    # Two pools, so one per-schedule coin (`eager`) can range the shape from GPipe-like (all
    # forwards first) to 1F1B-like (a backward as soon as one is ready).
    ready: tuple[list[Op], list[Op]] = ([op for op in ops if missing[op] == 0], [])
    eager = rnd.random()
    programs: list[list[Op]] = [[] for _ in range(config.ranks)]
    placement, limit = config.placement, config.memory_limit
    live = [0] * config.ranks
    while ready[0] or ready[1]:
        pool, i = _pick(ready, rnd, eager, placement, live, limit)
        op = pool[i]
        pool[i] = pool[-1]
        pool.pop()
        r = placement[op.stage]
        programs[r].append(op)
        if op.kind == "F":
            live[r] += 1
        elif op.kind != "I":
            live[r] -= 1
        for nxt in succs[op]:
            missing[nxt] -= 1
            if missing[nxt] == 0:
                ready[nxt.kind != "F"].append(nxt)
    return Schedule.from_programs(config, programs, name=name)


def _split_table(config: PipelineConfig, rnd: random.Random,
                 split_backward: bool | None) -> list[list[bool]]:
    mode = split_backward if split_backward is not None else rnd.choice((False, True, None))
    return [[rnd.random() < 0.5 if mode is None else mode for _ in range(config.microbatches)]
            for _ in range(config.stages)]


def _pick(ready: tuple[list[Op], list[Op]], rnd: random.Random, eager: float,
          placement: tuple[int, ...], live: list[int], limit: int | None
          ) -> tuple[list[Op], int]:
    """A random ready op, as (its pool, its index); a forward that would break the memory
    limit is never picked."""
    forwards, backwards = ready
    if backwards and (not forwards or rnd.random() < eager):
        return backwards, rnd.randrange(len(backwards))
    if limit is None:
        # Most recently readied forward (depth first: the micro-batch that just moved on),
        # with probability `eager` too; else any.
        return forwards, len(forwards) - 1 if rnd.random() < eager else \
            rnd.randrange(len(forwards))
    allowed = [i for i, op in enumerate(forwards) if live[placement[op.stage]] < limit]
    if allowed:
        return forwards, rnd.choice(allowed)
    if backwards:
        return backwards, rnd.randrange(len(backwards))
    raise ValueError(f"memory_limit = {limit} is too small for this placement: every "
                     "ready op is a forward on a rank at the limit")


@st.composite
def schedules(draw: st.DrawFn,
              config: PipelineConfig | st.SearchStrategy[PipelineConfig] | None = None,
              split_backward: bool | None = None, name: str = "random") -> Schedule:
    """Random valid schedules: any dependency-respecting interleaving of each rank's ops.

    `config` is a fixed config, a strategy of configs, or None for `configs()`.
    `split_backward`: False for B only, True for I + W only, None for either or a mix.
    Every schedule drawn passes `pipeir.verify` (with a config's `memory_limit`, too, when it
    can be met; draws that cannot are rejected).
    """
    if config is None:
        config = configs()
    cfg = draw(config) if isinstance(config, st.SearchStrategy) else config
    if not isinstance(cfg, PipelineConfig):  # (configs, not configs())
        raise InvalidArgument(f"schedules(config=...): a PipelineConfig or a strategy of them "
                              f"(configs(...), called), got {cfg!r}")
    if split_backward is not None and type(split_backward) is not bool:  # ("no" is true)
        raise InvalidArgument(f"schedules(split_backward=...): True, False or None, got "
                              f"{split_backward!r}")
    seed = draw(st.integers(0, 2**32 - 1))
    try:
        return random_schedule(cfg, random.Random(seed), split_backward, name)
    except ValueError:
        if cfg.memory_limit is None:
            raise
        reject()


# ---- mutations ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mutation:
    """A schedule broken in one way: `programs` (one op tuple per rank; may hold an op twice,
    which a `Schedule` cannot) on `config`, and what was done, for failure messages."""

    kind: MutationKind
    config: PipelineConfig
    programs: Programs
    description: str

    @property
    def expected_check(self) -> str:
        return expected_check(self.kind)

    def build(self) -> VerifyReport:
        """Build and verify; raises the VerifyError this mutation must cause."""
        return build(self.config, self.programs)[1]


def expected_check(kind: str) -> str:
    """The `VerifyError.check` that mutation `kind` must cause."""
    try:
        return _EXPECTED[kind]
    except KeyError:
        raise ValueError(f"unknown mutation kind {kind!r}; known: "
                         f"{', '.join(MUTATION_KINDS)}") from None


def build(config: PipelineConfig, programs: Sequence[Sequence[Op]]
          ) -> tuple[Schedule, VerifyReport]:
    """Build a schedule from raw programs and verify it: VerifyError ("duplicate" from the
    builder, the other checks from `verify`) if it is invalid."""
    schedule = Schedule.from_programs(config, programs)
    return schedule, verify(schedule)


def applicable_kinds(schedule: Schedule,
                     kinds: Sequence[str] = MUTATION_KINDS) -> tuple[MutationKind, ...]:
    """The mutation kinds that can break `schedule` ("move-rank" needs two ranks)."""
    return tuple(k for k in MUTATION_KINDS
                 if k in kinds and (k != "move-rank" or schedule.config.ranks > 1))


@st.composite
def mutations(draw: st.DrawFn, schedule: Schedule,
              kinds: Sequence[str] = MUTATION_KINDS) -> Mutation:
    """Mutations of a valid `schedule`, one kind each, with their expected check:

    - "drop": one op removed -> "completeness" (never a gradient reduction R, which
      verify's reduction check finds first; nor does a reorder put one before a backward);
    - "duplicate": one op run a second time (anywhere) -> "duplicate";
    - "move-rank": one op moved to another rank's program -> "placement";
    - "reorder-cycle": ops reordered so that the waits form a cycle -> "deadlock": either two
      ops on one rank swapped (a consumer now runs before its producer), or one op moved
      earlier on each of two ranks so that each waits for the other.
    """
    if isinstance(schedule, st.SearchStrategy):
        raise InvalidArgument("mutations takes a schedule, not a strategy of them: draw one "
                              "first, data.draw(schedules(...))")
    try:
        expect_schedule(schedule, "mutations")  # (hypothesis's own error: a strategy's misuse)
    except TypeError as e:
        raise InvalidArgument(str(e)) from None
    if isinstance(kinds, str):
        raise InvalidArgument(f"mutations(kinds=...): a list of kinds, e.g. ({kinds!r},)")
    try:
        verify(schedule)
    except VerifyError as e:
        raise InvalidArgument(f"mutations breaks a valid schedule, and this one is not: "
                              f"{e.diagnostics[0].message}") from None
    for k in kinds:
        expected_check(k)
    usable = applicable_kinds(schedule, kinds)
    if not usable:
        raise InvalidArgument(f"none of {tuple(kinds)} applies to a schedule on "
                              f"{schedule.config.ranks} rank(s)")
    kind = draw(st.sampled_from(usable))
    progs = [list(p) for p in schedule.programs]
    ranks = schedule.config.ranks
    if kind == "reorder-cycle":
        desc = _reorder_cycle(draw, schedule, progs)
    else:
        # (a gradient reduction dropped, or moved before its backward, is the reduction
        # check's to find, which verify runs before completeness and deadlock)
        spots = [(r, i) for r in range(ranks) for i, op in enumerate(progs[r])
                 if kind != "drop" or op.kind != REDUCE]
        r, i = draw(st.sampled_from(spots))
        op = progs[r][i]
        if kind == "drop":
            del progs[r][i]
            desc = f"dropped {op} from rank {r}"
        elif kind == "duplicate":
            to = draw(st.integers(0, ranks - 1))
            progs[to].insert(draw(st.integers(0, len(progs[to]))), op)
            desc = f"ran {op} (rank {r}) again on rank {to}"
        else:
            del progs[r][i]
            to = draw(st.sampled_from([x for x in range(ranks) if x != r]))
            progs[to].insert(draw(st.integers(0, len(progs[to]))), op)
            desc = f"moved {op} from rank {r} to rank {to}"
    return Mutation(kind, schedule.config, tuple(tuple(p) for p in progs), desc)


def _reorder_cycle(draw: st.DrawFn, schedule: Schedule, progs: list[list[Op]]) -> str:
    """Reorder in place so that program order plus data edges has a cycle; say how."""
    rank_of = schedule.rank_of
    edges = list(schedule.data_edges())
    def passes_no_reduction(u: Op, v: Op) -> bool:
        # (u moves to v's place: past its own stage's R, it is the reduction check's fault)
        prog = progs[rank_of(u)]
        return not any(o.kind == REDUCE and o.stage == u.stage
                       for o in prog[prog.index(u) + 1:prog.index(v)])
    local = [(u, v) for u, v in edges if rank_of(u) == rank_of(v) and v.kind != REDUCE and
             passes_no_reduction(u, v)]
    crossing = [(u, v) for u, v in edges if rank_of(u) != rank_of(v)]
    # NOTE: every schedule has a same-rank edge (F(s,m) -> B/I(s,m)), so `local` is never
    # empty; a crossing pair a->b, b->a exists whenever two consecutive stages differ in rank.
    back: dict[tuple[int, int], list[tuple[Op, Op]]] = {}
    for u, v in crossing:
        back.setdefault((rank_of(u), rank_of(v)), []).append((u, v))
    pairs = [e for e in crossing if (rank_of(e[1]), rank_of(e[0])) in back]
    if not pairs or draw(st.booleans()):
        u, v = draw(st.sampled_from(sorted(local)))
        prog = progs[rank_of(u)]
        i, j = prog.index(u), prog.index(v)
        prog[i], prog[j] = v, u
        return f"swapped {u} and {v} on rank {rank_of(u)} ({v} needs {u})"
    u1, v1 = draw(st.sampled_from(sorted(pairs)))
    a, b = rank_of(u1), rank_of(v1)
    u2, v2 = draw(st.sampled_from(sorted(back[b, a])))
    # Cycle: u1 -data-> v1 -order-> u2 -data-> v2 -order-> u1, once v1 precedes u2 on rank b
    # and v2 precedes u1 on rank a. Either may already hold, or be the same op.
    _move_before(progs[b], v1, u2)
    _move_before(progs[a], v2, u1)
    return (f"on rank {b}, {v1} moved before {u2}; on rank {a}, {v2} moved before {u1} "
            f"({v1} needs {u1}, {v2} needs {u2})")


def _move_before(prog: list[Op], op: Op, anchor: Op) -> None:
    """Move `op` just before `anchor` if it runs after it; otherwise leave the order alone."""
    i, j = prog.index(op), prog.index(anchor)
    if i > j:
        del prog[i]
        prog.insert(j, op)
