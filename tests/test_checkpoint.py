"""Checkpoints you can trust (issue 37), through `pipeirc run`: integrity checks on resume,
one writer per directory, a full disk, retention and its lines, kills at several moments of a
save, and the failing rank named. Runs that start processes are marked `mp` and use 2 ranks
of the small mlp."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).parent.parent
SCHED = REPO / "examples/1f1b.sched"
FAULTS = REPO / "tests/fixtures/ckpt_faults.py"
RUN = ("run", SCHED, "--set", "ranks=2", "--set", "microbatches=2", "--timeout", "60")
SMALL = ("--model", "pipeir.models.mlp:small")


def _weights(step_dir: Path) -> dict[int, dict[str, torch.Tensor]]:
    return {s: torch.load(step_dir / f"stage-{s}.pt", weights_only=True)["model"]
            for s in range(2)}


def _same(a: dict[int, dict[str, torch.Tensor]], b: dict[int, dict[str, torch.Tensor]]) -> bool:
    return a.keys() == b.keys() and all(
        a[s].keys() == b[s].keys() and all(torch.equal(a[s][k], b[s][k]) for k in a[s])
        for s in a)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 uninterrupted steps saved after each, keeping 2: the reference of every test here."""
    from pipeir.cli import main

    ck = tmp_path_factory.mktemp("ref") / "ck"
    assert main([str(a) for a in (*RUN, *SMALL, "--steps", "3", "--save", ck,
                                  "--save-every", "1", "--keep", "2")]) == 0
    return ck


@pytest.mark.mp
def test_retention_and_the_save_and_resume_lines(cli, saved: Path, tmp_path: Path) -> None:
    assert sorted(p.name for p in saved.iterdir()) == [".lock", "latest", "step-2", "step-3"]
    assert (saved / "latest").read_text() == "step-3"
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    code, out, err = cli(*RUN, *SMALL, "--steps", "5", "--resume", ck, "--save", ck,
                         "--keep", "0")
    assert code == 0, err
    assert f"resumed from {ck}/step-3 at step 3" in out
    assert f"saved {ck}/step-5 (0.3 MB)" in out and "step    3/5" not in out
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-2", "step-3", "step-5"]


def _corrupt(d: Path, how: str) -> None:
    """Damage the checkpoint d/step-3 one way."""
    step = d / "step-3"
    man_path = step / "manifest.json"
    man = json.loads(man_path.read_text())

    def set_manifest(m: Any) -> None:
        man_path.write_text(json.dumps(m))

    if how == "swapped stage files, manifest re-signed":
        a, b = step / "stage-0.pt", step / "stage-1.pt"
        a.rename(step / "x")
        b.rename(a)
        (step / "x").rename(b)
        man["files"] = {"stage-0.pt": man["files"]["stage-1.pt"],
                        "stage-1.pt": man["files"]["stage-0.pt"]}
        set_manifest(man)
    elif how == "swapped stage files":
        a, b = step / "stage-0.pt", step / "stage-1.pt"
        a.rename(step / "x")
        b.rename(a)
        (step / "x").rename(b)
    elif how == "negative step":
        set_manifest({**man, "step": -5})
    elif how == "a list":
        set_manifest([man])
    elif how == "no stages key":
        set_manifest({k: v for k, v in man.items() if k != "stages"})
    elif how == "a string step":
        set_manifest({**man, "step": "3"})
    elif how == "truncated":
        (step / "stage-1.pt").write_bytes((step / "stage-1.pt").read_bytes()[:1000])
    elif how == "random bytes":
        (step / "stage-0.pt").write_bytes(os.urandom(man["files"]["stage-0.pt"]["bytes"]))
    elif how == "latest outside":
        (d / "latest").write_text("../ck/step-3")
    elif how == "a dtype the model does not have":
        name = next(iter(man["params"]["1"]))
        man["params"]["1"][name]["dtype"] = "float16"
        set_manifest(man)


CORRUPTIONS = {
    "swapped stage files, manifest re-signed":
        "step-3/stage-0.pt: records stage 1, but is stage 0's file",
    "swapped stage files": "step-3/stage-0.pt: its sha256 differs from the manifest's",
    "negative step": "step-3/manifest.json: 'step' is -5; it must be at least 0",
    "a list": "step-3/manifest.json: the manifest must be a JSON object, not a list",
    "no stages key": "step-3/manifest.json: no 'stages' key",
    "a string step": "step-3/manifest.json: 'step' must be an integer, not a string (\"3\")",
    "truncated": "step-3/stage-1.pt: 1,000 bytes, the manifest says",
    "random bytes": "step-3/stage-0.pt: its sha256 differs",
    "latest outside": "latest: names '../ck/step-3'; it may only name a step-N directory",
    "a dtype the model does not have": "stage 1: '",
}


@pytest.mark.mp
@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_a_damaged_checkpoint_is_one_line_naming_the_file(cli, saved: Path, tmp_path: Path,
                                                         how: str) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    _corrupt(ck, how)
    before = {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()}
    code, out, err = cli(*RUN, *SMALL, "--steps", "5", "--resume", ck, "--save", ck)
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --resume {ck}: "), err
    assert CORRUPTIONS[how] in lines[0], err
    assert "weights_only" not in err and "training" not in out  # no process started
    assert before == {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()}


def test_a_stale_lock_is_taken_over_with_a_note(cli, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / ".lock").write_text(json.dumps({"pid": 999999999, "host": "gone"}))
    code, _, err = cli(*RUN, *SMALL, "--steps", "0", "--save", ck)
    assert code == 2 and "--steps must be at least 1" in err
    assert (f"note: --save {ck}: took over the lock of pid 999999999 on gone, which is no "
            "longer running") in err
    assert (ck / ".lock").read_text() == ""  # released


@pytest.mark.mp
def test_concurrent_writers(cli, tmp_path: Path) -> None:
    """The second run refuses naming the first's pid; the first's checkpoints complete."""
    ck = tmp_path / "ck"
    first = subprocess.Popen(
        [sys.executable, "-m", "pipeir", *map(str, RUN), *SMALL, "--steps", "30", "--save",
         str(ck), "--save-every", "10"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        assert first.stdout is not None
        assert first.stdout.readline().startswith("training ")  # it holds the lock by now
        code, out, err = cli(*RUN, *SMALL, "--steps", "3", "--save", ck)
        assert code == 2, out + err
        assert err.startswith(f"error: --save {ck}: another run is saving into it "
                              f"(pid {first.pid} on ")
        assert len(err.strip().splitlines()) == 1
        rest, first_err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, first_err
    assert f"saved {ck}/step-30" in rest
    assert sorted(p.name for p in ck.iterdir()) == [".lock", "latest", "step-20", "step-30"]
    # every file checks out: --resume validates it all, then finds nothing left to train
    code, _, err = cli(*RUN, *SMALL, "--steps", "30", "--resume", ck)
    assert code == 2 and "the checkpoint is at step 30; --steps 30 leaves" in err, err


@pytest.mark.mp
@pytest.mark.parametrize("fault, cause", [
    ("write_kill", "rank 1 died (killed by signal 9) while saving a checkpoint"),
    ("publish_kill", "rank 0 died (killed by signal 9) while saving a checkpoint"),
    ("latest_kill", "rank 0 died (killed by signal 9) while saving a checkpoint"),
])
def test_a_rank_killed_during_a_save_then_resume_equals_the_uninterrupted_run(
        cli, saved: Path, tmp_path: Path, fault: str, cause: str) -> None:
    ck = tmp_path / "ck"
    code, out, err = cli(*RUN, "--model", f"{FAULTS}:{fault}", "--steps", "3", "--save", ck,
                         "--save-every", "1")
    assert code == 1, out + err
    assert cause in err and "Connection closed" not in err, err
    assert (ck / "latest").read_text() == "step-1"
    assert not list(ck.glob(".step-*")) and not list(ck.glob(".latest*"))  # cleaned
    code, out, err = cli(*RUN, *SMALL, "--steps", "3", "--resume", ck, "--save", ck)
    assert code == 0, err
    assert f"resumed from {ck}/step-1 at step 1" in out
    assert _same(_weights(ck / "step-3"), _weights(saved / "step-3"))


def _tmpfs(where: Path, size: str) -> bool:
    where.mkdir()
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True)
    return r.returncode == 0


@pytest.mark.mp
def test_a_full_disk_names_the_directory_and_bytes_and_keeps_the_last_checkpoint(
        cli, tmp_path: Path) -> None:
    """On a small tmpfs where one can be mounted (root); else ENOSPC injected in the write."""
    disk, tiny = tmp_path / "disk", tmp_path / "tiny"
    mounted = [d for d, size in ((disk, "420k"), (tiny, "64k")) if _tmpfs(d, size)]
    try:
        if mounted:  # not even the weights fit: refused before any process starts
            code, out, err = cli(*RUN, *SMALL, "--steps", "1", "--save", tiny / "ck")
            assert code == 2 and "training" not in out, out + err
            assert f"--save {tiny / 'ck'}: a checkpoint needs at least 0.1 MB (the weights " \
                   f"alone), {tiny / 'ck'} has 0.1 MB free" in err
            assert not (tiny / "ck").exists()  # the run made it, and removed it
            ck, model = disk / "ck", SMALL
        else:
            ck, model = disk / "ck", ("--model", f"{FAULTS}:enospc")
        code, out, err = cli(*RUN, *model, "--steps", "3", "--save", ck, "--save-every", "1")
        assert code == 1, out + err
        line = err.strip().splitlines()[0]
        assert f"cannot save {ck}/step-2: No space left on device writing stage-" in line
        assert f"free in {ck}); the previous checkpoint is intact" in line
        assert (ck / "latest").read_text() == "step-1"
        assert sorted(p.name for p in ck.iterdir()) == [".lock", "latest", "step-1"]
        code, _, err = cli(*RUN, *SMALL, "--steps", "1", "--resume", ck)
        assert code == 2 and "the checkpoint is at step 1; --steps 1 leaves" in err, err
    finally:
        for d in mounted:
            subprocess.run(["umount", str(d)], check=False)


def test_a_save_never_deletes_a_step_directory_pipeir_did_not_write(tmp_path: Path) -> None:
    """A save retires step directories past its step (a crashed run's), and beyond `keep`:
    only ones holding pipeir's manifest, and a fresh run refuses a directory holding step
    directories that no `latest` names (they were deleted without a word)."""
    from pipeir import UsageError
    from pipeir.runtime.checkpoint import Saver, check_target
    from pipeir.runtime.manifest import MANIFEST

    for name, ours in (("step-1", True), ("step-5", True), ("step-9", False)):
        (tmp_path / name).mkdir()
        (tmp_path / name / (MANIFEST if ours else "notes.txt")).write_text("{}")
    Saver(str(tmp_path), "run", 0, "m", 1, {})._retire(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-9"]
    with pytest.raises(UsageError) as e:
        check_target(str(tmp_path), None)
    assert e.value.diagnostics[0].message == (
        f"--save {tmp_path}: holds step-1, which no 'latest' file names (a checkpoint whose run "
        f"stopped before naming it, or not pipeir's); a run saving here would replace or "
        f"delete it: save somewhere else, or move it away")
    check_target(str(tmp_path / "fresh"), None)  # (a new directory, or one without steps)
