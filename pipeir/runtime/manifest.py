"""A checkpoint's manifest (`DIR/step-N/manifest.json`): its schema, reading it back
defensively, and finding the checkpoint `DIR/latest` names. No torch here: `pipeirc run
--resume` checks all of this before any process starts.

Format 2 (JSON object, every key required):

    format   2
    model    the --model it was trained with (a string; informative)
    stages   the number of stages, an integer >= 1
    step     the optimizer steps done, an integer >= 0
    files    {"stage-S.pt": {"sha256": 64 hex digits, "bytes": integer >= 0}} for every stage
    params   {"S": {name: {"shape": [integers >= 0], "dtype": "float32"}}}: every stage's
             state-dict fingerprint, what the stage files must hold and the model must take

The rules are checked in that order, each later one assuming the earlier; the first that
fails is one `ManifestError` naming the key and what is wrong with its value.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = 2
LATEST = "latest"
MANIFEST = "manifest.json"
#: the name of a complete checkpoint directory (what `latest` may name)
STEP_DIR = re.compile(r"step-(\d{1,18})")
#: a manifest larger than this is not one pipeir wrote (a fingerprint is ~100 bytes a tensor)
MAX_MANIFEST_BYTES = 64 * 2**20
_SHA256 = re.compile(r"[0-9a-f]{64}")

#: stage -> parameter or buffer name -> (shape, dtype name)
Fingerprint = Mapping[str, tuple[tuple[int, ...], str]]


class ManifestError(ValueError):
    """What is wrong with a manifest or `latest` (the message names the key)."""


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    bytes: int


@dataclass(frozen=True)
class Manifest:
    model: str
    stages: int
    step: int
    files: Mapping[str, FileEntry]
    params: Mapping[int, Fingerprint]

    def to_json(self) -> str:
        return json.dumps({
            "format": FORMAT, "model": self.model, "stages": self.stages, "step": self.step,
            "files": {k: {"sha256": v.sha256, "bytes": v.bytes}
                      for k, v in sorted(self.files.items())},
            "params": {str(s): {k: {"shape": list(shape), "dtype": dtype}
                                for k, (shape, dtype) in fp.items()}
                       for s, fp in sorted(self.params.items())}}, indent=1)


def stage_file(stage: int) -> str:
    return f"stage-{stage}.pt"


def parse(data: bytes) -> Manifest:
    """The manifest in `data`, or a ManifestError saying what is wrong."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{len(data):,} bytes, more than any manifest pipeir writes")
    try:
        doc = json.loads(data, parse_constant=_no_constant)
    except (UnicodeDecodeError, RecursionError, ValueError) as e:
        raise ManifestError(f"not JSON ({_first_line(e)})") from None
    top = _object(doc, "the manifest")
    if "format" not in top:
        raise ManifestError("no 'format' key (not a pipeir checkpoint manifest)")
    fmt = top["format"]
    if fmt != FORMAT or isinstance(fmt, bool):
        raise ManifestError(f"'format' is {_show(fmt)}; this pipeir reads format {FORMAT} "
                            "(a checkpoint from another pipeir version or another tool)")
    for key in ("model", "stages", "step", "files", "params"):
        if key not in top:
            raise ManifestError(f"no '{key}' key")
    model = top["model"]
    if not isinstance(model, str):
        raise ManifestError(f"'model' must be a string, not {_kind(model)}")
    stages = _int(top["stages"], "'stages'", 1)
    step = _int(top["step"], "'step'", 0)
    files = _object(top["files"], "'files'")
    want = {stage_file(s) for s in range(stages)}
    if set(files) != want:
        extra, missing = sorted(set(files) - want), sorted(want - set(files))
        raise ManifestError(f"'files' must list {', '.join(sorted(want))} "
                            f"for {stages} stage(s)"
                            + (f"; has {', '.join(map(repr, extra))}" if extra else "")
                            + (f"; lacks {', '.join(missing)}" if missing else ""))
    entries = {name: _entry(files[name], f"'files' '{name}'") for name in sorted(files)}
    params = _object(top["params"], "'params'")
    if set(params) != {str(s) for s in range(stages)}:
        raise ManifestError(f"'params' must have one key per stage, \"0\" to "
                            f"\"{stages - 1}\"; has {sorted(params)[:4]}")
    prints = {s: _fingerprint(params[str(s)], f"'params' stage {s}") for s in range(stages)}
    return Manifest(model, stages, step, entries, prints)


def read(d: Path) -> Manifest:
    """The manifest of checkpoint directory `d`; ManifestError naming the file otherwise."""
    path = d / MANIFEST
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise ManifestError(f"{path}: not a regular file")
    try:
        with path.open("rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise ManifestError(f"{path}: missing (an incomplete checkpoint)") from None
    except OSError as e:
        raise ManifestError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return parse(data)
    except ManifestError as e:
        raise ManifestError(f"{path}: {e}") from None


def find(root: Path) -> Path | None:
    """The checkpoint directory `root` names: itself if it holds a manifest, else the one its
    `latest` file names (ManifestError if that is not a `step-N` inside `root`), else None."""
    if (root / MANIFEST).exists() or (root / MANIFEST).is_symlink():
        return root
    latest = root / LATEST
    if not latest.exists() and not latest.is_symlink():
        return None
    if latest.is_symlink() or not latest.is_file():
        raise ManifestError(f"{latest}: not a regular file (pipeir writes a file naming the "
                            "newest checkpoint)")
    try:
        with latest.open("rb") as f:
            raw = f.read(64)
        name = raw.decode("ascii").strip()
    except OSError as e:
        raise ManifestError(f"{latest}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ManifestError(f"{latest}: not text; it must name a step-N directory") from None
    if not STEP_DIR.fullmatch(name):
        raise ManifestError(f"{latest}: names {name[:40]!r}; it may only name a step-N "
                            f"directory inside {root}")
    d = root / name
    if d.is_symlink() or not d.is_dir():
        raise ManifestError(f"{latest}: names {name}, which is not a directory in {root}")
    return d


def step_of(d: Path) -> int | None:
    m = STEP_DIR.fullmatch(d.name)
    return int(m.group(1)) if m else None


def _entry(v: Any, where: str) -> FileEntry:
    obj = _object(v, where)
    digest = obj.get("sha256")
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise ManifestError(f"{where} 'sha256' must be 64 lowercase hex digits, not "
                            f"{_show(digest)}")
    return FileEntry(digest, _int(obj.get("bytes"), f"{where} 'bytes'", 0))


def _fingerprint(v: Any, where: str) -> Fingerprint:
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, t in _object(v, where).items():
        obj = _object(t, f"{where} '{name}'")
        shape, dtype = obj.get("shape"), obj.get("dtype")
        if not isinstance(shape, list) or len(shape) > 64:
            raise ManifestError(f"{where} '{name}' 'shape' must be a list of sizes, not "
                                f"{_show(shape)}")
        dims = tuple(_int(x, f"{where} '{name}' 'shape'", 0) for x in shape)
        if not isinstance(dtype, str) or not dtype.isidentifier():
            raise ManifestError(f"{where} '{name}' 'dtype' must be a dtype name such as "
                                f"\"float32\", not {_show(dtype)}")
        out[name] = (dims, dtype)
    return out


def _int(v: Any, where: str, least: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ManifestError(f"{where} must be an integer, not {_show(v)}")
    if not least <= v < 2**62:
        raise ManifestError(f"{where} is {v}; it must be at least {least}"
                            + (" (and below 2**62)" if v >= least else ""))
    return v


def _object(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ManifestError(f"{where} must be a JSON object, not {_kind(v)}")
    return v


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(v), "a value")


def _show(v: Any) -> str:
    text = json.dumps(v) if not isinstance(v, float) or v == v else "NaN"
    return f"{_kind(v)} ({text[:30]}{'...' if len(text) > 30 else ''})"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:100]
