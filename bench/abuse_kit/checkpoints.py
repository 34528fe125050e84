"""Issue 37's checkpoint families: every kind of damage to a checkpoint (hand-written and
generated), concurrent writers, stale locks, a full disk, read-only targets and ranks killed
during a save. Damaged checkpoints are copies of one real checkpoint, made once by `pipeirc run
--save`; each case checks its own copy. After a failed save the previous checkpoint must still
check out: `intact` re-hashes its files against its manifest (an oracle apart from pipeir's)."""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from abuse_kit.harness import OK, REPO, RUN2, Case, Setup, all_of, make_file

RESUME = [*RUN2, "--steps", "4", "--resume", "ck"]
FAULTS = str(REPO / "tests/fixtures/ckpt_faults.py")
_SOURCE: list[Path] = []
_MADE = threading.Lock()

Damage = Callable[[Path], None]


def _source() -> Path:
    """A real checkpoint of 2 steps (step-1 and step-2), made once per script run."""
    with _MADE:
        if not _SOURCE:
            d = Path(tempfile.mkdtemp(prefix="pipeir-abuse-ck."))
            atexit.register(shutil.rmtree, d, True)
            r = subprocess.run([sys.executable, "-m", "pipeir", *RUN2, "--steps", "2",
                                "--save", str(d / "ck"), "--save-every", "1"],
                               capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                raise RuntimeError(f"making the checkpoint the cases damage failed: {r.stderr}")
            _SOURCE.append(d / "ck")
        return _SOURCE[0]


def with_ck(damage: Damage | None = None) -> Setup:
    """A copy of the checkpoint at `ck`, then `damage(ck / "step-2")`."""
    def make(d: Path) -> None:
        shutil.copytree(_source(), d / "ck")
        if damage is not None:
            damage(d / "ck" / "step-2")
    return make


# ---- damage ------------------------------------------------------------------------------------
def _man(step: Path) -> Any:
    return json.loads((step / "manifest.json").read_text())


def edit_manifest(fn: Callable[[Any], Any]) -> Damage:
    def damage(step: Path) -> None:
        (step / "manifest.json").write_text(json.dumps(fn(_man(step))))
    return damage


def write(name: str, data: bytes) -> Damage:
    return lambda step: (step / name).write_bytes(data)


def without(key: str) -> Damage:
    return edit_manifest(lambda m: {k: v for k, v in m.items() if k != key})


def setting(key: str, value: Any) -> Damage:
    return edit_manifest(lambda m: {**m, key: value})


def _set_path(m: Any, path: list[str], value: Any) -> Any:
    node = m
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return m


def at(path: list[str], value: Any) -> Damage:
    return edit_manifest(lambda m: _set_path(m, path, value))


def _first_param(m: Any, stage: str = "0") -> str:
    return next(iter(m["params"][stage]))


def param_field(field: str, value: Any) -> Damage:
    return edit_manifest(lambda m: _set_path(m, ["params", "0", _first_param(m), field], value))


def resign(step: Path) -> None:
    """Make the manifest's sizes and sha256s match the files again (a forger's last step)."""
    m = _man(step)
    for name in m["files"]:
        data = (step / name).read_bytes()
        m["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (step / "manifest.json").write_text(json.dumps(m))


def swap(step: Path) -> None:
    a, b = step / "stage-0.pt", step / "stage-1.pt"
    a.rename(step / "x")
    b.rename(a)
    (step / "x").rename(b)


def truncate_to(name: str, fraction: float) -> Damage:
    def damage(step: Path) -> None:
        data = (step / name).read_bytes()
        (step / name).write_bytes(data[: int(len(data) * fraction)])
    return damage


def flip(name: str, offset: int, bit: int) -> Damage:
    def damage(step: Path) -> None:
        data = bytearray((step / name).read_bytes())
        data[offset % len(data)] ^= 1 << bit
        (step / name).write_bytes(bytes(data))
    return damage


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch pwned",))


def evil_pickle(step: Path) -> None:
    """A stage file whose unpickling would run a command, with the manifest re-signed."""
    import torch  # here, not at the top: only this setup needs it (seconds to import)

    torch.save({"model": {}, "stage": 0, "step": 2, "x": _Evil()}, step / "stage-0.pt",
               pickle_module=pickle)
    resign(step)


def older_file(step: Path) -> None:
    shutil.copy(step.parent / "step-1" / "stage-1.pt", step / "stage-1.pt")
    resign(step)


def latest(text: bytes) -> Damage:
    return lambda step: (step.parent / "latest").write_bytes(text)


def replace_with(name: str, make: Callable[[Path], None]) -> Damage:
    def damage(step: Path) -> None:
        p = step.parent / name if name == "latest" else step / name
        p.unlink()
        make(p)
    return damage


HAND: dict[str, Damage] = {
    "manifest: a list": write("manifest.json", b"[1, 2]"),
    "manifest: a string": write("manifest.json", b'"step-2"'),
    "manifest: null": write("manifest.json", b"null"),
    "manifest: empty": write("manifest.json", b""),
    "manifest: binary": write("manifest.json", bytes(range(256))),
    "manifest: cut in half": truncate_to("manifest.json", 0.5),
    "manifest: 100000 nested lists": write("manifest.json", b"[" * 100000 + b"]" * 100000),
    "manifest: step NaN": lambda s: (s / "manifest.json").write_text(
        (s / "manifest.json").read_text().replace('"step": 2', '"step": NaN')),
    "manifest: stages Infinity": lambda s: (s / "manifest.json").write_text(
        (s / "manifest.json").read_text().replace('"stages": 2', '"stages": Infinity')),
    **{f"manifest: no '{k}'": without(k)
       for k in ("format", "model", "stages", "step", "files", "params")},
    "manifest: step '2'": setting("step", "2"),
    "manifest: step -5": setting("step", -5),
    "manifest: step 2.5": setting("step", 2.5),
    "manifest: step true": setting("step", True),
    "manifest: step 10**30": setting("step", 10**30),
    "manifest: stages 0": setting("stages", 0),
    "manifest: stages 3": setting("stages", 3),
    "manifest: stages '2'": setting("stages", "2"),
    "manifest: format 1": setting("format", 1),
    "manifest: format '2'": setting("format", "2"),
    "manifest: model 7": setting("model", 7),
    "manifest: files a list": setting("files", []),
    "manifest: files without stage-1": edit_manifest(
        lambda m: {**m, "files": {"stage-0.pt": m["files"]["stage-0.pt"]}}),
    "manifest: files with an extra entry": at(["files", "../../etc/passwd"],
                                              {"sha256": "0" * 64, "bytes": 1}),
    "manifest: sha256 not hex": at(["files", "stage-0.pt", "sha256"], "xyz"),
    "manifest: sha256 entries swapped": edit_manifest(lambda m: {**m, "files": {
        "stage-0.pt": m["files"]["stage-1.pt"], "stage-1.pt": m["files"]["stage-0.pt"]}}),
    "manifest: bytes -1": at(["files", "stage-0.pt", "bytes"], -1),
    "manifest: bytes off by one": edit_manifest(lambda m: _set_path(
        m, ["files", "stage-0.pt", "bytes"], m["files"]["stage-0.pt"]["bytes"] + 1)),
    "manifest: params a list": setting("params", []),
    "manifest: params without stage 1": edit_manifest(
        lambda m: {**m, "params": {"0": m["params"]["0"]}}),
    "manifest: a shape changed": param_field("shape", [3, 3]),
    "manifest: a shape of strings": param_field("shape", ["64"]),
    "manifest: a dtype changed": param_field("dtype", "float16"),
    "manifest: a dtype of code": param_field("dtype", "__import__('os')"),
    "manifest: an extra tensor": at(["params", "1", "extra.weight"],
                                    {"shape": [1], "dtype": "float32"}),
    "manifest: a directory": replace_with("manifest.json", lambda p: p.mkdir()),
    "manifest: missing": lambda s: (s / "manifest.json").unlink(),
    "manifest: a FIFO": replace_with("manifest.json", lambda p: os.mkfifo(p)),
    "manifest: a link to /dev/zero": replace_with("manifest.json",
                                                  lambda p: p.symlink_to("/dev/zero")),
    "latest: ../step-2": latest(b"../step-2"),
    "latest: /etc": latest(b"/etc"),
    "latest: step-99": latest(b"step-99"),
    "latest: empty": latest(b""),
    "latest: binary": latest(bytes(range(200, 256))),
    "latest: a directory": replace_with("latest", lambda p: p.mkdir()),
    "latest: a link outside": replace_with("latest", lambda p: p.symlink_to("/etc/hostname")),
    "latest: a FIFO": replace_with("latest", lambda p: os.mkfifo(p)),
    "stage files swapped": swap,
    "stage files swapped, manifest re-signed": lambda s: (swap(s), resign(s))[0],
    "stage file empty": write("stage-1.pt", b""),
    "stage file cut in half": truncate_to("stage-1.pt", 0.5),
    "stage file of random bytes": lambda s: (s / "stage-0.pt").write_bytes(
        os.urandom((s / "stage-0.pt").stat().st_size)),
    "stage file of random bytes, manifest re-signed": lambda s: (
        (s / "stage-0.pt").write_bytes(os.urandom(4096)), resign(s))[0],
    "stage file missing": lambda s: (s / "stage-1.pt").unlink(),
    "stage file a directory": replace_with("stage-1.pt", lambda p: p.mkdir()),
    "stage file a link": replace_with("stage-1.pt", lambda p: p.symlink_to(
        p.parent.parent / "step-1" / "stage-1.pt")),
    "stage file that runs code, manifest re-signed": evil_pickle,
    "stage file of step 1, manifest re-signed": older_file,
}


def _intact(work: Path, *_: str) -> tuple[str, str] | None:
    """The checkpoint `ck/latest` names: its manifest's sizes and sha256s match its files,
    and no temporary is left."""
    ck = work / "ck"
    try:
        step = ck / (ck / "latest").read_text()
        man = json.loads((step / "manifest.json").read_text())
        for name, e in man["files"].items():
            data = (step / name).read_bytes()
            if len(data) != e["bytes"] or hashlib.sha256(data).hexdigest() != e["sha256"]:
                return "files lost", f"{step.name}/{name} differs from its manifest"
    except (OSError, ValueError, KeyError) as e:
        return "files lost", f"the previous checkpoint does not check out: {e}"
    left = [p.name for p in ck.iterdir() if p.name.startswith((".step-", ".latest"))]
    return ("stray", f"temporaries left: {left}") if left else None


def _no_pwned(work: Path, *_: str) -> tuple[str, str] | None:
    return ("files lost", "a stage file ran code") if (work / "pwned").exists() else None


def hand_cases() -> list[Case]:
    out = [Case(f"resume: {name}", RESUME, setup=with_ck(damage), timeout=60,
                check=_no_pwned, quick=name == "manifest: step -5")
           for name, damage in HAND.items()]
    save_ck = [*RUN2, "--steps", "3", "--save", "ck", "--save-every", "1"]
    out += [
        Case("a second run saving into a live run's directory", [*RUN2, "--steps", "2",
                                                                  "--save", "ck"],
             alongside=([*RUN2, "--steps", "60", "--save", "ck", "--save-every", "20"],
                        "training "), outputs=("ck",), timeout=400),
        Case("a second run saving into a live run's directory, with --resume",
             [*RUN2, "--steps", "3", "--save", "ck", "--resume", "ck"],
             alongside=([*RUN2, "--steps", "60", "--save", "ck", "--save-every", "20"],
                        "training "), outputs=("ck",), timeout=400),
        Case("a stale lock of a dead run", [*RUN2, "--steps", "1", "--save", "ck"], OK,
             make_file("ck/.lock", '{"pid": 999999999, "host": "gone"}'), ("ck",),
             timeout=300),
        Case("a stale lock and a dead run's temporary directory",
             [*RUN2, "--steps", "1", "--save", "ck"], OK,
             all_of(make_file("ck/.lock", '{"pid": 999999999}'),
                    make_file("ck/.step-1.tmp-dead/stage-0.pt", "half")), ("ck",), timeout=300),
        Case("--save into /proc", [*RUN2, "--save", "/proc/pipeir-ck"]),
        Case("--save into /dev/full", [*RUN2, "--save", "/dev/full/ck"]),
        Case("--save a file", [*RUN2, "--save", "f"], setup=make_file("f")),
        Case("--save under a file", [*RUN2, "--save", "f/ck"], setup=make_file("f")),
        Case("--keep -1", [*RUN2, "--save", "ck", "--keep", "-1"]),
        Case("--keep without --save", [*RUN2, "--keep", "3"]),
    ]
    for fault in ("write_kill", "publish_kill", "latest_kill", "enospc"):
        out.append(Case(f"save killed: {fault}", [*save_ck[:-6], "--model",
                                                  f"{FAULTS}:{fault}", *save_ck[-6:]],
                        frozenset({1}), outputs=("ck",), check=_intact, timeout=300))
    out += _mounted_cases(save_ck)
    return out


def _mounted_cases(save_ck: list[str]) -> list[Case]:
    """A full disk and a read-only one, as tmpfs mounts (root only; skipped otherwise)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return []

    def tmpfs(size: str, ro: bool = False) -> Setup:
        def make(d: Path) -> None:
            (d / "disk").mkdir()
            opts = f"size={size},mode=0755" + (",ro" if ro else "")  # the mount point's mode
            subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d / "disk")],
                           check=True)
        return make

    def unmount(then: Callable[..., tuple[str, str] | None] | None
                ) -> Callable[[Path, str, str], tuple[str, str] | None]:
        def check(work: Path, out: str, err: str) -> tuple[str, str] | None:
            try:
                return None if then is None else then(work / "disk", out, err)
            finally:
                subprocess.run(["umount", str(work / "disk")], check=False)
        return check

    disk_ck = [a if a != "ck" else "disk/ck" for a in save_ck]
    return [
        Case("disk full during the second save (420k tmpfs)", disk_ck, frozenset({1}),
             tmpfs("420k"), ("disk", "disk/ck"), timeout=300, check=unmount(_intact)),
        Case("disk too small for the weights (64k tmpfs)", disk_ck, setup=tmpfs("64k"),
             timeout=120, check=unmount(None)),
        Case("--save on a read-only file system", disk_ck, setup=tmpfs("1m", ro=True),
             timeout=120, check=unmount(None)),
    ]


# ---- generated ---------------------------------------------------------------------------------
_VALUES: tuple[Any, ...] = (None, -1, 0, "x", "", [], {}, 1.5, True, 10**20, "0" * 64, [[]])


def generated_cases(n: int, seed: int) -> list[Case]:
    """`n / 2` bit flips and `n / 4` truncations of stage files, `n / 2` random replacements of
    a manifest value, `n / 8` random `latest` contents."""
    rnd = random.Random(seed)
    out = []
    size = 1 << 17  # about a stage file of the small mlp; offsets wrap around
    for _ in range(n // 2):
        name, offset, bit = f"stage-{rnd.randrange(2)}.pt", rnd.randrange(size), rnd.randrange(8)
        out.append(Case(f"resume generated: bit {bit} of byte {offset} of {name} flipped",
                        RESUME, setup=with_ck(flip(name, offset, bit)), timeout=60))
    for _ in range(n // 4):
        name, fraction = f"stage-{rnd.randrange(2)}.pt", rnd.random()
        out.append(Case(f"resume generated: {name} cut to {fraction:.0%}", RESUME,
                        setup=with_ck(truncate_to(name, fraction)), timeout=60))
    for _ in range(n // 2):
        path, value = rnd.choice(_MANIFEST_PATHS), rnd.choice(_VALUES)
        out.append(Case(f"resume generated: manifest {'/'.join(path)} = {value!r:.20}",
                        RESUME, setup=with_ck(_replace_at(path, value)), timeout=60))
    for _ in range(n // 8):
        text = bytes(rnd.randrange(256) for _ in range(rnd.randint(0, 12)))
        out.append(Case(f"resume generated: latest = {text!r:.30}", RESUME,
                        setup=with_ck(latest(text)), timeout=60))
    return out


_MANIFEST_PATHS: list[list[str]] = [
    ["format"], ["stages"], ["step"], ["files"], ["params"],
    ["files", "stage-0.pt"], ["files", "stage-1.pt", "sha256"], ["files", "stage-0.pt", "bytes"],
    ["params", "0"], ["params", "1"], ["params", "0", "*", "shape"],
    ["params", "1", "*", "dtype"], ["params", "0", "*"],
]


def _replace_at(path: list[str], value: Any) -> Damage:
    """Set the value at `path` (`*`: the stage's first tensor); a value equal to the old one
    is made different, so every case is damage."""
    def fn(m: Any) -> Any:
        real = [(_first_param(m, path[1]) if k == "*" else k) for k in path]
        node = m
        for k in real[:-1]:
            node = node[k]
        with contextlib.suppress(TypeError):
            if node[real[-1]] == value and type(node[real[-1]]) is type(value):
                node[real[-1]] = [value]
                return m
        node[real[-1]] = value
        return m
    return edit_manifest(fn)
