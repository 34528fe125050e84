"""The torch side of bench/startup.py: pipeirc run's built-in `mlp` trained with
torch.distributed.pipelining's 1F1B under torchrun, one stage per rank, written as a user
would write it (torch only). The last rank prints `step N` after each optimizer step.

    torchrun --nproc-per-node 2 bench/startup_kit/torch_1f1b.py --microbatches 4 --steps 1
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

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
    dist.init_process_group("gloo")
    torch.manual_seed(rank)
    stage = nn.Sequential(*(Block() for _ in range(max(1, BLOCKS // world))))
    pipe = PipelineStage(stage, rank, world, torch.device("cpu"))
    sched = Schedule1F1B(pipe, args.microbatches, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
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
        if rank == world - 1:
            print(f"step {step + 1}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
