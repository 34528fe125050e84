"""The pass infrastructure: pipeline strings, the registry, plugins, the pass manager and its
instruments, and the `opt` / `passes` commands, including every kind of bad input."""

from __future__ import annotations

import importlib.metadata
from dataclasses import InitVar, dataclass
from pathlib import Path
from typing import ClassVar

import pytest

import pipeir
from pipeir.passes import (
    Pass,
    PassContext,
    PassManager,
    Pipeline,
    TimePasses,
    load_plugin,
    parse_pipeline,
)
from pipeir.passes.interleave import Interleave
from pipeir.passes.split_backward import SplitBackward
from pipeir.passes.verify import Verify

REPO = Path(__file__).parent.parent
PLUGIN = REPO / "examples" / "plugin" / "pipeir_delay_w.py"
LIB = ("--schedule", "1f1b", "--ranks", "2", "--microbatches", "4")

# A pass that breaks a dependency: rank 0 runs its first backward before its first forward.
BROKEN = '''
from dataclasses import dataclass
from typing import ClassVar
from pipeir.passes import LoweredPass, Pass

@dataclass(frozen=True)
class BreakDeps(Pass):
    name: ClassVar[str] = "break-deps"
    summary: ClassVar[str] = "test pass that runs a backward before its forward"
    def run(self, schedule, ctx=None):
        progs = [list(p) for p in schedule.programs]
        first_b = next(op for op in progs[0] if op.kind in ("B", "I"))
        progs[0].remove(first_b)
        progs[0].insert(0, first_b)
        return schedule.with_programs(progs)

@dataclass(frozen=True)
class ReturnsNone(Pass):
    name: ClassVar[str] = "returns-none"
    summary: ClassVar[str] = "test pass that forgets to return"
    def run(self, schedule, ctx=None):
        return None

@dataclass(frozen=True)
class Lowered(LoweredPass):
    name: ClassVar[str] = "lowered-only"
    summary: ClassVar[str] = "test pass at the lowered level"

class NotAPass:
    name = "not-a-pass"
'''


@pytest.fixture
def broken(tmp_path: Path) -> Path:
    path = tmp_path / "broken_passes.py"
    path.write_text(BROKEN, encoding="utf-8")
    return path


# ---- options given in Python ----------------------------------------------------------------
@dataclass(frozen=True)
class _Checked(Pass):
    """A user's pass with its own range check, which does not call the base's."""

    name: ClassVar[str] = "checked"
    summary: ClassVar[str] = "a range check of its own"
    depth: int = 1

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError("depth must be at least 1")


def _made(kind: str, **options: object) -> object:
    from pipeir.passes.memory import Recompute
    from pipeir.passes.merge_backward import MergeBackward
    from pipeir.passes.reorder import Reorder
    cls = {"recompute": Recompute, "merge-backward": MergeBackward, "reorder": Reorder,
           "checked": _Checked}[kind]
    return cls(**options)


@pytest.mark.parametrize(("kind", "options", "message"), [
    ("recompute", {"budget": 4, "all": "false"},
     "option 'all' of pass 'recompute' must be True or False, got 'false'"),
    ("merge-backward", {"adjacent_only": "no"},
     "option 'adjacent_only' of pass 'merge-backward' must be True or False, got 'no'"),
    ("reorder", {"by": "x"}, "option 'by' of pass 'reorder' must be one of cost, got 'x'"),
    ("reorder", {"seed": None}, "option 'seed' of pass 'reorder' must be an integer, got None"),
    ("reorder", {"budget_ms": "5"},
     "option 'budget_ms' of pass 'reorder' must be an integer, got '5'"),
    ("recompute", {"budget": "2"},
     "option 'budget' of pass 'recompute' must be a finite number, got '2'"),
    ("checked", {"depth": "2"}, "option 'depth' of pass 'checked' must be an integer, got '2'"),
])
def test_a_pass_made_in_python_is_held_to_its_option_types_as_it_is_made(
        kind: str, options: dict[str, object], message: str) -> None:
    """Not only when it joins a pipeline: `Recompute(all="false").run(schedule)` recomputed
    every forward (a true string), and `Reorder(budget_ms="5")` failed comparing a string in
    its own range check. A pass's own `__post_init__` runs after the type checks even when it
    does not call the base's."""
    with pytest.raises(pipeir.UsageError) as e:
        _made(kind, **options)
    assert e.value.diagnostics[0].message == message


def test_the_checks_around_a_pass_keep_what_a_pass_may_do() -> None:
    """The type checks wrap a pass's own `__post_init__` and `run`; they must not change what
    a valid pass or call does: its own checks (after the types), InitVars, keyword calls,
    `super().run` in a subclass, a pass class without a name, numpy's numbers."""
    np = pytest.importorskip("numpy")
    from pipeir.passes.reorder import Reorder

    assert _Checked(depth=2).depth == 2
    with pytest.raises(ValueError, match="depth must be at least 1"):
        _Checked(depth=0)

    @dataclass(frozen=True)
    class WithInit(Pass):
        name: ClassVar[str] = "with-init"
        summary: ClassVar[str] = "an InitVar"
        extra: InitVar[int] = 0

        def __post_init__(self, extra: int) -> None:
            if extra < 0:
                raise ValueError("extra must be >= 0")

        def run(self, schedule: pipeir.Schedule, ctx: object = None) -> pipeir.Schedule:
            return schedule

    @dataclass(frozen=True)
    class Nameless(Pass):
        summary: ClassVar[str] = "no name"

        def run(self, schedule: pipeir.Schedule, ctx: object = None) -> pipeir.Schedule:
            return schedule

    @dataclass(frozen=True)
    class Sub(Reorder):
        def run(self, schedule: pipeir.Schedule, ctx: PassContext | None = None
                ) -> pipeir.Schedule:
            return super().run(schedule, ctx)

    s = pipeir.library.get("1f1b", 2, 4)
    ctx = PassContext()
    assert WithInit(extra=2).run(s) is s and Nameless().run(schedule=s) is s
    with pytest.raises(ValueError, match="extra must be >= 0"):
        WithInit(extra=-1)
    assert Reorder().run(schedule=s, ctx=ctx) == Reorder().run(s, ctx) == Sub().run(s, ctx)
    with pytest.raises(TypeError, match=r"^Nameless\.run: expected a Schedule, got str"):
        Nameless().run("1f1b")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^reorder\.run\(ctx=\.\.\.\): expected a PassContext"):
        Reorder().run(schedule=s, ctx="x")  # type: ignore[arg-type]
    made = Reorder(budget_ms=np.int64(5))
    assert type(made.budget_ms) is int and str(made) == "reorder{budget_ms=5}"
    assert Verify(memory_limit=np.float64(3.5)) == Verify(3.5)
    with pytest.raises(pipeir.UsageError, match="out of range: at most 9,223,372,036,854,775,807"):
        Verify(memory_limit=10**400)


def test_a_pass_class_without_a_name_is_named_when_it_joins_a_pipeline() -> None:
    @dataclass(frozen=True)
    class NoName(Pass):
        summary: ClassVar[str] = "nameless"

    with pytest.raises(TypeError, match=r"pass class NoName has no name: give it one, e\.g\. "
                                        r"name: ClassVar\[str\] = \"my-pass\""):
        PassManager([NoName()])


@pytest.mark.parametrize(("ranks", "mbs", "accumulate", "changed"), [
    (2, 8, 1, "the ranks from 4 to 2"),
    (4, 4, 1, "the micro-batches from 8 to 4"),
    (4, 8, 3, "the accumulation rounds from 1 to 3"),
])
def test_a_pass_that_changes_the_pipelines_shape_is_refused(ranks: int, mbs: int,
                                                             accumulate: int, changed: str) -> None:
    """A user's pass that returns a schedule of other ranks, micro-batches or rounds compiled
    to programs doing other work than the command asked for (2 programs for 4 ranks)."""
    @dataclass(frozen=True)
    class Reshape(Pass):
        name: ClassVar[str] = "reshape"
        summary: ClassVar[str] = "returns another pipeline's schedule"

        def run(self, schedule: pipeir.Schedule, ctx: object = None) -> pipeir.Schedule:
            return pipeir.library.get("1f1b", ranks, mbs, accumulate=accumulate)

    with pytest.raises(pipeir.VerifyError) as e:
        pipeir.compile(pipeir.library.get("1f1b", 4, 8), [Reshape()])
    assert e.value.diagnostics[0].message.startswith(f"pass 'reshape' changed {changed}: ")


# ---- pipeline strings ------------------------------------------------------------------------
def test_pipeline_string_gives_typed_instances() -> None:
    pipe = parse_pipeline(" interleave{v=3, placement=vshape} , split-backward{mode=h2},verify")
    assert pipe.passes == (Interleave(v=3, placement="vshape"), SplitBackward(mode="h2"),
                           Verify())
    assert str(pipe) == "interleave{v=3,placement=vshape},split-backward{mode=h2},verify"
    assert parse_pipeline(str(pipe)).passes == pipe.passes
    assert pipe.spans[1] is not None and pipe.spans[1].col == 38
    assert parse_pipeline("verify{memory_limit=none}").passes == (Verify(None),)
    # (counts may be fractional, as `check` takes them; a whole number stays as written)
    assert parse_pipeline("verify{memory_limit=3.5}").passes == (Verify(3.5),)
    assert str(parse_pipeline("verify{memory_limit=3},recompute{budget=2}")) == \
        "verify{memory_limit=3},recompute{budget=2}"
    assert parse_pipeline("verify{memory_limit=99999999999999999999}").passes == (Verify(1e20),)
    assert parse_pipeline("merge-backward{adjacent_only=true}").passes[0].options() == {
        "adjacent_only": True}


BAD_PIPELINES = [
    ("interleav", 1, "unknown pass 'interleav'", "did you mean 'interleave'?"),
    ("verify,split-backwrd", 8, "unknown pass 'split-backwrd'", "did you mean"),
    ("interleave{v=x}", 14, "option 'v' of pass 'interleave' must be an integer, got 'x'", ""),
    ("interleave{w=2}", 12, "pass 'interleave' has no option 'w' (options: v, placement)", ""),
    ("interleave{v=2", 11, "unclosed '{': expected '}'", ""),
    ("interleave{v=2,v=3}", 16, "option 'v' of pass 'interleave' is given twice", ""),
    ("interleave{v=0}", 14, "v (chunks per rank) must be a positive integer, got 0", ""),
    ("interleave{placement=ring}", 22,
     "option 'placement' of pass 'interleave' must be one of loop, vshape, got 'ring'", ""),
    ("split-backward{mode=h3}", 21, "must be one of h1, h2, got 'h3'", ""),
    ("merge-backward{adjacent_only=maybe}", 30, "must be true or false, got 'maybe'", ""),
    ("recompute{budget=1e400}", 18,
     "option 'budget' of pass 'recompute' must be a finite number, got '1e400'", ""),
    ("recompute{budget=nan}", 18, "must be a finite number, got 'nan'", ""),
    ("reorder{budget_ms=99999999999999999999999}", 19,
     "option 'budget_ms' of pass 'reorder' is out of range: integers are 64-bit", ""),
    ("verify{memory_limit=0}", 21, "memory_limit must be a positive number, got 0", ""),
    ("verify{memory_limit=\u0663}", 21, "must be a number, got '\u0663'", ""),
    ("reorder{seed=\u0663}", 14, "must be an integer, got '\u0663'", ""),
    ("verify,", 7, "expected a pass name after ','", ""),
    ("verify;interleave", 7, "expected ',' between passes, found ';'", ""),
    ("interleave{v}", 12, "expected '=' and a value after option 'v'", ""),
    ("interleave{v=}", 14, "expected a value for option 'v'", ""),
    ("interleave{v=2,}", 16, "expected an option after ','", ""),
    ("", 1, "empty pipeline", ""),
]


@pytest.mark.parametrize(("spec", "col", "message", "note"), BAD_PIPELINES)
def test_bad_pipeline_strings_point_into_the_string(spec: str, col: int, message: str,
                                                    note: str) -> None:
    with pytest.raises(pipeir.UsageError) as e:
        parse_pipeline(spec)
    d = e.value.diagnostics[0]
    assert message in d.message
    assert d.span is not None and (d.span.file, d.span.line, d.span.col) == ("<passes>", 1, col)
    if note:
        assert any(note in n.message for n in d.notes)
    assert e.value.exit_code == 2


def test_bad_pipeline_on_the_command_line_is_rendered_with_a_caret(cli) -> None:
    code, out, err = cli("opt", *LIB, "--passes", "interleave{v=2},split-backward{mode=h3}")
    assert code == 2 and out == ""
    assert err.splitlines()[:3] == [
        "<passes>:1:37: error: option 'mode' of pass 'split-backward' must be one of h1, h2, "
        "got 'h3'",
        "    interleave{v=2},split-backward{mode=h3}",
        "                                        ^^"]
    assert "Traceback" not in err


# ---- plugins and the registry ----------------------------------------------------------------
def test_registry_lists_builtins_and_loads_them_lazily() -> None:
    from pipeir.passes import registry

    assert {"interleave", "split-backward", "merge-backward", "verify"} <= set(registry.names())
    assert registry.get("split-backward") is SplitBackward
    with pytest.raises(pipeir.UsageError, match="unknown pass 'nope'"):
        registry.get("nope")


def test_plugin_from_a_file_runs_in_a_pipeline(cli) -> None:
    cls = load_plugin(f"{PLUGIN}:DelayW")
    s = pipeir.library.get("1f1b", 3, 6)
    out = PassManager(parse_pipeline("split-backward,delay-w", {cls.name: cls})).run(s)
    for prog in out.programs:  # every W moved behind every other op
        kinds = [op.kind for op in prog]
        assert kinds[kinds.index("W"):] == ["W"] * 6
    code, text, err = cli("opt", *LIB, "--pass-plugin", f"{PLUGIN}:DelayW",
                          "--passes", "split-backward,delay-w{max_pending=1}")
    assert code == 0, err
    assert pipeir.parse(text).program(0)[-1] == pipeir.W(0, 3)


@pytest.mark.parametrize(("spec", "message"), [
    ("no_colon_here", "expected module:Class or file.py:Class"),
    ("missing_file.py:X", "no such file missing_file.py"),
    ("pipeir.ops:Op", "is not a Pass (or LoweredPass) subclass"),
    ("pipeir.no_such_module:X", "cannot import pipeir.no_such_module"),
    ("pipeir.passes.interleave:Nope", "has no attribute 'Nope'"),
])
def test_bad_plugin_specs_are_usage_errors(cli, spec: str, message: str) -> None:
    code, _, err = cli("opt", *LIB, "--pass-plugin", spec, "--passes", "verify")
    assert code == 2 and message in err and "Traceback" not in err


def test_plugin_file_that_fails_to_import(cli, tmp_path: Path) -> None:
    bad = tmp_path / "bad_plugin.py"
    bad.write_text("raise RuntimeError('boom')\n", encoding="utf-8")
    code, _, err = cli("opt", *LIB, "--pass-plugin", f"{bad}:X", "--passes", "verify")
    assert code == 1 and f"RuntimeError: boom at {bad}:1 while importing {bad}" in err
    assert "Traceback" not in err


def test_installed_plugin_is_found_through_its_entry_point(cli) -> None:
    eps = {ep.name for ep in importlib.metadata.entry_points(group="pipeir.passes")}
    if "delay-w" not in eps:
        pytest.skip("examples/plugin is not installed (pip install -e examples/plugin)")
    code, out, _ = cli("passes")
    assert code == 0 and "delay-w{max_pending: int = 0}" in out
    code, _, err = cli("opt", *LIB, "--passes", "split-backward,delay-w")
    assert code == 0, err


# ---- the pass manager ------------------------------------------------------------------------
def test_verify_each_blames_the_pass_that_broke_the_schedule(cli, broken: Path) -> None:
    code, out, err = cli("opt", *LIB, "--pass-plugin", f"{broken}:BreakDeps",
                         "--passes", "split-backward,break-deps,verify")
    assert code == 1 and out == ""
    first = err.splitlines()[0]
    assert first.startswith("error: after split-backward, break-deps: deadlock: rank 0 ")
    assert ("<passes>:1:16: note: pass 2 of 3, 'break-deps', produced an invalid schedule "
            "from a valid one") in err


def test_broken_pass_in_python_raises_verify_error(broken: Path) -> None:
    cls = load_plugin(f"{broken}:BreakDeps")
    s = pipeir.library.get("gpipe", 2, 2)
    with pytest.raises(pipeir.VerifyError) as e:
        PassManager([Interleave(v=2), cls()]).run(s)
    assert e.value.check == "deadlock"
    assert e.value.message.startswith("after interleave, break-deps: deadlock")


def test_no_verify_each_lets_a_broken_schedule_through_to_check(cli, broken: Path,
                                                                tmp_path: Path) -> None:
    out_file = tmp_path / "broken.sched"
    code, _, err = cli("opt", *LIB, "--pass-plugin", f"{broken}:BreakDeps", "--passes",
                       "break-deps", "--no-verify-each", "-o", out_file)
    assert code == 0, err
    code, _, err = cli("check", out_file)
    assert code == 1 and "deadlock" in err


def test_invalid_input_is_reported_before_any_pass(cli, tmp_path: Path) -> None:
    bad = tmp_path / "incomplete.sched"
    bad.write_text("pipeline { ranks = 1  microbatches = 2 }\n"
                   "schedule s { rank 0 { F(0,0) B(0,0) F(0,1) } }\n", encoding="utf-8")
    code, _, err = cli("opt", bad, "--passes", "split-backward")
    assert code == 1
    assert "the input schedule is invalid, before any pass ran: missing B(0,1)" in err


def test_pass_rejecting_its_input_is_named(cli) -> None:
    code, _, err = cli("opt", *LIB, "--passes", "split-backward,interleave{v=2}")
    assert code == 2
    assert err.startswith("error: in interleave after split-backward: the input has split "
                          "backwards (I and W)")
    assert "note: pass 2 of 2, 'interleave', rejected its input" in err


def test_pass_returning_garbage_and_lowered_passes(cli, broken: Path) -> None:
    code, _, err = cli("opt", *LIB, "--pass-plugin", f"{broken}:ReturnsNone",
                       "--passes", "returns-none")
    assert code == 1 and "pass 'returns-none' returned NoneType, not a Schedule" in err
    code, _, err = cli("opt", *LIB, "--pass-plugin", f"{broken}:Lowered",
                       "--passes", "verify,lowered-only")
    assert code == 2 and "<passes>:1:8: error: pass 'lowered-only' works on lowered" in err
    code, _, err = cli("opt", *LIB, "--pass-plugin", f"{broken}:NotAPass", "--passes", "verify")
    assert code == 2 and "is not a Pass (or LoweredPass) subclass" in err


def test_time_passes_instrument_records_every_pass() -> None:
    timer = TimePasses()
    s = pipeir.library.get("1f1b", 2, 4)
    PassManager(Pipeline.of([SplitBackward(), Verify()]), instruments=[timer]).run(s)
    assert [name for name, _, _ in timer.rows] == ["split-backward", "verify"]
    assert timer.report().splitlines()[-1].startswith("total")


# ---- the opt command and its instruments -----------------------------------------------------
def test_opt_output_is_accepted_by_check_and_reparses_equal(cli, tmp_path: Path) -> None:
    out_file = tmp_path / "out.sched"
    code, out, err = cli("opt", REPO / "examples" / "1f1b.sched", "--passes",
                         "interleave{v=2},split-backward{mode=h2}", "-o", out_file)
    assert (code, out, err) == (0, f"wrote {out_file} (pipeirc simulate {out_file})\n", "")
    expected = PassManager(parse_pipeline("interleave{v=2},split-backward{mode=h2}")).run(
        pipeir.parse(REPO / "examples" / "1f1b.sched"))
    assert pipeir.parse(out_file) == expected
    code, out, _ = cli("check", out_file)
    assert code == 0 and "8 stages" in out


def test_passes_after_interleave_plan_with_each_chunks_costs(cli, tmp_path: Path) -> None:
    # heavy-ends: stage 0 embeds, stage 3 has the head. After interleave{v=2} the 8 stages are
    # halves of those 4 (stage 6 and 7 of the head's), not 8 new stages with stage 0 and 3
    # heavy; the oracle is the closed form: 1/v of each stage's times on each of its chunks
    from pipeir.ops import Op
    from pipeir.sim import CostModel, simulate

    costs = REPO / "examples" / "costs" / "heavy-ends.toml"
    file_costs = CostModel.load(costs)
    inter, synth = tmp_path / "inter.sched", tmp_path / "synth.sched"
    args = ("opt", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "4", "--costs", costs)
    assert cli(*args, "--passes", "interleave{v=2}", "-o", inter)[0] == 0
    chunks = CostModel.from_settings(pipeir.load(inter).costs)
    for s in range(8):
        for kind in ("F", "W"):
            assert chunks.cost(Op(kind, s, 0)) == file_costs.cost(Op(kind, s // 2, 0)) / 2
    # a costed pass after it plans with those costs, and the file simulates as it planned:
    # synth never returns a slower order than its input
    code, _, err = cli(*args, "--passes", "interleave{v=2},synth{time_limit=2}", "-o", synth)
    assert code == 0, err
    step = simulate(pipeir.load(synth).schedule, chunks).makespan
    assert step <= simulate(pipeir.load(inter).schedule, chunks).makespan
    assert step == simulate(pipeir.load(synth).schedule,
                            CostModel.from_settings(pipeir.load(synth).costs)).makespan


def test_dump_dir_writes_numbered_canonical_files(cli, tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    code, final, err = cli("opt", *LIB, "--passes", "interleave{v=2},split-backward,verify",
                           "--dump-dir", dump)
    assert code == 0, err
    names = sorted(p.name for p in dump.iterdir())
    assert names == ["00-input.sched", "01-interleave.sched", "02-split-backward.sched",
                     "03-verify.sched"]
    assert pipeir.parse(dump / "00-input.sched") == pipeir.library.get("1f1b", 2, 4)
    assert pipeir.parse(dump / "01-interleave.sched") == pipeir.library.get(
        "interleaved-1f1b", 2, 4, v=2)
    assert (dump / "03-verify.sched").read_text(encoding="utf-8") == final


def test_every_dumped_file_simulates_as_the_passes_planned(cli, tmp_path: Path) -> None:
    """Each file carries the costs its schedule is planned under: after interleave, the
    chunks' (1/2 of a stage's); closed forms at p = 4, m = 8 with F = 1, B = 2: 1F1B
    (m + p - 1)(F + B) = 33, interleaved (v*m + p - 1)(F + B)/v = 28.5, and split backward
    with W filling the bubble 25.5 (simulate's own figure, as the README's table)."""
    from pipeir.sim import CostModel, simulate

    dump = tmp_path / "dump"
    code, _, err = cli("opt", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8",
                       "--passes", "interleave{v=2},split-backward", "--dump-dir", dump)
    assert code == 0, err
    steps = []
    for name in ("00-input", "01-interleave", "02-split-backward"):
        loaded = pipeir.load(dump / f"{name}.sched")
        steps.append(simulate(loaded.schedule, CostModel.from_settings(loaded.costs)).makespan)
    assert steps == [pytest.approx(33), pytest.approx(28.5), pytest.approx(25.5)]


def test_opt_without_costs_writes_the_default_costs_cut_into_chunks(cli, tmp_path: Path
                                                                     ) -> None:
    """Interleaving 1F1B with no costs given plans with the defaults (F = 1, B = 2) halved per
    chunk; the file must simulate to the closed form (v*m + p - 1) * (F + B) / v, not to
    whole-stage chunks (57 at p = 4, m = 8)."""
    from pipeir.sim import CostModel, simulate

    out = tmp_path / "i.sched"
    code, _, err = cli("opt", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8",
                       "--passes", "interleave{v=2}", "-o", out)
    assert code == 0, err
    loaded = pipeir.load(out)
    step = simulate(loaded.schedule, CostModel.from_settings(loaded.costs)).makespan
    assert step == pytest.approx((2 * 8 + 4 - 1) * (1 + 2) / 2)  # 28.5


def test_print_after_and_time_passes_go_to_stderr(cli) -> None:
    code, _, err = cli("opt", *LIB, "--passes", "interleave,split-backward",
                       "--print-after", "split-backward", "--time-passes")
    assert code == 0
    assert "# ---- after pass 2: split-backward ----" in err
    assert "after pass 1" not in err
    assert err.count("schedule one_f_one_b {") == 1
    rows = [line.split()[0] for line in err.splitlines() if line and line[0].isalpha()]
    assert rows[-4:] == ["pass", "interleave", "split-backward", "total"]
    code, _, err = cli("opt", *LIB, "--passes", "verify", "--print-after", "all")
    assert code == 0 and "after pass 1: verify" in err
    code, _, err = cli("opt", *LIB, "--passes", "verify", "--print-after", "interleave")
    assert code == 2 and "--print-after interleave: the pipeline has no pass called that" in err


def test_opt_usage_errors(cli, tmp_path: Path) -> None:
    code, _, err = cli("opt", *LIB, "--passes", "verify", "--dump-dir", REPO / "pyproject.toml")
    assert code == 2 and "exists and is not a directory" in err
    code, _, err = cli("opt", *LIB, "--passes", "verify", "-o", tmp_path / "no" / "x.sched")
    assert code == 2 and "does not exist" in err
    assert not (tmp_path / "no").exists()
    code, _, err = cli("opt", *LIB)
    assert code == 2 and "--passes" in err
    dump = tmp_path / "dump"  # a bad -o is refused before any pass runs (none dumps)
    code, _, err = cli("opt", *LIB, "--passes", "verify", "--dump-dir", dump,
                       "-o", tmp_path / "no" / "x.sched")
    assert code == 2 and "does not exist" in err and not dump.exists()
    code, out, err = cli("opt", *LIB, "--passes", "verify", "-o", "")
    assert (code, out) == (2, "") and "-o: empty path" in err


def test_opt_writes_the_costs_it_ran_under(cli, tmp_path: Path) -> None:
    """`--costs FILE` replaces the file's costs block for the passes, so the output carries
    FILE's costs (not the input's, nor FILE's free-form meta table): simulating the output
    alone gives the step simulating the input under FILE gives."""
    src = tmp_path / "in.sched"
    src.write_text("pipeline {\n ranks = 4\n microbatches = 8\n}\ncosts {\n F = 5.0\n}\n"
                   "schedule = 1f1b\n")
    costs = REPO / "examples" / "costs" / "heavy-ends.toml"
    out = tmp_path / "out.sched"
    code, _, err = cli("opt", src, "--costs", costs, "--passes", "verify", "-o", out)
    assert code == 0, err
    code, want, _ = cli("simulate", src, "--costs", costs)
    assert code == 0
    code, got, err = cli("simulate", out)
    assert code == 0, err
    assert got.splitlines()[1] == want.splitlines()[1]
    code, own, _ = cli("simulate", src)  # the input's own block (F = 5) gives another step
    assert code == 0 and own.splitlines()[1] != got.splitlines()[1]
    assert "meta" not in out.read_text(encoding="utf-8")


def test_passes_command_lists_options_and_summaries(cli) -> None:
    code, out, err = cli("passes")
    assert code == 0, err
    lines = out.splitlines()
    assert "interleave{v: int = 2, placement: loop|vshape = loop}" in lines
    assert "split-backward{mode: h1|h2 = h1}" in lines
    assert "merge-backward{adjacent_only: bool = false}" in lines
    assert "verify{memory_limit: float | none = none}" in lines
    assert all(line.startswith("    ") for line in lines[1::2])  # a summary under each
    code, out, _ = cli("passes", "--pass-plugin", f"{PLUGIN}:DelayW")
    assert code == 0 and "delay-w{max_pending: int = 0} (from " in out
