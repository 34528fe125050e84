"""User code cannot take pipeir down (issue 37): a model file, a `--model` spec, a pass
plugin or a batch function that exits, is interrupted or raises is one line naming its file,
the line of the raise and the exception, exit 1 (130 for an interrupt); `--traceback` adds the
trace; a plugin's or model's output, printed or written to descriptor 1, cannot corrupt a
schedule written to stdout nor the run's report. Nothing here starts a process but the `mp`
test of a model writing from the ranks: every failure comes before training."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeir.cli import main
from pipeir.runtime.launch import free_port

REPO = Path(__file__).parent.parent
SCHED = REPO / "examples/1f1b.sched"
RUN = ("run", SCHED, "--set", "ranks=2", "--set", "microbatches=2")
LIB = ("--schedule", "1f1b", "--ranks", "2", "--microbatches", "2")

MODEL_HEAD = "from pipeir.models.mlp import small\n"


@pytest.mark.parametrize("body, line, shown, code", [
    ("import sys\nsys.exit(0)\n", 2, "SystemExit(0)", 1),
    ("import sys\n\nsys.exit(3)\n", 3, "SystemExit(3)", 1),
    ("raise KeyboardInterrupt\n", 1, "KeyboardInterrupt", 130),
    ("x = 1\nraise ValueError('no data')\n", 2, "ValueError: no data", 1),
    ("def spec():\n    raise SystemExit('bye')\n", 2, "SystemExit('bye')", 1),
    ("def spec():\n    return {}[1]\n", 2, "KeyError: 1", 1),
    ("def spec():\n    raise KeyboardInterrupt\n", 2, "KeyboardInterrupt", 130),
    (MODEL_HEAD + "import torch\nfrom pipeir.models import ModelSpec\n"
     "def spec():\n    b = small()\n    def batch(step):\n        raise OSError('disk gone')\n"
     "    return ModelSpec(stage=b.stage, loss=b.loss, batch=batch)\n", 7,
     "OSError: disk gone", 1),
    (MODEL_HEAD + "import sys\nfrom pipeir.models import ModelSpec\n"
     "def spec():\n    b = small()\n    def batch(step):\n        sys.exit(4)\n"
     "    return ModelSpec(stage=b.stage, loss=b.loss, batch=batch)\n", 7, "SystemExit(4)", 1),
])
def test_a_model_file_that_exits_or_raises(cli, tmp_path: Path, body: str, line: int,
                                           shown: str, code: int) -> None:
    model = tmp_path / "model.py"
    model.write_text(body)
    got, out, err = cli(*RUN, "--model", model, "--steps", "1")
    assert got == code, out + err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: --model "), err
    assert f"{shown} at {model}:{line} while " in err, err
    assert "Traceback" not in err and "training" not in out
    got, _, err = cli(*RUN, "--model", model, "--steps", "1", "--traceback")
    assert got == code and "Traceback (most recent call last)" in err
    assert f'File "{model}", line {line}' in err


def test_a_model_module_that_raises_while_importing(cli, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "brokenpkg_37.py").write_text("import no_such_dependency_37\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = cli(*RUN, "--model", "brokenpkg_37:spec")
    assert code == 1
    assert (f"error: --model 'brokenpkg_37:spec': ModuleNotFoundError: No module named "
            f"'no_such_dependency_37' at {tmp_path / 'brokenpkg_37.py'}:1 while importing "
            "brokenpkg_37") in err
    code, _, err = cli(*RUN, "--model", "no_such_module_37:spec")
    assert code == 2 and "cannot import no_such_module_37" in err


PLUGIN = '''from dataclasses import dataclass
from typing import ClassVar
from pipeir.passes import Pass

@dataclass(frozen=True)
class Loud(Pass):
    name: ClassVar[str] = "loud"
    summary: ClassVar[str] = "prints, then {what}"

    def run(self, schedule, context):
        print("hello from the plugin")
        {what}
        return schedule
'''


@pytest.mark.parametrize("what, line, shown, code", [
    ("pass", None, None, 0),
    ("raise RuntimeError('broken pass')", 12, "RuntimeError: broken pass", 1),
    ("raise SystemExit(0)", 12, "SystemExit(0)", 1),
    ("raise KeyboardInterrupt", 12, "KeyboardInterrupt", 130),
])
def test_a_plugin_that_prints_exits_or_raises(cli, tmp_path: Path, what: str,
                                              line: int | None, shown: str | None,
                                              code: int) -> None:
    plugin = tmp_path / "loud.py"
    plugin.write_text(PLUGIN.replace("{what}", what))
    got, out, err = cli("opt", *LIB, "--pass-plugin", f"{plugin}:Loud", "--passes", "loud")
    assert got == code, out + err
    assert "hello from the plugin" in err and "hello" not in out
    if code == 0:  # stdout is exactly the schedule
        _, plain, _ = cli("opt", *LIB, "--passes", "verify")
        assert out == plain
        return
    assert err.splitlines()[1] == (f"error: pass 'loud': {shown} at {plugin}:{line} while "
                                   "running pass 1 of 1, 'loud'"), err
    assert len(err.splitlines()) == 2 and "Traceback" not in err


@pytest.mark.parametrize("body, line, shown, code", [
    ("import sys\nsys.exit(0)\n", 2, "SystemExit(0)", 1),
    ("import sys\nsys.exit(3)\n", 2, "SystemExit(3)", 1),
    ("raise KeyboardInterrupt\n", 1, "KeyboardInterrupt", 130),
    ("print('noise')\nraise ImportError('half installed')\n", 2,
     "ImportError: half installed", 1),
])
def test_a_plugin_file_that_exits_or_raises_while_importing(
        cli, tmp_path: Path, body: str, line: int, shown: str, code: int) -> None:
    plugin = tmp_path / "bad.py"
    plugin.write_text(body)
    got, out, err = cli("opt", *LIB, "--pass-plugin", f"{plugin}:X", "--passes", "verify")
    assert got == code and out == ""
    assert f"error: --pass-plugin '{plugin}:X': {shown} at {plugin}:{line} while importing " \
           f"{plugin}" in err, err
    assert "Traceback" not in err


FD_PLUGIN = '''import os
from dataclasses import dataclass
from typing import ClassVar
from pipeir.passes import Pass

os.write(1, b"noise while importing\\n")

@dataclass(frozen=True)
class Raw(Pass):
    name: ClassVar[str] = "raw"
    summary: ClassVar[str] = "writes to descriptor 1"

    def run(self, schedule, context):
        os.write(1, b"noise from the pass\\n")
        return schedule
'''


def test_a_plugin_writing_to_descriptor_1_cannot_corrupt_stdout(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """`os.write(1, ...)` (as a C extension writes) bypasses `sys.stdout`: it is sent to
    stderr at the descriptor, and stdout is exactly the schedule."""
    plugin = tmp_path / "raw.py"
    plugin.write_text(FD_PLUGIN)
    assert main(["opt", *LIB, "--pass-plugin", f"{plugin}:Raw", "--passes", "raw"]) == 0
    out, err = capfd.readouterr()
    assert "noise while importing" in err and "noise from the pass" in err
    assert main(["opt", *LIB, "--passes", "verify"]) == 0
    assert out == capfd.readouterr().out


NOISY_MODEL = '''import os
from torch import nn
from pipeir.models import ModelSpec
from pipeir.models.mlp import small


class Noisy(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        os.write(1, b"NOISE-FD\\n")
        print("NOISE-PY")
        return self.inner(x)


def spec():
    b = small()
    return ModelSpec(stage=lambda s, n: Noisy(b.stage(s, n)), loss=b.loss, batch=b.batch)
'''


@pytest.mark.mp
def test_a_model_writing_to_descriptor_1_in_the_ranks_cannot_corrupt_the_report(
        tmp_path: Path) -> None:
    """The ranks run the model outside any contained block: their descriptor 1 is stderr,
    so `pipeirc run`'s stdout holds its report only."""
    model = tmp_path / "noisy.py"
    model.write_text(NOISY_MODEL)
    done = subprocess.run([sys.executable, "-m", "pipeir", "run", *LIB, "--model", model,
                           "--steps", "1"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr
    assert "NOISE" not in done.stdout and "step" in done.stdout
    assert "NOISE-FD" in done.stderr and "NOISE-PY" in done.stderr


@pytest.mark.mp
def test_a_model_writing_to_descriptor_1_under_torchrun_cannot_corrupt_the_step_lines(
        tmp_path: Path) -> None:
    """A torchrun rank prints its own step lines: onto a copy of the stdout it had, while
    the model's output, printed or written to descriptor 1, goes to stderr."""
    model = tmp_path / "noisy.py"
    model.write_text(NOISY_MODEL)
    assert main(["compile", str(SCHED), "--set", "ranks=2", "--set", "microbatches=2",
                 "-o", str(tmp_path / "gen")]) == 0
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(tmp_path / "gen" / "main.py"),
         "--steps", "2", "--model", str(model)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step 2/2  loss " in done.stdout and "NOISE" not in done.stdout
    assert "NOISE-FD" in done.stderr and "NOISE-PY" in done.stderr
