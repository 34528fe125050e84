"""Checkpoints: per-stage model, optimizer and LR-scheduler state, the step (which is also the
data position: `batch(step)` is a function of the step) and the fp16 loss scale.

Layout of `DIR` (`pipeirc run --save DIR`):

    DIR/latest                 the name of the newest complete checkpoint, e.g. "step-20"
    DIR/step-20/manifest.json  format, model, stages, step, every stage's parameter shapes
    DIR/step-20/stage-3.pt     stage 3: {"model", "optimizer", "scheduler", "scale", ...}

Stages, not ranks, are the unit, so a checkpoint written with one schedule or rank count loads
into any other with the same stages (e.g. 1F1B on 4 ranks -> interleaved v=2 on 2 ranks).

NOTE (atomic): every rank writes its stages into `DIR/.step-N.tmp`; after a barrier rank 0
writes the manifest, renames the directory to `step-N`, then replaces `latest` (os.replace) and
only then deletes older checkpoints. A crash at any point leaves `latest` naming a complete
checkpoint. Plain `torch.save` per stage rather than torch.distributed.checkpoint: a stage is
never split across ranks, so there is nothing to reshard and one file per stage is the unit.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeir.diagnostics import UsageError
from pipeir.files import check_dir
from pipeir.models.spec import ModelSpec
from pipeir.runtime.optim import Optim

FORMAT = 1
LATEST = "latest"
MANIFEST = "manifest.json"


def shapes_of(spec: ModelSpec, stages: int) -> dict[str, dict[str, list[int]]]:
    """Stage (as a string, for JSON) -> parameter and buffer name -> shape, built on meta."""
    with torch.device("meta"):
        return {str(s): {k: list(v.shape) for k, v in spec.stage(s, stages).state_dict().items()}
                for s in range(stages)}


def find(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under `root` (or `root` itself if it is one)."""
    root = Path(root)
    if (root / MANIFEST).is_file():
        return root
    latest = root / LATEST
    if latest.is_file():
        d = root / latest.read_text().strip()
        if (d / MANIFEST).is_file():
            return d
    return None


def validate(root: str, spec: ModelSpec, stages: int) -> int:
    """Check before any process starts that checkpoint `root` fits this model and stage count;
    returns its step. Problems are UsageErrors naming the stage and parameter."""
    d = find(root)
    if d is None:
        raise UsageError(f"--resume {root}: no checkpoint there (no {LATEST} or {MANIFEST})")
    try:
        man = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--resume {root}: unreadable {d / MANIFEST}: {e}") from None
    if man.get("format") != FORMAT:
        raise UsageError(f"--resume {root}: {d} is not a pipeir checkpoint of format {FORMAT}")
    if man["stages"] != stages:
        raise UsageError(f"--resume {root}: the checkpoint has {man['stages']} stages, the "
                         f"schedule runs {stages} (stages, not ranks, must match)")
    want = shapes_of(spec, stages)
    for s in range(stages):
        have, need = man["params"][str(s)], want[str(s)]
        for name in need:
            if name not in have:
                raise UsageError(f"--resume {root}: stage {s}: the checkpoint has no "
                                 f"'{name}' (a checkpoint of another model?)")
            if have[name] != need[name]:
                raise UsageError(f"--resume {root}: stage {s} '{name}': the checkpoint has "
                                 f"shape {have[name]}, the model {need[name]}")
        extra = sorted(set(have) - set(need))
        if extra:
            raise UsageError(f"--resume {root}: stage {s}: the model has no '{extra[0]}' "
                             "(a checkpoint of another model?)")
    return int(man["step"])


def check_target(save: str, resume: str | None) -> None:
    """`--save DIR` must be a directory pipeir can make, and must not overwrite a checkpoint
    it does not continue."""
    check_dir(save, "--save")
    d = find(save)
    if d is not None and (resume is None or find(resume) != d):
        raise UsageError(f"--save {save}: already holds a checkpoint ({d.name}); resume it "
                         "with --resume, or save somewhere else")


def save(root: str, step: int, spec: ModelSpec, model: str, stages: int,
         modules: dict[int, torch.nn.Module], optim: Optim, rank: int, group: Any = None) -> None:
    """Write this rank's stages; rank 0 completes the checkpoint (collective over `group`, the
    ranks of one pipeline, default all: each calls it at the same step). With data
    parallelism only replica 0's pipeline saves (the replicas hold the same state), so the
    barrier is over its group: one over the world waited for replicas that never came."""
    base = Path(root)
    tmp = base / f".step-{step}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    for s, m in modules.items():
        state = {"model": m.state_dict(), "step": step, "stage": s, **optim.stage_state(s)}
        part = tmp / f"stage-{s}.pt.part"
        torch.save(state, part)
        os.replace(part, tmp / f"stage-{s}.pt")
    dist.barrier(group=group)
    if rank != 0:
        return
    manifest = {"format": FORMAT, "model": model, "stages": stages, "step": step,
                "params": shapes_of(spec, stages)}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    final = base / f"step-{step}"
    if final.exists():  # saved again after resuming from an earlier checkpoint
        shutil.rmtree(final)
    os.replace(tmp, final)
    (base / f"{LATEST}.tmp").write_text(final.name)
    os.replace(base / f"{LATEST}.tmp", base / LATEST)
    for old in base.glob("step-*"):
        if old != final and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def load(root: str, modules: dict[int, torch.nn.Module], optim: Optim,
         device: torch.device) -> int:
    """Load this rank's stages from the newest checkpoint under `root`; returns its step."""
    d = find(root)
    if d is None:
        raise RuntimeError(f"no checkpoint in {root}")
    for s, m in modules.items():
        state: dict[str, Any] = torch.load(d / f"stage-{s}.pt", map_location=device,
                                           weights_only=True)
        m.load_state_dict(state["model"])
        optim.load_stage_state(s, state)
    return int(json.loads((d / MANIFEST).read_text())["step"])
