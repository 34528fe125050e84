"""The torch side of bench/startup.py: pipeirc run's built-in `mlp` trained with
torch.distributed.pipelining's 1F1B under torchrun, one stage per rank, written as a user
would write it (torch only). The last rank prints `step N` after each optimizer step.
With PIPEIR_MILESTONES=FILE (bench/startup.py --breakdown) each rank also appends its
start-up milestones to FILE in pipeir.runtime.milestones's format (written out here, so that
the script imports nothing but torch).

    torchrun --nproc-per-node 2 bench/startup_kit/torch_1f1b.py --microbatches 4 --steps 1
"""

from __future__ import annotations

import argparse
import os
import time


def mark(name: str) -> None:
    """pipeir.runtime.milestones.mark, for this script's ranks."""
    path = os.environ.get("PIPEIR_MILESTONES")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{time.time():.6f} {os.getpid()} rank {os.environ['RANK']}: {name}\n")


mark("started")

import torch  # noqa: E402 - after the first milestone, to time its import
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.pipelining import PipelineStage, Schedule1F1B  # noqa: E402

WIDTH, BLOCKS, BATCH = 512, 8, 256  # pipeir.models.mlp


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + step % 4)
    x = torch.randn(BATCH, WIDTH, generator=g)
    target_map = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(7))
    return x, torch.tanh(x @ target_map / WIDTH**0.5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=1)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    mark("torch imported")
    dist.init_process_group("gloo")
    mark("process group")
    torch.manual_seed(rank)
    stage = nn.Sequential(*(Block() for _ in range(max(1, BLOCKS // world))))
    pipe = PipelineStage(stage, rank, world, torch.device("cpu"))
    sched = Schedule1F1B(pipe, args.microbatches, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    mark("model built")
    for step in range(args.steps):
        x, y = batch(step)
        opt.zero_grad()
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        opt.step()
        if step == 0:
            mark("first step")
        if rank == world - 1:
            print(f"step {step + 1}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
