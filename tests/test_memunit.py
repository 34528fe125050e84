"""One memory unit (`pipeir.memunit`): whatever `tune` and `synth` write under
`--memory-limit K` passes `pipeirc check --memory-limit K`; the oracle is the verifier's own
count of the written file, not the search's. Also synth's Ctrl-C and its "best:" line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import pipeir
from pipeir.cli.synth import best_line
from pipeir.diagnostics import VerifyError
from pipeir.search.tune import search
from pipeir.sim import CostModel
from pipeir.sim.cost_files import read_cost_file

REPO = Path(__file__).parent.parent
UNIFORM = REPO / "examples/costs/uniform.toml"


def _peaks(check_out: str) -> list[int]:
    m = re.search(r"peak in-flight activations per rank: ([\d ]+)", check_out)
    assert m, check_out
    return [int(x) for x in m.group(1).split()]


@pytest.mark.solver
@pytest.mark.parametrize("limit", [5, 6, 8])
def test_synth_with_chunks_writes_what_check_accepts_at_the_same_limit(
        cli, tmp_path: Path, limit: int) -> None:
    out_file = tmp_path / "s.sched"
    code, out, err = cli("synth", "--costs", UNIFORM, "--ranks", 4, "--microbatches", 8,
                         "--v", 2, "--memory-limit", limit, "--time-limit", 1, "--workers", 1,
                         "-o", out_file)
    assert code == 0, err
    assert f"--memory-limit {limit}\n" in out
    code, out, err = cli("check", out_file, "--memory-limit", limit)
    assert code == 0, err
    assert max(_peaks(out)) <= limit


@pytest.mark.solver
def test_synth_default_budget_is_1f1b_memory_at_every_v(cli, tmp_path: Path) -> None:
    # no flag: P x V activations, 1F1B's memory cut into V chunks
    out_file = tmp_path / "s.sched"
    code, out, err = cli("synth", "--costs", UNIFORM, "--ranks", 4, "--microbatches", 8,
                         "--v", 2, "--split-backward", "--time-limit", 1, "--workers", 1,
                         "-o", out_file)
    assert code == 0, err
    assert "--memory-limit P x V (1F1B's memory)" in out
    assert cli("check", out_file, "--memory-limit", 8)[0] == 0
    code, out, _ = cli("check", out_file)
    assert max(_peaks(out)) > 4  # it uses the chunks' memory, which a count of 4 would refuse


@pytest.mark.solver
def test_synth_too_small_a_limit_names_the_least_in_the_same_unit(cli) -> None:
    code, _, err = cli("synth", "--costs", UNIFORM, "--ranks", 4, "--microbatches", 8, "--v", 2,
                       "--memory-limit", "0.5", "--time-limit", 1)
    assert code == 2
    least = re.search(r"smallest feasible limit is --memory-limit (\S+) \(activations per "
                      r"rank", err)
    assert least, err
    # the least named is a limit synth accepts, counted as check counts
    code, _, err = cli("synth", "--costs", UNIFORM, "--ranks", 4, "--microbatches", 8, "--v", 2,
                       "--memory-limit", least.group(1), "--time-limit", 1, "--workers", 1)
    assert code == 0, err


def test_every_tune_candidate_within_the_limit_passes_the_verifier_at_it() -> None:
    costs = CostModel.from_settings(read_cost_file(str(UNIFORM)))
    result = search(costs, 4, [8], memory_limit=8, max_v=4)
    assert any(c.v > 1 for c in result.ranked)  # chunked candidates are ranked too
    for cand in result.ranked:
        pipeir.verify(cand.schedule, memory_limit=8)
    for cand in result.over_limit:  # and those left out are the ones the verifier refuses
        with pytest.raises(VerifyError):
            pipeir.verify(cand.schedule, memory_limit=8)


def test_tune_writes_what_check_accepts_at_the_same_limit(cli, tmp_path: Path) -> None:
    out_file = tmp_path / "t.sched"
    code, out, err = cli("tune", "--costs", UNIFORM, "--ranks", 4, "--microbatches", 8,
                         "--memory-limit", 10, "--max-v", 2, "-o", out_file)
    assert code == 0, err
    code, out, err = cli("check", out_file, "--memory-limit", 10)
    assert code == 0, err
    assert max(_peaks(out)) <= 10


def test_check_names_the_unit_it_counts(cli, tmp_path: Path) -> None:
    code, _, err = cli("check", REPO / "examples/1f1b.sched", "--memory-limit", 1)
    assert code == 1
    assert "counting one per stage, or chunk, and micro-batch" in err


def test_the_best_line_is_a_finished_sentence(golden) -> None:
    cases = [(28.5, 30.0, "exact model; second round: 3 windows re-solved"),
             (17.1, 17.1, "the warm start"),
             (17.1, 17.1, "exact model"),
             (17.1, 17.1, "the warm start meets the lower bound"),
             (16.0, 17.1, "the warm start, then 2 windows re-solved"),
             (16.0, 17.1, "the decomposition meets the lower bound")]
    golden("synth/best_line.expected",
           "".join(best_line(step, warm, method, " ms") + "\n" for step, warm, method in cases))
