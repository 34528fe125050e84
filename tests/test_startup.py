"""`pipeirc run`'s start-up: the launcher never imports torch (the fork server does, once, and
the model check before the launch runs in a process forked from it); an error of that check
arrives from the forked process exactly as it reads when the launcher checks the model itself
(one line, the same exit code, the user's traceback with --traceback); and with
PIPEIR_MILESTONES every process records where its start-up time went."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from pipeir.diagnostics import (
    Diagnostic,
    PipeirError,
    Source,
    Span,
    UsageError,
    VerifyError,
)
from pipeir.runtime import forkserver
from pipeir.usercode import UserCodeError, contained

LIB = ("--schedule", "1f1b", "--ranks", "2", "--microbatches", "2")
SMALL = "pipeir.models.mlp:small"
#: a model whose batch() raises on line 7 of its file
BAD_BATCH = ("from pipeir.models.mlp import small\nimport torch\n"
             "from pipeir.models import ModelSpec\n"
             "def spec():\n    b = small()\n    def batch(step):\n"
             "        raise OSError('disk gone')\n"
             "    return ModelSpec(stage=b.stage, loss=b.loss, batch=batch)\n")


def _pipeirc(*args: str, cwd: Path, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeir", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_pipeir_errors_pickle_as_themselves() -> None:
    """What carries an error from the forked model check back to the launcher."""
    span = Span(Source("a.sched", "x\ny\nlet abcdef = 1\n"), 3, 5, 3, 9)
    for e in (UsageError("--model x: no such model", span), VerifyError(Diagnostic("bad"), "deps"),
              PipeirError(Diagnostic("plain"), exit_code=7)):
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and back.render() == e.render() and str(back) == str(e)
        assert back.exit_code == e.exit_code and back.diagnostics == e.diagnostics
    assert pickle.loads(pickle.dumps(VerifyError(Diagnostic("bad"), "deps"))).check == "deps"


def test_a_user_code_error_pickles_with_its_traceback_as_text() -> None:
    class Mine(Exception):  # a class that does not exist where the error arrives
        pass

    with pytest.raises(UserCodeError) as info, contained("--model m.py", "calling batch(0)"):
        raise Mine("no data")
    e = info.value
    back = pickle.loads(pickle.dumps(e))
    assert back.render() == e.render() and back.exit_code == e.exit_code == 1
    assert back.cause is None and back.format_cause() == e.format_cause()
    assert 'raise Mine("no data")' in back.format_cause()


@pytest.mark.mp
def test_the_launcher_never_imports_torch_and_milestones_say_where_time_went(
        tmp_path: Path) -> None:
    log = tmp_path / "milestones"
    code = ("import sys\nfrom pipeir.cli import main\nif __name__ == '__main__':\n"
            f"    c = main({['run', *LIB, '--model', SMALL, '--steps', '2']!r})\n"
            "    print('torch in the launcher:', 'torch' in sys.modules)\n    sys.exit(c)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "PIPEIR_MILESTONES": str(log)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step    2/2" in r.stdout and "torch in the launcher: False" in r.stdout
    seen: dict[str, tuple[float, int]] = {}
    for line in log.read_text().splitlines():
        when, pid, name = line.split(" ", 2)
        seen.setdefault(name, (float(when), int(pid)))
    order = ["launcher: ready", "launcher: compiled", "preflight: started", "preflight: done",
             "launcher: preflight done", "launcher: ranks started"]
    assert set(order) <= set(seen), seen
    assert [seen[n][0] for n in order] == sorted(seen[n][0] for n in order)
    launcher, checker = seen["launcher: ready"][1], seen["preflight: started"][1]
    assert checker != launcher  # the model check ran in its own (forked) process
    assert seen["launcher: ranks started"][1] == launcher
    for rank in (0, 1):
        steps = [f"rank {rank}: {n}" for n in ("started", "process group", "model built",
                                               "first step")]
        assert [seen[n][0] for n in steps] == sorted(seen[n][0] for n in steps)
        assert seen[steps[0]][0] >= seen["launcher: preflight done"][0]
        assert len({seen[n][1] for n in steps} | {launcher, checker}) == 3


def _reference(cli, monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str]:
    """The launcher's own model check (no fork server), in this process."""
    monkeypatch.setattr(forkserver, "prestart", lambda: False)
    code, _, err = cli(*args)
    return code, err


@pytest.mark.mp
@pytest.mark.parametrize("case", ["unknown model", "batch raises", "trace over the model"])
def test_a_failing_model_check_reads_the_same_from_the_forked_process(
        cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, case: str) -> None:
    model = tmp_path / "model.py"
    model.write_text(BAD_BATCH if case == "batch raises" else
                     "from pipeir.models.mlp import small as spec\n")
    args = {"unknown model": ("--model", "no_such_model_41"),
            "batch raises": ("--model", str(model), "--traceback"),
            "trace over the model": ("--model", str(model), "--trace", str(model))}[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    r = _pipeirc("run", *LIB, *args, "--steps", "1", cwd=tmp_path)
    monkeypatch.chdir(tmp_path)
    code, err = _reference(cli, monkeypatch, "run", *LIB, *args, "--steps", "1")
    assert (r.returncode, r.stderr) == (code, err)
    assert r.returncode == (1 if case == "batch raises" else 2)
    assert r.stdout == "" and err.startswith("error: ")
    if case == "batch raises":  # the user's frame, from the forked process's traceback
        assert f"OSError: disk gone at {model}:7 while calling batch(0)" in err.splitlines()[0]
        assert f'File "{model}", line 7' in err and "Traceback (most recent call last)" in err
    else:
        assert len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == \
        [n for n in before if n != "__pycache__"]  # nothing written


@pytest.mark.mp
def test_a_model_check_that_dies_is_one_line(tmp_path: Path) -> None:
    """A model whose batch() kills its process (a crash in C code, the OOM killer) took the
    launcher with it when the launcher checked the model itself; forked, it is one line."""
    model = tmp_path / "model.py"
    model.write_text(BAD_BATCH.replace("raise OSError('disk gone')",
                                       "import os; os.kill(os.getpid(), 9)"))
    r = _pipeirc("run", *LIB, "--model", str(model), "--steps", "1", cwd=tmp_path)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (f"error: the check of --model {model} died (killed by signal 9) "
                        "before it finished\n")


@pytest.mark.mp
def test_what_the_fork_server_forks_collects_garbage() -> None:
    """The fork server imports with the garbage collector off (`pipeir.runtime.preload`);
    what it forks turns it back on, and finds torch's import frozen out of collection."""
    from pipeir.runtime import forked

    assert forked.call("a check", "gc:isenabled") is True
    assert forked.call("a check", "gc:get_freeze_count") > 100_000
