"""Pipeline x data parallelism: the 2-D mesh of ranks and the gradient all-reduces.

P pipeline ranks times D data-parallel replicas make P*D processes. Global rank
g = pp * D + dp (torch's `init_device_mesh(..., (P, D), mesh_dim_names=("pp", "dp"))`
layout): the D replicas of a pipeline rank are neighbours, so with `--nproc-per-node` a
multiple of D the heavy all-reduces stay inside a machine and only point-to-point activations
cross machines. Every replica runs the same compiled programs; its point-to-point peers are
the pipeline ranks of its own replica, and each stage's gradients are averaged over the stage's
dp group by the `reduce-grad` / `wait-reduce` instructions (lowered from R ops).

NOTE (CUDA): a reduction runs on its own stream: it waits for the compute stream (the
gradients are complete), flattens and all-reduces there, and the compute stream waits for it
at `wait-reduce`; on CPU (gloo) the asynchronous work object is the overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


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


def shard(batch: Sequence[Any], dp: int, replica: int) -> tuple[Any, ...]:
    """Replica `replica`'s equal share of a global batch: dim 0 of every tensor cut in `dp`
    (in a dict or other pytree part alike, constants kept; a list of per-micro-batch inputs is
    cut by micro-batches). A ValueError when the batch does not split evenly: unequal shards
    would weigh samples unequally in the average."""
    from torch.utils import _pytree as pytree

    if dp == 1:
        return tuple(batch)

    def cut(x: Any, n: int, what: str) -> Any:
        if n % dp:
            raise ValueError(f"a batch of {n} {what} does not split over {dp} data-parallel "
                             f"replicas (use a batch that is a multiple of {dp})")
        k = n // dp
        return x[replica * k:(replica + 1) * k]

    out = []
    for part in batch:
        if isinstance(part, list | tuple):
            out.append(cut(part, len(part), "micro-batches"))
            continue
        leaves, tree = pytree.tree_flatten(part)
        out.append(pytree.tree_unflatten(
            [cut(x, int(x.shape[0]), "samples") if isinstance(x, torch.Tensor) and x.dim()
             else x for x in leaves], tree))
    return tuple(out)


@dataclass
class Mesh:
    """This process's place in the mesh and its process groups."""

    shape: MeshShape
    rank: int
    dp_group: Any  # torch ProcessGroup of this rank's replicas
    pp_group: Any  # torch ProcessGroup of this replica's pipeline
    device: torch.device
    stream: Any = None  # CUDA: the reduction stream
    pending: dict[int, tuple[Any, torch.Tensor, list[torch.Tensor]]] = field(
        default_factory=dict)

    @classmethod
    def build(cls, shape: MeshShape, rank: int, device: torch.device,
              timeout_s: float) -> Mesh:
        """Create the (pp, dp) device mesh; every rank calls this at the same point.

        NOTE: gloo runs a group's asynchronous collectives on two threads by default, so two
        all-reduces could run at once; one thread serializes them, as NCCL's stream does and
        as the simulator's reduction channel assumes."""
        from datetime import timedelta

        from torch.distributed.device_mesh import init_device_mesh

        override: dict[int | str, Any] = {}
        if device.type == "cpu":
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._threads = 1
            opts._timeout = timedelta(seconds=timeout_s)
            override["dp"] = ("gloo", opts)
        mesh = init_device_mesh(device.type, (shape.pp, shape.dp), mesh_dim_names=("pp", "dp"),
                                backend_override=override or None)
        stream = (torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                  if device.type == "cuda" else None)
        return cls(shape, rank, mesh.get_group("dp"), mesh.get_group("pp"), device, stream)

    @property
    def pp_rank(self) -> int:
        return self.shape.coords(self.rank)[0]

    @property
    def replica(self) -> int:
        return self.shape.coords(self.rank)[1]

    def peer(self, pp_rank: int) -> int:
        """The global rank of pipeline rank `pp_rank` in this replica."""
        return self.shape.rank(pp_rank, self.replica)

    def start_reduce(self, stage: int, module: torch.nn.Module) -> None:
        """Start the all-reduce (sum) of `module`'s gradients, flattened into one buffer."""
        grads = []
        for p in module.parameters():
            if p.grad is None:  # every replica must send the same sizes
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                flat = torch.cat([g.reshape(-1) for g in grads])
                work = dist.all_reduce(flat, group=self.dp_group, async_op=True)
            flat.record_stream(self.stream)
        else:
            flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
            work = dist.all_reduce(flat, group=self.dp_group, async_op=True)
        self.pending[stage] = (work, flat, grads)

    def finish_reduce(self, stage: int) -> None:
        """Wait for `stage`'s all-reduce and write the mean back into the gradients."""
        work, flat, grads = self.pending.pop(stage)
        work.wait()
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        flat.div_(self.shape.dp)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n


def mesh_for(rank: int, world: int, dps: set[int], pp: int, device: torch.device,
             timeout_s: float) -> Mesh | None:
    """The mesh of a launch whose jobs run `dps` replicas (one value: every job of a launch
    has the same) of `pp`-rank pipelines, or None without data parallelism."""
    if len(dps) > 1:
        raise ValueError(f"the jobs of one launch must have the same dp, got {sorted(dps)}")
    dp = dps.pop() if dps else 1
    if dp == 1:
        return None
    return Mesh.build(check_world(world, pp, dp), rank, device, timeout_s)
