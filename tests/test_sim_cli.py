"""`pipeirc simulate`, `plot` and `bubble`: output, goldens, the trace format, bad input."""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import pipeir
from pipeir.sim import CostModel, simulate
from pipeir.views.timeline import render_timeline
from pipeir.views.trace import chrome_trace

Cli = Callable[..., tuple[int, str, str]]
REPO = Path(__file__).parent.parent
COSTS = REPO / "examples" / "costs"
LIB = ("--schedule", "1f1b", "--ranks", "4", "--microbatches", "8")


# ---- goldens ------------------------------------------------------------------------------------
def test_timeline_golden(golden: Callable[[str, str], None]) -> None:
    r = simulate(pipeir.library.get("1f1b", 4, 8))
    golden("sim/1f1b-4x8.timeline.expected", render_timeline(r, width=66))


SPLIT = """
pipeline { ranks = 3 microbatches = 4 }
schedule split_1f1b {
    rank r {
        let warmup = min(ranks - r - 1, microbatches)
        for i in 0 .. warmup { F(r, i) }
        for i in 0 .. microbatches - warmup { F(r, warmup + i)  I(r, i)  W(r, i) }
        for i in microbatches - warmup .. microbatches { I(r, i)  W(r, i) }
    }
}
"""


def test_timeline_golden_blocking_split_backward(golden: Callable[[str, str], None]) -> None:
    r = simulate(pipeir.parse(SPLIT), CostModel(F=1, I=1, W=1, latency=0.5), "blocking")
    text = render_timeline(r, width=72)
    assert ">" in text.split("legend")[0] and "I" in text and "W" in text
    golden("sim/split-blocking.timeline.expected", text)


def test_simulate_cli_golden(cli: Cli, golden: Callable[[str, str], None]) -> None:
    code, out, err = cli("simulate", *LIB, "--width", "66")
    assert code == 0, err
    golden("sim/simulate-1f1b.expected", out)


def test_simulate_json_golden(cli: Cli, golden: Callable[[str, str], None]) -> None:
    code, out, err = cli("simulate", COSTS / "variable-length.sched", "--json")
    assert code == 0, err
    data = json.loads(out)
    for key in ("makespan", "bubble", "bubble_vs_ideal", "peak_activations", "per_rank"):
        assert key in data
    assert len(data["peak_activations"]) == len(data["per_rank"]) == 4
    golden("sim/variable-length.json.expected", out)


# ---- simulate -----------------------------------------------------------------------------------
def test_simulate_reports_the_formula_figures(cli: Cli) -> None:
    code, out, _ = cli("simulate", *LIB, "--json")
    data = json.loads(out)
    assert code == 0
    assert data["makespan"] == 33 and round(data["bubble"], 4) == round(3 / 11, 4)
    assert data["peak_activations"] == [4, 3, 2, 1]
    assert [r["utilisation"] for r in data["per_rank"]] == [round(24 / 33, 9)] * 4


def test_set_overrides_costs_and_pipeline_settings(cli: Cli) -> None:
    _, out, _ = cli("simulate", *LIB, "--json", "--set", "F=2", "--set", "stage.3.B=6",
                    "--set", "latency=0.5")
    data = json.loads(out)
    assert data["costs"]["F"] == 2 and data["costs"]["stage.3.B"] == 6
    s = pipeir.library.get("1f1b", 4, 8)
    ref = simulate(s, CostModel(F=2, latency=0.5, stage={3: {"B": 6.0}}))
    assert data["makespan"] == pytest.approx(ref.makespan)
    code, out, _ = cli("simulate", COSTS / "variable-length.sched", "--json", "--set",
                       "microbatches=4")
    assert code == 0 and json.loads(out)["microbatches"] == 4


def test_costs_file_replaces_the_costs_block(cli: Cli) -> None:
    _, out, _ = cli("simulate", COSTS / "variable-length.sched", "--json", "--costs",
                    COSTS / "profile.json")
    data = json.loads(out)
    assert data["unit"] == "ms" and "mb.2.F" not in data["costs"]
    assert data["costs"]["stage.3.F"] == 1.5


def test_blocking_comm_and_bytes_show_in_the_summary(cli: Cli) -> None:
    code, out, err = cli("simulate", "--schedule", "1f1b", "--ranks", "8", "--microbatches",
                         "16", "--costs", COSTS / "h100-llama.toml", "--comm", "blocking",
                         "--width", "40")
    assert code == 0, err
    assert "blocking communication" in out and "sending" in out and "GiB" in out
    assert "> sending" in out


def test_timeline_colour_only_on_a_terminal(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    _, plain, _ = cli("simulate", *LIB, "--width", "30")
    assert "\x1b[" not in plain
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    monkeypatch.delenv("NO_COLOR", raising=False)
    _, coloured, _ = cli("simulate", *LIB, "--width", "30")
    assert "\x1b[44;97m" in coloured
    monkeypatch.setenv("NO_COLOR", "1")
    _, no_color, _ = cli("simulate", *LIB, "--width", "30")
    assert "\x1b[" not in no_color


def test_invalid_schedule_is_rejected_before_simulating(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "bad.sched"
    f.write_text("pipeline { ranks = 2 microbatches = 1 }\n"
                 "schedule s { rank 0 { B(0, 0) F(0, 0) } rank 1 { F(1, 0) B(1, 0) } }\n")
    code, out, err = cli("simulate", f)
    assert code == 1 and out == ""
    assert "deadlock" in err and "Traceback" not in err


# ---- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "expected"), [
    (("--set", "Fx=2"), "--set Fx: unknown setting"),
    (("--set", "latncy=1"), "did you mean 'latency'?"),
    (("--set", "F=-1"), "error: --set: cost 'F' must be non-negative, got -1"),
    (("--set", "stage.1.Q=1"), "error: --set: unknown cost 'stage.1.Q'"),
    (("--set", "bandwidth=0"), "cost 'bandwidth' must be positive"),
    (("--costs", "/nonexistent/c.toml"), "/nonexistent/c.toml: no such cost file"),
    (("--comm", "async"), "invalid choice: 'async'"),
    (("--width", "3"), "--width: expected 10 to 10,000 columns, got 3"),
])
def test_bad_simulate_arguments(cli: Cli, args: tuple[str, ...], expected: str) -> None:
    code, _out, err = cli("simulate", *LIB, *args)
    assert code == 2
    assert expected in err
    assert "Traceback" not in err


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("c.json", '{"F": 1,\n "Bee": 2}', "c.json:2:2: error: unknown cost 'Bee'"),
    ("c.json", '{"F": 1,\n "B": -2}', "c.json:2:2: error: cost 'B' must be non-negative"),
    ("c.json", '{"F": 1,\n "B": }', "c.json:2:7: error: malformed JSON cost file"),
    ("c.json", '{"F": 1,\n "F": 2}', "c.json:2:2: error: cost 'F' is given twice in one "
     "object (JSON would keep the last without a word)"),
    ("c.json", "[1, 2]", "c.json:1:1: error: a cost file must be a JSON object"),
    ("c.json", '{"stage": {"0": {"B": 1, "F": 1},\n "1": {"F": -2}}}',
     "c.json:2:8: error: cost 'stage.1.F' must be non-negative"),
    ("c.json", '{"stage.1.F": 1, "stage": {"1": {"F": 2}}}',
     "c.json:1:34: error: cost 'stage.1.F' is given twice, once as a dotted key"),
    ("c.toml", "F = 1\nB = \n", "c.toml:2:5: error: malformed TOML cost file"),
    ("c.toml", "F = 1\n[stage.1]\nFF = 2\n", "c.toml:3:1: error: unknown cost 'stage.1.FF'"),
    ("c.toml", 'F = "fast"\n', "c.toml:1:1: error: cost 'F' must be a number"),
    ("c.toml", "version = 3\n", "cost file version 3 is not supported"),
    ("c.toml", "", "c.toml:1:1: error: the cost file sets no costs; leave --costs out"),
    ("c.json", "{}", "c.json:1:1: error: the cost file sets no costs"),
    ("c.toml", 'version = 1\n[meta]\nnote = "x"\n', "c.toml:1:1: error: the cost file sets no"),
])
def test_malformed_cost_files(cli: Cli, tmp_path: Path, name: str, text: str,
                              expected: str) -> None:
    path = _write(tmp_path, name, text)
    code, _, err = cli("simulate", *LIB, "--costs", path)
    assert code == 2, err
    assert expected in err.replace(str(tmp_path) + "/", "")
    assert "Traceback" not in err


def test_bad_costs_block_points_into_the_sched_file(cli: Cli, tmp_path: Path) -> None:
    f = _write(tmp_path, "s.sched", "pipeline { ranks = 2 microbatches = 2 }\n"
                                    "costs {\n    F = 1\n    stage.0.Fw = 2\n}\nschedule = 1f1b\n")
    code, _, err = cli("simulate", f)
    assert code == 2
    assert f"{f}:4:5: error: unknown cost 'stage.0.Fw'" in err
    assert "did you mean 'stage.0.F'?" in err
    g = _write(tmp_path, "t.sched", "pipeline { ranks = 2 microbatches = 2 }\n"
                                    "costs { F = -1 }\nschedule = 1f1b\n")
    code, _, err = cli("simulate", g)
    assert code == 2 and f"{g}:2:9: error: cost 'F' must be non-negative" in err


# ---- trace --------------------------------------------------------------------------------------
def _check_trace(trace: dict[str, Any]) -> None:
    """What Chrome / Perfetto need: known phases, complete events with ts and dur, named
    processes and threads, and every flow start matched by exactly one end."""
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    names: dict[tuple[int, int], str] = {}
    starts: dict[int, dict[str, Any]] = {}
    ends: dict[int, dict[str, Any]] = {}
    for e in events:
        assert e["ph"] in ("X", "M", "s", "f"), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] >= 0 and e["name"]
        elif e["ph"] == "M" and e["name"] == "thread_name":
            names[e["pid"], e["tid"]] = e["args"]["name"]
        elif e["ph"] == "s":
            assert e["id"] not in starts
            starts[e["id"]] = e
        elif e["ph"] == "f":
            assert e["id"] not in ends and e.get("bp") == "e"
            ends[e["id"]] = e
    assert starts.keys() == ends.keys()
    for i, s in starts.items():
        assert ends[i]["ts"] >= s["ts"]
    used = {(e["pid"], e["tid"]) for e in events if e["ph"] in ("X", "s", "f")}
    assert used <= names.keys()  # every track has a name
    assert {n.split()[0] for n in names.values()} == {"compute", "comm"}


def test_trace_is_valid_chrome_trace_json(cli: Cli, tmp_path: Path) -> None:
    out_file = tmp_path / "trace.json"
    code, out, err = cli("simulate", *LIB, "--set", "latency=0.25", "--trace", out_file)
    assert code == 0, err
    assert f"wrote {out_file}" in out
    trace = json.loads(out_file.read_text())
    _check_trace(trace)
    events = trace["traceEvents"]
    procs = sorted(e["args"]["name"] for e in events if e.get("name") == "process_name")
    assert procs == ["rank 0", "rank 1", "rank 2", "rank 3"]
    compute = [e for e in events if e["ph"] == "X" and e["tid"] == 0]
    assert len(compute) == 64
    assert {e["dur"] for e in compute} == {1000.0, 2000.0}  # real durations, 1 unit = 1 ms
    assert sum(e["ph"] == "s" for e in events) == 48  # one arrow per transfer


def test_overlapping_transfers_get_separate_comm_tracks() -> None:
    # latency far above the op time: a rank has several messages in flight at once
    r = simulate(pipeir.library.get("1f1b", 3, 6), CostModel(latency=5))
    trace = chrome_trace(r)
    _check_trace(trace)
    by_track: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["tid"] > 0:
            by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    assert max(tid for _, tid in by_track) > 1
    for spans in by_track.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


def test_trace_to_a_missing_directory_is_a_usage_error(cli: Cli, tmp_path: Path) -> None:
    code, _, err = cli("simulate", *LIB, "--trace", tmp_path / "no" / "t.json")
    assert code == 2 and "does not exist" in err


# ---- plot ---------------------------------------------------------------------------------------
def test_plot_png_and_svg(cli: Cli, tmp_path: Path) -> None:
    png, svg = tmp_path / "t.png", tmp_path / "t.svg"
    code, out, err = cli("plot", *LIB, "-o", png)
    assert code == 0, err
    assert png.read_bytes().startswith(b"\x89PNG") and "bubble 27.3%" in out
    code, _, err = cli("plot", "--schedule", "interleaved-1f1b", "--ranks", "4",
                       "--microbatches", "8", "--set", "latency=0.2", "--comm", "blocking",
                       "--arrows", "-o", svg)
    assert code == 0, err
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "bubble" in text


def test_plot_rejects_unknown_formats_and_writes_nothing(cli: Cli, tmp_path: Path) -> None:
    out = tmp_path / "t.gif"
    code, _, err = cli("plot", *LIB, "-o", out)
    assert code == 2 and "cannot tell the image format" in err and not out.exists()


def test_plot_without_matplotlib_names_the_extra(cli: Cli, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    out = tmp_path / "t.png"
    code, _, err = cli("plot", *LIB, "-o", out)
    assert code == 2 and "pip install 'pipeir[viz]'" in err and not out.exists()


# ---- bubble -------------------------------------------------------------------------------------
def test_bubble_table_agrees_with_the_formulas(cli: Cli) -> None:
    code, out, err = cli("bubble", "--schedule", "1f1b,interleaved-1f1b", "--ranks", "4,8",
                         "--microbatches", "8,16,32", "--v", "2")
    assert code == 0, err
    rows = [line.split() for line in out.splitlines()[1:] if line.strip()]
    assert len(rows) == 12
    assert all(r[-1] == "yes" for r in rows)
    assert ["1f1b", "4", "8", "-", "27.27%", "27.27%", "4", "(4)", "yes"] in rows
    assert ["interleaved-1f1b", "8", "16", "2", "17.95%", "17.95%", "23", "yes"] in rows


def test_bubble_skips_and_explains(cli: Cli) -> None:
    code, out, _ = cli("bubble", "--schedule", "interleaved-1f1b", "--ranks", "4",
                       "--microbatches", "6,9", "--v", "2")
    assert code == 0
    assert "skipped interleaved-1f1b p=4 m=9 v=2: not defined at these sizes" in out
    assert "n/a: the closed form for interleaved 1F1B needs m a multiple of p" in out


def test_bubble_zb_h1_closed_form_only_where_the_pipeline_fills(cli: Cli) -> None:
    """With m < p ZB-H1's warm-up never fills: p = 4, m = 1 (F = I = W = 1) is four F, four
    I back, then rank 0's W: a step of 9 with 3 busy per rank, 66.67 % idle; the formula,
    (p - 1) / (3m + p - 1) = 50 %, was reported as a disagreement (exit 1)."""
    code, out, err = cli("bubble", "--schedule", "zb-h1", "--ranks", "4",
                         "--microbatches", "1,4")
    assert code == 0, err
    rows = [line.split() for line in out.splitlines()[1:3]]
    assert rows[0] == ["zb-h1", "4", "1", "-", "n/a", "66.67%", "1", "-"]
    assert rows[1] == ["zb-h1", "4", "4", "-", "20.00%", "20.00%", "4", "(4)", "yes"]
    assert "n/a: ZB-H1's closed form needs m >= p" in out


def test_bubble_markdown(cli: Cli) -> None:
    code, out, _ = cli("bubble", "--schedule", "gpipe", "--ranks", "4", "--microbatches", "8",
                       "--markdown")
    assert code == 0
    assert out.splitlines()[0].startswith("| schedule | p | m |")
    assert "| gpipe | 4 | 8 | - | 27.27% | 27.27% | 8 (8) | yes |" in out


@pytest.mark.parametrize(("args", "expected"), [
    (("--ranks", "4,x"), "--ranks 4,x: expected positive integers"),
    (("--schedule", "1f1c"), "did you mean '1f1b'?"),
    (("--v", "0"), "--v 0: expected positive integers"),
])
def test_bubble_bad_input(cli: Cli, args: tuple[str, ...], expected: str) -> None:
    code, _, err = cli("bubble", *args)
    assert code == 2 and expected in err


@pytest.mark.parametrize(("name", "text", "where"), [
    ("k1.toml", 'F = 1\n[stage.1]\nF = "x"\n', ":3:1: error: cost 'stage.1.F' must be a number"),
    ("k2.json", '{"F": 1, "stage": {"1": {"F": -2}}}\n', ":1:26: error: cost 'stage.1.F'"),
])
def test_cost_file_errors_point_at_the_nested_key(cli, tmp_path, name: str, text: str,
                                                  where: str) -> None:
    f = tmp_path / name
    f.write_text(text)
    code, out, err = cli("simulate", "--schedule", "1f1b", "--ranks", "2", "--microbatches",
                         "2", "--costs", f)
    assert code == 2 and out == ""
    assert err.startswith(f"{f}{where}")


def test_costs_for_missing_stages_warn_with_their_location(cli, tmp_path) -> None:
    f = tmp_path / "c9.sched"
    f.write_text("pipeline { ranks = 2  microbatches = 2 }\ncosts { stage.9.F = 1 }\n"
                 "schedule = 1f1b\n")
    code, out, err = cli("simulate", f)
    assert code == 0 and out.startswith("one_f_one_b")
    assert err.startswith(f"{f}:2:9: warning: cost 'stage.9.F' names stage 9")


def test_two_costs_blocks_are_an_error(cli, tmp_path) -> None:
    f = tmp_path / "c2.sched"
    f.write_text("pipeline { ranks = 2  microbatches = 2 }\ncosts { F = 1 }\ncosts { B = 1 }\n"
                 "schedule = 1f1b\n")
    code, _, err = cli("simulate", f)
    assert code == 2 and err.startswith(f"{f}:3:1: error: a file can have only one 'costs'")


def test_lengths_must_match_the_micro_batches(cli) -> None:
    """One length per micro-batch: a shorter list (the rest at plain costs) or a longer one
    (cut) is an error at the setting, not a silent half-applied model (issue 11)."""
    lengths = REPO / "examples" / "costs" / "lengths.toml"
    for m in (4, 16):
        code, _, err = cli("simulate", "--schedule", "1f1b", "--ranks", "4",
                           "--microbatches", m, "--costs", lengths)
        assert code == 2
        assert f"lengths.toml:12:1: error: lengths gives 8 micro-batch lengths but the " \
               f"schedule has {m} micro-batches" in err
    code, _, err = cli("simulate", "--schedule", "1f1b", "--ranks", "2", "--microbatches",
                       "3", "--set", "lengths=[1,2]")
    assert code == 2 and err.startswith("error: --set: lengths gives 2")
    code, _, err = cli("simulate", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8",
                       "--costs", lengths)
    assert code == 0, err


@pytest.mark.parametrize(("name", "text", "line", "col"), [
    ("d.json", '{"stage": {"1": {"F": 2}},\n "stage.1.F": 3}', 2, 2),  # the second
    ("d.toml", '"stage.1.F" = 3\n[stage.1]\nF = 2\n', 3, 1),
])
def test_a_cost_given_dotted_and_nested_is_refused(name: str, text: str, line: int, col: int,
                                                   cli: Cli, tmp_path: Path) -> None:
    """Either spelling alone is fine; both used to keep whichever came last, silently."""
    f = tmp_path / name
    f.write_text(text)
    code, out, err = cli("simulate", "--schedule", "1f1b", "--ranks", "2", "--microbatches",
                         "2", "--costs", f)
    assert (code, out) == (2, "")
    assert err.splitlines()[0] == (f"{f}:{line}:{col}: error: cost 'stage.1.F' is given "
                                   "twice, once as a dotted key and once in a table (the file "
                                   "would keep one without a word)")


@pytest.mark.parametrize(("setting", "message"), [
    ("length_ref = 0", "length_ref must be a positive number"),
    ("length_cost = [0, -1, 0]", "length_cost coefficients must be non-negative and not all "
                                 "zero"),
])
def test_a_bad_length_setting_is_reported_where_it_is_written(setting: str, message: str,
                                                              cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "len.sched"
    f.write_text("pipeline { ranks = 2  microbatches = 4 }\ncosts {\n"
                 f"    lengths = [1, 2, 3, 4]\n    {setting}\n}}\nschedule = 1f1b\n")
    code, _, err = cli("simulate", f)
    assert code == 2
    assert err.splitlines()[0] == f"{f}:4:5: error: {message}"
