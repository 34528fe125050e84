"""A new user's first-hour slips (issue 38): each gets one clear error that says what to type
instead, or a line saying what was written. Exact messages and exit codes, through the CLI."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

import pipeir
from pipeir.models.mlp import small
from pipeir.runtime.preflight import preflight

REPO = Path(__file__).parent.parent
SCHED = str(REPO / "examples" / "1f1b.sched")
LIBRARY = ("the library has 1f1b, dualpipe-v, gpipe, interleaved-1f1b, looped-bfs, zb-h1, "
           "zb-h2, zb-v")

Cli = Callable[..., tuple[int, str, str]]


def test_a_mistyped_model_gets_did_you_mean(cli: Cli) -> None:
    code, out, err = cli("run", SCHED, "--model", "transfomer")
    assert (code, out) == (2, "")
    assert err == ("error: --model 'transfomer': cannot import transfomer: No module named "
                   "'transfomer'\nnote: did you mean 'transformer'?\n")


def test_a_mistyped_model_is_refused_before_the_model_check(
        cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model check waits for the fork server's import of torch (seconds); a bare word
    that names nothing importable is refused before it."""
    from pipeir.runtime import forked, preflight

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model check ran")

    monkeypatch.setattr(forked, "call", never)
    monkeypatch.setattr(preflight, "check_model", never)
    code, _, err = cli("run", SCHED, "--model", "heavy_lm")
    assert code == 2
    assert err == ("error: --model 'heavy_lm': cannot import heavy_lm: No module named "
                   "'heavy_lm'\nnote: did you mean 'heavy-lm'?\n")


def test_a_module_path_model_gets_no_guess(cli: Cli) -> None:
    """A dotted name is a module the user meant, not a slip of a built-in name."""
    code, _, err = cli("run", SCHED, "--model", "no_such_pkg.mlp:spec")
    assert code == 2
    assert "did you mean" not in err


@pytest.mark.parametrize(("given", "note"), [
    ("ZBVZeroBubble", "note: did you mean 'zb-v'? (torch's ScheduleZBVZeroBubble)"),
    ("ScheduleZBVZeroBubble", "note: did you mean 'zb-v'? (torch's ScheduleZBVZeroBubble)"),
    ("Interleaved1F1B", "note: did you mean 'interleaved-1f1b'? (torch's "
                        "ScheduleInterleaved1F1B)"),
    ("schedule_gpipe", "note: did you mean 'gpipe'? (torch's ScheduleGPipe)"),
    ("zbv", "note: did you mean 'zb-v'?"),
])
def test_a_torch_class_name_names_the_library_schedule(given: str, note: str, cli: Cli) -> None:
    code, out, err = cli("simulate", "--schedule", given, "--ranks", "2", "--microbatches", "4")
    assert (code, out) == (2, "")
    assert err == f"error: unknown library schedule '{given}'; {LIBRARY}\n{note}\n"


def test_a_torch_class_name_in_the_python_api() -> None:
    with pytest.raises(pipeir.UsageError) as e:
        pipeir.library.get("ZBVZeroBubble", 2, 4)
    assert [n.message for n in e.value.diagnostics[0].notes] == [
        "did you mean 'zb-v'? (torch's ScheduleZBVZeroBubble)"]


@pytest.mark.parametrize(("command", "name", "flags"), [
    ("run", "1f1b", "--ranks P --microbatches M"),
    ("check", "zb-v", "--ranks P --microbatches M"),
    ("simulate", "one_f_one_b", "--ranks P --microbatches M"),
    ("export-torch", "interleaved-1f1b", "--ranks P --microbatches M --v V"),
    ("print", "gpipe", "--ranks P --microbatches M"),
])
def test_a_library_name_given_as_file_shows_the_flags(command: str, name: str, flags: str,
                                                     cli: Cli, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    canonical = pipeir.library.canonical_name(name)
    code, out, err = cli(command, name)
    assert (code, out) == (2, "")
    assert err == (f"error: {name}: no such .sched file\nnote: '{canonical}' is a library "
                   f"schedule: use --schedule {canonical} {flags}\n")


def test_a_file_named_like_a_library_schedule_is_read(cli: Cli, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The hint is for a missing file only: a file called `1f1b` is the user's schedule."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "1f1b").write_text(Path(SCHED).read_text())
    assert cli("check", "1f1b")[0] == 0


@pytest.mark.parametrize(("spec", "col", "note"), [
    ("interleave(v=2)", 11, "did you mean 'interleave{v=2}'?"),
    ("verify, split-backward(mode=h2)", 23, "did you mean 'split-backward{mode=h2}'?"),
    ("interleave[v=2", 11, "did you mean 'interleave{...}'?"),
    ("verify()", 7, "did you mean 'verify'?"),
])
def test_pass_options_in_parentheses_say_braces(spec: str, col: int, note: str,
                                                cli: Cli) -> None:
    code, out, err = cli("opt", SCHED, "--passes", spec)
    assert (code, out) == (2, "")
    name = spec[:col - 1].split(",")[-1].strip()
    lines = err.splitlines()
    assert lines[0] == (f"<passes>:1:{col}: error: options of pass '{name}' go in braces, not "
                        f"'{spec[col - 1]}'")
    assert lines[2] == " " * (4 + col - 1) + "^"
    assert lines[3] == f"note: {note}"


@pytest.mark.parametrize("command", [
    ["opt", SCHED, "--passes", "verify"],
    ["print", SCHED],
])
def test_writing_a_schedule_says_so(command: list[str], cli: Cli, tmp_path: Path) -> None:
    out_file = tmp_path / "out.sched"
    code, out, err = cli(*command, "-o", out_file)
    assert (code, err) == (0, "")
    assert out == f"wrote {out_file} (pipeirc simulate {out_file})\n"
    assert pipeir.parse(out_file).config.ranks == 4


def test_export_and_import_torch_say_what_they_wrote(cli: Cli, tmp_path: Path) -> None:
    csv = tmp_path / "1f1b.csv"
    code, out, err = cli("export-torch", SCHED, "-o", csv)
    assert (code, err) == (0, "")
    assert out == (f"wrote {csv} (compute_only CSV for torch.distributed.pipelining: 4 ranks, "
                   "8 micro-batches)\n")
    back = tmp_path / "back.sched"
    code, out, _ = cli("import-torch", csv, "-o", back)
    assert code == 0
    assert out == f"wrote {back} (pipeirc simulate {back})\n"
    assert pipeir.parse(back) == pipeir.parse(SCHED)


@pytest.mark.parametrize(("n", "unit"), [(0, ("B", 1)), (1023, ("B", 1)), (2**10, ("KiB", 2**10)),
                                         (3e9, ("GiB", 2**30)), (2**40, ("TiB", 2**40))])
def test_binary_units(n: float, unit: tuple[str, int]) -> None:
    assert pipeir.limits.binary_unit(n) == unit


def test_the_memory_plot_reads_in_gib_and_shows_every_rank(cli: Cli, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """GPipe's ranks all reach 8 x 3e9 bytes = 22.4 GiB: the axis says GiB, not `1e10`, and
    the four lines that coincide on the plateau are drawn in four widths and dashes."""
    matplotlib = pytest.importorskip("matplotlib")
    monkeypatch.setitem(matplotlib.rcParams, "svg.fonttype", "none")  # text stays text
    costs = tmp_path / "costs.json"
    costs.write_text('{"version": 1, "F": 1, "B": 2, "memory_bytes": 3e9}')
    svg = tmp_path / "gpipe.svg"
    code, _, err = cli("plot", "--schedule", "gpipe", "--ranks", "4", "--microbatches", "8",
                       "--costs", costs, "-o", svg)
    assert code == 0, err
    text = svg.read_text()
    assert "saved activations (GiB)" in text
    # (what is drawn: matplotlib's element ids are random hex, and may hold "1e9")
    drawn = re.sub(r'\b(id|xlink:href|clip-path)="[^"]*"', "", text)
    assert "1e10" not in drawn and "1e9" not in drawn
    assert all(text.count(f">rank {r}<") == 2 for r in range(4))  # lane label and legend
    widths = re.findall(r"stroke-width: (2\.8|2\.166667|1\.533333|0\.9)(?![0-9])", text)
    assert sorted(widths) == sorted(["2.8", "2.166667", "1.533333", "0.9"] * 2)  # + legend


@pytest.mark.mp
def test_progress_lines_show_the_gradient_norm_without_clipping(cli: Cli, tmp_path: Path
                                                                ) -> None:
    """The mlp does not clip; its progress lines and --metrics still give the global
    gradient norm, the one single-process training's gradients have (torch computes it)."""
    torch = pytest.importorskip("torch")
    from pipeir.models.spec import resolve
    from pipeir.runtime.reference import train_reference

    spec = resolve("mlp")
    assert spec.clip_grad_norm is None
    metrics = tmp_path / "m.jsonl"
    code, out, err = cli("run", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "4",
                         "--model", "mlp", "--steps", "2", "--metrics", metrics)
    assert code == 0, err
    got = [json.loads(line)["grad_norm"] for line in metrics.read_text().splitlines()]
    want = []
    for steps in (1, 2):
        _, grads = train_reference(spec, 2, 4, 1, steps)
        want.append(float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for s in grads.values() for g in s.values()]))))
    assert got == pytest.approx(want, rel=1e-5)
    for k, norm in enumerate(want, 1):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"step    {k}/2"))
        assert line.endswith(f"grad norm {norm:.3g}")


BOOM = '''
import dataclasses

import torch

from pipeir.models import mlp


class Boom(torch.nn.Module):
    def forward(self, x):
        raise RuntimeError("my model: expected 512 features, got 7")


def spec():
    return dataclasses.replace(mlp.spec(), stage=lambda s, n: Boom())
'''


@pytest.mark.mp
def test_a_failing_model_under_torchrun_ends_torchruns_report(cli: Cli, tmp_path: Path) -> None:
    """torchrun prints its own report after the workers' output: its root cause is pipeir's
    one line (from the error file torchrun reads), not "To enable traceback see: ...". One
    process is enough: what is checked is what torchrun prints about it."""
    import subprocess
    import sys

    from pipeir.runtime.launch import free_port

    assert cli("compile", "--schedule", "1f1b", "--ranks", "1", "--microbatches", "2",
               "-o", tmp_path / "gen")[0] == 0
    (tmp_path / "boom.py").write_text(BOOM)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
         "--master-port", str(free_port()), str(tmp_path / "gen" / "main.py"), "--steps", "1",
         "--model", str(tmp_path / "boom.py")], capture_output=True, text=True, timeout=120)
    ours = ("main.py: rank 0 failed: PlanError: stage 0 cannot take the micro-batch input "
            "float32[128x512]: RuntimeError: my model: expected 512 features, got 7")
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip("=")]
    assert lines[-1] == f"  traceback : {ours}", proc.stderr[-3000:]
    assert lines.count(ours) == 1  # and once as the worker wrote it
    assert "To enable traceback" not in proc.stderr
    assert "pipeir/runtime" not in proc.stderr  # no frame of ours


@pytest.mark.parametrize(("change", "message"), [
    ({"clip_grad_norm": 0}, "clip_grad_norm must be a positive number (or None: no clipping), "
                            "got 0"),
    ({"clip_grad_norm": -1.0}, "clip_grad_norm must be a positive number"),
    ({"seed": "x"}, "the model's seed must be an integer, got 'x'"),
    ({"optimizer": "sgd"}, "the model's optimizer must be a function, got 'sgd' (give the "
                           "optimizer's class"),
    ({"batch": lambda step: (1, 2, 3)}, "batch(step) must return a pair (inputs, targets), "
                                        "got tuple of 3"),
])
def test_a_model_spec_of_the_wrong_kind_stops_before_launch(change: dict[str, object],
                                                            message: str) -> None:
    """A clip of 0 stopped training and a negative one reversed it, silently; a seed, an
    optimizer or a batch of the wrong kind failed only inside the ranks."""
    spec = dataclasses.replace(small(), **change)  # type: ignore[arg-type]
    with pytest.raises(pipeir.UsageError) as e:
        preflight(spec, "m", 2, 2, 1)
    assert message in e.value.diagnostics[0].message
