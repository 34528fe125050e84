"""`pipeir.torch_schedule` checks the stages' wiring when it builds the schedule, not at the
first `step()`: the oracle is torch's own runtime on the same `PipelineStage`s (what it runs,
what it fails on at `step()`) and plain single-process training of the unsplit module. One
process, one gloo rank holding every stage (a process group: `mp`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mp

HERE = Path(__file__).parent

_SCRIPT = '''
import json, os, sys, warnings
import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.pipelining import (PipelineStage, ScheduleInterleaved1F1B, SplitPoint,
                                          build_stage, pipeline)
sys.path.insert(0, {tests!r})
import byom_models as BM
import pipeir
from pipeir.runtime.launch import free_port

warnings.simplefilter("ignore")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)
ids, target = BM._tokens(0)
out = {{}}


def attempt(key, build, step=None):
    """Record what building (pipeir) or stepping (torch) says: 'ok' or the error."""
    try:
        sched = build()
        if step is not None:
            step(sched)
        out[key] = "ok"
    except Exception as e:
        out[key] = f"{{type(e).__name__}}: {{e}}"


def stages(modules):
    return [PipelineStage(m, s, len(modules), torch.device("cpu"))
            for s, m in enumerate(modules)]


# 1. a skip connection: torch's tracer lets stage 2 read stage 0's outputs
torch.manual_seed(0)
pipe = pipeline(BM.Tied(skip=True), mb_args=(ids[:2],),
                split_spec={{"layers.1": SplitPoint.BEGINNING, "layers.3": SplitPoint.BEGINNING}})
skip = [build_stage(pipe.get_stage_module(s), s, pipe.info(), torch.device("cpu"))
        for s in range(3)]
attempt("skip pipeir", lambda: pipeir.torch_schedule(skip, "interleaved-1f1b",
                                                     n_microbatches=4, loss_fn=BM._ce))
attempt("skip torch", lambda: ScheduleInterleaved1F1B(skip, 4, loss_fn=BM._ce),
        lambda s: s.step(ids, target=target))


# 2. stage 0 gives two outputs (a tuple: two arguments), stage 1 takes one
class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(BM.V, BM.V)

    def forward(self, ids):
        h = self.embed(ids)
        return h, 2 * h


def two():
    torch.manual_seed(0)
    return stages([fx.symbolic_trace(Two()), nn.Linear(BM.V, BM.V)])


attempt("arity pipeir", lambda: pipeir.torch_schedule(two(), "interleaved-1f1b",
                                                      n_microbatches=4, loss_fn=BM._ce))
attempt("arity torch", lambda: ScheduleInterleaved1F1B(two(), 4, loss_fn=BM._ce),
        lambda s: s.step(ids, target=target))


# 3. a tied weight split into copies (stage 0's embedding, stage 1's head)
def tied():
    torch.manual_seed(0)
    model = BM.Tied()
    return model, pipeir.split(model, ["layers.2"], example=ids[:2])


grads = {{}}
for who, make in (("pipeir", lambda st: pipeir.torch_schedule(st, "interleaved-1f1b",
                                                              n_microbatches=4,
                                                              loss_fn=BM._ce)),
                  ("torch", lambda st: ScheduleInterleaved1F1B(st, 4, loss_fn=BM._ce))):
    model, mods = tied()
    make(stages(mods)).step(ids, target=target)
    grads[who] = {{k: p.grad for m in mods for k, p in m.named_parameters()}}
model, _ = tied()
for x, y in zip(ids.chunk(4), target.chunk(4)):
    (BM._ce(model(x), y) / 4).backward()
want = {{k: p.grad for k, p in model.named_parameters(remove_duplicate=False)}}
for who, got in grads.items():
    out[f"tied {{who}}"] = sorted(k for k, g in got.items()
                                 if not torch.allclose(g, want[k], rtol=1e-5, atol=1e-7))
out["tied names"] = sorted(grads["pipeir"])
print("RESULT " + json.dumps(out))
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    script = tmp_path_factory.mktemp("wiring") / "wiring.py"
    script.write_text(_SCRIPT.format(tests=str(HERE)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout + done.stderr
    got: dict[str, object] = json.loads(lines[0].removeprefix("RESULT "))
    return got


def test_a_skip_connection_is_refused_when_the_schedule_is_built(outcome: dict[str, object]
                                                                 ) -> None:
    """torch's tracer lets stage 2 read stage 0's scale; torch's runtime fails on it only
    inside `step()`; pipeir refuses it at once, naming the stage and the value."""
    assert outcome["skip pipeir"] == (
        "UsageError: error: torch_schedule: stage 2 reads stage 0's output 'div' (argument "
        "1), a skip connection: pipeir's schedules pass values between neighbouring stages "
        "only; split the module with pipeir.split, which carries such a value along the chain")
    assert outcome["skip torch"] != "ok"


def test_outputs_that_do_not_fit_the_next_stage_are_refused_when_built(
        outcome: dict[str, object]) -> None:
    """A tuple output is the next stage's arguments: two for a stage taking one. torch
    builds the schedule and fails at `step()` (TypeError); pipeir refuses at build."""
    assert str(outcome["arity torch"]).startswith("TypeError")
    assert outcome["arity pipeir"] == (
        "UsageError: error: torch_schedule: stage 1 takes 1 positional argument(s), stage 0 "
        "gives 2 output(s) (a tuple output is the next stage's positional arguments, as in "
        "torch's PipelineStage)")


def test_tied_copies_train_as_one_weight(outcome: dict[str, object]) -> None:
    """pipeir.split's copies of the tied embedding / head: under torch's own schedule each
    copy gets only its share of the gradient; under torch_schedule both get the unsplit
    module's gradient, and every other gradient matches it too."""
    assert {"embed.weight", "head.weight"} <= set(outcome["tied names"])  # type: ignore[arg-type]
    assert outcome["tied torch"] == ["embed.weight", "head.weight"]
    assert outcome["tied pipeir"] == []
