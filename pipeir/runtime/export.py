"""`pipeirc export-weights`: a `--save` checkpoint as one unsplit state_dict under the model's
own parameter names, which loads into the unsplit module with `strict=True` (and back into
pipeir as a `ModuleSpec`'s `weights`).

Stages keep the unsplit module's names (`pipeir.models.module`), so the export is a union of
the stages' state_dicts: a name held by several stages (a tied weight's copies, equal after
every step) must hold one value, and with a `ModuleSpec` every name of the unsplit module must
be there (a tied weight under each of its names).

NOTE: the stage files are read through `checkpoint.stage_models`, which checks them against
their manifest as a resume does, so the checkpoint format lives in one module.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path

import torch

from pipeir.diagnostics import UsageError
from pipeir.files import write_atomic
from pipeir.models.spec import HasModelSpec, ModelSpec
from pipeir.runtime import checkpoint

FORMATS = (".pt", ".safetensors")


def unsplit(stages: Mapping[int, Mapping[str, torch.Tensor]],
            names: Mapping[str, list[str]] | None = None) -> dict[str, torch.Tensor]:
    """One state_dict from the stages'. `names` (name -> every name of that tensor, from
    `ModuleSpec.state_names`) adds a tied weight's other names and requires every name."""
    out: dict[str, torch.Tensor] = {}
    where: dict[str, int] = {}
    for s in sorted(stages):
        for k, v in stages[s].items():
            if k in out and not torch.equal(out[k], v):
                why = ("stages that share a name must hold one tensor" if names is not None
                       else "the model's stages are built apart, not cut from one module, so "
                            "their names are not one module's: export-weights needs a model "
                            "whose stages keep its own names, a ModuleSpec")
                raise UsageError(f"'{k}' differs between stage {where[k]} and stage {s} "
                                 f"({why})")
            out.setdefault(k, v)
            where.setdefault(k, s)
    if names is None:
        return out
    for k, aliases in names.items():
        if k not in out:
            held = next((a for a in aliases if a in out), None)
            if held is None:
                raise UsageError(f"the checkpoint holds no '{k}' (a checkpoint of another "
                                 "model?)")
            out[k] = out[held]
    extra = sorted(set(out) - set(names))
    if extra:
        raise UsageError(f"the model has no '{extra[0]}' (a checkpoint of another model?)")
    return {k: out[k] for k in names}


def encode(state: Mapping[str, torch.Tensor], suffix: str) -> bytes:
    """The bytes of a `.pt` (torch.save) or `.safetensors` file holding `state`."""
    if suffix == ".safetensors":
        try:
            from safetensors.torch import save
        except ImportError:
            raise UsageError("writing .safetensors needs the safetensors package (pip install "
                             "'pipeir[hf]')") from None
        # safetensors refuses tensors sharing memory (a tied weight's names): one copy each
        data: bytes = save({k: v.detach().clone().contiguous() for k, v in state.items()})
        return data
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    return buf.getvalue()


def export(root: str, spec: ModelSpec | HasModelSpec, output: str) -> int:
    """Write checkpoint `root` as one state_dict to `output` (`.pt` or `.safetensors`);
    returns the number of names written."""
    suffix = Path(output).suffix
    if suffix not in FORMATS:
        raise UsageError(f"-o {output}: expected a {' or '.join(FORMATS)} file")
    names = spec.state_names() if isinstance(spec, HasModelSpec) else None
    model = spec.model_spec() if isinstance(spec, HasModelSpec) else spec
    state = unsplit(checkpoint.stage_models(root, model), names)
    write_atomic(output, encode(state, suffix), "-o")
    return len(state)
