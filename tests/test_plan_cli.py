"""pipeirc plan and pipeirc run --plan through the CLI: a profiled plan of the built-in
transformer, re-planning from its costs, the built-in Splittable models, every bad input one
line with exit 2 and nothing written, and one small run of a plan checked against
single-process training."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pipeir.api import load  # noqa: E402
from pipeir.models import build_stage, resolve, resolve_splittable  # noqa: E402
from pipeir.plan import LayerCost, Link, plan  # noqa: E402
from pipeir.plan.planfile import to_json  # noqa: E402
from pipeir.printer import print_schedule  # noqa: E402
from pipeir.verify import verify  # noqa: E402

Cli = Callable[..., tuple[int, str, str]]
NAMES = ["", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm"]  # the transformer's


@pytest.fixture
def costs_plan(tmp_path: Path) -> Path:
    """A plan file for the transformer from hand-made costs (no profiling): a heavy head."""
    layers = [LayerCost(n, F=3.0 if n == "norm" else 1.0, B=2.0, I=1.0, W=1.0,
                        activation_bytes=4e3, memory_bytes=1e5, param_bytes=1e5)
              for n in NAMES]
    p = plan(layers, 2, 4, Link(0.01))
    path = tmp_path / "costs.json"
    path.write_text(to_json(p, "transformer", "pipeline { }\n", "by hand"))
    return path


def test_plan_profiles_the_transformer_and_replans_from_its_costs(cli: Cli,
                                                                  tmp_path: Path) -> None:
    out, sched = tmp_path / "p.json", tmp_path / "p.sched"
    code, text, err = cli("plan", "--model", "transformer", "--ranks", "2", "--latency", "0",
                          "--warmup", "0", "--iters", "1", "-o", out, "--schedule-out", sched)
    assert code == 0, err
    data = json.loads(out.read_text())
    assert data["format"] == "pipeir-plan" and data["version"] == 2
    points = data["points"]  # at least one stage per rank (v chunks, or three on two ranks)
    assert len(points) + 1 >= 2 and points == [n for n in NAMES if n in points]
    assert [x["name"] for x in data["costs"]["layers"]] == NAMES
    assert all(x["F"] > 0 and x["param_bytes"] > 0 for x in data["costs"]["layers"])
    assert data["step"] >= data["bound"] >= data["best_bound"] > 0
    # profiled with the split: after I each block's W keeps some, not all, of what it saved
    # (the head's weight gradient needs all of its input)
    pieces = data["costs"]["layers"]
    assert all(0 < x["memory_w_bytes"] <= x["memory_bytes"] for x in pieces)
    assert all(x["memory_w_bytes"] < x["memory_bytes"] for x in pieces[1:-1])
    assert data["memory"]["release"] == "partial"
    assert "lower bound" in text and "uniform split" in text
    elab = load(sched)  # the written schedule parses, verifies and carries its costs
    verify(elab.schedule)
    assert elab.schedule.config.ranks == 2 and "stage.1.F" in elab.costs
    # ... and what W keeps, each stage the sum of its pieces' (stage 0: all it saved)
    stages = [NAMES[lo:hi] for lo, hi in
              zip([0, *map(NAMES.index, points)], [*map(NAMES.index, points), len(NAMES)])]
    by_name = {x["name"]: x for x in pieces}
    for k, names in enumerate(stages):
        key = "memory_bytes" if k == 0 else "memory_w_bytes"
        assert elab.costs[f"stage.{k}.memory_w_bytes"][0] == pytest.approx(
            sum(by_name[n][key] for n in names))
    # the same costs, another rank count: no profiling
    again = tmp_path / "p3.json"
    code, text, err = cli("plan", "--model", "transformer", "--ranks", "3", "--microbatches",
                          "4", "--layer-costs", out, "-o", again)
    assert code == 0, err
    assert len(json.loads(again.read_text())["points"]) + 1 >= 3


def test_builtin_splittables_keep_weights_and_names_under_every_cut() -> None:
    assert resolve("transformer").stage.__name__ == "Stage"  # the default is unchanged
    for ref in ("transformer", "heavy-lm"):
        model = resolve_splittable(ref)
        points = list(model.split_points())
        whole = dict(build_stage(model.at([]), 0, 1).named_parameters())
        for cut in ([points[0]], points[1:3], [points[-1]], points):
            spec = model.at(cut)
            got = {k: v for s in range(len(cut) + 1)
                   for k, v in build_stage(spec, s, len(cut) + 1).named_parameters()}
            assert got.keys() == whole.keys()
            assert all(torch.equal(got[k], whole[k]) for k in whole)
    # `--model heavy-lm` is the uniform cut: blocks evenly, embedding first, head last
    plain = [build_stage(resolve("heavy-lm"), s, 4) for s in range(4)]
    firsts = [next(iter(dict(m.named_parameters()))).rsplit(".", 2)[0] for m in plain]
    assert firsts == ["embed", "blocks.2", "blocks.4", "blocks.6"]
    heavy = resolve_splittable("heavy-lm").at([])
    emb = dict(build_stage(heavy, 0, 1).named_parameters())["embed.weight"]
    assert emb.shape[0] >= 8 * emb.shape[1]  # vocabulary >= 8x hidden


@pytest.mark.parametrize("extra, message", [
    (["--model", "mlp", "--ranks", "2"], "a model that can be cut at named points"),
    (["--model", "transformer@blocks.1", "--ranks", "2"], "without split points"),
    (["--model", "transformer", "--ranks", "0"], "--ranks 0: need at least 1"),
    (["--model", "transformer", "--ranks", "7"], "at most 6 stages"),
    (["--model", "transformer", "--ranks", "2", "--microbatches", "0"], "--microbatches 0"),
    (["--model", "transformer", "--ranks", "2", "--memory", "0"], "argument --memory"),
    (["--model", "transformer", "--ranks", "2", "--memory", "-1.5"], "argument --memory"),
    (["--model", "transformer", "--ranks", "2", "--memory", "nan"], "argument --memory"),
    (["--model", "transformer", "--ranks", "2", "--memory", "8XB"],
     "expected a count or bytes with a unit"),
    (["--model", "transformer", "--ranks", "2", "--memory", "infB"],
     "expected a positive, finite size"),
    (["--model", "transformer", "--ranks", "2", "--weight-copies", "-1"], "--weight-copies"),
    (["--model", "transformer", "--ranks", "2", "--layer-costs", "missing.json"],
     "missing.json"),
    (["--model", "heavy-lm", "--ranks", "2", "--layer-costs", "COSTS"],
     "are not heavy-lm's"),
    (["--model", "transformer", "--ranks", "2", "--layer-costs", "COSTS", "--microbatches",
      "8"], "costs are for one of 4 micro-batches"),
    (["--model", "transformer", "--ranks", "2", "--layer-costs", "COSTS", "--memory", "1KB"],
     "no split and schedule fits --memory"),
    (["--model", "transformer", "--ranks", "2", "--layer-costs", "COSTS", "--schedule-out",
      "OUT"], "both name"),
    (["--model", "transformer", "--ranks", "2", "--synth-time", "-1"],
     "--synth-time -1: need a finite number of seconds >= 0"),
    (["--model", "transformer", "--ranks", "2", "--synth-time", "nan"],
     "--synth-time nan: need a finite number"),
])
def test_plan_bad_usage(cli: Cli, tmp_path: Path, costs_plan: Path, extra: list[str],
                        message: str) -> None:
    out = tmp_path / "out.json"
    args = [str(costs_plan) if a == "COSTS" else str(out) if a == "OUT" else a for a in extra]
    code, _, err = cli("plan", *args, "-o", out)
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2  # one error line (and a note at most)
    assert not out.exists()


@pytest.mark.parametrize("given, budget, unit", [
    ("3.5", 3.5, "activations"),  # a fractional count, as tune's --memory-limit takes
    ("4", 4.0, "activations"),
    ("40MB", 4e7, "bytes"),
    ("1.5GiB", 1.5 * 2**30, "bytes"),
])
def test_plan_memory_reads_as_tunes_memory_limit(cli: Cli, tmp_path: Path, costs_plan: Path,
                                                 given: str, budget: float, unit: str
                                                 ) -> None:
    out = tmp_path / "p.json"
    code, text, err = cli("plan", "--model", "transformer", "--ranks", "2", "--layer-costs",
                          costs_plan, "--synth-time", "0", "--memory", given, "-o", out)
    assert code == 0, err
    data = json.loads(out.read_text())
    assert (data["memory"]["budget"], data["memory"]["unit"]) == (budget, unit)
    if unit == "activations":  # every rank's counted peak within it
        assert data["peak_activations"] <= budget
        assert f"memory per rank: {given} activations" in text
    else:
        assert max(data["rank_bytes"]) <= budget


@pytest.mark.parametrize("extra, message", [
    (["--plan", "PLAN", "--schedule", "1f1b"], "not both"),
    (["--plan", "PLAN", "--model", "mlp"], "a model that can be cut at named points"),
    (["--plan", "PLAN", "--model", "transformer@blocks.1"], "without split points"),
    (["--plan", "BAD"], "not a plan file"),
    (["--plan", "FAR"], "split point 'blocks.7' is not one of the model's"),
])
def test_run_plan_bad_usage(cli: Cli, tmp_path: Path, costs_plan: Path, extra: list[str],
                            message: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    far = tmp_path / "far.json"  # a heavy-lm plan run on the transformer (4 blocks)
    far.write_text(json.dumps({**json.loads(costs_plan.read_text()), "points": ["blocks.7"]}))
    names = {"PLAN": costs_plan, "BAD": bad, "FAR": far}
    code, out, err = cli("run", *[str(names.get(a, a)) for a in extra], "--steps", "1")
    assert code == 2, err
    assert message in err and "Traceback" not in err and "training" not in out


@pytest.mark.mp
@pytest.mark.parametrize("extra, message", [
    (["--model", "mlp"], "a model that can be cut at named points"),
    ([], "split point 'blocks.7' is not one of the model's"),
])
def test_run_plan_cut_is_checked_in_the_forked_preflight(tmp_path: Path, extra: list[str],
                                                         message: str) -> None:
    """With the fork server (a real `pipeirc run`), the plan's cut is refused by the model
    check in its forked process, in the same words, and the launcher imports no torch."""
    layers = [LayerCost(n, F=1.0, B=2.0, I=1.0, W=1.0) for n in NAMES]
    p = plan(layers, 2, 4, splits=(None,))
    cand = p.planned.candidate
    data = json.loads(to_json(p, "transformer", print_schedule(cand.schedule,
                                                               cand.costs.settings()), "hand"))
    far = tmp_path / "far.json"  # a cut of a larger model: the transformer has 4 blocks
    far.write_text(json.dumps({**data, "points": ["blocks.7", *data["points"][1:]]}))
    argv = ["run", "--plan", str(far), *extra, "--steps", "1"]
    code = ("import sys\nfrom pipeir.cli import main\nif __name__ == '__main__':\n"
            f"    c = main({argv!r})\n"
            "    print('torch in the launcher:', 'torch' in sys.modules)\n    sys.exit(c)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "torch in the launcher: False" in r.stdout


def test_run_plan_takes_an_interleaved_plan(cli: Cli, tmp_path: Path) -> None:
    """A plan with two chunks per rank: 4 stages from 3 points, compiled for 2 ranks (the
    run stops at --nproc, after the plan's schedule and cut have been checked)."""
    layers = [LayerCost(n, F=1.0, B=2.0, I=1.0, W=1.0) for n in NAMES]
    p = plan(layers, 2, 4, splits=(None,))  # unsplit backwards: interleaving wins
    assert p.planned.candidate.v == 2 and len(p.planned.cut) == 3

    cand = p.planned.candidate
    path = tmp_path / "p.json"
    path.write_text(to_json(p, "transformer", print_schedule(cand.schedule,
                                                             cand.costs.settings()), "hand"))
    code, _, err = cli("run", "--plan", path, "--nproc", "3")
    assert code == 2 and "--nproc 3: the schedule runs on 2 ranks" in err, err
    # a plan simulated with blocking communication runs blocking, unless the command line
    # asks for overlap (--max-posted bounds the overlap pass: it asks for it)
    data = json.loads(path.read_text())
    data["schedule"]["comm"] = "blocking"
    path.write_text(json.dumps(data))
    code, _, err = cli("run", "--plan", path, "--max-posted", "2", "--nproc", "3")
    assert code == 2 and "--nproc 3: the schedule runs on 2 ranks" in err, err


@pytest.mark.mp
def test_run_plan_trains_like_one_process(cli: Cli, tmp_path: Path) -> None:
    """The planned split and schedule train to single-process training's parameters."""
    layers = [LayerCost(n, F=4.0 if n == "norm" else 1.0, B=2.0, I=1.0, W=1.0,
                        activation_bytes=4e3, memory_bytes=1e5, param_bytes=1e5)
              for n in NAMES]
    p = plan(layers, 2, 4)
    assert p.planned.cut != (3,)  # not the transformer's own cut: the head weighs more
    text = to_json(p, "transformer", "", "by hand")
    costs = tmp_path / "costs.json"
    costs.write_text(text)
    path = tmp_path / "p.json"  # with the schedule `pipeirc plan` writes
    code, _, err = cli("plan", "--model", "transformer", "--ranks", "2", "--microbatches", "4",
                       "--layer-costs", costs, "-o", path)
    assert code == 0, err
    assert json.loads(path.read_text())["points"] == [NAMES[i] for i in p.planned.cut]
    code, out, err = cli("run", "--plan", path, "--steps", "2", "--check", "--timeout", "120")
    assert code == 0, err
    assert "all stages within 1e-05 of single-process training" in out


def test_plan_refuses_a_bad_number_before_loading_torch() -> None:
    """A bad --synth-time (or --ranks) is refused before the planner and torch are imported:
    they were imported first, seconds of waiting for a one-line usage error."""
    code = ("import sys\nfrom pipeir.cli import main\n"
            "rc = main(['plan', '--model', 'transformer', '--ranks', '2', '--synth-time', "
            "'nan'])\nprint(rc, 'torch' in sys.modules, 'pipeir.plan.search' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert r.stdout.split() == ["2", "False", "False"], (r.stdout, r.stderr)
    assert "--synth-time nan: need a finite number" in r.stderr
