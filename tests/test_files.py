"""The output policy (pipeir/files.py) through every command that writes: links written
through, special files and /proc refused untouched, modes kept, umask honoured, atomic, and
every failure one `error:` line; `compile -o DIR` owns only the directory it wrote."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import pipeir
from pipeir import files

REPO = Path(__file__).parent.parent
SCHED = str(REPO / "examples/1f1b.sched")
COSTS = str(REPO / "examples/costs/compute-bound.toml")
Cli = Callable[..., tuple[int, str, str]]


@pytest.fixture(autouse=True)
def _umask() -> Iterator[None]:
    old = os.umask(0o027)
    yield
    os.umask(old)


def _csv(tmp_path: Path, cli: Cli) -> str:
    csv = tmp_path / "in.csv"
    assert cli("export-torch", SCHED, "-o", csv)[0] == 0
    return str(csv)


#: Every command that writes a file, as (arguments before the output, output flag).
WRITERS: dict[str, Callable[[Path, Cli], list[str]]] = {
    "print": lambda t, c: ["print", SCHED, "-o"],
    "opt": lambda t, c: ["opt", SCHED, "--passes", "verify", "-o"],
    "simulate --trace": lambda t, c: ["simulate", SCHED, "--trace"],
    "run --trace": lambda t, c: ["run", SCHED, "--steps", "1", "--trace"],
    "plot": lambda t, c: ["plot", SCHED, "-o"],
    "tune": lambda t, c: ["tune", "--costs", COSTS, "--ranks", "4", "--microbatches", "8",
                          "--max-v", "1", "-o"],
    "synth": lambda t, c: ["synth", "--costs", COSTS, "--ranks", "4", "--microbatches", "4",
                           "--time-limit", "1", "--workers", "1", "-o"],
    "profile": lambda t, c: ["profile", "--model", "mlp", "--iters", "1", "--warmup", "0",
                             "-o"],
    "import-torch": lambda t, c: ["import-torch", _csv(t, c), "-o"],
    "export-torch": lambda t, c: ["export-torch", SCHED, "-o"],
}


def _suffix(name: str) -> str:
    return {"plot": ".png", "export-torch": ".csv", "profile": ".json"}.get(name, ".out")


def _one_error(code: int, err: str) -> None:
    assert code in (1, 2), err
    assert err.startswith("error: ") or ": error: " in err.splitlines()[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_every_writer_refuses_a_fifo_before_any_work(name: str, cli: Cli, tmp_path: Path) -> None:
    fifo = tmp_path / f"out{_suffix(name)}"
    os.mkfifo(fifo)
    code, out, err = cli(*WRITERS[name](tmp_path, cli), fifo)
    _one_error(code, err)
    assert "is a FIFO" in err and out == ""  # refused first: nothing ran, nothing printed
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.parametrize("name", ["print", "opt", "simulate --trace", "export-torch", "tune"])
def test_writers_write_through_a_symlink_and_keep_the_mode(name: str, cli: Cli,
                                                           tmp_path: Path) -> None:
    real = tmp_path / f"real{_suffix(name)}"
    real.write_text("old")
    real.chmod(0o604)
    link = tmp_path / f"link{_suffix(name)}"
    link.symlink_to(real.name)
    code, _, err = cli(*WRITERS[name](tmp_path, cli), link)
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == real.name
    assert real.read_text() != "old"
    assert stat.S_IMODE(real.stat().st_mode) == 0o604
    new = tmp_path / f"new{_suffix(name)}"
    assert cli(*WRITERS[name](tmp_path, cli), new)[0] == 0
    assert stat.S_IMODE(new.stat().st_mode) == 0o640  # 0666 less the umask 027, not 0600
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("target", ["/dev/full", "/dev/null", "/dev/stdout", "/proc/version",
                                    "/proc/self/nothing", "/sys/pipeir"])
def test_special_files_and_kernel_file_systems_are_refused(target: str, cli: Cli) -> None:
    if not os.path.exists(target) and target.startswith("/dev/"):
        pytest.skip(f"no {target} here")
    before = os.stat(target, follow_symlinks=False) if os.path.lexists(target) else None
    code, out, err = cli("print", SCHED, "-o", target)
    _one_error(code, err)
    if target == "/dev/stdout":  # (a link: the message says where it leads)
        assert err.startswith("error: -o /dev/stdout: leads to /proc/"), err
    assert out == "" and len([ln for ln in err.splitlines() if "error:" in ln]) == 1
    if before is not None:
        after = os.stat(target, follow_symlinks=False)
        assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)


def test_dump_dir_and_trace_under_proc(cli: Cli) -> None:
    code, _, err = cli("opt", SCHED, "--passes", "verify", "--dump-dir", "/proc/pipeir/d")
    _one_error(code, err)
    assert "--dump-dir /proc/pipeir/d: refusing to write under /proc" in err
    code, _, err = cli("compile", SCHED, "-o", "/proc/pipeir")
    _one_error(code, err)


@pytest.mark.parametrize("inside", [False, True])
def test_opt_output_in_its_dump_dir_is_refused_before_anything_is_written(
        cli: Cli, tmp_path: Path, inside: bool) -> None:
    """`--dump-dir out.sched -o out.sched` left the dump behind and then failed; `-o
    d/00-input.sched` put the output where the dump's input file goes."""
    dump = tmp_path / ("d" if inside else "out.sched")
    out = dump / "00-input.sched" if inside else dump
    if inside:
        dump.mkdir()
    code, _, err = cli("opt", SCHED, "--passes", "split-backward", "--dump-dir", dump, "-o", out)
    _one_error(code, err)
    assert f"-o {out}: is in --dump-dir {dump}, where the dump writes its files" in err
    assert list(tmp_path.rglob("*")) == ([dump] if inside else [])


def test_an_unwritable_directory_is_one_error(cli: Cli, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(*a: object, **k: object) -> tuple[int, str]:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(files.tempfile, "mkstemp", denied)  # what a read-only dir does as root
    code, _, err = cli("print", SCHED, "-o", tmp_path / "x.sched")
    _one_error(code, err)
    assert "cannot write: Permission denied" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory(cli: Cli, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    code, _, err = cli("print", SCHED, "-o", ro / "x.sched")
    _one_error(code, err)
    assert "not writable" in err


def test_a_full_disk_leaves_the_old_file_and_no_temporary(cli: Cli, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out.sched"
    out.write_text("keep me")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full)
    code, _, err = cli("print", SCHED, "-o", out)
    _one_error(code, err)
    assert "No space left on device" in err
    assert out.read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["out.sched"]


def test_compile_owns_only_its_directory(cli: Cli, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert cli("compile", SCHED, "-o", out)[0] == 0
    assert (out / files_marker()).is_file() and (out / "rank3.py").is_file()
    code, _, err = cli("compile", SCHED, "--set", "ranks=2", "-o", out)
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == [
        ".pipeir-compile", "lowered.json", "main.py", "rank0.py", "rank1.py"]  # no rank2/3

    user = tmp_path / "user"
    user.mkdir()
    (user / "main.py").write_text("mine")
    code, out_text, err = cli("compile", SCHED, "-o", user)
    _one_error(code, err)
    assert "not empty" in err and "--force" in err and out_text == ""
    assert (user / "main.py").read_text() == "mine"
    (user / "notes.txt").write_text("also mine")
    assert cli("compile", SCHED, "-o", user, "--force")[0] == 0
    assert (user / "main.py").read_text() != "mine"
    assert cli("compile", SCHED, "--set", "ranks=2", "-o", user)[0] == 0  # ours now
    assert (user / "notes.txt").read_text() == "also mine"  # never listed, never removed
    assert not (user / "rank3.py").exists()


def test_an_output_directory_through_a_dangling_symlink_is_named(cli: Cli, tmp_path: Path
                                                                  ) -> None:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    for args in (("compile", SCHED, "-o", link), ("run", SCHED, "--save", link)):
        code, _, err = cli(*args)
        _one_error(code, err)
        assert (f"{link}: a symbolic link to {tmp_path / 'gone'}, which does not exist; create "
                "that directory first") in err  # mkdir said only "File exists"
    assert not (tmp_path / "gone").exists()


def files_marker() -> str:
    from pipeir.cli.compile import MARKER

    return MARKER


def test_write_atomic_api(tmp_path: Path) -> None:
    p = tmp_path / "a.txt"
    files.write_atomic(p, b"bytes")
    assert p.read_bytes() == b"bytes"
    with pytest.raises(pipeir.UsageError, match="is a directory"):
        files.write_atomic(tmp_path, "x")


@pytest.mark.parametrize("argv", [["print", SCHED], ["simulate", SCHED]])
def test_a_full_disk_under_stdout_is_one_line_not_a_traceback(argv: list[str]) -> None:
    """`pipeirc print X > FILE` on a full disk: the write fails in print() (or at the final
    flush); the user gets one line and exit 1, and the interpreter's exit flush stays quiet."""
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "pipeir", *argv], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    assert r.returncode == 1
    assert r.stderr == "pipeirc: cannot write the output: No space left on device\n"


#: Commands whose output could be their own input, as (arguments up to the input, the rest up
#: to the output flag); the input is a copy in tmp_path.
SELF = {
    "print": (["print"], ["-o"]),
    "opt": (["opt"], ["--passes", "verify", "-o"]),
    "simulate --trace": (["simulate"], ["--trace"]),
    "export-torch": (["export-torch"], ["-o"]),
    "print --costs (the cost file)": (["print", "--costs"], []),
    "run --metrics": (["run"], ["--steps", "1", "--metrics"]),
    "run --trace": (["run"], ["--steps", "1", "--trace"]),
}


@pytest.mark.parametrize("name", sorted(SELF))
def test_no_command_writes_over_what_it_read(name: str, cli: Cli, tmp_path: Path) -> None:
    """`pipeirc print a.sched -o a.sched` would replace a hand-written source (loops,
    comments) with its flat canonical form: refused, the file untouched."""
    before, after = SELF[name]
    if name.startswith("print --costs"):  # the cost file as the output
        src = tmp_path / "c.toml"
        src.write_text("F = 1.0\nB = 2.0\n")
        args = [*before, src, SCHED, "-o", src]
    else:
        src = tmp_path / "in.sched"
        src.write_text(Path(SCHED).read_text())
        args = [*before, src, *after, src]
    text = src.read_text()
    code, _, err = cli(*args)
    _one_error(code, err)
    assert "is an input of this command" in err, err
    assert src.read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]  # no temporary left


def test_import_torch_does_not_write_over_its_csv(cli: Cli, tmp_path: Path) -> None:
    csv = Path(_csv(tmp_path, cli))
    text = csv.read_text()
    code, _, err = cli("import-torch", csv, "-o", csv)
    _one_error(code, err)
    assert csv.read_text() == text


@pytest.mark.parametrize("name", ["print", "plot"])
def test_an_output_ending_in_a_slash_names_a_directory(name: str, cli: Cli, tmp_path: Path
                                                       ) -> None:
    """`Path("out/")` drops the slash: without a check, `-o out/` wrote a file `out`."""
    code, _, err = cli(*WRITERS[name](tmp_path, cli), f"{tmp_path / ('out' + _suffix(name))}/")
    _one_error(code, err)
    assert "names a directory" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["profile", "opt --pass-plugin"])
def test_no_command_writes_over_a_python_file_it_imported(name: str, cli: Cli, tmp_path: Path
                                                          ) -> None:
    """Models and pass plugins are imported, not read as text; they are inputs all the same."""
    src = tmp_path / "mine.py"
    if name == "profile":
        src.write_text("from pipeir.models.mlp import spec\n")
        args = ["profile", "--model", src, "--nproc", "1", "--iters", "1", "--warmup", "0",
                "-o", src]
    else:
        src.write_text((REPO / "examples/plugin/pipeir_delay_w.py").read_text())
        args = ["opt", SCHED, "--pass-plugin", f"{src}:DelayW", "--passes", "verify", "-o", src]
    text = src.read_text()
    code, _, err = cli(*args)
    _one_error(code, err)
    assert "is an input of this command" in err, err
    assert src.read_text() == text


@pytest.mark.parametrize("failure", [RuntimeError("a bug while encoding"), KeyboardInterrupt()])
def test_contents_that_fail_while_written_leave_nothing_behind(tmp_path: Path,
                                                               failure: BaseException) -> None:
    """A file whose contents are made as they are written (lowered.json) can fail or be
    interrupted after other files are staged: none of them stays, the directory is as it
    was, and the failure propagates as it is."""
    out = tmp_path / "out"
    files.write_tree(out, {"a.py": "old a\n"}, ".marker", flag="-o", force=False)
    before = sorted(p.name for p in out.iterdir())

    def parts() -> Iterator[str]:
        yield "{"
        raise failure
    with pytest.raises(type(failure)):
        files.write_tree(out, {"a.py": "new a\n", "b.py": "b\n", "lowered.json": parts},
                         ".marker", flag="-o", force=True)
    assert sorted(p.name for p in out.iterdir()) == before
    assert (out / "a.py").read_text() == "old a\n"
    new = tmp_path / "new"  # a directory made for the write goes with it (a full disk)
    with pytest.raises(type(failure)):
        files.write_tree(new, {"a.py": "a\n", "lowered.json": parts}, ".marker", flag="-o",
                         force=False)
    assert not new.exists()
