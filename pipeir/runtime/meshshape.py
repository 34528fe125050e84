"""Who is who among P pipeline ranks x D data-parallel replicas: global rank
g = pp * D + dp (pipeir.runtime.mesh's docstring says why). Arithmetic only, without torch,
so that the launcher can name ranks in its messages without importing it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MeshShape:
    """P pipeline ranks x D data-parallel replicas, and who is who."""

    pp: int
    dp: int

    @property
    def world(self) -> int:
        return self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int]:
        """(pipeline rank, replica) of global rank `rank`."""
        return divmod(rank, self.dp)

    def rank(self, pp: int, dp: int) -> int:
        return pp * self.dp + dp

    def pp_group(self, rank: int) -> list[int]:
        """The global ranks of `rank`'s pipeline (its replica's P ranks)."""
        return [self.rank(p, self.coords(rank)[1]) for p in range(self.pp)]

    def dp_group(self, rank: int) -> list[int]:
        """The global ranks that hold the same stages as `rank` (its all-reduce group)."""
        return [self.rank(self.coords(rank)[0], d) for d in range(self.dp)]

    def name(self, rank: int) -> str:
        """`rank 3 (pp 1, dp 1)`, or `rank 3` without data parallelism."""
        if self.dp == 1:
            return f"rank {rank}"
        pp, dp = self.coords(rank)
        return f"rank {rank} (pp {pp}, dp {dp})"

    def groups(self, rank: int) -> str:
        """`rank`'s two groups, for failure messages."""
        return (f"pipeline group ranks {', '.join(map(str, self.pp_group(rank)))}; "
                f"data-parallel group ranks {', '.join(map(str, self.dp_group(rank)))}")


def check_world(world: int, pp: int, dp: int | None) -> MeshShape:
    """The mesh for `world` processes running a `pp`-rank pipeline: `dp` replicas, or as many
    as the world holds when `dp` is None. A ValueError says what does not fit."""
    if dp is not None and dp < 1:
        raise ValueError(f"--dp {dp}: need at least 1 replica")
    if dp is None:
        if world % pp:
            raise ValueError(f"world size {world} is not a multiple of the schedule's {pp} "
                             f"pipeline ranks (P x D processes for D replicas)")
        dp = world // pp
    if world != pp * dp:
        raise ValueError(f"world size {world} is not P x D = {pp} x {dp} = {pp * dp} "
                         f"(the schedule has {pp} pipeline ranks, --dp {dp})")
    return MeshShape(pp, dp)
