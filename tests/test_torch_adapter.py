"""`pipeir.torch_schedule`: a pipeir schedule run by torch.distributed.pipelining's own runtime
on torch `PipelineStage`s trains to the gradients of single-process training."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeir.runtime.launch import free_port

pytestmark = pytest.mark.mp

EXAMPLES = Path(__file__).parent.parent / "examples"
M = 4  # micro-batches
#: (schedule as given to torch_schedule, stages): library names and a .sched file
ORDERS = [("1f1b", 2), ("interleaved-1f1b", 4), ("zb-v", 4), (str(EXAMPLES / "1f1b.sched"), 2)]

_RANK = '''
import json, os, sys, warnings
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
import pipeir

warnings.simplefilter("ignore")
rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
orders = json.loads(sys.argv[4])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=2)
m = {m}


def model(n):
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()) for _ in range(n)]


x = torch.randn(2 * m, 6, generator=torch.Generator().manual_seed(1))
y = torch.randn(2 * m, 6, generator=torch.Generator().manual_seed(2))
for k, (name, n) in enumerate(orders):
    mods = model(n)
    v_shape = name == "zb-v"
    mine = [s for s in range(n) if (s if s < 2 or not v_shape else 3 - s) % 2 == rank]
    stages = [PipelineStage(mods[s], s, n, torch.device("cpu")) for s in mine]
    sched = pipeir.torch_schedule(stages, name, n_microbatches=m,
                                  loss_fn=torch.nn.functional.mse_loss)
    sched.step(*((x,) if 0 in mine else ()), target=y if n - 1 in mine else None)
    torch.save({{s: {{k: p.grad for k, p in mods[s].named_parameters()}} for s in mine}},
               os.path.join(out, f"{{k}}-rank{{rank}}.pt"))
# a schedule that places other stages on this rank than it holds: one clear message
mods = model(4)
stages = [PipelineStage(mods[s], s, 4, torch.device("cpu")) for s in (rank, rank + 2)]
try:
    pipeir.torch_schedule(stages, "zb-v", n_microbatches=m)
except pipeir.UsageError as e:
    open(os.path.join(out, f"error-rank{{rank}}.txt"), "w").write(str(e))
# torch's class name for a schedule the library has: the library's name in a note
try:
    pipeir.torch_schedule(stages, "ZBVZeroBubble", n_microbatches=m)
except pipeir.UsageError as e:
    open(os.path.join(out, f"torch-name-rank{{rank}}.txt"), "w").write(str(e))
dist.destroy_process_group()
'''


def _reference(stages: int) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = [torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()) for _ in range(stages)]
    x = torch.randn(2 * M, 6, generator=torch.Generator().manual_seed(1))
    y = torch.randn(2 * M, 6, generator=torch.Generator().manual_seed(2))
    for xm, ym in zip(x.chunk(M), y.chunk(M)):
        h = xm
        for stage in model:
            h = stage(h)
        torch.autograd.backward(torch.nn.functional.mse_loss(h, ym) / M)
    return [{k: p.grad for k, p in stage.named_parameters()} for stage in model]


def test_pipeir_schedules_train_under_torch_pipelining(tmp_path: Path) -> None:
    import json

    script = tmp_path / "rank.py"
    script.write_text(_RANK.format(m=M))
    port = str(free_port())
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, str(tmp_path),
                               json.dumps(ORDERS)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=env) for r in range(2)]
    try:
        logs = [p.communicate(timeout=120)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    for k, (name, stages) in enumerate(ORDERS):
        got: dict[int, dict[str, torch.Tensor]] = {}
        for r in range(2):
            got.update(torch.load(tmp_path / f"{k}-rank{r}.pt"))
        assert sorted(got) == list(range(stages)), name
        for s, ref in enumerate(_reference(stages)):
            for key, g in ref.items():
                torch.testing.assert_close(got[s][key], g, rtol=1e-5, atol=1e-7,
                                           msg=lambda m, w=f"{name} stage {s} {key}": f"{w}: {m}")
    assert ("torch_schedule: schedule 'zb_v' places stages [0, 3] on rank 0, which holds "
            "stages [0, 2]") in (tmp_path / "error-rank0.txt").read_text()
    assert (tmp_path / "torch-name-rank0.txt").read_text().splitlines() == [
        "error: torch_schedule: 'ZBVZeroBubble' is neither a library schedule nor a .sched "
        "file; the library has 1f1b, dualpipe-v, gpipe, interleaved-1f1b, looped-bfs, zb-h1, "
        "zb-h2, zb-v",
        "note: did you mean 'zb-v'? (torch's ScheduleZBVZeroBubble)"]
