"""pipeirc profile: a small model on 2 ranks gives a cost file that `simulate` and `tune`
accept; bad usage is a clear error before anything is launched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")


@pytest.mark.mp
def test_profile_mlp_on_two_ranks_feeds_simulate_and_tune(cli, tmp_path: Path) -> None:
    out = tmp_path / "costs.json"
    code, text, err = cli("profile", "--model", "mlp", "--nproc", "2", "--iters", "3",
                          "--timeout", "60", "-o", str(out))
    assert code == 0, err
    data = json.loads(out.read_text())
    assert data["version"] == 2 and data["unit"] == "ms"
    for s in ("0", "1"):
        assert data["stage"][s]["F"] > 0 and data["stage"][s]["W"] > 0
        assert data["stage"][s]["memory_bytes"] > 0
    assert data["stage"]["0"]["I"] == 0  # stage 0's input needs no gradient
    assert data["stage"]["1"]["I"] > 0
    assert data["stage"]["0"]["activation_bytes"] == 64 * 512 * 4  # 256 samples / 4, width 512
    # 4 of the mlp's 8 blocks per stage: weights and biases, float32 (what dp all-reduces)
    assert data["stage"]["0"]["param_bytes"] == 4 * (512 * 512 + 512) * 4
    assert data["latency"] > 0
    assert "-bound" in text or "balanced" in text
    code, sim, err = cli("simulate", "--schedule", "1f1b", "--ranks", "2", "--microbatches",
                         "4", "--costs", str(out), "--json")
    assert code == 0, err
    assert json.loads(sim)["makespan"] > 0
    code, table, err = cli("tune", "--costs", str(out), "--microbatches", "4", "--max-v", "2")
    assert code == 0, err
    assert "best:" in table


@pytest.mark.mp
def test_profile_one_rank_measures_no_link(cli, tmp_path: Path) -> None:
    out = tmp_path / "one.json"
    code, text, err = cli("profile", "--model", "mlp", "--nproc", "1", "--iters", "2",
                          "-o", str(out))
    assert code == 0, err
    data = json.loads(out.read_text())
    assert "latency" not in data and data["stage"]["0"]["F"] > 0
    assert "no transfers measured" in text


@pytest.mark.parametrize("extra, message", [
    (["--model", "mlp", "--nproc", "0"], "--nproc 0: need at least 1"),
    (["--model", "mlp", "--iters", "0"], "--iters 0: too small"),
    (["--model", "no_such_module:spec"], "cannot import no_such_module"),
    (["--model", "mlp", "--microbatches", "1000"], "running its stages failed"),
])
def test_bad_usage(cli, tmp_path: Path, extra: list[str], message: str) -> None:
    out = tmp_path / "x.json"
    code, _, err = cli("profile", *extra, "-o", str(out))
    assert code == 2 and message in err and "Traceback" not in err
    assert not out.exists()


class _Clock:
    """A timer whose successive timed intervals take `ms` in turn (cycling): the profile
    reads it twice around each run, so run k of every op lasts ms[k % len(ms)]."""

    def __init__(self, *ms: float) -> None:
        self.ms, self.t, self.reads = ms, 0.0, 0

    def __call__(self) -> float:
        self.reads += 1
        if self.reads % 2 == 0:
            self.t += self.ms[(self.reads // 2 - 1) % len(self.ms)] / 1e3
        return self.t


def test_spread_is_measured_with_the_timer_given() -> None:
    from pipeir.models.spec import resolve
    from pipeir.runtime import profile

    # 4 runs of every op: 1, 10, 1, 10 ms: median 5.5, stdev 5.196, cv 0.945
    stages = profile.profile_stages(resolve("mlp"), 2, 4, warmup=0, iters=4,
                                    clock=_Clock(1, 10))
    assert [t for s in stages for t in (s.F, s.B, s.I, s.W)] == pytest.approx(
        [5.5, 5.5, 0.0, 5.5, 5.5, 5.5, 5.5, 5.5])
    for op in "FBIW":
        sp = stages[1].spread[op]
        assert (sp.cv, sp.low, sp.high, sp.runs) == (pytest.approx(0.9447, abs=1e-4),
                                                     pytest.approx(1), pytest.approx(10), 4)
    assert stages[0].spread["I"] == profile.NO_SPREAD  # stage 0's input needs no gradient
    warned = profile.unstable(stages)
    assert len(warned) == 7
    assert warned[-1] == ("stage 1 W: 4 runs took 1 to 10 ms (coefficient of variation 0.94, "
                          "over 0.5); the cost file keeps the median, 5.5 ms, which may not "
                          "be this op's time")
    steady = profile.profile_stages(resolve("mlp"), 2, 4, warmup=1, iters=3, clock=_Clock(2))
    assert profile.unstable(steady) == []
    sp = steady[1].spread["W"]
    assert (sp.cv, sp.low, sp.high, sp.runs) == (pytest.approx(0, abs=1e-9), pytest.approx(2),
                                                 pytest.approx(2), 3)
    # a single run has no spread to judge
    one = profile.profile_stages(resolve("mlp"), 1, 2, warmup=0, iters=1, clock=_Clock(1, 10))
    assert profile.unstable(one) == [] and one[0].spread["W"].cv == 0.0


def test_profile_warns_of_unstable_ops_and_records_the_spread(
        cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from functools import partial

    from pipeir.runtime import profile

    # every op 0.35 ms in three runs, 14.5 ms in the fourth: the median hides it
    monkeypatch.setattr(profile, "profile_stages",
                        partial(profile.profile_stages, clock=_Clock(0.35, 0.35, 0.35, 14.5)))
    out = tmp_path / "noisy.json"
    code, text, err = cli("profile", "--model", "mlp", "--nproc", "1", "--warmup", "0",
                          "--iters", "4", "-o", str(out))
    assert code == 0, err
    lines = err.splitlines()
    assert [ln for ln in lines if ln.startswith("warning:")] == [
        f"warning: unstable measurement: stage 0 {op}: 4 runs took 0.35 to 14.5 ms "
        f"(coefficient of variation 1.82, over 0.5); the cost file keeps the median, 0.35 ms, "
        f"which may not be this op's time; close other programs or raise --iters and profile "
        f"again" for op in ("F", "B", "W")]
    meta = json.loads(out.read_text())["meta"]["spread"]
    assert meta["threshold"] == profile.UNSTABLE_CV == 0.5
    assert meta["stage"] == {"0": {"F": 1.8199, "B": 1.8199, "W": 1.8199}}
    assert "wrote" in text


def test_profile_writes_only_a_file_a_cost_reader_reads_as_json(cli, tmp_path: Path) -> None:
    """Cost files are read by suffix (.json as JSON, anything else as TOML): `-o costs.toml`
    wrote JSON that `--costs costs.toml` then could not read. Refused before measuring."""
    out = tmp_path / "costs.toml"
    code, _, err = cli("profile", "--model", "mlp", "--nproc", "1", "-o", out)
    assert code == 2 and err.splitlines() == [
        f"error: -o {out}: profile writes a JSON cost file; name it .json (a cost file is read "
        f"as JSON by its suffix, anything else as TOML)"], err
    assert not out.exists()
