"""The pipeline configuration: ranks, micro-batches, stages and where each stage lives.

NOTE: this is the one place a configuration is checked. The frontend builds its config with
`PipelineConfig.make` and turns a `ConfigError` into a diagnostic at the offending setting,
so a file, `--set` and the Python API all get the same rules and the same messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from pipeir import limits

#: Named placements; anything else is an explicit list of ranks, one per stage.
PLACEMENTS: Final = ("loop", "vshape")

#: The settings of a pipeline, with what they mean (for messages and `--set`).
PIPELINE_KEYS: Final[dict[str, str]] = {
    "ranks": "number of ranks (pipeline-parallel degree)",
    "microbatches": "micro-batches per schedule round",
    "stages": "model chunks; defaults to ranks",
    "placement": "loop, vshape, or a list of ranks, one per stage",
    "memory_limit": "most in-flight activations per rank (stage x micro-batch units)",
    "accumulate": "schedule rounds per optimizer step",
}

class ConfigError(ValueError):
    """A bad configuration value; `key` names the setting so a caller can point at it, and
    `also` the others that share the blame (a size is a product of several)."""

    def __init__(self, key: str, message: str, also: tuple[str, ...] = ()):
        self.key = key
        self.also = also
        super().__init__(message)


def spell(value: object) -> str:
    """A value as a `.sched` file or `--set` writes it (true, [0, 1]), for messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(spell(x) for x in value) + "]"
    return str(value)


def type_name(v: object) -> str:
    """What a value is, in the language's words, for messages (a `--set` list is a tuple
    in Python, and a list in the language)."""
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            tuple: "a list", list: "a list"}.get(type(v), f"a {type(v).__name__}")


def _positive(key: str, value: int) -> None:
    if type(value) is not int or value < 1:
        # (the string '2' spelt as 2 read "must be a positive integer, got 2")
        got = spell(value) if type(value) in (int, bool) else \
            f"{spell(value) if isinstance(value, tuple | list) else repr(value)} " \
            f"({type_name(value)})"
        raise ConfigError(key, f"{key} must be a positive integer, got {got}")


def _check_sizes(ranks: int, stages: int, microbatches: int) -> None:
    """Positive integers, and a pipeline small enough to build within the memory budget
    (`pipeir.limits`: every pair has at least an F and a B); checked before a named
    placement is expanded (a tuple of `stages` ranks)."""
    _positive("ranks", ranks)
    _positive("stages", stages)
    _positive("microbatches", microbatches)
    too_big = limits.over(f"{stages} stages x {microbatches} micro-batches on {ranks} ranks",
                          2 * max(stages, ranks) * microbatches, "ops (F and B)",
                          limits.BYTES_PER_OP)
    if too_big is not None:
        sizes = {"stages": stages, "microbatches": microbatches, "ranks": ranks}
        first, *rest = sorted(sizes, key=lambda k: -sizes[k])  # blame the largest first
        raise ConfigError(first, too_big, also=tuple(rest))


def loop_placement(stages: int, ranks: int) -> tuple[int, ...]:
    """Stage s on rank s % ranks (Megatron's interleaving)."""
    return tuple(s % ranks for s in range(stages))


def vshape_placement(stages: int, ranks: int) -> tuple[int, ...]:
    """Zig-zag: stages 0..p-1 on ranks 0..p-1, then p..2p-1 back on ranks p-1..0, and so on."""
    return tuple(s % ranks if (s // ranks) % 2 == 0 else ranks - 1 - s % ranks
                 for s in range(stages))


def named_placement(name: str, stages: int, ranks: int) -> tuple[int, ...]:
    if name == "loop":
        return loop_placement(stages, ranks)
    if name == "vshape":
        return vshape_placement(stages, ranks)
    raise ConfigError("placement", f"unknown placement '{name}' (expected loop, vshape or a list)")


@dataclass(frozen=True)
class PipelineConfig:
    """What a schedule runs on. `placement[s]` is the rank that owns stage `s`.

    `memory_limit` bounds the in-flight activations per rank (in units of one stage's
    activations for one micro-batch); `accumulate` is the number of schedule rounds per
    optimizer step.
    """

    ranks: int
    microbatches: int
    stages: int
    placement: tuple[int, ...]
    memory_limit: int | None = None
    accumulate: int = 1
    _rank_stages: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_sizes(self.ranks, self.stages, self.microbatches)
        _positive("accumulate", self.accumulate)
        if self.memory_limit is not None:
            _positive("memory_limit", self.memory_limit)
        if isinstance(self.placement, str) or not isinstance(self.placement, Sequence):
            raise ConfigError("placement", f"placement is each stage's rank, e.g. (0, 1, 0, 1), "
                                           f"got {self.placement!r} (PipelineConfig.make also "
                                           f"takes 'loop' or 'vshape')")
        if type(self.placement) is not tuple or \
                any(type(r) is not int for r in self.placement):
            # (a list would make the config unhashable; numpy's ranks are plain ints, as
            # `Op`'s stages are)
            object.__setattr__(self, "placement", tuple(map(limits.plain_number,
                                                            self.placement)))
        if len(self.placement) != self.stages:
            raise ConfigError("placement", f"placement lists {len(self.placement)} ranks "
                                           f"but there are {self.stages} stages")
        owned: list[list[int]] = [[] for _ in range(self.ranks)]
        for s, r in enumerate(self.placement):
            if type(r) is not int:
                raise ConfigError("placement", f"placement puts stage {s} on {r!r}, which is "
                                               f"not a rank (an integer)")
            if not 0 <= r < self.ranks:
                raise ConfigError("placement", f"placement puts stage {s} on rank {r}, "
                                               f"but ranks are 0 to {self.ranks - 1}")
            owned[r].append(s)
        idle = [r for r, ss in enumerate(owned) if not ss]
        if idle:
            raise ConfigError("placement", f"rank {idle[0]} owns no stage "
                                           f"({self.stages} stages on {self.ranks} ranks)")
        object.__setattr__(self, "_rank_stages", tuple(tuple(ss) for ss in owned))

    @classmethod
    def make(cls, ranks: int, microbatches: int, stages: int | None = None,
             placement: str | tuple[int, ...] | list[int] = "loop",
             memory_limit: int | None = None, accumulate: int = 1) -> PipelineConfig:
        """Build a config with a named or explicit placement; stages default to ranks."""
        stages = ranks if stages is None else stages
        _check_sizes(ranks, stages, microbatches)
        if isinstance(placement, str):
            placement = named_placement(placement, stages, ranks)
        elif not isinstance(placement, tuple | list):
            raise ConfigError("placement", "placement must be loop, vshape or a list of ranks, "
                                           f"got {spell(placement)}")
        return cls(ranks, microbatches, stages, tuple(placement), memory_limit, accumulate)

    def out_of_range(self, stage: int, mb: int | None) -> str | None:
        """Why an op of `stage` and micro-batch `mb` (None: no micro-batch) names something the
        pipeline lacks, or None. Shared by the verifier and the builder, which meets such an
        op first as a duplicate when every rank's program writes it."""
        if not 0 <= stage < self.stages:
            return f"stage {stage} is out of range (stages are 0 to {self.stages - 1})"
        if mb is not None and not 0 <= mb < self.microbatches:
            return (f"micro-batch {mb} is out of range (micro-batches are "
                    f"0 to {self.microbatches - 1})")
        return None

    def misplaced(self, rank: int, stage: int) -> str | None:
        """Why rank `rank` cannot run stage `stage` (another rank owns it), or None."""
        owner = self.placement[stage]
        return None if owner == rank else f"stage {stage} lives on rank {owner}"

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank `rank` owns, in increasing order."""
        return self._rank_stages[rank]

    @property
    def placement_name(self) -> str | None:
        """'loop' or 'vshape' when the placement is one of those, else None."""
        for name in PLACEMENTS:
            if self.placement == named_placement(name, self.stages, self.ranks):
                return name
        return None
