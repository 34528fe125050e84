"""The optimizer step of one rank: per-stage optimizers and LR schedulers, tied parameters,
fp16 loss scaling and clipping by the global gradient norm over all pipeline ranks.

NOTE (why one optimizer per stage): the stage, not the rank, is the unit of a checkpoint, so a
run saved on one rank count resumes on another. For elementwise optimizers (SGD, Adam, AdamW,
...) one optimizer per stage updates exactly as one over the whole model; a stage without
trainable parameters has none (torch refuses an empty parameter list).

NOTE (tied parameters): each stage in a tied group owns a copy. At set-up every copy takes the
value of the group's first member (broadcast from its rank); before each optimizer step the
copies' gradients are summed (locally, then all-reduced among the owning ranks), so every copy
gets the gradient the one shared tensor gets in single-process training and the copies stay
equal. The global norm counts each group once (at its first member). A group whose copies all
got no gradient keeps `None`, as a shared tensor would.

The order at the step, as `torch.amp.GradScaler` and `clip_grad_norm_` do it in one process:
tied sum, unscale (fp16), skip if any rank saw inf/NaN, clip, step, scheduler.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pipeir.models.spec import ModelSpec, autocast_dtype, tied_groups

if TYPE_CHECKING:
    from pipeir.runtime.mesh import Mesh

#: fp16 dynamic loss scaling, as torch.amp.GradScaler's defaults.
INIT_SCALE, GROWTH, BACKOFF, GROWTH_INTERVAL = 2.0**16, 2.0, 0.5, 2000


class StepStats:
    """What an optimizer step reports: the global gradient norm before clipping (fp16:
    unscaled; None until a step), whether fp16 skipped the update for non-finite gradients,
    and the step's learning rate (this rank's first optimizer). The norm may still be on its
    way (`Optim.step`'s NOTE): reading it waits for it."""

    def __init__(self, grad_norm: float | Callable[[], float] | None, skipped: bool,
                 lr: float | None):
        self._norm = grad_norm
        self.skipped = skipped
        self.lr = lr

    @property
    def grad_norm(self) -> float | None:
        if callable(self._norm):
            self._norm = self._norm()
        return self._norm


@dataclass
class _Tied:
    members: list[tuple[int, torch.nn.Parameter]]  # this rank's copies (stage, parameter)
    first: bool  # this rank holds the group's first member (counted in the norm)
    src: int  # the rank of the first member
    group: Any  # process group of the owning ranks, None when they are one rank


def param(module: torch.nn.Module, name: str) -> torch.nn.Parameter:
    return module.get_parameter(name)


class Optim:
    """Optimizers, schedulers, tied groups and loss scale of the stages on one rank."""

    def __init__(self, spec: ModelSpec, modules: dict[int, torch.nn.Module], stages: int,
                 placement: Sequence[int], rank: int, distributed: bool,
                 mesh: Mesh | None = None):
        """`rank` is the pipeline rank; with data parallelism (`mesh`) the groups below are
        those of this replica's pipeline (its gradients are already averaged over replicas
        when the step runs)."""
        self.spec = spec
        self.modules = modules
        self.distributed = distributed
        self.norm_group = None if mesh is None else mesh.pp_group
        #: the norm is summed over ranks only where the pipeline has more than one
        self.norm_reduce = distributed and dist.get_world_size(self.norm_group) > 1
        self._pending: Any = None  # the norm's all-reduce still running (`step`'s NOTE)
        self.mesh = mesh
        #: every parameter of the rank's stages, once (zero_grad sets their gradients to None
        #: without walking the modules)
        self.params = list({id(p): p for m in modules.values() for p in m.parameters()}.values())
        self.optimizers: dict[int, Any] = {}
        self.schedulers: dict[int, Any] = {}
        for s, m in modules.items():
            params = [p for p in m.parameters() if p.requires_grad]
            if params:
                self.optimizers[s] = spec.optimizer(params)
                if spec.scheduler is not None:
                    self.schedulers[s] = spec.scheduler(self.optimizers[s])
        self.fp16 = autocast_dtype(spec) == torch.float16
        self.scale = INIT_SCALE if self.fp16 else 1.0
        self.good_steps = 0
        self.tied: list[_Tied] = []
        for g in tied_groups(spec, stages):
            ranks = sorted({placement[s] for s, _ in g})
            # every rank creates every group's process group (each replica's), in the same order
            pg = None
            for d in range(1 if mesh is None else mesh.shape.dp):
                made = dist.new_group([r if mesh is None else mesh.shape.rank(r, d)
                                       for r in ranks]) \
                    if distributed and len(ranks) > 1 else None
                if mesh is None or d == mesh.replica:
                    pg = made
            if rank in ranks:
                mine = [(s, param(modules[s], n)) for s, n in g if placement[s] == rank]
                src = placement[g[0][0]]
                self.tied.append(_Tied(mine, src == rank,
                                       src if mesh is None else mesh.peer(src), pg))
        self._copy_tied()
        if mesh is not None:
            mesh.attach(modules)  # gradients as views of the all-reduce buckets

    # ---- set-up -------------------------------------------------------------------------------
    def _copy_tied(self) -> None:
        """Every copy takes the first member's value (see the module NOTE)."""
        with torch.no_grad():
            for t in self.tied:
                value: torch.Tensor = t.members[0][1]
                if t.group is not None:
                    value = value.detach().clone() if t.first else torch.empty_like(value)
                    dist.broadcast(value, t.src, group=t.group)
                for _, p in t.members[0 if t.group is not None else 1:]:
                    p.copy_(value)

    # ---- the step -----------------------------------------------------------------------------
    def zero_grad(self) -> None:
        if self.mesh is not None:
            self.mesh.zero_grad()  # in place: the gradients are views of the buckets
            return
        for p in self.params:  # as Module.zero_grad(set_to_none=True)
            p.grad = None

    def step(self) -> StepStats:
        self.settle()
        self._sum_tied()
        grads = self._grads()
        if self.fp16:
            for g in grads:
                g.div_(self.scale)
        # NOTE: the norm is computed at every step, clipping or not: the progress line and
        # --metrics show it for every model. Its cost is one pass over the gradients and one
        # scalar all-reduce among the pipeline ranks (bench/grad_norm.py measures it against
        # the step). Only clipping and fp16 act on it: a non-finite norm skips the step there
        # alone, as before.
        acts = self.spec.clip_grad_norm is not None or self.fp16  # the step needs the norm
        norm: float | Callable[[], float]
        if acts or not self.norm_reduce:
            norm = self._global_norm(grads)
        else:
            # NOTE: a norm only shown (the progress line, --metrics) is summed over the
            # pipeline ranks in the background: a blocking all-reduce here made each rank
            # wait, after its last backward, for the rank that finishes last: one round trip
            # on the critical path of every step (two-rank 1F1B: 5-10 % of the step). The
            # last rank, which reports it, waits for it after its step; the others before
            # their next collective (`settle`).
            sq = self._local_sq(grads)
            self._pending = dist.all_reduce(sq, group=self.norm_group, async_op=True)
            norm = functools.partial(self._reported, sq)
        skipped = isinstance(norm, float) and acts and not math.isfinite(norm)
        if skipped:
            self.scale *= BACKOFF
            self.good_steps = 0
        else:
            if self.spec.clip_grad_norm is not None:
                assert isinstance(norm, float)
                coef = min(1.0, self.spec.clip_grad_norm / (norm + 1e-6))
                for g in grads:
                    g.mul_(coef)
            for opt in self.optimizers.values():
                opt.step()
            if self.fp16:
                self.good_steps += 1
                if self.good_steps == GROWTH_INTERVAL:
                    self.scale *= GROWTH
                    self.good_steps = 0
        lr = next((float(o.param_groups[0]["lr"]) for o in self.optimizers.values()), None)
        for sched in self.schedulers.values():
            sched.step()
        return StepStats(norm, skipped, lr)

    def _sum_tied(self) -> None:
        for t in self.tied:
            got = [p.grad for _, p in t.members if p.grad is not None]
            total = torch.zeros_like(t.members[0][1]) if not got else sum(got[1:], got[0].clone())
            if t.group is not None:
                flag = torch.tensor([float(bool(got))], device=total.device)
                dist.all_reduce(total, group=t.group)
                dist.all_reduce(flag, group=t.group)
                if flag.item() == 0:
                    continue
            elif not got:
                continue
            for _, p in t.members:
                p.grad = total.clone()

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        """The L2 norm of all stages' gradients (tied groups once), over all ranks; inf or NaN
        when any gradient is not finite."""
        sq = self._local_sq(grads)
        if self.norm_reduce:
            dist.all_reduce(sq, group=self.norm_group)
        return float(sq.sqrt())

    def _local_sq(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The squared L2 norm of this rank's gradients (tied groups once), in float64."""
        repeated = {id(p.grad) for t in self.tied for i, (_, p) in enumerate(t.members)
                    if (i > 0 or not t.first) and p.grad is not None}
        counted = [g.float() for g in grads if id(g) not in repeated]
        if counted:  # one norm per gradient in one call, as clip_grad_norm_; summed in float64
            return torch.stack(torch._foreach_norm(counted)).double().square().sum()
        # (no gradients: on the rank's device all the same, where NCCL all-reduces it)
        return torch.zeros((), dtype=torch.float64,
                           device=grads[0].device if grads else self._device())

    def _device(self) -> torch.device:
        """This rank's device, for a norm of no gradients (NCCL all-reduces on it)."""
        if self.params:
            return self.params[0].device
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _reported(self, sq: torch.Tensor) -> float:
        self.settle()
        return float(sq.sqrt())

    def settle(self) -> None:
        """Wait for the background all-reduce of the last step's norm, if any (before any
        other collective of this rank, and before the process group ends)."""
        if self._pending is not None:
            work, self._pending = self._pending, None
            work.wait()

    # ---- checkpoints ----------------------------------------------------------------------------
    def stage_state(self, s: int) -> dict[str, Any]:
        return {"optimizer": self.optimizers[s].state_dict() if s in self.optimizers else None,
                "scheduler": self.schedulers[s].state_dict() if s in self.schedulers else None,
                "scale": self.scale, "good_steps": self.good_steps}

    def load_stage_state(self, s: int, state: dict[str, Any]) -> None:
        if s in self.optimizers and state["optimizer"] is not None:
            self.optimizers[s].load_state_dict(state["optimizer"])
        if s in self.schedulers and state["scheduler"] is not None:
            self.schedulers[s].load_state_dict(state["scheduler"])
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
