"""Bring your own nn.Module: `pipeir.split` and `ModuleSpec` train an unsplit module to the
parameters of ordinary single-process training of that module (the oracle is written here
with plain torch, not pipeir's reference), with its parameter names, tied weights and
initial weights."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import byom_models as BM
import pytest
import torch
from byom_helpers import MODELS, TIMEOUT, byom_job, synthesised, train_unsplit
from torch import nn

import pipeir
from pipeir.diagnostics import UsageError
from pipeir.models import ModuleSpec, resolve
from pipeir.models.splittable import Splittable
from pipeir.runtime.compare import differences
from pipeir.runtime.launch import launch
from pipeir.runtime.worker import split_batch


def test_split_keeps_names_and_computes_the_unsplit_forward() -> None:
    """Both routes: pruned deep copies (no example) and torch's tracer (an example); a
    traced stage hands a tuple on as the next stage's arguments."""
    torch.manual_seed(0)
    seq = BM._seq()
    x = torch.randn(3, BM.D)
    pruned = pipeir.split(seq, ["2.2", "3"])
    assert [sorted(n for n, _ in s.named_parameters()) for s in pruned] == [
        ["0.bias", "0.weight", "2.0.bias", "2.0.weight", "2.1.bias", "2.1.weight"],
        ["2.2.bias", "2.2.weight", "2.3.bias", "2.3.weight"], ["3.bias", "3.weight"]]
    h = x
    for s in pruned:
        h = s(h)
    torch.testing.assert_close(h, seq(x), rtol=0, atol=0)

    model = BM.Tied()
    ids = torch.randint(0, BM.V, (2, 6))
    traced = pipeir.split(model, ["layers.1", "layers.3"], example=ids)
    names = set().union(*({n for n, _ in s.named_parameters()} for s in traced))
    assert names <= {n for n, _ in model.named_parameters(remove_duplicate=False)}
    out = traced[0](ids)
    assert isinstance(out, tuple) and len(out) == 2  # (hidden, scale): two arguments
    for s in traced[1:]:
        out = s(*out) if isinstance(out, tuple) else s(out)
    torch.testing.assert_close(out, model(ids), rtol=1e-6, atol=1e-6)


def test_a_skip_connection_is_carried_along_the_chain() -> None:
    """Stage 0's embedding, read after the last block, passes through stage 1."""
    torch.manual_seed(0)
    model = BM.Tied(skip=True)
    ids = torch.randint(0, BM.V, (2, 6))
    stages = pipeir.split(model, ["layers.1", "layers.3"], example=ids)
    out: Any = ids
    widths = []
    for s in stages:
        out = s(*out) if isinstance(out, tuple) else s(out)
        widths.append(len(out) if isinstance(out, tuple) else 1)
    assert widths == [3, 3, 1]  # hidden, scale and the carried embedding
    torch.testing.assert_close(out, model(ids), rtol=1e-6, atol=1e-6)


def test_module_spec_recognises_tied_weights_and_starts_from_the_unsplit_weights() -> None:
    ms = BM.tied4().model_spec()
    assert ms.tied(4) == [[(0, "embed.weight"), (3, "head.weight")]]
    torch.manual_seed(0)
    unsplit = BM.Tied().state_dict()
    for s in range(4):
        for k, v in ms.stage(s, 4).state_dict().items():
            assert torch.equal(v, unsplit[k]), (s, k)


def test_weights_come_from_an_unsplit_state_dict_file_and_stages_build_on_meta(
        tmp_path: Path) -> None:
    torch.manual_seed(3)
    other = BM._seq()
    path = tmp_path / "w.pt"
    torch.save(other.state_dict(), path)
    spec = ModuleSpec(module=BM._seq, batch=BM._batch, loss=nn.functional.mse_loss,
                      points=["2.2"], weights=str(path))
    ms = spec.model_spec()
    with torch.device("meta"):
        meta = ms.stage(1, 2)
    assert all(p.is_meta for p in meta.parameters())
    for s in range(2):
        for k, v in ms.stage(s, 2).state_dict().items():
            assert torch.equal(v, other.state_dict()[k]), (s, k)


@pytest.mark.parametrize(("fn", "points", "message"), [
    ("seq_bad_point", None, "split point '2.9' is not a candidate; the candidates are 1, "
                            "2.0, 2.1, 2.2, 2.3, 3"),
    ("seq", ["3", "2.2"], "must be distinct and in model order"),
    ("seq", "23", "split points are a list of module names, e.g. ['layers.2'], got '23'"),
    ("seq", [3], "split points are a list of module names, e.g. ['layers.2'], got [3]"),
])
def test_bad_points_are_one_clear_error(fn: str, points: Any,
                                        message: str) -> None:
    spec = getattr(BM, fn)()
    with pytest.raises(UsageError, match=re.escape(message)):
        spec.at(points) if points is not None else spec.model_spec()


def test_run_refuses_a_point_count_the_schedule_does_not_run(cli, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("run", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "4",
                       "--model", f"{MODELS}:seq")
    assert code == 2 and "Traceback" not in err
    assert "the split points ['2.2'] make 2 stages; the schedule runs 4" in err
    code, _, err = cli("run", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2",
                       "--model", f"{MODELS}:seq_bad_point")
    assert code == 2 and "split point '2.9' is not a candidate" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.mp
def test_module_specs_train_like_the_unsplit_module() -> None:
    """Pruned and traced splits, a tied weight across ranks, Adam and clipping, on 1F1B,
    interleaved (four traced stages on two ranks), zb-h1 (split backward) and a
    synthesised schedule: every parameter equals single-process training of the unsplit
    module (1e-5), under its original name."""
    lib = pipeir.library.get
    jobs = [
        byom_job(lib("1f1b", 2, 4), "seq", 3),
        byom_job(lib("1f1b", 2, 4), "seq_uniform", 2),
        byom_job(lib("1f1b", 2, 4), "tied", 3),
        byom_job(lib("interleaved-1f1b", 2, 4, v=2), "tied4", 3),
        byom_job(lib("zb-h1", 2, 4), "tied", 2),
        byom_job(synthesised(), "tied", 2),
    ]
    result = launch(jobs, 2, timeout_s=TIMEOUT)
    for j, job in enumerate(jobs):
        spec = getattr(BM, job.model.rpartition(":")[2])()
        want, want_grads = train_unsplit(spec, 4, job.steps)
        got: dict[str, Any] = {}
        grads: dict[str, Any] = {}
        for s in sorted(result.params[j]):
            got.update(result.params[j][s])
            grads.update(result.grads[j][s])
        assert set(got) <= set(want) and set(want) - set(got) <= {"head.weight"}, j
        for k, v in want.items():
            mine = torch.from_numpy(got.get(k, got.get("embed.weight")))
            torch.testing.assert_close(mine, v, rtol=1e-5, atol=1e-5 * float(v.abs().max()),
                                       msg=lambda m, k=k, j=j: f"job {j} {k}: {m}")
        for k, g in grads.items():
            torch.testing.assert_close(torch.from_numpy(g), want_grads[k], rtol=1e-5,
                                       atol=1e-5 * float(want_grads[k].abs().max()))
    tied = result.params[3]
    assert (tied[0]["embed.weight"] == tied[3]["head.weight"]).all()
    # --check's judgement passes these correct runs (Adam, clipping, a tied weight)
    for j, job in enumerate(jobs):
        rows = differences(resolve(job.model), job, result, j)
        assert max(max(p, g) for _, p, g, _ in rows) <= 1e-5, (j, rows)


def test_resolve_turns_a_module_spec_into_the_model_spec_run_trains() -> None:
    assert isinstance(BM.tied(), Splittable)  # the seam `pipeirc plan` cuts through
    ms = resolve(f"{MODELS}:tied")
    assert ms.tied is not None and ms.tied(2) == [[(0, "embed.weight"), (1, "head.weight")]]
    assert ms.clip_grad_norm == 0.5


@pytest.mark.mp
def test_run_save_exports_one_state_dict_that_loads_into_the_unsplit_module(
        cli, tmp_path: Path) -> None:
    """`run --save` then `export-weights`: the file loads into the unsplit module with
    strict=True and holds single-process training's parameters; as a ModuleSpec's
    `weights` it gives the stages those parameters back."""
    save, out = tmp_path / "ckpt", tmp_path / "w.safetensors"
    code, _, err = cli("run", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "4",
                       "--steps", "2", "--model", f"{MODELS}:tied", "--save", save)
    assert code == 0, err
    code, printed, err = cli("export-weights", save, "--model", f"{MODELS}:tied", "-o", out)
    assert code == 0, err
    # every name of the unsplit module, head.weight (embed.weight's second name) included
    assert f"wrote {len(BM.Tied().state_dict())} tensors" in printed
    from safetensors.torch import load_file

    state = load_file(str(out))
    module = BM.Tied()
    module.load_state_dict(state, strict=True)
    want, _ = train_unsplit(BM.tied(), 4, 2)
    for k, v in module.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6)
    back = ModuleSpec(module=BM.Tied, batch=BM._tokens, loss=BM._ce, points=["layers.2"],
                      example=BM._tokens(0)[0][:2], weights=str(out)).model_spec()
    for s in range(2):
        for k, v in back.stage(s, 2).state_dict().items():
            assert torch.equal(v, state[k]), (s, k)
    # never over the checkpoint it reads; never a checkpoint of another model
    stage0 = save / "step-2" / "stage-0.pt"
    before = stage0.read_bytes()
    code, _, err = cli("export-weights", save, "--model", f"{MODELS}:tied", "-o", stage0)
    assert code == 2 and f"-o {stage0}: is an input of this command" in err, err
    assert stage0.read_bytes() == before
    code, _, err = cli("export-weights", save, "--model", "transformer", "-o", tmp_path / "x.pt")
    assert code == 2 and "(a checkpoint of another model?)" in err, err
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize(("args", "message"), [
    (("nowhere",), "nowhere: no checkpoint there"),
    (("CKPT", "-o", "w.bin"), "-o w.bin: expected a .pt or .safetensors file"),
])
def test_export_weights_rejects_bad_input(cli, tmp_path: Path, args: tuple[str, ...],
                                          message: str, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    monkeypatch.chdir(tmp_path)
    argv = [a.replace("CKPT", "nowhere") for a in args]
    if "-o" not in argv:
        argv += ["-o", "w.pt"]
    code, _, err = cli("export-weights", *argv, "--model", f"{MODELS}:tied")
    assert code == 2 and message in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_hand_off_whose_structure_depends_on_the_data_is_refused_before_launch(
        cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Micro-batch 1 of batch(0) has no padding, so stage 0 hands over None for the mask;
    the run stops before any process starts, naming the stage, micro-batch and element."""
    monkeypatch.chdir(tmp_path)
    xs, _ = split_batch(BM._batch(0), 4)
    pads = [bool((x[:, 0] > 1.5).any()) for x in xs]
    assert not all(pads) and any(pads)  # the data has both kinds of micro-batch
    mb = pads.index(False)
    code, _, err = cli("run", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "4",
                       "--model", f"{MODELS}:data_dependent")
    assert code == 2 and "Traceback" not in err
    assert (f"stage 0's output for micro-batch {mb} of batch(0) differs from the traced plan "
            "at [1]: None here, bool[2] there: the hand-off's structure depends on the "
            "data's values") in err
    assert list(tmp_path.iterdir()) == []


def test_stages_from_a_safetensors_file_build_the_module_on_meta_only(tmp_path: Path) -> None:
    """The unsplit module is built on the meta device only (no memory for weights a stage
    does not own), each stage materialised from the file; a tied weight stored once, as
    Hugging Face's safetensors files store it, reaches both names."""
    from safetensors.torch import save_file

    torch.manual_seed(4)
    other = BM.Tied()
    state = {k: v.contiguous() for k, v in other.state_dict().items() if k != "head.weight"}
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    devices: list[str] = []

    def build() -> nn.Module:
        model = BM.Tied()
        devices.append(model.embed.weight.device.type)
        return model

    ms = ModuleSpec(module=build, batch=BM._tokens, loss=BM._ce, points=["layers.2"],
                    example=BM._tokens(0)[0][:2], weights=str(path)).model_spec()
    stages = [ms.stage(s, 2) for s in range(2)]
    assert devices and set(devices) == {"meta"}
    assert torch.equal(stages[1].state_dict()["head.weight"], state["embed.weight"])
    for s in stages:
        for k, v in s.state_dict().items():
            assert not v.is_meta and torch.equal(v, other.state_dict()[k]), k


def test_a_traced_stage_refuses_other_shapes_before_launch(cli, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """`tied` is traced for micro-batches of 2 (8 samples in 4); cut in 2 the batch gives
    micro-batches of 4: refused before any process starts, naming the stage and shapes."""
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("run", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2",
                       "--model", f"{MODELS}:tied")
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"error: --model {MODELS}:tied: stage 0 was traced for inputs of shape (2x6) "
        "(ModuleSpec's example) but is given (4x6): a traced stage keeps the example's "
        "shapes; give an example of one micro-batch as this run cuts the batch")
    assert list(tmp_path.iterdir()) == []


def test_causal_lm_imports_as_the_function() -> None:
    """`from pipeir.models import causal_lm` (what examples/hf_llama.py writes) gives the
    function, not its submodule of the same name, in a fresh interpreter where nothing has
    imported it before."""
    code = ("from pipeir.models import ModuleSpec, causal_lm\n"
            "from torch import nn\n"
            "spec = causal_lm(nn.Sequential(nn.Embedding(64, 8), nn.Linear(8, 64)), vocab=64)\n"
            "assert isinstance(spec, ModuleSpec), spec\n"
            "print(tuple(spec.example.shape))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=TIMEOUT, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["(2,", "16)"]


def test_weights_that_lack_a_parameter_are_refused_not_made_up() -> None:
    """A parameter missing from the weights (a DDP `module.` prefix, a partial file) was
    filled from a random build, silently; only non-persistent buffers may be missing."""
    torch.manual_seed(0)
    src = BM._seq()
    prefixed = {"module." + k: v for k, v in src.state_dict().items()}
    spec = ModuleSpec(module=BM._seq, batch=BM._batch, loss=nn.functional.mse_loss,
                      points=["2.2"], weights=prefixed)
    with pytest.raises(UsageError, match=re.escape("it has 'module.0.weight': strip the "
                                                   "prefix 'module.' from its names")):
        spec.model_spec().stage(0, 2)
    partial = {k: v for k, v in src.state_dict().items() if k != "3.bias"}
    spec = ModuleSpec(module=BM._seq, batch=BM._batch, loss=nn.functional.mse_loss,
                      points=["2.2"], weights=partial)
    spec.model_spec().stage(0, 2)  # (stage 0 holds all it needs)
    with pytest.raises(UsageError, match=re.escape("weights: the file has no '3.bias'; it "
                                                   "must hold the unsplit module's "
                                                   "state_dict")):
        spec.model_spec().stage(1, 2)
