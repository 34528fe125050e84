"""The pipeline configuration: ranks, micro-batches, stages and where each stage lives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

#: Named placements; anything else is an explicit list of ranks, one per stage.
PLACEMENTS: Final = ("loop", "vshape")


class ConfigError(ValueError):
    """A bad configuration value; `key` names the setting so a caller can point at it."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(message)


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
        for key in ("ranks", "microbatches", "stages", "accumulate"):
            value = getattr(self, key)
            if type(value) is not int or value < 1:
                raise ConfigError(key, f"{key} must be a positive integer, got {value!r}")
        if self.memory_limit is not None and (
                type(self.memory_limit) is not int or self.memory_limit < 1):
            raise ConfigError("memory_limit",
                              f"memory_limit must be a positive integer, got {self.memory_limit!r}")
        if len(self.placement) != self.stages:
            raise ConfigError("placement", f"placement lists {len(self.placement)} ranks "
                                           f"but there are {self.stages} stages")
        owned: list[list[int]] = [[] for _ in range(self.ranks)]
        for s, r in enumerate(self.placement):
            if type(r) is not int or not 0 <= r < self.ranks:
                raise ConfigError("placement", f"placement puts stage {s} on rank {r}, "
                                               f"but ranks are 0..{self.ranks - 1}")
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
        if isinstance(placement, str):
            if not isinstance(stages, int) or stages < 1:
                raise ConfigError("stages", f"stages must be a positive integer, got {stages!r}")
            if not isinstance(ranks, int) or ranks < 1:
                raise ConfigError("ranks", f"ranks must be a positive integer, got {ranks!r}")
            placement = named_placement(placement, stages, ranks)
        return cls(ranks, microbatches, stages, tuple(placement), memory_limit, accumulate)

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
