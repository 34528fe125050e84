"""Properties of the IR, the verifier, the printer and the library, over random schedules from
`pipeir.testing` (hypothesis profile from conftest: `default`, or HYPOTHESIS_PROFILE=thorough)."""

from __future__ import annotations

import contextlib
import io
import random
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

import pipeir
from pipeir import PipelineConfig, Schedule, UsageError, VerifyError, library, verify
from pipeir.cli import main
from pipeir.ops import Op
from pipeir.passes.dp_reduce import DpReduce
from pipeir.printer import print_schedule
from pipeir.testing import (
    MUTATION_KINDS,
    Mutation,
    build,
    configs,
    expected_check,
    mutations,
    random_schedule,
    schedules,
)
from pipeir.views.grid import unit_steps

SMALL = configs(max_ranks=5, max_microbatches=6, max_chunks=3)


# ---- generated schedules ---------------------------------------------------------------------
@given(schedules(SMALL))
def test_generated_schedules_verify(s: Schedule) -> None:
    report = verify(s)
    c = s.config
    assert len(report.peak_activations) == c.ranks
    # Independent of the verifier: every op sits on its stage's rank, each backward is B or
    # I + W, and nothing is missing.
    for r, prog in enumerate(s.programs):
        assert all(c.placement[op.stage] == r for op in prog)
    kinds: dict[tuple[int, int], list[str]] = {}
    for op in s:
        kinds.setdefault((op.stage, op.mb), []).append(op.kind)
    assert len(kinds) == c.stages * c.microbatches
    assert all(sorted(k) in (["B", "F"], ["F", "I", "W"]) for k in kinds.values())


@given(schedules(configs(max_ranks=4, max_microbatches=4), split_backward=True),
       schedules(configs(max_ranks=4, max_microbatches=4), split_backward=False))
def test_split_backward_is_honoured(split: Schedule, whole: Schedule) -> None:
    assert {op.kind for op in split} == {"F", "I", "W"}
    assert {op.kind for op in whole} == {"F", "B"}


@given(st.data())
def test_a_fixed_config_is_kept(data: st.DataObject) -> None:
    config = PipelineConfig.make(3, 5, stages=6, placement="vshape")
    s = data.draw(schedules(config))
    assert s.config == config
    verify(s)


@settings(max_examples=3)
@given(schedules(PipelineConfig.make(16, 64, stages=32)))
def test_large_schedules_are_cheap_to_generate(s: Schedule) -> None:
    """p = 16, m = 64 (4096 F + 4096 backward ops) must stay usable in a property test."""
    assert len(s) >= 2 * 32 * 64
    verify(s)


def test_generation_covers_more_than_one_shape() -> None:
    """A generator that always produced the same order would pass every other test here."""
    config = PipelineConfig.make(3, 4)
    seen = {random_schedule(config, random.Random(seed), split_backward=False).programs
            for seed in range(30)}
    assert len(seen) > 10
    peaks = {verify(Schedule.from_programs(config, p)).peak_activations for p in seen}
    assert len(peaks) > 2


@given(st.integers(1, 4), st.integers(1, 8), st.integers(1, 3), st.integers(0, 2**32 - 1))
def test_memory_limit_is_respected_when_given(p: int, m: int, limit: int, seed: int) -> None:
    config = PipelineConfig.make(p, m, memory_limit=limit)
    s = random_schedule(config, random.Random(seed))
    assert max(verify(s).peak_activations) <= limit


def test_an_impossible_memory_limit_is_a_clear_error() -> None:
    # Two chunks per rank: micro-batch 0 alone puts 2 activations on rank 0 before any backward.
    config = PipelineConfig.make(2, 2, stages=4, memory_limit=1)
    with pytest.raises(ValueError, match="memory_limit = 1 is too small"):
        random_schedule(config, random.Random(0))


# ---- printer round trip ----------------------------------------------------------------------
@given(schedules(SMALL))
def test_print_parse_print_is_identity(s: Schedule) -> None:
    text = print_schedule(s)
    again = pipeir.parse(text)
    assert again == s
    assert again.name == s.name
    assert print_schedule(again) == text
    # Equality and hashing are by config and programs, whatever built the schedule.
    rebuilt = Schedule.from_programs(s.config, s.programs, name="other")
    assert rebuilt == s and hash(rebuilt) == hash(s)
    assert s.with_programs(s.programs) == s


# ---- mutations -------------------------------------------------------------------------------
def _assert_rejected(mut: Mutation) -> VerifyError:
    with pytest.raises(VerifyError) as info:
        mut.build()
    assert info.value.check == mut.expected_check, mut.description
    return info.value


@pytest.mark.parametrize("kind", MUTATION_KINDS)
@given(data=st.data())
def test_each_mutation_is_rejected_with_its_check(kind: str, data: st.DataObject) -> None:
    cfg = configs(min_ranks=2 if kind == "move-rank" else 1, max_ranks=5, max_microbatches=5,
                  max_chunks=3)
    s = data.draw(schedules(cfg))
    mut = data.draw(mutations(s, kinds=(kind,)))
    assert mut.kind == kind
    assert mut.programs != s.programs
    _assert_rejected(mut)


@given(data=st.data())
def test_mutations_of_any_kind_are_rejected(data: st.DataObject) -> None:
    s = data.draw(schedules(SMALL))
    _assert_rejected(data.draw(mutations(s)))


@given(data=st.data())
def test_mutations_of_schedules_with_gradient_reductions_say_the_check_they_cause(
        data: st.DataObject) -> None:
    """With R ops (`dp-reduce`), a dropped or early reduction is the reduction check's:
    the mutations leave those alone, so their expected check is the one verify gives."""
    cfg = configs(min_ranks=2, max_ranks=4, max_microbatches=4, max_chunks=2)
    s = DpReduce().run(data.draw(schedules(cfg)))
    assert any(op.kind == "R" for op in s)
    _assert_rejected(data.draw(mutations(s)))


@given(data=st.data())
def test_a_cycle_across_ranks_names_both_ranks(data: st.DataObject) -> None:
    s = data.draw(schedules(configs(min_ranks=2, max_ranks=4, max_microbatches=4)))
    mut = data.draw(mutations(s, kinds=("reorder-cycle",)))
    err = _assert_rejected(mut)
    assert err.message.startswith("deadlock: rank ")


@pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
def test_mutation_helpers_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown mutation kind 'swap'"):
        expected_check("swap")
    one_rank = library.get("gpipe", 1, 2)
    with pytest.raises(InvalidArgument, match="1 rank"):
        mutations(one_rank, kinds=("move-rank",)).example()
    with pytest.raises(InvalidArgument, match="placements"):
        configs(placements=("zigzag",)).example()
    with pytest.raises(InvalidArgument, match=re.escape("draw one first, "
                                                        "data.draw(schedules(...))")):
        mutations(schedules()).example()  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=re.escape("(configs(...), called)")):
        schedules(config=configs).example()  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=re.escape("a list of kinds, e.g. ('drop',)")):
        mutations(one_rank, kinds="drop").example()
    with pytest.raises(InvalidArgument, match=re.escape("mutations: expected a Schedule, got "
                                                        "Compiled: give its .schedule")):
        mutations(pipeir.compile(one_rank)).example()  # type: ignore[arg-type]
    forwards = pipeir.Schedule.from_programs(one_rank.config, [[pipeir.F(0, 0), pipeir.F(0, 1)]])
    with pytest.raises(InvalidArgument, match=re.escape(
            "mutations breaks a valid schedule, and this one is not: missing B(0,0)")):
        mutations(forwards).example()
    with pytest.raises(InvalidArgument, match=re.escape(
            "schedules(split_backward=...): True, False or None, got 'no'")):
        schedules(one_rank.config, split_backward="no").example()  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=re.escape("configs(max_ranks=...): an integer, "
                                                        "got '4'")):
        configs(max_ranks="4").example()  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=re.escape("random_schedule: expected a random.Random "
                                                  "(random.Random(seed)), got int 3")):
        random_schedule(one_rank.config, 3)  # type: ignore[arg-type]


def test_build_accepts_valid_programs() -> None:
    s = library.get("1f1b", 3, 4)
    built, report = build(s.config, s.programs)
    assert built == s
    assert report == verify(s)


@pytest.mark.parametrize("kind", ["drop", "move-rank", "reorder-cycle"])
@given(data=st.data())
def test_mutated_files_fail_check_with_exit_1(kind: str, data: st.DataObject) -> None:
    """The same breakage, written out as a .sched file, is caught by `pipeirc check`."""
    s = data.draw(schedules(configs(min_ranks=2, max_ranks=4, max_microbatches=4)))
    mut = data.draw(mutations(s, kinds=(kind,)))
    text = print_schedule(Schedule.from_programs(mut.config, mut.programs, name="broken"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "broken.sched"
        path.write_text(text, encoding="utf-8")
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(["check", str(path)])
    assert code == 1
    first = err.getvalue().splitlines()[0]
    assert first.startswith(f"{path}:") or first.startswith(f"{path}: error:"), first
    assert "Traceback" not in err.getvalue()


# ---- the library -----------------------------------------------------------------------------
@given(st.integers(1, 16), st.integers(1, 64))
def test_1f1b_verifies_with_its_known_memory(p: int, m: int) -> None:
    report = verify(library.get("1f1b", p, m))
    # p - r on rank r once the pipeline fills (m >= p); never more than m micro-batches.
    assert report.peak_activations == tuple(min(m, p - r) for r in range(p))


@given(st.integers(1, 16), st.integers(1, 64))
def test_gpipe_verifies_holding_every_microbatch(p: int, m: int) -> None:
    s = library.get("gpipe", p, m)
    assert verify(s).peak_activations == (m,) * p
    assert all(prog[:m] == tuple(Op("F", r, i) for i in range(m))
               for r, prog in enumerate(s.programs))


def _interleaved_admits(p: int, m: int) -> bool:
    return m % max(1, m // p) == 0


@given(st.integers(1, 16), st.integers(1, 64), st.integers(1, 4))
def test_interleaved_1f1b_verifies_where_admitted(p: int, m: int, v: int) -> None:
    if not _interleaved_admits(p, m):
        with pytest.raises(UsageError, match="multiple of max\\(1, microbatches // ranks\\)"):
            library.get("interleaved-1f1b", p, m, v=v)
        return
    s = library.get("interleaved-1f1b", p, m, v=v)
    assert s.config.stages == p * v
    assert s.config.placement == tuple(st_ % p for st_ in range(p * v))
    assert len(s) == 2 * p * v * m
    report = verify(s)
    assert all(1 <= peak <= v * m for peak in report.peak_activations)


def test_interleaved_admits_some_m_that_are_not_multiples_of_p() -> None:
    # Guards the premise of the property above: both branches really occur.
    assert _interleaved_admits(4, 6) and not _interleaved_admits(4, 9)
    with pytest.raises(UsageError, match="multiple of"):
        library.get("interleaved-1f1b", 4, 9, v=2)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_one_stage_schedules_refuse_more_stages(name: str) -> None:
    with pytest.raises(UsageError, match="stages = ranks"):
        library.get(name, 2, 4, stages=4)


# ---- the unit-step grid ----------------------------------------------------------------------
def _check_unit_steps(s: Schedule) -> None:
    steps = unit_steps(s)
    assert set(steps) == set(s.graph)
    for u, v in s.data_edges():
        assert steps[u] < steps[v], f"{v} at step {steps[v]} runs before {u} at {steps[u]}"
    for r, prog in enumerate(s.programs):
        for i, op in enumerate(prog):
            # As early as possible: right after the rank's previous op or the last input.
            earliest = [steps[prog[i - 1]] + 1] if i else [0]
            earliest += [steps[p] + 1 for p, _ in s.graph.in_edges(op) if s.rank_of(p) != r]
            assert steps[op] == max(earliest), f"{op} on rank {r} could start earlier"


@given(schedules(SMALL))
def test_unit_steps_respect_every_dependency(s: Schedule) -> None:
    _check_unit_steps(s)


@pytest.mark.parametrize(("name", "kw"), [("gpipe", {}), ("1f1b", {}),
                                          ("interleaved-1f1b", {"v": 2})])
def test_unit_steps_of_library_schedules(name: str, kw: dict[str, int]) -> None:
    _check_unit_steps(library.get(name, 4, 8, **kw))


@given(data=st.data())
def test_unit_steps_refuse_a_deadlock(data: st.DataObject) -> None:
    s = data.draw(schedules(configs(min_ranks=2, max_ranks=3, max_microbatches=3)))
    broken = Schedule.from_programs(s.config, data.draw(mutations(s, ("reorder-cycle",))).programs)
    with pytest.raises(VerifyError) as info:
        unit_steps(broken)
    assert info.value.check == "deadlock"


def test_unit_steps_refuse_a_crossed_wait() -> None:
    # rank 1 waits for F(0,0), which rank 0 runs after B(0,1), which waits for rank 1's B(1,1).
    config = PipelineConfig.make(2, 2)
    broken = Schedule.from_programs(config, [
        [Op("F", 0, 1), Op("B", 0, 1), Op("F", 0, 0), Op("B", 0, 0)],
        [Op("F", 1, 0), Op("B", 1, 0), Op("F", 1, 1), Op("B", 1, 1)]])
    with pytest.raises(VerifyError):
        unit_steps(broken)
    with pytest.raises(VerifyError) as info:
        verify(broken)
    assert info.value.check == "deadlock"
