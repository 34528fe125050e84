"""Checkpoints: per-stage model, optimizer and LR-scheduler state, the step (which is also the
data position: `batch(step)` is a function of the step) and the fp16 loss scale.

Layout of `DIR` (`pipeirc run --save DIR`):

    DIR/latest                 the name of the newest complete checkpoint, e.g. "step-20"
    DIR/.lock                  held by the run saving into DIR (`savelock`)
    DIR/step-20/manifest.json  format, stages, step, a sha256 per file, every stage's
                               parameter names, shapes and dtypes (`manifest`)
    DIR/step-20/stage-3.pt     stage 3: {"model", "optimizer", "scheduler", "scale", "stage",
                               "step", ...}

Stages, not ranks, are the unit, so a checkpoint written with one schedule or rank count loads
into any other with the same stages (e.g. 1F1B on 4 ranks -> interleaved v=2 on 2 ranks).

NOTE (atomic): every rank writes its stages into `DIR/.step-N.tmp-RUNID` (RUNID: one per run,
so two runs never share one), each file as `.part` then renamed, with its sha256 beside it;
after a barrier rank 0 writes the manifest, renames the directory to `step-N`, replaces
`latest` (os.replace) and only then deletes checkpoints beyond `keep`. Files and directories
are fsynced before each rename. A crash at any point leaves `latest` naming a complete
checkpoint; the temporary directory is removed by whoever holds the lock next.

NOTE (resume): `validate` checks, before any process starts, the manifest's schema, that
`latest` stays inside DIR, every file's size and sha256, and that each stage file records its
own stage and holds exactly the model's tensors (names, shapes, dtypes, read through mmap);
ranks check stage and fingerprint again as they load. Plain `torch.save` per stage rather than
torch.distributed.checkpoint: a stage is never split across ranks, so there is nothing to
reshard and one file per stage is the unit. A stage is serialized in memory first: torch's
writer turns a full disk into "unexpected pos", a plain write says ENOSPC and how many bytes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeir.diagnostics import UsageError, mark_input
from pipeir.files import check_dir
from pipeir.models.spec import ModelSpec, structure
from pipeir.runtime import manifest as mf
from pipeir.runtime.context import CommFailure
from pipeir.runtime.optim import Optim

_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """Saving or loading a checkpoint failed at run time (the message names the file)."""


def fingerprint(state: Mapping[str, Any]) -> mf.Fingerprint:
    """Name -> (shape, dtype name) of a state dict's tensors."""
    return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch."))
            for k, v in state.items() if isinstance(v, torch.Tensor)}


def model_fingerprints(spec: ModelSpec, stages: int) -> dict[int, mf.Fingerprint]:
    """Every stage's fingerprint, built on the meta device (no memory)."""
    return {s: fingerprint(m.state_dict())
            for s, m in structure(spec, stages, range(stages)).items()}


# ---- before any process starts ---------------------------------------------------------------
def validate(root: str, spec: ModelSpec, stages: int) -> tuple[Path, int]:
    """The checkpoint directory `--resume root` names and its step, after checking everything
    in the module NOTE; a UsageError naming the file and the problem otherwise."""
    def fail(what: str) -> UsageError:
        return UsageError(f"--resume {root}: {what}")

    base = Path(root)
    if not base.is_dir():
        raise fail("no such directory" if not base.exists() else "not a directory")
    try:
        d = mf.find(base)
        if d is None:
            raise fail(f"no checkpoint there (no {mf.LATEST} or {mf.MANIFEST})")
        man = mf.read(d)
    except mf.ManifestError as e:
        raise fail(str(e)) from None
    if man.stages != stages:
        raise fail(f"the checkpoint has {man.stages} stages, the schedule runs {stages} "
                   "(stages, not ranks, must match)")
    problem = _another_model(man, spec)
    if problem:
        raise fail(problem)
    for s in range(stages):
        problem = _check_stage(d, s, man)
        if problem:
            raise fail(problem)
    return d, man.step


def stage_models(root: str | os.PathLike[str], spec: ModelSpec | None = None
                 ) -> dict[int, dict[str, torch.Tensor]]:
    """Stage -> its model state_dict, from the checkpoint `root` names, every file checked
    against the manifest first as `validate` does (what `pipeirc export-weights` reads),
    and the manifest against `spec`'s stages when given; a UsageError naming the file and
    the problem otherwise."""
    base = Path(root)
    try:
        d = mf.find(base) if base.is_dir() else None
        if d is None:
            raise UsageError(f"{root}: no checkpoint there (no {mf.LATEST} or {mf.MANIFEST})")
        man = mf.read(d)
    except mf.ManifestError as e:
        raise UsageError(str(e)) from None
    problem = _another_model(man, spec) if spec is not None else None
    if problem:
        raise UsageError(f"{d}: {problem}")
    out = {}
    for s in range(man.stages):
        problem = _check_stage(d, s, man)
        if problem:
            raise UsageError(problem)
        try:
            out[s] = dict(_torch_load(d / mf.stage_file(s), torch.device("cpu"))["model"])
        except CheckpointError as e:
            raise UsageError(str(e)) from None
    return out


def _another_model(man: mf.Manifest, spec: ModelSpec) -> str | None:
    """What differs between the checkpoint's stages and `spec`'s (names, shapes, dtypes)."""
    want = model_fingerprints(spec, man.stages)
    for s in range(man.stages):
        problem = _differs(man.params[s], want[s], "the checkpoint", "the model")
        if problem:
            return f"stage {s}: {problem} (a checkpoint of another model?)"
    return None


def check_target(save: str, resume: str | None) -> None:
    """`--save DIR` must be a directory pipeir can make, and must not hold a checkpoint this
    run does not continue. (`pipeirc run` holds DIR's lock before it asks: `savelock`.)"""
    check_dir(save, "--save")
    base = Path(save)
    try:
        d = mf.find(base)
        same = resume is not None and d is not None and mf.find(Path(resume)) == d
    except mf.ManifestError as e:
        raise UsageError(f"--save {save}: {e}") from None
    if d is not None and not same:
        raise UsageError(f"--save {save}: already holds a checkpoint ({d.name}); resume it "
                         "with --resume, or save somewhere else")
    if d is None and base.is_dir():
        # (a save retires step directories past its step: nothing may be there to lose)
        stray = sorted((n, p.name) for p in base.iterdir() if (n := mf.step_of(p)) is not None)
        if stray:
            raise UsageError(f"--save {save}: holds {stray[0][1]}, which no 'latest' file "
                             f"names (a checkpoint whose run stopped before naming it, or not "
                             f"pipeir's); a run saving here would replace or delete it: save "
                             f"somewhere else, or move it away")


def check_space(save: str, spec: ModelSpec, stages: int) -> None:
    """Refuse a `--save` directory whose file system cannot hold even the model's weights
    (a checkpoint holds them and the optimizer's state)."""
    need = sum(_nbytes(shape, dtype) for fp in model_fingerprints(spec, stages).values()
               for shape, dtype in fp.values())
    there = Path(save).absolute()
    while not there.exists():
        there = there.parent
    free = shutil.disk_usage(there).free
    if free < need:
        raise UsageError(f"--save {save}: a checkpoint needs at least {_mb(need)} (the "
                         f"weights alone), {there} has {_mb(free)} free")


# ---- ranks: saving -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Saver:
    """What every save of one run shares: the directory, the run's id (its temporary
    directories' suffix), how many checkpoints to keep (0: all), and the manifest's constants."""

    root: str
    run_id: str
    keep: int
    model: str
    stages: int
    params: Mapping[int, mf.Fingerprint]

    def save(self, step: int, modules: Mapping[int, torch.nn.Module], optim: Optim,
             rank: int, group: Any, report: Callable[[str], None]) -> None:
        """Write this rank's stages; rank 0 completes the checkpoint (collective over
        `group`, the ranks of one pipeline, default all: each calls it at the same step).
        With data parallelism only replica 0's pipeline saves (the replicas hold the same
        state), so the barrier is over its group."""
        base = Path(self.root)
        tmp = base / f".step-{step}.tmp-{self.run_id}"
        _io(base, step, tmp.name, 0, lambda: tmp.mkdir(parents=True, exist_ok=True))
        for s, m in modules.items():
            state = {"model": m.state_dict(), "step": step, "stage": s,
                     **optim.stage_state(s)}
            buf = io.BytesIO()
            torch.save(state, buf)
            data = buf.getbuffer()
            name = mf.stage_file(s)
            entry = f"{hashlib.sha256(data).hexdigest()} {len(data)}\n".encode()
            _io(base, step, name, len(data), _write_file, tmp / name, data)
            _io(base, step, name, len(entry), _write_file, tmp / f"{name}.sha256", entry)
        try:
            dist.barrier(group=group)
        except RuntimeError as e:  # a peer died: it is the cause, not this rank
            raise CommFailure(f"waiting for the other ranks to save step-{step}: {e}") from e
        if rank != 0:
            return
        size = self._publish(base, tmp, step)
        report(f"saved {base / f'step-{step}'} ({_mb(size)})")

    def _publish(self, base: Path, tmp: Path, step: int) -> int:
        files = {}
        for s in range(self.stages):
            name = mf.stage_file(s)
            digest, nbytes = (tmp / f"{name}.sha256").read_text().split()
            files[name] = mf.FileEntry(digest, int(nbytes))
            (tmp / f"{name}.sha256").unlink()
        text = mf.Manifest(self.model, self.stages, step, files, self.params).to_json()
        _io(base, step, mf.MANIFEST, len(text), _write_file, tmp / mf.MANIFEST, text.encode())
        _fsync_dir(tmp)
        final = base / f"step-{step}"
        if final.exists():  # a step-N no `latest` names: a crash after its rename
            old = base / f".step-{step}.old-{self.run_id}"
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(base)
        _io(base, step, mf.LATEST, len(final.name), _point_latest, base, final.name,
            self.run_id)
        self._retire(base, step)
        return sum(e.bytes for e in files.values())

    def _retire(self, base: Path, step: int) -> None:
        """Delete checkpoints beyond `keep` and any newer than `step` (left by a run that
        crashed after renaming but before pointing `latest` at them: nothing names them)."""
        done = sorted((n, p) for p in base.iterdir()
                      if (n := mf.step_of(p)) is not None and p.is_dir() and not p.is_symlink()
                      and (p / mf.MANIFEST).is_file())  # (only what pipeir wrote)
        kept = [n for n, _ in done if n <= step][-self.keep:] if self.keep else None
        for n, p in done:
            if n > step or (kept is not None and n not in kept):
                shutil.rmtree(p, ignore_errors=True)


def _write_file(path: Path, data: bytes | memoryview) -> None:
    """Write `path` durably: `.part`, fsync, rename."""
    part = path.with_name(path.name + ".part")
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            part.unlink()
        raise
    os.close(fd)
    os.replace(part, path)


def _point_latest(base: Path, name: str, run_id: str) -> None:
    tmp = base / f".latest.tmp-{run_id}"
    _write_file(tmp, name.encode())
    os.replace(tmp, base / mf.LATEST)
    _fsync_dir(base)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _io(base: Path, step: int, what: str, nbytes: int, action: Callable[..., None],
        *args: Any) -> None:
    """`action(*args)`, a write of a save; an OSError becomes one CheckpointError naming the
    directory, the file and the bytes it needed."""
    try:
        action(*args)
    except OSError as e:
        full = e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        raise CheckpointError(
            f"cannot save {base / f'step-{step}'}: {e.strerror or e} writing {what}"
            + (f" ({_mb(nbytes)} needed, {_mb(_free(base))} free in {base})" if full else "")
            + "; the previous checkpoint is intact") from None


def _free(base: Path) -> int:
    try:
        return shutil.disk_usage(base).free
    except OSError:
        return 0


# ---- ranks: loading ----------------------------------------------------------------------------
def load(root: str, modules: Mapping[int, torch.nn.Module], optim: Optim,
         device: torch.device) -> int:
    """Load this rank's stages from the checkpoint `root` names; returns its step. Each file
    must record its stage and hold the tensors of the module it is loaded into."""
    try:
        d = mf.find(Path(root))
        if d is None:
            raise CheckpointError(f"no checkpoint in {root}")
        step = mf.read(d).step
    except mf.ManifestError as e:
        raise CheckpointError(str(e)) from None
    for s, m in modules.items():
        path = d / mf.stage_file(s)
        state = _torch_load(path, device)
        problem = _recorded(state, s) or _differs(
            fingerprint(state["model"]), fingerprint(m.state_dict()), "the file", "the stage")
        if problem:
            raise CheckpointError(f"{path}: {problem}")
        m.load_state_dict(state["model"])
        try:
            optim.load_stage_state(s, state)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: its optimizer state does not fit this "
                                  f"optimizer: {type(e).__name__}: {e}") from None
    return step


# ---- checks shared by both ---------------------------------------------------------------------
def _check_stage(d: Path, stage: int, man: mf.Manifest) -> str:
    """"PATH: problem" for stage `stage`'s file in checkpoint `d`, or "" if it is sound."""
    path = d / mf.stage_file(stage)
    problem = _check_file(path, man.files[path.name]) or _check_content(path, stage, man)
    return f"{path}: {problem}" if problem else ""


def _check_file(path: Path, entry: mf.FileEntry) -> str:
    """What is wrong with the bytes of `path` against its manifest entry ("" if nothing)."""
    try:
        if path.is_symlink() or not path.is_file():
            return "missing" if not path.exists() else "not a regular file"
        size = path.stat().st_size
        if size != entry.bytes:
            return (f"{size:,} bytes, the manifest says {entry.bytes:,} (truncated or "
                    "replaced after it was saved)")
        h = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    except OSError as e:
        return f"cannot read: {e.strerror}"
    if h.hexdigest() != entry.sha256:
        return "its sha256 differs from the manifest's (corrupt, or replaced after it was saved)"
    return ""


def _check_content(path: Path, stage: int, man: mf.Manifest) -> str:
    """Whether the file records `stage` and holds the manifest's tensors (through mmap:
    nothing but the headers is read)."""
    try:
        state = _torch_load(path, torch.device("cpu"), mmap=True)
    except CheckpointError as e:
        return str(e).removeprefix(f"{path}: ")
    if state.get("step") != man.step:
        return (f"records step {state.get('step')!r}, the manifest says step {man.step} "
                "(a file of another checkpoint)")
    return _recorded(state, stage) or _differs(fingerprint(state["model"]), man.params[stage],
                                               "the file", "the manifest")


def _torch_load(path: Path, device: torch.device, mmap: bool = False) -> dict[str, Any]:
    mark_input(path)  # (a command reading it may not write over it: `export-weights -o`)
    try:
        state = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as e:
        raise CheckpointError(f"{path}: {_load_error(e)}") from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise CheckpointError(f"{path}: not a pipeir stage file (no 'model' state)")
    return state


def _load_error(e: Exception) -> str:
    """torch's reason, without its advice to load with weights_only=False (wrong for a
    damaged file, and unsafe: it runs whatever code the file holds)."""
    text = str(e)
    if "weights_only" in text or "Unsupported global" in text:
        return ("holds objects other than tensors and plain data; pipeir does not load "
                "those (loading them could run code)")
    first = (text.strip().splitlines() or [type(e).__name__])[0]
    return f"not a stage file torch can read ({first[:120]})"


def _recorded(state: Mapping[str, Any], stage: int) -> str:
    got = state.get("stage")
    if got != stage:
        return f"records stage {got!r}, but is stage {stage}'s file (files swapped or renamed?)"
    return ""


def _differs(have: mf.Fingerprint, need: mf.Fingerprint, a: str, b: str) -> str:
    """The first difference between two fingerprints, worded for a message ("" if none)."""
    for name in need:
        if name not in have:
            return f"{a} has no '{name}'"
        if have[name] != need[name]:
            (s1, d1), (s2, d2) = have[name], need[name]
            return (f"'{name}': {a} has {d1} {list(s1)}, {b} {d2} {list(s2)}")
    extra = sorted(set(have) - set(need))
    return f"{b} has no '{extra[0]}'" if extra else ""


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = 1
    for x in shape:
        n *= x
    dt = getattr(torch, dtype, None)
    size = dt.itemsize if isinstance(dt, torch.dtype) else 4
    return n * size


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
