"""The resource policy (pipeir/limits.py, issue 11): every entrance refuses an input too large
for the memory budget before doing the work, names the limit and how to raise it."""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import pipeir
from pipeir import B, F, W, limits
from pipeir.backend.lower import lower
from pipeir.config import ConfigError, PipelineConfig
from pipeir.interop.reader import loads_csv
from pipeir.runtime.measure import expand_rounds

REPO = Path(__file__).parent.parent

HEAD = "pipeline { ranks = 1  microbatches = 1 }\n"
BODY = "schedule s { rank r {%s\n F(r, 0) B(r, 0) } }\n"


@contextmanager
def refused_before_the_work(most: int = 16 * 2**20) -> Iterator[None]:
    """Assert the block allocates at most `most` bytes at its peak (16 MiB by default).

    "Refused before the work" measured by what the work would have allocated (a list of a
    billion rounds, 137 MiB of candidates, ...), which is the same on any machine, instead of
    by wall-clock time, which is not.
    """
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= most, f"allocated {peak:,} bytes before refusing (at most {most:,})"


@pytest.fixture
def budget(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(limits.ENV, raising=False)
    return monkeypatch


def test_budget_reads_units_and_refuses_nonsense(budget: pytest.MonkeyPatch) -> None:
    assert limits.budget() == limits.DEFAULT_BUDGET
    budget.setenv(limits.ENV, "8GiB")
    assert limits.budget() == 8 * 2**30
    assert limits.max_ops() == 8 * 2**30 // limits.BYTES_PER_OP
    budget.setenv(limits.ENV, "500MB")
    assert limits.budget() == 500 * 10**6
    for bad in ("lots", "-1", "0", "nan", "1e400"):
        budget.setenv(limits.ENV, bad)
        with pytest.raises(pipeir.UsageError, match=f"{limits.ENV}={bad}: expected a size"):
            limits.budget()


def test_pipeline_sizes_are_checked_against_the_budget(budget: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError) as e:
        PipelineConfig.make(ranks=2000, microbatches=2000)
    assert "8,000,000 ops (F and B) need 14.9 GiB" in str(e.value)
    assert f"set {limits.ENV}=15GiB" in str(e.value)
    budget.setenv(limits.ENV, "16GiB")
    assert PipelineConfig.make(ranks=2000, microbatches=2000).stages == 2000


def test_library_sizes_point_at_the_setting(budget: pytest.MonkeyPatch) -> None:
    with refused_before_the_work(), \
            pytest.raises(pipeir.UsageError, match="1024 stages x 1024 micro-batches") as e:
        pipeir.library.get("interleaved-1f1b", 128, 1024, v=8)
    assert e.value.diagnostics[0].span is not None


def test_absurd_sizes_say_a_number_is_wrong() -> None:
    with pytest.raises(ConfigError, match="is a number wrong"):
        PipelineConfig.make(ranks=1, microbatches=10**20)


def test_builder_stops_at_the_op_limit(budget: pytest.MonkeyPatch) -> None:
    budget.setenv(limits.ENV, str(50 * limits.BYTES_PER_OP))  # 50 ops
    cfg = PipelineConfig.make(ranks=1, microbatches=20)  # 40 ops of F and B fit
    progs = [[F(0, m) for m in range(20)] + [B(0, m) for m in range(20)]
             + [W(0, m) for m in range(20)]]
    with pytest.raises(pipeir.UsageError, match="schedule 'x' is too large: 51 ops"):
        pipeir.Schedule.from_programs(cfg, progs, name="x")


def test_input_files_are_read_up_to_the_limit(budget: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    with pytest.raises(pipeir.UsageError, match=r"/dev/zero: longer than 5\.12 MiB"):
        pipeir.parse("/dev/zero")
    f = tmp_path / "a.sched"
    f.write_text(HEAD + BODY % "")
    budget.setenv(limits.ENV, str(10 * limits.BYTES_PER_INPUT_BYTE))
    with pytest.raises(pipeir.UsageError, match=f"longer than 10 B.*{limits.ENV}=1GiB"):
        pipeir.parse(f)


def test_lowering_and_rounds_are_checked_before_the_work() -> None:
    s = pipeir.parse(HEAD.replace("}", " accumulate = 1000000000000 }") + BODY % "")
    with refused_before_the_work():
        with pytest.raises(pipeir.UsageError,
                           match=r"1000000000000 rounds: accumulate\) is too"):
            lower(s)
        with pytest.raises(pipeir.UsageError, match="rounds of 's'"):
            expand_rounds(s)


def test_pass_outputs_are_checked_before_they_are_built() -> None:
    s = pipeir.library.get("1f1b", 4, 8)
    with pytest.raises(pipeir.UsageError, match="4000000 stages x 8 micro-batches"):
        pipeir.compile(s, "interleave{v=1000000}")


def test_recursion_that_fans_out_is_stopped() -> None:
    # (distinct arguments at every level: a call with arguments seen before is not run again)
    deep = "def f30(x) = x\n" + "".join(f"def f{i}(x) = f{i + 1}(2 * x) + f{i + 1}(2 * x + 1)\n"
                                        for i in reversed(range(30)))
    # the count in the message is the behaviour: 2**30 calls were not made
    with pytest.raises(pipeir.UsageError, match="calls functions more than 100,008 times"):
        pipeir.parse(HEAD + deep + BODY % "let k = f0(0)")


def test_a_function_called_again_with_its_arguments_is_not_run_again() -> None:
    # 2**30 calls by the tree, 31 distinct ones: each level's second call is answered
    deep = "def f30(x) = x\n" + "".join(f"def f{i}(x) = f{i + 1}(f{i + 1}(x))\n"
                                        for i in reversed(range(30)))
    s = pipeir.parse(HEAD + deep + BODY % "let k = f0(5)  require k == 5")
    assert list(s.programs[0]) == [F(0, 0), B(0, 0)]
    # the calls a loop makes with one argument do not count against the budget again
    many = "def g(x) = x * 0\n" + BODY % "for i in 0 .. 200000 { let z = g(3) }"
    assert len(pipeir.parse(HEAD + many)) == 2


def test_integers_are_64_bit() -> None:
    with pytest.raises(pipeir.UsageError, match=r"\(16385 digits\) is out of range") as e:
        pipeir.parse(HEAD + BODY % ("let k = 1" + "0" * 16384))
    d = e.value.diagnostics[0]
    assert d.span is not None and (d.span.line, d.span.col) == (2, 30)
    with pytest.raises(pipeir.UsageError, match="integer overflow: 4294967296 \\* 4294967296"):
        pipeir.parse(HEAD + BODY % "let k = 4294967296 * 4294967296")
    # the largest integers compute exactly: k - (MAX_INT - 1) is micro-batch 0
    text = HEAD + BODY.replace("F(r, 0)", "F(r, k - %d)") % (
        f"let k = {limits.MAX_INT} - 1", limits.MAX_INT - 1)
    assert set(pipeir.parse(text)) == {F(0, 0), B(0, 0)}


def test_torch_csv_stage_numbers_are_not_listed() -> None:
    with refused_before_the_work():
        with pytest.raises(pipeir.VerifyError, match="stage 0 appears in no cell"):
            loads_csv("999999999F0\n")
        with pytest.raises(pipeir.UsageError,
                           match=r"integer 99999999999999999999 \(20 digits\)"):
            loads_csv("0F99999999999999999999\n")
        with pytest.raises(pipeir.UsageError, match="is a number wrong"):
            loads_csv("0F9999999999999999\n")


def test_every_integer_in_the_input_is_64_bit(cli, tmp_path: Path) -> None:
    """Rank numbers, cost indices and CSV cells past 64 bits are errors at their place, not
    Python's 4,300-digit ValueError; a long line is shown as a window around the span."""
    big = "9" * 5000
    cases = {
        "rank.sched": HEAD + f"schedule s {{ rank {big} {{ F(0,0) B(0,0) }} }}\n",
        "cost.sched": HEAD + f"costs {{ stage.{big}.F = 1 }}\n" + BODY % "",
        "zeros.sched": HEAD + BODY % ("let k = " + "0" * 5000 + "1"),
        "cell.csv": f"{big}F0\n",
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        code, _, err = cli("simulate" if name == "cost.sched" else "check", tmp_path / name)
        if name == "zeros.sched":
            assert code == 0, err  # leading zeros are still a small number
            continue
        assert code == 2, err
        first, source, carets = err.splitlines()[:3]
        assert "integer 999999999999... (5000 digits) is out of range" in first
        assert len(source) < 220 and len(carets) < 220 and "^" in carets


def test_integer_lists_on_the_command_line_are_64_bit(cli) -> None:
    big = "9" * 5000
    costs = Path(__file__).parent.parent / "examples" / "costs" / "compute-bound.toml"
    for flag, args in (("--ranks", ["bubble", "--ranks", big]),
                       ("--microbatches", ["tune", "--costs", costs, "--microbatches",
                                           f"8,{big}"])):
        code, _, err = cli(*args)
        assert code == 2 and err.startswith(f"error: {flag}: integer 999999999999... (5000")


def _trained_state_bytes(stage: torch.nn.Module) -> int:
    """Oracle: a real stage after a real backward and optimizer step (not the fake count)."""
    from pipeir.models.mlp import small

    opt = small().optimizer(stage.parameters())
    stage(torch.randn(4, 64)).sum().backward()
    opt.step()
    tensors = [*stage.parameters(), *stage.buffers(),
               *(p.grad for p in stage.parameters() if p.grad is not None),
               *(t for s in opt.state.values() for t in s.values() if t.dim() > 0)]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.mp
def test_training_that_cannot_fit_is_refused_before_any_process(
        budget: pytest.MonkeyPatch, cli, tmp_path: Path) -> None:
    import re

    from pipeir.models.mlp import small

    budget.setenv(limits.ENV, "300MB")
    trace = tmp_path / "t.json"
    code, out, err = cli("run", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2",
                         "--model", "pipeir.models.mlp:small", "--passes", "interleave{v=20}",
                         "--steps", "1", "--trace", trace)
    assert code == 2 and out == "" and not trace.exists()
    found = re.search(r"error: training needs at least .* 2 processes, .* \(rank (\d): 20 "
                      r"stages, ([\d.]+) KiB\), over pipeir's memory budget \(PIPEIR_MAX_MEMORY\) "
                      r"of 286 MiB; .* set PIPEIR_MAX_MEMORY=1GiB to try anyway\n$", err)
    assert found, err
    want = sum(_trained_state_bytes(small().stage(s, 40)) for s in range(0, 40, 2))
    assert abs(float(found[2]) * 1024 - want) <= 0.005 * want
    budget.setenv(limits.ENV, "1GiB")  # the same run fits a larger budget
    code, _, err = cli("run", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2",
                       "--model", "pipeir.models.mlp:small", "--passes", "interleave{v=20}",
                       "--steps", "1")
    assert code == 0, err


def test_tunes_whole_search_is_checked_against_the_budget(budget: pytest.MonkeyPatch, cli,
                                                            tmp_path: Path) -> None:
    """tune keeps every candidate: eight ranks and 64 micro-batches plan 70,748 ops (1F1B and
    GPipe with B, h1 and h2 backwards, 4,096 ops each; interleaved v = 2, 4 and 8, twice,
    four and eight times that; ZB-V 3,072 and DualPipe-V 2,140, built second and counted as
    built), over a 40 MB budget's 20,000
    ops; refused before any simulation, nothing written."""
    budget.setenv(limits.ENV, "40MB")
    out = tmp_path / "best.sched"
    with refused_before_the_work():  # the search would hold 137 MiB
        code, _, err = cli("tune", "--costs", REPO / "examples" / "costs" / "uniform.toml",
                           "--ranks", 8, "--microbatches", 64, "--comm", "overlapped", "-o",
                           out)
    assert code == 2
    assert err.startswith("error: tune's search (8 ranks, every candidate kept for the "
                          "ranking) is too large: 70,748 ops need 135 MiB")
    assert "over pipeir's memory budget of 38.1 MiB; to allow it, set PIPEIR_MAX_MEMORY=1GiB" \
        in err
    assert not out.exists()
    budget.setenv(limits.ENV, "1GiB")
    assert cli("tune", "--costs", REPO / "examples" / "costs" / "uniform.toml", "--ranks", 8,
               "--microbatches", 64, "--comm", "overlapped", "-o", out)[0] == 0


def test_a_search_with_a_deadline_keeps_what_fits(budget: pytest.MonkeyPatch) -> None:
    """synth's warm start (`search(deadline=...)`) is cut to what fits, not refused. A 40 MB
    budget holds 20,000 ops. p = 8, m = 64, in tune's order: 1F1B holds 1,024 ops and 1,536
    per split copy (4,096); ZB-V 3,072 and DualPipe-V 2,140 (no passes; 9,308 so far); GPipe
    as 1F1B (13,404); interleaved v = 2 twice that, of which the schedule and one split copy
    fit (18,524); v = 4 and v = 8 do not fit and are skipped. A candidate with no passes is
    the library schedule itself."""
    from pipeir.search.tune import search
    from pipeir.sim import CostModel

    budget.setenv(limits.ENV, "40MB")
    costs = CostModel.load(REPO / "examples" / "costs" / "uniform.toml")
    got = search(costs, 8, [64], comms=("overlapped",), deadline=time.perf_counter() + 600)
    kept = [*got.ranked, *got.over_limit]
    assert {(c.family, c.v) for c in kept} == {("1f1b", 1), ("gpipe", 1),
                                               ("interleaved-1f1b", 2), ("zb-v", 2),
                                               ("dualpipe-v", 2)}
    held = {id(c.schedule): len(c.schedule) for c in kept}
    assert sum(held.values()) == 1024 + 1024 + 2048 + 4 * 1536 + 3072 + 3072 + 2140
    assert sum(held.values()) <= limits.max_ops()
    # the first candidate, plain 1F1B, is kept even where its split copies do not fit
    alone = search(costs, 8, [800], comms=("overlapped",), deadline=time.perf_counter() + 600)
    assert [(c.family, c.passes) for c in alone.ranked] == [("1f1b", "")]


def test_a_lowered_json_is_read_under_its_own_cost_per_byte(cli, budget: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    """What `compile` writes, `check --lowered` reads under the same budget: a lowered.json
    costs ~8 B of memory per byte, not a .sched file's 400 (which refused compile's own output
    at p=32 by default)."""
    out = tmp_path / "gen"
    assert cli("compile", "--schedule", "1f1b", "--ranks", 2, "--microbatches", 4, "-o",
               out)[0] == 0
    path = out / "lowered.json"
    size = path.stat().st_size
    budget.setenv(limits.ENV, str(size * limits.BYTES_PER_JSON_BYTE * 2))
    assert size > limits.max_input_bytes()  # a .sched file this long would be refused
    code, out_text, err = cli("check", "--lowered", path)
    assert code == 0, err
    assert "lowered ok" in out_text
    budget.setenv(limits.ENV, str(size * limits.BYTES_PER_JSON_BYTE // 2))
    code, _, err = cli("check", "--lowered", path)
    assert code == 2
    assert f"the most pipeir reads as a lowered-program JSON (~{limits.BYTES_PER_JSON_BYTE} B " \
        "of memory per byte" in err


def test_state_on_cuda_devices_is_not_counted_against_host_memory(
        budget: pytest.MonkeyPatch) -> None:
    """Ranks on CUDA keep weights, gradients and optimizer state on their devices: the host
    check then counts only the processes (`check_training(on_host=False)`)."""
    budget.setenv(limits.ENV, "4GiB")
    big = [3 * 2**30, 3 * 2**30]  # two ranks of 3 GiB state: 6 GiB, over the budget on host
    with pytest.raises(pipeir.UsageError, match=r"training needs at least 6.+ of memory: 2 "
                                                r"processes.+rank 0: 1 stages, 3 GiB"):
        limits.check_training(big, [1, 1], 1)
    limits.check_training(big, [1, 1], 1, on_host=False)  # the processes alone fit
    many = [0] * (4 * 2**30 // limits.BYTES_PER_PROCESS + 1)  # more processes than fit
    with pytest.raises(pipeir.UsageError, match="training needs at least"):
        limits.check_training(many, [0] * len(many), 1, on_host=False)
