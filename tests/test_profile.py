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
    assert data["version"] == 1 and data["unit"] == "ms"
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
