"""Pipeline x data parallelism: the 2-D mesh of ranks and the gradient all-reduces.

P pipeline ranks times D data-parallel replicas make P*D processes. Global rank
g = pp * D + dp (torch's `init_device_mesh(..., (P, D), mesh_dim_names=("pp", "dp"))`
layout): the D replicas of a pipeline rank are neighbours, so with `--nproc-per-node` a
multiple of D the heavy all-reduces stay inside a machine and only point-to-point activations
cross machines. Every replica runs the same compiled programs; its point-to-point peers are
the pipeline ranks of its own replica, and each stage's gradients are averaged over the stage's
dp group by the `reduce-grad` / `wait-reduce` instructions (lowered from R ops).

NOTE (gradient buckets): each stage's gradients live in flat buffers (one per dtype), the
parameters' `.grad` being views of them (DDP's `gradient_as_bucket_view`): autograd
accumulates into the views in place, `reduce-grad` hands the buffer to the all-reduce as it is
and `wait-reduce` only waits. The loss is scaled by 1/D (`Context.loss`), so the all-reduce's
sum is already the mean. Nothing of a reduction then runs on the rank's compute thread, as the
simulator's reduction channel assumes. Flattening the gradients at the post (and copying
the mean back at the wait), as this did before, held the compute thread 1-20 ms (8 typical)
per post of an 8 MB stage on 2 shared cores, mid-backward, where the simulator charges nothing.

NOTE (CUDA): a reduction runs on its own stream: it waits for the compute stream (the
gradients are complete) and all-reduces there, and the compute stream waits for it at
`wait-reduce`. On CPU the asynchronous gloo work is the overlap, on a backend with one
thread (`_serial_gloo`), so a rank's all-reduces run one after another as on the simulator's
channel, and the work's future records when the all-reduce finished (`Mesh.done`), which
`pipeir.runtime.measure` uses to time each reduction in the run itself.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from pipeir.runtime.meshshape import MeshShape, check_world


def shard(batch: Sequence[Any], dp: int, replica: int, microbatches: int = 1
          ) -> tuple[Any, ...]:
    """Replica `replica`'s equal share of a global batch: dim 0 of every tensor cut in `dp`
    (in a dict or other pytree part alike, constants kept; a list of per-micro-batch inputs is
    cut by micro-batches). A ValueError when the batch does not split evenly into `dp` shares
    of `microbatches` equal micro-batches (microbatches x accumulate): unequal shards, or a
    share cut 3, 3, 2, 2, would weigh samples unequally in the average."""
    from torch.utils import _pytree as pytree

    if dp == 1:
        return tuple(batch)

    def cut(x: Any, n: int, per: int, what: str) -> Any:
        if n % (dp * per):
            each = f"{dp} data-parallel replicas" + (
                f" of {per} micro-batches (microbatches x accumulate)" if per > 1 else "")
            raise ValueError(f"a batch of {n} {what} does not split evenly over {each}; "
                             f"use a batch that is a multiple of {dp * per}")
        k = n // dp
        return x[replica * k:(replica + 1) * k]

    out = []
    for part in batch:
        if isinstance(part, list | tuple):
            if len(part) != dp * microbatches:
                raise ValueError(f"the batch gives {len(part)} micro-batches; with {dp} "
                                 f"data-parallel replicas it must give {dp * microbatches} "
                                 f"({microbatches} per replica: microbatches x accumulate)")
            out.append(cut(part, len(part), 1, "micro-batches"))
            continue
        leaves, tree = pytree.tree_flatten(part)
        out.append(pytree.tree_unflatten(
            [cut(x, int(x.shape[0]), microbatches, "samples")
             if isinstance(x, torch.Tensor) and x.dim() else x for x in leaves], tree))
    return tuple(out)


class Pending(Protocol):
    """What `Mesh.finish_reduce` waits on: a collective's `Work` or a `Future` chained to one.

    NOTE: torch's stubs type the two differently and change between releases (2.14 types
    `dist.all_reduce`'s result as `Work`, so a list inferred from it refuses the future);
    waiting is all this module does with either, so it types them by that alone.
    """

    def wait(self) -> object: ...


@dataclass
class Mesh:
    """This process's place in the mesh and its process groups."""

    shape: MeshShape
    rank: int
    dp_group: Any  # torch ProcessGroup of this rank's replicas
    pp_group: Any  # torch ProcessGroup of this replica's pipeline
    device: torch.device
    stream: Any = None  # CUDA: the reduction stream
    reducer: Any = None  # CPU: the gloo backend that all-reduces gradients (`_serial_gloo`)
    #: stage -> its gradient buckets: (flat buffer, [(parameter, its view of the buffer)])
    buckets: dict[int, list[tuple[torch.Tensor, list[tuple[torch.nn.Parameter, torch.Tensor]]]]] \
        = field(default_factory=dict)
    #: stage -> its work objects (and, on CPU, the future that records when they are done)
    pending: dict[int, list[Pending]] = field(default_factory=dict)
    #: stage -> when its last all-reduce finished (time.perf_counter(); CPU only: a CUDA
    #: work's future completes when the collective is queued, not when it is done)
    done: dict[int, float] = field(default_factory=dict)

    @classmethod
    def build(cls, shape: MeshShape, rank: int, device: torch.device,
              timeout_s: float) -> Mesh:
        """Create the (pp, dp) device mesh; every rank calls this at the same point."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (shape.pp, shape.dp), mesh_dim_names=("pp", "dp"))
        stream = (torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                  if device.type == "cuda" else None)
        reducer = _serial_gloo(shape, rank, timeout_s) if device.type == "cpu" else None
        return cls(shape, rank, mesh.get_group("dp"), mesh.get_group("pp"), device, stream,
                   reducer)

    @property
    def pp_rank(self) -> int:
        return self.shape.coords(self.rank)[0]

    @property
    def replica(self) -> int:
        return self.shape.coords(self.rank)[1]

    def peer(self, pp_rank: int) -> int:
        """The global rank of pipeline rank `pp_rank` in this replica."""
        return self.shape.rank(pp_rank, self.replica)

    def attach(self, modules: dict[int, torch.nn.Module]) -> None:
        """Give every trainable parameter's gradient a place in its stage's bucket (a
        parameter that two stages share, in the first); called once, before the first step."""
        seen: set[int] = set()
        for stage, module in sorted(modules.items()):
            groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
            for p in module.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    groups.setdefault((p.dtype, p.device), []).append(p)
            buckets = []
            for (dtype, device), params in groups.items():
                flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
                views: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
                offset = 0
                for q in params:
                    views.append((q, flat[offset:offset + q.numel()].view_as(q)))
                    offset += q.numel()
                buckets.append((flat, views))
            self.buckets[stage] = buckets
        self.zero_grad()

    def zero_grad(self) -> None:
        """Zero the buckets and point every `.grad` at its view again (the optimizer step may
        have replaced one, e.g. the sum of a tied group)."""
        for buckets in self.buckets.values():
            for flat, views in buckets:
                flat.zero_()
                for p, view in views:
                    if p.grad is not view:
                        p.grad = view

    def start_reduce(self, stage: int) -> None:
        """Start the all-reduce (sum) of `stage`'s gradient buckets."""
        works: list[Pending] = []
        last: Any = None  # the CPU reducer's last work (the gloo backend is untyped)
        for flat, _ in self.buckets.get(stage, ()):
            if self.stream is not None:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream):
                    work = dist.all_reduce(flat, group=self.dp_group, async_op=True)
                assert work is not None, "an asynchronous all-reduce returns its work"
                works.append(work)
            else:
                last = self.reducer.allreduce([flat])
                works.append(last)
        if last is not None:
            # NOTE: `then`, not `add_done_callback`: a waiter may wake before the callbacks
            # run; waiting for the chained future makes sure the time is recorded
            recorded: torch.futures.Future[None] = last.get_future().then(
                lambda _: self._finished(stage))
            works.append(recorded)
        self.pending[stage] = works

    def _finished(self, stage: int) -> None:
        self.done[stage] = time.perf_counter()

    def finish_reduce(self, stage: int) -> None:
        """Wait for `stage`'s all-reduce (the gradients then hold the mean)."""
        for work in self.pending.pop(stage):
            work.wait()
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

def _serial_gloo(shape: MeshShape, rank: int, timeout_s: float) -> Any:
    """A gloo backend over `rank`'s replicas that runs its collectives on one thread.

    NOTE: gloo runs a group's asynchronous collectives on two threads by default, so two
    all-reduces of one rank run at once and share the link, where NCCL's stream and the
    simulator's reduction channel run them one after the other. torch (2.13) drops the
    options of a gloo group made by `new_group` or `init_device_mesh(backend_override=...)`:
    a thread count set there never takes effect (two 8 MB all-reduces posted together both
    finished after 15 ms instead of at 7 and 15 ms). So the backend is built here, with its
    options, on a prefix of the default group's store; all replicas build it at once."""
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _get_default_store

    gloo = dist.ProcessGroupGloo
    opts = gloo._Options()  # type: ignore[attr-defined]
    opts._threads = 1
    opts._timeout = timedelta(seconds=timeout_s)
    opts._devices = [gloo.create_default_device()]
    pp, replica = shape.coords(rank)
    store = dist.PrefixStore(  # type: ignore[attr-defined]
        f"pipeir/reduce/pp{pp}", _get_default_store())
    return gloo(store, replica, shape.dp, opts)


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
