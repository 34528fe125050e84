"""The two front doors agree: `pipeirc compile --emit json` and `pipeir.compile` lower the
same schedule, passes, data-parallel replicas and costs to the same programs, because both go
through `pipeir.driver`. The matrix: library 1F1B, interleaved 1F1B, ZB-H1, an example file
and one with a costs block × no passes, split-backward, overlap, interleave{v=2} and reorder
× one replica, two from the costs and two from the flag × every example cost file (and none),
each cost file met in turn. A case compiles to identical JSON through both doors, or
(interleaving a schedule that is not one stage per rank) fails with the same message through
both."""

from __future__ import annotations

import itertools
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import pipeir
from pipeir import driver
from pipeir.backend.program_io import dumps, format_lowered
from pipeir.cli import main
from pipeir.diagnostics import PipeirError
from pipeir.driver import ScheduleRef
from pipeir.frontend.elaborate import Elaborated
from pipeir.interop import compute_actions, from_torch_actions, load_csv, loads_csv, parse_action
from pipeir.interop.check import prove_comms
from pipeir.models import causal_lm
from pipeir.models.refs import resolve
from pipeir.passes import PassContext, PassManager, parse_pipeline
from pipeir.passes.interleave import Interleave
from pipeir.passes.memory import Recompute
from pipeir.passes.overlap import Overlap
from pipeir.passes.reorder import Reorder
from pipeir.passes.split_backward import SplitBackward
from pipeir.plan import LayerCost, plan
from pipeir.runtime.pipelining import _instantiate
from pipeir.schedule import Schedule
from pipeir.search.synth import synth
from pipeir.search.tune import search as tune_search
from pipeir.sim import CostModel
from pipeir.sim.steady import steady, steady_state
from pipeir.views.plot import render_gantt
from pipeir.views.timeline import render_timeline
from pipeir.views.trace import chrome_trace

REPO = Path(__file__).parent.parent
EXAMPLES = REPO / "examples"
FILE = EXAMPLES / "1f1b.sched"
BLOCK = EXAMPLES / "costs" / "variable-length.sched"  # with a costs block of its own

#: name: (CLI words that name the schedule, the API's way to build it); 8 micro-batches
#: each, the count examples/costs/lengths.toml gives lengths for.
SCHEDULES: dict[str, tuple[list[str], Callable[[], Schedule | Elaborated]]] = {
    "1f1b": (["--schedule", "1f1b", "--ranks", "4", "--microbatches", "8"],
             lambda: pipeir.library.get("1f1b", ranks=4, microbatches=8)),
    "interleaved": (["--schedule", "interleaved-1f1b", "--ranks", "2", "--microbatches", "8",
                     "--v", "2"],
                    lambda: pipeir.library.get("interleaved-1f1b", ranks=2, microbatches=8,
                                               v=2)),
    "zb-h1": (["--schedule", "zb-h1", "--ranks", "4", "--microbatches", "8"],
              lambda: pipeir.library.get("zb-h1", ranks=4, microbatches=8)),
    "file": ([str(FILE)], lambda: pipeir.parse(FILE)),
    # what pipeir.load returns: its costs block is the costs, as on the command line
    "block": ([str(BLOCK)], lambda: pipeir.load(BLOCK)),
}
#: reorder bounded by evaluations, not by its default 20 ms: what it finds in 20 ms depends
#: on the machine's load, and the doors must be compared on the same search
PASSES = ["", "split-backward", "overlap", "interleave{v=2}", "reorder{budget_ms=1000000,evals=60}"]
DP = ["1", "2-costs", "2-flag"]
COSTS: list[Path | None] = [None, *sorted((EXAMPLES / "costs").glob("*.toml")),
                            EXAMPLES / "costs" / "profile.json"]
CASES = [(s, p, dp, COSTS[i % len(COSTS)])
         for i, (s, p, dp) in enumerate(itertools.product(SCHEDULES, PASSES, DP))]


def _with_dp2(path: Path | None, tmp: Path) -> Path:
    """A copy of the cost file `path` (or an empty one) that says dp = 2."""
    out = tmp / ("dp2.json" if path is not None and path.suffix == ".json" else "dp2.toml")
    if path is None:
        out.write_text("dp = 2\n")
    elif path.suffix == ".json":
        out.write_text(json.dumps({**json.loads(path.read_text()), "dp": 2}))
    else:  # top-level keys before the first table
        out.write_text("dp = 2\n" + path.read_text())
    return out


def _cli(words: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(words)
    out, err = capsys.readouterr()
    return code, out, err


def _errors(err: str) -> str:
    """The CLI's error lines (its warnings are the API's `warnings.warn`s)."""
    return "\n".join(line for line in err.splitlines() if "error:" in line)


@pytest.mark.parametrize(("name", "passes", "dp", "costs"), CASES,
                         ids=[f"{s}-{p.split('{')[0] or 'none'}-dp{d}-{c.name if c else 'nocosts'}"
                              for s, p, d, c in CASES])
def test_cli_and_api_lower_alike(name: str, passes: str, dp: str, costs: Path | None,
                                 tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    words, build = SCHEDULES[name]
    # interleave takes one stage per rank, before any split: the only refusals here
    refused = passes == "interleave{v=2}" and name in ("interleaved", "zb-h1")
    cost_file = _with_dp2(costs, tmp_path) if dp == "2-costs" else costs
    cli = ["compile", *words, "--emit", "json"]
    cli += ["--passes", passes] if passes else []
    cli += ["--costs", str(cost_file)] if cost_file is not None else []
    cli += ["--dp", "2"] if dp == "2-flag" else []
    code, out, err = _cli(cli, capsys)

    try:
        schedule = build()
        model = CostModel.load(cost_file) if cost_file is not None else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = pipeir.compile(schedule, passes, costs=model,
                                      dp=2 if dp == "2-flag" else None)
    except PipeirError as e:
        assert refused, e.render()
        assert code != 0, f"the CLI compiled what the API refused: {e.render()}"
        assert _errors(err).endswith(e.diagnostics[0].render().splitlines()[0]), err
        return
    assert not refused
    assert code == 0, f"the CLI refused what the API compiled:\n{err}"
    assert out == dumps(compiled.lowered)
    kinds = [row[0] for program in json.loads(out)["programs"] for row in program["table"]]
    # two replicas: every rank reduces its gradients (the dp policy ran in both doors)
    assert ("reduce-grad" in kinds) == (dp != "1"), kinds


def test_api_compile_reduces_with_dp2_costs() -> None:
    """The issue's case: dp = 2 in the costs gives the two gradient reductions of a
    two-rank pipeline through `pipeir.compile`, as through `pipeirc compile`; dp=1 given
    outright builds one replica."""
    s = pipeir.library.get("1f1b", ranks=2, microbatches=2)
    def reductions(dp: int | None) -> int:
        lowered = pipeir.compile(s, costs=CostModel(dp=2), dp=dp).lowered
        return sum(row[0] == "reduce-grad" for p in json.loads(dumps(lowered))["programs"]
                   for row in p["table"])

    assert (reductions(None), reductions(2), reductions(1)) == (2, 2, 0)


def test_load_with_costs_returns_warnings_and_prints_nothing(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A cost for a stage the pipeline lacks is a warning in the result, not a print."""
    loaded = driver.load_with_costs(ScheduleRef(library="1f1b", ranks=2, microbatches=4),
                                    {"stage.7.F": 2.0, "F": 1.5})
    assert capsys.readouterr() == ("", "")
    assert [(d.severity, d.message) for d in loaded.warnings] == [
        ("warning", "cost 'stage.7.F' names stage 7, but the pipeline has 2 (stage 0 to 1); "
                    "it is ignored")]
    assert loaded.costs.F == 1.5
    assert loaded.elaborated.costs["F"] == (1.5, None)


def test_the_front_door_warns_of_costs_the_pipeline_does_not_have() -> None:
    """`pipeir.compile` and `pipeir.simulate` warn as the command line does (the test above):
    a cost given for stage 5 of a two-stage pipeline, or micro-batch 9 of four, is ignored."""
    s = pipeir.library.get("1f1b", 2, 4)
    costs = CostModel(stage={5: {"F": 2.0}, 1: {"F": 3.0}}, mb={9: {"B": 1.0}})
    want = ["cost 'stage.5.F' names stage 5, but the pipeline has 2 (stage 0 to 1); it is "
            "ignored",
            "cost 'mb.9.B' names mb 9, but the pipeline has 4 (mb 0 to 3); it is ignored"]
    for call in (lambda: pipeir.simulate(s, costs), lambda: pipeir.compile(s, costs=costs)):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            call()
        assert [str(w.message) for w in got] == want
        assert all(w.filename == __file__ for w in got)  # (at the caller's line)
    in_file = pipeir.load("pipeline { ranks = 1  microbatches = 1 }\ncosts { stage.3.F = 2 }\n"
                          "schedule s { rank r { F(0, 0) B(0, 0) } }")
    with pytest.warns(UserWarning, match=r"cost 'stage\.3\.F' names stage 3, but the pipeline "
                                         r"has 1 \(stage 0 to 0\)"):
        pipeir.compile(in_file)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # costs it all uses: nothing to say
        pipeir.simulate(s, CostModel(stage={1: {"F": 3.0}}, mb={3: {"B": 1.0}}))
        pipeir.compile(s, costs=CostModel(stage={1: {"F": 3.0}}))


def test_a_file_named_like_a_library_schedule_is_read(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpipe").write_text((REPO / "examples/1f1b.sched").read_text())
    assert pipeir.parse("gpipe") == pipeir.parse(str(REPO / "examples/1f1b.sched"))


def test_the_front_door_simulates_only_what_verifies() -> None:
    """`pipeir.simulate` verifies first, as `pipeirc simulate` does: a schedule without its
    backwards was timed (a makespan of 3, a bubble of a third) as if it were a step."""
    cfg = pipeir.PipelineConfig.make(ranks=2, microbatches=2)
    forwards = Schedule.from_programs(cfg, [[pipeir.F(0, 0), pipeir.F(0, 1)],
                                            [pipeir.F(1, 0), pipeir.F(1, 1)]])
    with pytest.raises(pipeir.VerifyError) as e:
        pipeir.simulate(forwards)
    assert e.value.check == "completeness"
    assert e.value.diagnostics[0].message == ("missing B(0,0): the schedule never runs it "
                                              "(stage 0 lives on rank 0)")
    assert pipeir.sim.simulate(forwards).makespan == 3.0  # (the engine times what it is given)


def test_load_schedules_refuses_a_cost_where_none_is_used() -> None:
    with pytest.raises(PipeirError) as e:
        driver.load_schedules(ScheduleRef(library="1f1b", ranks=2, microbatches=4),
                              {"F": 5})
    assert e.value.diagnostics[0].message.startswith("--set F=5: 'F' is a cost, and this "
                                                     "command uses none")


def test_data_parallel_policy() -> None:
    """dp-reduce goes before the first lowered pass, once; a schedule with its own R ops
    keeps them; too many processes for torch.distributed are refused."""
    from pipeir.passes import parse_pipeline

    s = pipeir.library.get("1f1b", ranks=2, microbatches=2)
    rep = driver.data_parallel(parse_pipeline("split-backward,overlap"), s, CostModel(dp=2))
    assert [p.name for p in rep.pipeline.passes] == ["split-backward", "dp-reduce", "overlap"]
    assert rep.dp == 2 and rep.costs.dp == 2
    again = driver.data_parallel(rep.pipeline, s, rep.costs)
    assert [p.name for p in again.pipeline.passes] == ["split-backward", "dp-reduce", "overlap"]
    reduced = pipeir.compile(s, "dp-reduce", costs=CostModel(dp=2)).schedule
    own = driver.data_parallel(parse_pipeline("overlap"), reduced, CostModel(dp=2))
    assert [p.name for p in own.pipeline.passes] == ["overlap"]
    with pytest.raises(PipeirError, match="need at least 1 replica"):
        driver.data_parallel(parse_pipeline("overlap"), s, CostModel(), dp=0)
    with pytest.raises(PipeirError, match="32-bit integers"):
        driver.data_parallel(parse_pipeline("overlap"), s, CostModel(), dp=2**31)


def test_the_driver_never_prints() -> None:
    """Warnings travel back as diagnostics: no module of the driver calls print or writes to
    sys.stdout / sys.stderr (read from its source, so a new one cannot slip in)."""
    import ast

    for path in Path(driver.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            assert not (isinstance(node, ast.Name) and node.id == "print"), path
            assert not (isinstance(node, ast.Attribute) and node.attr in ("stdout", "stderr")), \
                path


def test_both_doors_overlap_by_default_and_block_when_told(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Communication is asynchronous unless `--blocking` / `overlap=False`; both doors agree on
    both, and the blocking programs have no asynchronous send."""
    words, build = SCHEDULES["1f1b"]
    for flags, kw, overlapped in (([], {}, True), (["--blocking"], {"overlap": False}, False),
                                  (["--passes", "split-backward"], {}, True)):
        passes = flags[1] if flags[:1] == ["--passes"] else None
        code, out, err = _cli(["compile", *words, *flags, "--emit", "json"], capsys)
        assert code == 0, err
        low = pipeir.compile(build(), passes, **kw).lowered
        assert out == dumps(low) and low.overlap is overlapped
        sends = {i.mnemonic for prog in low.programs for i in prog} & {"send", "isend"}
        assert sends == ({"isend"} if overlapped else {"send"}), (flags, sends)


def test_blocking_contradicted_is_refused_through_both_doors(
        capsys: pytest.CaptureFixture[str]) -> None:
    words, build = SCHEDULES["1f1b"]
    code, _, err = _cli(["compile", *words, "--blocking", "--passes", "split-backward,overlap",
                         "--emit", "json"], capsys)
    assert code == 2
    assert "error: blocking communication was asked for, but the pass pipeline includes " \
        "'overlap'" in err, err
    with pytest.raises(PipeirError, match="blocking communication was asked for"):
        pipeir.compile(build(), "overlap", overlap=False)
    code, _, err = _cli(["compile", *words, "--blocking", "--max-posted", "2", "--emit",
                         "json"], capsys)
    assert code == 2 and "error: --max-posted bounds the receives the overlap pass posts " \
        "ahead; with blocking communication there are none" in err, err
    code, _, err = _cli(["compile", *words, "--blocking", "--overlap", "--emit", "json"],
                        capsys)
    assert code == 2 and "not allowed with argument" in err, err
    # two bounds for one pass: refused, not one of them dropped
    code, _, err = _cli(["compile", *words, "--passes", "overlap{max_posted=2}",
                         "--max-posted", "3", "--emit", "json"], capsys)
    assert code == 2 and "error: --max-posted 3: the pass pipeline's 'overlap' sets its own " \
        "bound" in err, err


def test_compile_proves_the_programs_it_returns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last lowered pass's programs, proved after the pass, are not proved again."""
    from pipeir.passes import manager

    proved: list[object] = []
    real = manager.check_comm
    monkeypatch.setattr(manager, "check_comm", lambda low: proved.append(low) or real(low))
    s = pipeir.library.get("1f1b", 2, 4)
    for overlap in (True, False):
        proved.clear()
        low = pipeir.compile(s, overlap=overlap).lowered
        assert proved == [low]


_LAYERS = [LayerCost("" if i == 0 else f"l{i}", F=1.0, B=2.0, I=1.0, W=1.0) for i in range(4)]


def _api_mistakes() -> list[tuple[Callable[[], object], type[Exception], str]]:
    s = pipeir.library.get("1f1b", 2, 4)
    loaded = pipeir.load("pipeline { ranks = 1  microbatches = 1 }\n"
                         "schedule s { rank r { F(0, 0) B(0, 0) } }")
    return [
        (lambda: pipeir.verify(loaded), TypeError,  # type: ignore[arg-type]
         "verify: expected a Schedule, got Elaborated: give its .schedule"),
        (lambda: pipeir.simulate(pipeir.compile(s)), TypeError,  # type: ignore[arg-type]
         "simulate: expected a Schedule, got Compiled: give its .schedule"),
        (lambda: pipeir.print_schedule(pipeir.simulate(s)), TypeError,  # type: ignore[arg-type]
         "print_schedule: expected a Schedule, got SimResult"),
        (lambda: pipeir.simulate("1f1b"), TypeError,  # type: ignore[arg-type]
         "simulate: expected a Schedule, got str: read a .sched file or text with "
         "pipeir.parse(...)"),
        (lambda: pipeir.print_schedule(None), TypeError,  # type: ignore[arg-type]
         "print_schedule: expected a Schedule, got NoneType"),
        (lambda: PassManager([SplitBackward()]).run(loaded), TypeError,  # type: ignore[arg-type]
         "PassManager: expected a Schedule, got Elaborated"),
        (lambda: pipeir.simulate(s, {"F": 1}), TypeError,  # type: ignore[arg-type]
         "simulate(costs=...): expected a CostModel, got dict: make one of settings with "
         "CostModel.from_settings({...})"),
        (lambda: pipeir.compile(s, costs="costs.toml"), TypeError,  # type: ignore[arg-type]
         "pipeir.compile(costs=...): expected a CostModel, got str: read a costs file with "
         "CostModel.load(path)"),
        (lambda: pipeir.verify(s, sizes={"F": 1}), TypeError,  # type: ignore[arg-type]
         "verify(sizes=...): expected a CostModel (its activation sizes), got dict"),
        (lambda: PassContext(costs={"F": 1}), TypeError,  # type: ignore[arg-type]
         "PassContext(costs=...): expected a CostModel, got dict"),
        (lambda: pipeir.compile(s, ["split-backward"]), TypeError,  # type: ignore[list-item]
         "expected a pass, got str 'split-backward': a pipeline is one string of passes"),
        (lambda: pipeir.compile(s, [SplitBackward]), TypeError,  # type: ignore[list-item]
         "give an instance, SplitBackward()"),
        (lambda: pipeir.compile(s, SplitBackward()), TypeError,  # type: ignore[arg-type]
         "expected a list of passes, got SplitBackward SplitBackward(mode='h1'): put it in a "
         "list"),
        (lambda: PassManager("split-backward"), TypeError,  # type: ignore[arg-type]
         "PassManager takes passes, not a pipeline string: "
         "PassManager(parse_pipeline('split-backward'))"),
        (lambda: PassManager([], context=CostModel()), TypeError,  # type: ignore[arg-type]
         "PassManager(context=...): expected a PassContext, got CostModel: give costs as "
         "PassContext(costs=...)"),
        (lambda: pipeir.compile(s, [Recompute(all="false")]),  # type: ignore[arg-type]
         pipeir.UsageError, "option 'all' of pass 'recompute' must be True or False, got "
                            "'false'"),
        (lambda: pipeir.compile(s, [Reorder(by="time")]),  # type: ignore[arg-type]
         pipeir.UsageError, "option 'by' of pass 'reorder' must be one of cost, got 'time'"),
        (lambda: pipeir.compile(s, [Overlap(max_posted=True)]), pipeir.UsageError,
         "option 'max_posted' of pass 'overlap' must be an integer, got True"),
        (lambda: pipeir.compile(s, comm="async"),  # type: ignore[arg-type]
         pipeir.UsageError, "pipeir.compile(comm=...): expected one of overlapped, blocking"),
        (lambda: pipeir.compile(s, comm="blocking"), pipeir.UsageError,
         "give overlap=False for blocking programs"),
        (lambda: pipeir.compile(s, comm="overlapped", overlap=False), pipeir.UsageError,
         "pipeir.compile(comm='overlapped') plans for asynchronous communication, but "
         "overlap=False lowers to blocking programs: give comm='blocking', or leave comm out"),
        (lambda: pipeir.compile(s, overlap="no"), TypeError,  # type: ignore[arg-type]
         "pipeir.compile(overlap=...): expected True or False, got 'no'"),
        (lambda: s.program(-1), IndexError, "no rank -1: ranks are 0 to 1"),
        (lambda: s.rank_of(pipeir.F(5, 0)), KeyError,
         "F(5,0) is not an op of schedule 'one_f_one_b'"),
        (lambda: pipeir.compile(s, dp=True), pipeir.UsageError,
         "pipeir.compile(dp=...): expected a whole number of data-parallel replicas, at least "
         "1, got True"),
        (lambda: pipeir.F(0, 0.5), TypeError,  # type: ignore[arg-type]
         "F op: the micro-batch must be an integer, got float 0.5"),
        (lambda: pipeir.Op("X", 0, 0), ValueError,  # type: ignore[arg-type]
         "unknown op kind 'X'; the kinds are F, B, I, W, FC, RC, OFF, RELOAD, R"),
        (lambda: pipeir.Op("R", 0, 3), ValueError,
         "R(0) reduces every micro-batch of its stage: its mb is NO_MB (-1), not 3"),
        (lambda: CostModel(F=1e308), ValueError,
         "cost 'F' = 1e+308 is out of range: it must be at most 1e+15"),
        (lambda: CostModel(bandwidth=1e-300), ValueError,
         "bandwidth must be a positive number from 1e-15 to 1e+15, got 1e-300"),
        (lambda: CostModel(stage={0: 5}), ValueError,  # type: ignore[dict-item]
         "stage[0]: stage maps each stage to {kind: time}, e.g. {0: {'F': 2.0}}"),
        (lambda: CostModel(stage={"0": {"F": 5}}), ValueError,  # type: ignore[dict-item]
         "stage['0']: stage maps each stage to {kind: time}"),
        (lambda: CostModel(stage_mb={0: {"F": 1}}), ValueError,  # type: ignore[dict-item]
         "stage_mb[0]: stage_mb maps each (stage, micro-batch) to {kind: time}"),
        (lambda: CostModel(mb=None), ValueError,  # type: ignore[arg-type]
         "mb must map each micro-batch to {kind: time}, got None"),
        (lambda: CostModel(mb={0: {"memory_bytes": 2}}), ValueError,
         "mb[0]: 'memory_bytes' is a size per stage, the same for every micro-batch: give it "
         "in stage={S: {'memory_bytes': ...}}"),
        (lambda: CostModel(unit=5), ValueError,  # type: ignore[arg-type]
         'unit must be a name like "ms" (at most 16 characters, no quotes, spaces or '
         'backslashes), got 5'),
        (lambda: pipeir.verify(s, sizes=CostModel(), memory_limit_bytes=100),
         pipeir.UsageError, "memory_limit_bytes needs the activation sizes: a cost model with "
                            "memory_bytes"),
        (lambda: pipeir.verify(s, sizes=CostModel(memory_bytes=8),
                               memory_limit_bytes=float("nan")),
         pipeir.UsageError, "memory_limit_bytes must be a positive number of bytes, got nan"),
        (lambda: Schedule.from_programs(None, [[]]), TypeError,  # type: ignore[arg-type]
         "expected a PipelineConfig (PipelineConfig.make(ranks, microbatches, ...)), got "
         "NoneType"),
        (lambda: Schedule.from_programs(s.config, [pipeir.F(0, 0)]),  # type: ignore[list-item]
         TypeError, "programs: expected one list of ops per rank, got [Op(kind='F'"),
        (lambda: Schedule.from_programs(s.config, s.programs, name=3),  # type: ignore[arg-type]
         TypeError, "a schedule's name is a string, got 3"),
        (lambda: pipeir.ScheduleBuilder(s.config).add("0", pipeir.F(0, 0)),  # type: ignore[arg-type]
         TypeError, "F(0,0): a rank is an integer, got '0'"),
        (lambda: pipeir.PipelineConfig(2, 2, 2, "loop"),  # type: ignore[arg-type]
         pipeir.config.ConfigError, "placement is each stage's rank, e.g. (0, 1, 0, 1), got "
                                    "'loop' (PipelineConfig.make also takes 'loop' or 'vshape')"),
        (lambda: pipeir.parse(None), TypeError,  # type: ignore[arg-type]
         "expected a .sched file's path or its text, got NoneType"),
        (lambda: pipeir.library.get("1f1b", 4, 8, v=2), pipeir.UsageError,
         "library.get('1f1b', ...): v= is neither a parameter of 1f1b (it has none) nor a "
         "pipeline setting (stages, placement, memory_limit, accumulate)"),
        (lambda: pipeir.PipelineConfig(2, 2, 2, (0, "1")),  # type: ignore[arg-type]
         pipeir.config.ConfigError, "placement puts stage 1 on '1', which is not a rank (an "
                                    "integer)"),
        (lambda: pipeir.library.get(None, 4, 8), TypeError,  # type: ignore[arg-type]
         "a library schedule is named by a string, e.g. '1f1b', got None"),
        (lambda: Interleave(v=2).run("1f1b"), TypeError,  # type: ignore[arg-type]
         "interleave.run: expected a Schedule, got str: read a .sched file or text with "
         "pipeir.parse(...)"),
        (lambda: Reorder().run(s, CostModel()), TypeError,  # type: ignore[arg-type]
         "reorder.run(ctx=...): expected a PassContext, got CostModel: give "
         "PassContext(costs=...)"),
        (lambda: SplitBackward().run(pipeir.compile(s)), TypeError,  # type: ignore[arg-type]
         "split-backward.run: expected a Schedule, got Compiled: give its .schedule"),
        (lambda: Overlap().run(s), TypeError,  # type: ignore[arg-type]
         "overlap.run: expected lowered programs (a Lowered), got Schedule"),
        (lambda: Schedule.from_programs(s.config, s.programs,
                                        spans={pipeir.F(0, 0): 5}),  # type: ignore[dict-item]
         TypeError, "F(0,0)'s span: expected a pipeir.diagnostics.Span or None, got int 5"),
        (lambda: pipeir.parse("examples/1f1b.shed"), pipeir.UsageError,
         "examples/1f1b.shed: no such .sched file"),
        (lambda: pipeir.parse("1f1b"), pipeir.UsageError,
         "'1f1b' is a library schedule, not a file or text: pipeir.library.get('1f1b', ranks, "
         "microbatches)"),
        (lambda: plan(_LAYERS, True, 4), TypeError,
         "plan: ranks must be an integer, got bool True"),
        (lambda: plan(_LAYERS, 2, 4, splits="h1"), pipeir.UsageError,  # type: ignore[arg-type]
         "plan(splits=...): a list of None, h1, h2, got 'h1'"),
        (lambda: plan(_LAYERS, 2, 4, comms=("async",)), pipeir.UsageError,
         "plan(comms=...): a list of overlapped, blocking, got ('async',)"),
        (lambda: tune_search(CostModel(), 2, []), pipeir.UsageError,
         "tune's search(microbatches=...): a list of micro-batch counts, got []"),
        (lambda: plan(_LAYERS, 2, 4, link=(0, 1)), TypeError,  # type: ignore[arg-type]
         "plan(link=...): expected a Link (pipeir.plan.Link(latency, bandwidth)), got tuple"),
        (lambda: plan([{"F": 1}] * 4, 2, 4), TypeError,  # type: ignore[list-item]
         "plan: layers are LayerCost objects (pipeir.plan.LayerCost, or what profile "
         "measures), got dict"),
        (lambda: CostModel.from_settings(None), TypeError,  # type: ignore[arg-type]
         "CostModel.from_settings: expected a mapping of settings, e.g. {'F': 1.0, "
         "'stage.0.B': 3.0}, got NoneType"),
        (lambda: CostModel.load(None), TypeError,  # type: ignore[arg-type]
         "expected the path of a cost file (JSON or TOML), got NoneType"),
        (lambda: load_csv(None), TypeError,  # type: ignore[arg-type]
         "expected the path of a torch schedule CSV, got NoneType"),
        (lambda: parse_action(None), TypeError,  # type: ignore[arg-type]
         "parse_action: expected an action's text such as '0F1', got NoneType"),
        (lambda: prove_comms(s), TypeError,  # type: ignore[arg-type]
         "prove_comms: expected an imported torch CSV (what load_csv or loads_csv returns), "
         "got Schedule; for a schedule, pipeir.compile proves its programs"),
        (lambda: compute_actions("x"), TypeError,  # type: ignore[arg-type]
         "compute_actions: expected a Schedule, got str"),
        (lambda: from_torch_actions([["0F0\n1F0"]]), pipeir.UsageError,
         "rank 0's action '0F0\\n1F0' holds a comma or a line break: give one action per "
         "item"),
        (lambda: resolve(None), TypeError,  # type: ignore[arg-type]
         "a model reference is a string (a built-in name, 'file.py:fn' or 'module:fn'), got "
         "NoneType"),
        (lambda: resolve("transformer@"), pipeir.UsageError,
         "model 'transformer@' names no split point after '@': give transformer@POINT,POINT..., "
         "or transformer alone"),
        (lambda: PassManager(None), TypeError,  # type: ignore[arg-type]
         "expected a list of passes, got NoneType"),
        (lambda: PassManager([], verify_each="no"), TypeError,  # type: ignore[arg-type]
         "PassManager(verify_each=...): expected True or False, got 'no'"),
        (lambda: PassManager([], instruments=[print]), TypeError,  # type: ignore[list-item]
         "PassManager(instruments=...): expected Instrument objects"),
        (lambda: parse_pipeline(None), TypeError,  # type: ignore[arg-type]
         "parse_pipeline: expected a pipeline string such as 'split-backward,overlap', got "
         "NoneType"),
        (lambda: parse_pipeline("x", extra={"x": SplitBackward()}),  # type: ignore[dict-item]
         TypeError, "parse_pipeline(extra=...): 'x' must name a pass class"),
        (lambda: pipeir.print_schedule(s, CostModel()), TypeError,  # type: ignore[arg-type]
         "print_schedule(costs=...): expected a costs block's settings, e.g. {'F': 1, 'B': 2}, "
         "got CostModel"),
        (lambda: pipeir.print_schedule(s, {"bogus": 2}), pipeir.UsageError,
         "print_schedule(costs=...): unknown cost 'bogus'"),
        (lambda: steady_state(pipeir.parse(str(REPO / "tests/errors/deadlock.sched")),
                              CostModel()),
         pipeir.VerifyError, "deadlock: rank 0 waits at B(0,0) (line 6) for B(1,0) on rank 1"),
        (lambda: pipeir.torch_schedule(pipeir.split(torch.nn.Sequential(
            torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)), ["1"]), "1f1b", n_microbatches=2),
         pipeir.UsageError, "torch_schedule: expected torch's PipelineStage objects, got "
                            "Sequential: wrap each of this rank's chunks as "
                            "PipelineStage(chunk, stage_index, num_stages, device)"),
        (lambda: synth(CostModel(), 2, 4, objective="speed"),  # type: ignore[arg-type]
         pipeir.UsageError, "synth: objective must be one of makespan, steady, got 'speed'"),
        (lambda: synth(CostModel(), 2, 4, v=0), pipeir.UsageError,
         "synth: v (chunks per rank) must be a positive integer, got 0"),
        (lambda: format_lowered(pipeir.compile(s)), TypeError,  # type: ignore[arg-type]
         "format_lowered: expected lowered programs (a Lowered), got Compiled: give its "
         ".lowered"),
        (lambda: dumps(s), TypeError,  # type: ignore[arg-type]
         "dumps: expected lowered programs (a Lowered), got Schedule"),
        (lambda: loads_csv(Path("a.csv")), TypeError,  # type: ignore[arg-type]
         "loads_csv reads a CSV's text; for a file, load_csv(path) (got PosixPath('a.csv'))"),
        (lambda: loads_csv("zbv.csv"), pipeir.UsageError,
         "loads_csv reads a CSV's text, and 'zbv.csv' looks like a file's name: "
         "load_csv(path) reads a file"),
        (lambda: causal_lm(torch.nn.Identity, vocab=16, microbatches=0), pipeir.UsageError,
         "causal_lm: microbatches must be a positive integer, got 0"),
        (lambda: _instantiate(pipeir.compile(s), 2, 4, 2), TypeError,  # type: ignore[arg-type]
         "torch_schedule: expected a Schedule, got Compiled: give its .schedule"),
        (lambda: _instantiate("zbv.csv", 2, 4, 2), pipeir.UsageError,
         "torch_schedule: 'zbv.csv' is a torch schedule CSV; read it with "
         "pipeir.interop.load_csv(path) and give its .schedule"),
        (lambda: tune_search(CostModel(), 2, 4), pipeir.UsageError,  # type: ignore[arg-type]
         "tune's search(microbatches=...): a list of micro-batch counts, got 4"),
        (lambda: tune_search(CostModel(), 2, [4], splits="whole"), pipeir.UsageError,
         "tune's search(splits=...): a list of None, h1, h2, got 'whole'"),
        (lambda: steady(s), TypeError,  # type: ignore[arg-type]
         "steady: expected what simulate returns (a SimResult), got Schedule; for a schedule: "
         "steady_state(schedule, costs)"),
        (lambda: steady(pipeir.compile(s)), TypeError,  # type: ignore[arg-type]
         "steady: expected what simulate returns (a SimResult), got Compiled"),
        (lambda: render_timeline(s), TypeError,  # type: ignore[arg-type]
         "render_timeline: expected what simulate returns (a SimResult), got Schedule; "
         "simulate it first: pipeir.simulate(schedule, costs)"),
        (lambda: chrome_trace(s), TypeError,  # type: ignore[arg-type]
         "chrome_trace: expected what simulate returns (a SimResult), got Schedule"),
        (lambda: render_gantt("r.png"), TypeError,  # type: ignore[arg-type]
         "render_gantt: expected what simulate returns (a SimResult), got str"),
        (lambda: from_torch_actions("0F0,0B0"), TypeError,  # type: ignore[arg-type]
         "from_torch_actions takes each rank's actions (a dict rank -> actions, or a list per "
         "rank), got str; for a CSV's text, loads_csv(text); for a file, load_csv(path)"),
        (lambda: from_torch_actions(["0F0,0B0", "1F0"]), TypeError,
         "from_torch_actions: rank 0's actions must be a list of torch actions (or their "
         "strings), got str '0F0,0B0'"),
        (lambda: from_torch_actions({0: None}), TypeError,  # type: ignore[dict-item]
         "from_torch_actions: rank 0's actions must be a list of torch actions (or their "
         "strings), got NoneType None"),
        (lambda: driver.load_schedules("a.sched"), TypeError,  # type: ignore[arg-type]
         "load_schedules: expected a ScheduleRef, got str: ScheduleRef(files=('a.sched',)) "
         "names a file"),
        (lambda: CostModel().cost("F"), TypeError,  # type: ignore[arg-type]
         "CostModel.cost: expected an op (e.g. pipeir.F(0, 0)), got str 'F'"),
        (lambda: ScheduleRef(files="a.sched"), TypeError,  # type: ignore[arg-type]
         "ScheduleRef(files=...): expected a tuple of files, got str: "
         "ScheduleRef(files=('a.sched',))"),
    ]


@pytest.mark.parametrize("case", range(len(_api_mistakes())))
def test_the_api_names_a_mistaken_argument_where_it_is_given(case: int) -> None:
    """A wrong argument to the Python API fails at the call with what was wrong and how to
    do it right, not as an AttributeError (or a silently wrong result) deep inside."""
    call, kind, message = _api_mistakes()[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (passes planned without costs warn)
        with pytest.raises(kind) as e:
            call()
    text = e.value.diagnostics[0].message if isinstance(e.value, pipeir.PipeirError) \
        else str(e.value)
    assert text.startswith(message) or message in text, text


def test_a_cost_model_holds_its_own_checked_copy_of_plain_numbers() -> None:
    """Edited after it is made, a caller's dict once gave a checked model a negative cost;
    numpy's int64 was refused where its float64 was taken; and the model had no hash."""
    np = pytest.importorskip("numpy")
    levels = {0: {"F": 5.0}}
    costs = CostModel(stage=levels, F=np.int64(2), mb={1: {"B": np.int64(3)}})
    levels[0]["F"] = -7.0
    assert costs.cost(pipeir.F(0, 0)) == 5.0 and costs.stage == {0: {"F": 5.0}}
    assert type(costs.F) is int and type(costs.mb[1]["B"]) is int
    assert costs == CostModel(stage={0: {"F": 5.0}}, F=2, mb={1: {"B": 3}})
    assert hash(costs) == hash(CostModel(stage={0: {"F": 5.0}}, F=2, mb={1: {"B": 3}}))
    assert costs != CostModel(stage={0: {"F": 6.0}}, F=2, mb={1: {"B": 3}})


def test_numpy_integers_make_plain_ops_ranks_and_configs() -> None:
    np = pytest.importorskip("numpy")
    op = pipeir.F(np.int64(1), np.int32(2))
    assert op == pipeir.F(1, 2) and type(op.stage) is int and type(op.mb) is int
    assert hash(op) == hash(pipeir.F(1, 2))
    cfg = pipeir.PipelineConfig(2, 2, 2, [0, 1])  # type: ignore[arg-type]
    placed = pipeir.PipelineConfig(2, 2, 2, (0, np.int64(1)))  # (numpy's ranks too)
    assert placed == cfg and all(type(r) is int for r in placed.placement)
    s = pipeir.library.get("1f1b", 2, 4)
    assert pipeir.verify(s, memory_limit=np.int64(5)) == pipeir.verify(s, memory_limit=5)
    assert cfg == pipeir.PipelineConfig.make(2, 2) and hash(cfg) == hash(
        pipeir.PipelineConfig.make(2, 2))
    b = pipeir.ScheduleBuilder(cfg)
    b.add(np.int64(1), pipeir.F(1, 0))  # type: ignore[arg-type]
    assert b.build().programs == ((), (pipeir.F(1, 0),))
