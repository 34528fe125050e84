"""The Hugging Face examples (`examples/hf_llama.py`, `examples/hf_gpt2.py`): tiny configs
built in code, trained from an unsplit state_dict to the parameters of single-process
training of the unsplit HF model (plain torch, the oracle), on 1F1B, interleaved and a
synthesised schedule; the checkpoint exports to a state_dict the unsplit model loads with
strict=True; the same stage modules train under torch's own `PipelineStage` with
`pipeir.torch_schedule`. Skipped without transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from byom_helpers import byom_job, synthesised, train_unsplit

from pipeir.models import resolve
from pipeir.runtime.compare import differences
from pipeir.runtime.launch import free_port, launch
from pipeir.schedule import Schedule

EXAMPLES = Path(__file__).parent.parent / "examples"
LLAMA, GPT2 = EXAMPLES / "hf_llama.py", EXAMPLES / "hf_gpt2.py"
TIMEOUT = 180.0


def _load(path: Path) -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unsplit state_dicts of other seeds than the examples build with, named by the
    examples' environment variables (the worker processes inherit them)."""
    for path, var, seed in ((LLAMA, "HF_LLAMA_WEIGHTS", 5), (GPT2, "HF_GPT2_WEIGHTS", 6)):
        monkeypatch.delenv(var, raising=False)
        torch.manual_seed(seed)
        model = _load(path).spec().module()  # type: ignore[attr-defined]
        out = tmp_path / f"{path.stem}.pt"
        torch.save(model.state_dict(), out)
        monkeypatch.setenv(var, str(out))


def _ref(path: Path, fn: str = "spec") -> str:
    return f"{path}:{fn}"


@pytest.mark.mp
def test_hf_examples_train_like_the_unsplit_model_and_export(cli, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    import pipeir

    _weights(tmp_path, monkeypatch)
    lib = pipeir.library.get
    plan: list[tuple[Schedule, Path, str]] = [
        (lib("1f1b", 2, 4), LLAMA, "spec"),
        (lib("interleaved-1f1b", 2, 4, v=2), LLAMA, "spec"),
        (synthesised(), LLAMA, "spec"),
        (lib("1f1b", 2, 4), GPT2, "spec"),
        (lib("interleaved-1f1b", 2, 4, v=2), GPT2, "spec"),
        (synthesised(), GPT2, "untied"),
    ]
    jobs = [byom_job(s, _ref(p, fn), 2) for s, p, fn in plan]
    result = launch(jobs, 2, timeout_s=TIMEOUT)
    for j, (_, path, fn) in enumerate(plan):
        spec = getattr(_load(path), fn)()
        want, _ = train_unsplit(spec, 4, 2)
        got: dict[str, object] = {}
        for s in sorted(result.params[j]):
            got.update(result.params[j][s])
        assert set(got) <= set(want), j
        for k, v in want.items():
            if k not in got:  # a tied weight's second name lives in no stage of its own
                continue
            torch.testing.assert_close(torch.from_numpy(got[k]), v, rtol=1e-5,  # type: ignore[arg-type]
                                       atol=1e-5 * float(v.abs().max()),
                                       msg=lambda m, k=k, j=j: f"job {j} {k}: {m}")
    # the tied GPT-2's copies on stage 0 and stage 3 (two ranks) are one weight
    assert (result.params[4][0]["transformer.wte.weight"]
            == result.params[4][3]["lm_head.weight"]).all()
    # --check's judgement passes every one of these correct runs
    for j, job in enumerate(jobs):
        rows = differences(resolve(job.model), job, result, j)
        assert max(max(p, g) for _, p, g, _ in rows) <= 1e-5, (j, rows)

    # --save, then export-weights: the unsplit HF model loads it with strict=True
    save, out = tmp_path / "ckpt", tmp_path / "gpt2.pt"
    code, _, err = cli("run", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "4",
                       "--steps", "2", "--model", _ref(GPT2), "--save", save)
    assert code == 0, err
    code, _, err = cli("export-weights", save, "--model", _ref(GPT2), "-o", out)
    assert code == 0, err
    model = _load(GPT2).spec().module()  # type: ignore[attr-defined]
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    want, _ = train_unsplit(_load(GPT2).spec(), 4, 2)  # type: ignore[attr-defined]
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-5 * float(v.abs().max()))


_RANK = '''
import os, sys, warnings
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
import pipeir
sys.path.insert(0, {examples!r})
import hf_gpt2, hf_llama

warnings.simplefilter("ignore")
rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=2)
for name, spec in (("llama", hf_llama.spec()), ("gpt2", hf_gpt2.spec())):
    module = spec.model_spec().stage(rank, 2)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    sched = pipeir.torch_schedule(stage, "1f1b", n_microbatches=4, loss_fn=spec.loss)
    x, y = spec.batch(0)
    sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)
    torch.save({{k: p.grad for k, p in module.named_parameters()}},
               os.path.join(out, f"{{name}}-rank{{rank}}.pt"))
dist.destroy_process_group()
'''


@pytest.mark.mp
def test_the_same_stage_modules_train_under_torch_pipeline_stage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama, and GPT-2 whose tied embedding and head sit on two ranks: torch's
    `PipelineStage`s of pipeir's stage modules, run by `pipeir.torch_schedule`, get the
    gradients of the unsplit HF model (the tied copies both get the whole gradient)."""
    monkeypatch.delenv("HF_LLAMA_WEIGHTS", raising=False)
    monkeypatch.delenv("HF_GPT2_WEIGHTS", raising=False)
    script = tmp_path / "rank.py"
    script.write_text(_RANK.format(examples=str(EXAMPLES)))
    port = str(free_port())
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
             for r in range(2)]
    try:
        logs = [p.communicate(timeout=240)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    for name, path in (("llama", LLAMA), ("gpt2", GPT2)):
        _, want = train_unsplit(_load(path).spec(), 4, 1)  # type: ignore[attr-defined]
        got = {**torch.load(tmp_path / f"{name}-rank0.pt"),
               **torch.load(tmp_path / f"{name}-rank1.pt")}
        assert set(got) <= set(want), json.dumps(sorted(set(got) - set(want)))
        assert len(got) == len({id(p) for p in _load(path).spec().module().parameters()}) \
            + (name == "gpt2")  # GPT-2's tied weight: one copy per rank
        for k, g in got.items():
            torch.testing.assert_close(g, want[k], rtol=1e-5,
                                       atol=1e-5 * float(want[k].abs().max()),
                                       msg=lambda m, k=k, n=name: f"{n} {k}: {m}")
