"""Interop with torch.distributed.pipelining: its CSV and action lists in, CSV out, checked
against torch itself (its schedule classes, its own lowering, and its runtime on gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import pipeir
from pipeir import library
from pipeir.interop import (
    Action,
    comms_actions,
    compute_actions,
    dumps_csv,
    from_torch_actions,
    load_csv,
    loads_csv,
    parse_action,
)
from pipeir.interop.check import prove_comms
from pipeir.passes.dp_reduce import DpReduce
from pipeir.printer import print_schedule
from pipeir.sim import CostModel, simulate

GOLDEN = Path(__file__).parent / "golden" / "interop"
UNIT = CostModel(F=1, I=1, W=1)


def _torch_ops(name: str, p: int, m: int, with_comms: bool = False) -> list[list[object]] | None:
    """torch's own order for schedule class `name` on mock stages, or None if torch refuses."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

        try:
            return get_schedule_ops(name, p, m, with_comms=with_comms)  # type: ignore[no-any-return]
        except (ValueError, AssertionError, RuntimeError, ZeroDivisionError):
            return None


# ---- the action grammar --------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["2F0", "0I3", "1W3", "3B2", "0SEND_F1", "1RECV_B0", "12F107",
                                  "0REDUCE_GRAD", "3UNSHARD", "3RESHARD", "(0F7;7B3)OVERLAP_F_B"])
def test_action_strings_read_and_print_as_torch_does(text: str) -> None:
    from torch.distributed.pipelining.schedules import _Action

    action = parse_action(text)
    assert action is not None and str(action) == text == str(_Action.from_str(text))


def test_empty_cell_is_idle_and_pairs_hold_their_ops() -> None:
    assert parse_action("  ") is None
    pair = parse_action("(0F7;7B3)OVERLAP_F_B")
    assert pair is not None and [a.op for a in pair.sub] == [pipeir.F(0, 7), pipeir.B(7, 3)]


@pytest.mark.parametrize(("text", "message"), [
    ("2X0", "'2X0' is not a torch action"),
    ("F0", "'F0' is not a torch action"),
    ("2F0x", "'2F0x' is not a torch action"),  # torch's re.match would read 2F0
    ("2F", "F needs a micro-batch number"),
    ("2SEND_F", "SEND_F needs a micro-batch number"),
    ("(0F7;7B3)", "must end in )OVERLAP_F_B"),
    ("(0F7;7B3", "'(' without ')'"),
    ("(0F7)OVERLAP_F_B", "exactly two compute actions"),
    ("(0F7;1SEND_F7)OVERLAP_F_B", "exactly two compute actions"),
])
def test_bad_action_strings_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_action(text)


# ---- import --------------------------------------------------------------------------------------

def test_import_infers_ranks_stages_placement_and_microbatches() -> None:
    imp = loads_csv("0F0,0F1,,3F0,3B0,0B0,3F1,3B1,0B1\n1F0,2F0,2B0,1B0,1F1,2F1,2B1,1B1\n")
    c = imp.schedule.config
    assert (c.ranks, c.stages, c.microbatches, c.placement) == (2, 4, 2, (0, 1, 1, 0))
    assert c.placement_name == "vshape" and imp.format == "compute_only"
    pipeir.verify(imp.schedule)


def test_import_points_errors_at_the_csv_cell(cli, tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0B0\n1F0,1Q0,1B0\n")
    code, _, err = cli("import-torch", bad)
    assert code == 2
    assert err.startswith(f"{bad}:2:5: error: row 2, cell 2: '1Q0' is not a torch action")
    assert "    1F0,1Q0,1B0\n        ^^^\n" in err


def test_a_stage_on_two_ranks_names_both_cells(cli, tmp_path: Path) -> None:
    """Cells that read but cannot be placed make an invalid schedule (exit 1), as torch's own
    `_validate_schedule` says, not a syntax error."""
    bad = tmp_path / "two.csv"
    bad.write_text("0F0,1F0,1B0,0B0\n1F0,1B0\n")
    code, _, err = cli("import-torch", bad)
    assert code == 1
    assert (f"{bad}:2:1: error: stage 1 appears on two ranks: rank 0 (row 1, column 5) and "
            f"rank 1 (row 2, column 1)") in err
    assert f"{bad}:1:5: note: stage 1 is first on rank 0 here" in err


@pytest.mark.parametrize(("text", "args", "message"), [
    ("", (), "empty schedule"),
    ("\n0F0,0B0\n", (), "rank 0 owns no stage"),
    ("0F0,0SEND_F0\n", ("--format", "compute_only"), "0SEND_F0 is a communication action"),
    ("0F0,0B0\n", ("--microbatches", "0"), "microbatches must be a positive integer"),
])
def test_import_rejects_bad_files(cli, tmp_path: Path, text: str, args: tuple[str, ...],
                                  message: str) -> None:
    f = tmp_path / "s.csv"
    f.write_text(text)
    code, out, err = cli("import-torch", f, *args)
    assert code == 2 and message in err and out == ""


def test_import_reports_invalid_schedules_at_their_cells(cli, tmp_path: Path) -> None:
    f = tmp_path / "order.csv"
    f.write_text("0F0,0B0\n2F0,2B0\n")
    code, _, err = cli("import-torch", f)
    assert code == 1 and "stage 1 appears in no cell" in err
    f.write_text("0F0,0F1,0B0,0B1\n1F1,1B1,1F0,1B0\n")  # a valid order, but not for torch:
    code, _, err = cli("check", f)  # its last stage must compute the losses in mb order
    assert code == 1 and f"{f}:2:1: error: 1F1 (rank 1, action 1 of its row, column 1) is " \
        "forward number 1 of the last stage, but for micro-batch 1" in err
    f.write_text("0F0,0F1,0B1,0B0\n1F0,1B0,1F1,1B1\n")  # rank 0 waits for B1 first: fine too
    assert cli("check", f)[0] == 0
    f.write_text("0F0,0B0\n1F0\n")
    code, _, err = cli("check", f)
    assert code == 1 and "B(1,0)" in err and "missing" in err
    f.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    code, _, err = cli("import-torch", f, "--microbatches", "1")
    assert code == 1 and f"{f}:1:5: error:" in err and "out of range" in err


def test_from_torch_actions_takes_dicts_lists_and_none() -> None:
    ops = {0: ["0F0", None, "0B0"], 1: ["1F0", "1B0"]}
    imp = from_torch_actions(ops)
    assert imp.schedule == library.get("1f1b", 2, 1)
    with pytest.raises(pipeir.UsageError, match=r"ranks must be 0 to 1"):
        from_torch_actions({0: ["0F0"], 2: ["1F0"]})


# ---- export and round trips ------------------------------------------------------------------

ROUND_TRIPS = [
    ("1f1b", 2, 3, {}, "compute_only"),
    ("zb-h1", 2, 4, {}, "compute_only"),
    ("interleaved-1f1b", 2, 4, {"v": 2}, "compute_comms"),
    ("zb-v", 2, 4, {}, "compute_comms"),
    ("dualpipe-v", 2, 4, {}, "compute_only"),
    ("dualpipe-v", 2, 4, {}, "compute_comms"),
]


@pytest.mark.parametrize(("name", "p", "m", "kw", "fmt"), ROUND_TRIPS)
def test_export_then_import_is_identity(cli, golden, tmp_path: Path, name: str, p: int, m: int,
                                        kw: dict[str, int], fmt: str) -> None:
    sched = library.get(name, p, m, **kw)
    out = tmp_path / f"{name}.csv"
    args = ["--v", str(kw["v"])] if kw else []
    code, _, err = cli("export-torch", "--schedule", name, "--ranks", p, "--microbatches", m,
                       *args, "--format", fmt, "-o", out)
    assert code == 0, err
    data = out.read_bytes()
    assert b"\r\n" in data  # rows end as torch's csv.writer ends them
    text = data.decode().replace("\r\n", "\n")
    golden(f"interop/{name}-p{p}m{m}-{fmt}.csv.expected", text)
    # .sched -> CSV -> .sched, and CSV -> .sched -> CSV
    code, printed, err = cli("import-torch", out)
    assert code == 0, err
    # torch's REDUCE_GRAD (compute_comms) comes back as R ops exactly where dp-reduce puts them
    want = sched if fmt == "compute_only" else DpReduce().run(sched)
    assert pipeir.parse(printed) == want.with_programs(want.programs, name=out.stem)
    assert printed == print_schedule(pipeir.parse(printed))
    back = tmp_path / "back.sched"
    assert cli("import-torch", out, "-o", back)[0] == 0
    assert cli("export-torch", back, "--format", fmt, "-o", tmp_path / "again.csv")[0] == 0
    assert (tmp_path / "again.csv").read_bytes() == data
    assert cli("export-torch", out, "--format", fmt)[1].replace("\r\n", "\n") == text


def test_export_places_comms_exactly_as_torch_lowers_the_compute_file() -> None:
    """Our compute_comms is what torch's `_add_send_recv` makes of our compute_only file."""
    from torch.distributed.pipelining import schedules as S

    for name, p, m, kw in (("interleaved-1f1b", 4, 8, {"v": 2}), ("zb-v", 4, 8, {}),
                           ("dualpipe-v", 4, 8, {}), ("looped-bfs", 2, 4, {}),
                           ("zb-h2", 4, 8, {})):
        sched = library.get(name, p, m, **kw)
        rows = {r: S._add_reduce_grad([S._Action.from_str(str(a)) for a in row], m)
                for r, row in enumerate(compute_actions(sched))}
        place = sched.config.placement
        theirs = S._add_send_recv(rows, lambda s, place=place: place[s], len(place))
        assert [[str(a) for a in theirs[r]] for r in range(p)] == \
            [[str(a) for a in row] for row in comms_actions(sched)], name


def test_export_rejects_bad_input(cli, tmp_path: Path) -> None:
    code, _, err = cli("export-torch", "--schedule", "1f1b", "--ranks", "2",
                       "--microbatches", "2", "--format", "xml")
    assert code == 2 and "invalid choice: 'xml'" in err
    bad = tmp_path / "bad.sched"
    bad.write_text("pipeline { ranks = 2  microbatches = 1 }\n"
                   "schedule s { rank 0 { F(0,0) B(0,0) } rank 1 { B(1,0) F(1,0) } }\n")
    code, _, err = cli("export-torch", bad, "-o", tmp_path / "out.csv")
    assert code == 1 and "deadlock" in err and not (tmp_path / "out.csv").exists()


# ---- compute_comms: static deadlock proof ----------------------------------------------------

MISORDERED = (
    # rank 1 waits for micro-batch 1's activation before it sends micro-batch 0's gradient;
    # rank 0 sends that activation only after it has the gradient. torch accepts this file
    # and hangs until the process-group timeout.
    "0F0,0SEND_F0,0F1,0RECV_B0,0B0,0SEND_F1,0RECV_B1,0B1\n"
    "1RECV_F0,1F0,1RECV_F1,1F1,1B0,1SEND_B0,1B1,1SEND_B1\n"
)


def test_check_refutes_a_misordered_compute_comms_file(cli, tmp_path: Path) -> None:
    f = tmp_path / "hang.csv"
    f.write_text(MISORDERED)
    code, out, err = cli("check", f)
    assert code == 1 and out == ""
    assert err.startswith(f"{f}:1:27: error: torch's runtime would hang on this schedule: "
                          f"rank 0 -> rank 1 -> rank 0 wait on each other\n")
    assert f"rank 0 at #7 `wait-recv tensor=grad stage=1 mb=0 peer=1 tag=3` (0B0, {f}:1:27)" in err
    assert f"rank 1 at #7 `wait-recv tensor=act stage=0 mb=1 peer=0 tag=4` (1F1, {f}:2:23)" in err
    # the compute order alone is fine: only the placement of the transfers is wrong
    f.write_text(MISORDERED.replace("SEND_F", "XX").replace("RECV_F", "XX"))
    assert cli("check", f)[0] == 2
    fixed = tmp_path / "fixed.csv"
    fixed.write_text("0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1,0REDUCE_GRAD\n"
                     "1RECV_F0,1F0,1RECV_F1,1F1,1B0,1SEND_B0,1B1,1SEND_B1,1REDUCE_GRAD\n")
    code, out, err = cli("check", fixed)
    assert code == 0, err
    assert "comms ok: 4 transfers over 2 rank pairs" in out


def test_check_lowered_lowers_a_csv_as_pipeir_would(cli, tmp_path: Path) -> None:
    """`check --lowered` on a CSV adds the proof of pipeir's own lowering of its compute
    order (it used to ignore the flag; issue 11)."""
    f = tmp_path / "s.csv"
    f.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    code, out, _ = cli("check", f)
    assert code == 0 and "lowered by pipeir" not in out
    code, out, err = cli("check", "--lowered", f)
    assert code == 0, err
    assert f"{f}: lowered by pipeir (import-torch, compile): lowered ok: 4 blocking " \
           "transfers over 2 rank pairs" in out


@pytest.mark.parametrize(("text", "message"), [
    ("0F0,0B0\n1F0,1B0,1SEND_B0\n",  # no RECV_F
     ":2:1: error: 1F0 (rank 1, action 1 of its row, column 1) waits for a transfer it never "
     "posted (receive of the activation of stage 0, micro-batch 0)"),
    ("0F0,0SEND_F0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n",  # no RECV_B
     ":1:14: error: 0B0 (rank 0, action 3 of its row, column 14) waits for a transfer it never "
     "posted (receive of the input gradient of stage 1, micro-batch 0)"),
    ("0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0,1SEND_F0\n",
     ":2:27: error: 1SEND_F0 (rank 1, action 5 of its row, column 27) sends the activation of "
     "stage 1, micro-batch 0, but there is no stage 2 (stages are 0 to 1)"),
])
def test_check_refutes_missing_transfers(cli, tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "s.csv"
    f.write_text(text)
    code, _, err = cli("check", f)
    assert code == 1 and f"{f}{message}\n" in err


# ---- live oracle: torch's own schedule classes -----------------------------------------------

ORACLE = [  # torch class, pipeir library schedule, parameters
    ("GPipe", "gpipe", {}),
    ("Interleaved1F1B", "interleaved-1f1b", {"v": 2}),
    ("LoopedBFS", "looped-bfs", {"v": 2}),
    ("ZBVZeroBubble", "zb-v", {}),
    ("DualPipeV", "dualpipe-v", {}),
]


@pytest.mark.parametrize(("torch_name", "ours", "kw"), ORACLE)
def test_torch_orders_import_verify_and_match_the_library(torch_name: str, ours: str,
                                                           kw: dict[str, int]) -> None:
    compared = 0
    for p in (2, 4, 8):
        for m in (2, 4, 8, 16):
            ops = _torch_ops(torch_name, p, m)
            if ops is None:
                continue
            theirs = from_torch_actions(ops, microbatches=m).schedule
            pipeir.verify(theirs)
            mine = library.get(ours, p, m, **kw)
            if any(op.kind == "R" for op in theirs):  # torch's REDUCE_GRAD: dp-reduce's R
                mine = DpReduce().run(mine)
            got, want = simulate(mine, UNIT), simulate(theirs, UNIT)
            assert got.makespan <= want.makespan, f"{ours} p={p} m={m} slower than torch"
            assert mine.programs == theirs.programs and mine.pairs == theirs.pairs
            compared += 1
    assert compared >= 6


@pytest.mark.parametrize("torch_name", ["Interleaved1F1B", "LoopedBFS", "ZBVZeroBubble",
                                        "DualPipeV", "InterleavedZeroBubble"])
def test_torch_compute_comms_orders_are_proved_deadlock_free(torch_name: str) -> None:
    from pipeir.interop import prove_comms

    proved = 0
    for p, m in ((2, 4), (4, 8), (8, 16)):
        ops = _torch_ops(torch_name, p, m, with_comms=True)
        if ops is None:
            continue
        imp = from_torch_actions(ops, microbatches=m)
        assert imp.has_comms
        pipeir.verify(imp.schedule)
        report = prove_comms(imp)
        assert report.total == sum(str(a).count("SEND") for row in ops for a in row if a)
        proved += 1
    assert proved >= 2


def test_torch_1f1b_order_is_rejected_with_the_reason() -> None:
    """torch's Schedule1F1B.pipeline_order (visualisation only) shifts the last rank by one
    micro-batch; pipeir says which op is out of range (see tests/test_library.py)."""
    ops = _torch_ops("1F1B", 4, 8)
    assert ops is not None
    imp = from_torch_actions(ops, microbatches=8)
    with pytest.raises(pipeir.VerifyError) as e:
        pipeir.verify(imp.schedule)
    assert e.value.check == "range" and "F(3,8): micro-batch 8 is out of range" in e.value.render()


def test_interleaved_zero_bubble_from_torch_simulates_and_loses_to_zb_v() -> None:
    """torch's ScheduleInterleavedZeroBubble has no library twin; imported, it verifies, and
    zb-v (same chunks per rank, same I/W split) is at least as fast under F = I = W = 1."""
    for p, m in ((2, 4), (4, 8)):
        ops = _torch_ops("InterleavedZeroBubble", p, m)
        assert ops is not None
        theirs = from_torch_actions(ops, microbatches=m).schedule
        pipeir.verify(theirs)
        assert simulate(library.get("zb-v", p, m), UNIT).makespan <= \
            simulate(theirs, UNIT).makespan


# ---- an exported schedule trains under torch's own runtime ---------------------------------------

_WORKER = '''
import os, sys, warnings
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
from pipeir.interop import load_csv

warnings.simplefilter("ignore")
rank, port, path, fmt, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
config = load_csv(path).schedule.config
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=config.ranks)
torch.manual_seed(0)
model = [torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh())
         for _ in range(config.stages)]
m, last = config.microbatches, config.stages - 1
x, y = torch.randn(2 * m, 6), torch.randn(2 * m, 6)
mine = config.stages_of(rank)
stages = [PipelineStage(model[s], s, config.stages, torch.device("cpu")) for s in mine]
runtime = _PipelineScheduleRuntime(stages, m, loss_fn=torch.nn.functional.mse_loss)
runtime._load_csv(path, format=fmt)
runtime.step(*((x,) if 0 in mine else ()), target=y if last in mine else None)
torch.save({s: {k: p.grad for k, p in model[s].named_parameters()} for s in mine},
           os.path.join(out, f"rank{rank}.pt"))
dist.destroy_process_group()
'''


def _reference_grads(stages: int, m: int) -> list[dict[str, object]]:
    import torch

    torch.manual_seed(0)
    model = [torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()) for _ in range(stages)]
    x, y = torch.randn(2 * m, 6), torch.randn(2 * m, 6)
    for xm, ym in zip(x.chunk(m), y.chunk(m)):
        h = xm
        for stage in model:
            h = stage(h)
        (torch.nn.functional.mse_loss(h, ym) / m).backward()
    return [{k: p.grad for k, p in stage.named_parameters()} for stage in model]


@pytest.mark.mp
@pytest.mark.parametrize(("name", "fmt"), [("zb-h1", "compute_only"),
                                           ("dualpipe-v", "compute_comms")])
def test_exported_schedule_trains_under_torch_runtime(tmp_path: Path, name: str,
                                                      fmt: str) -> None:
    import torch

    from pipeir.runtime.launch import free_port

    sched = library.get(name, 2, 4)
    csv_path = tmp_path / "s.csv"
    csv_path.write_text(dumps_csv(sched, fmt), newline="")
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    port = str(free_port())
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, str(csv_path), fmt,
                               str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=env)
             for r in range(2)]
    try:
        logs = [p.communicate(timeout=90)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    got: dict[int, dict[str, torch.Tensor]] = {}
    for r in range(2):
        got.update(torch.load(tmp_path / f"rank{r}.pt"))
    want = _reference_grads(sched.config.stages, 4)
    assert sorted(got) == list(range(sched.config.stages))
    for s, ref in enumerate(want):
        for k, g in ref.items():
            torch.testing.assert_close(got[s][k], g, rtol=1e-5, atol=1e-7)


def test_load_csv_reports_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(pipeir.UsageError, match="no such torch schedule CSV"):
        load_csv(tmp_path / "nope.csv")
    with pytest.raises(pipeir.UsageError, match="is a directory"):
        load_csv(tmp_path)
    pair = Action(-1, "OVERLAP_F_B", None, (Action(0, "F", 7), Action(7, "B", 3)))
    assert str(pair) == "(0F7;7B3)OVERLAP_F_B"


def test_proving_the_comms_of_a_compute_only_file_says_there_are_none() -> None:
    """Not a false finding that every receive is missing: torch adds them."""
    s = pipeir.library.get("1f1b", 2, 4)
    with pytest.raises(pipeir.UsageError, match="compute_only file: torch adds its sends and "
                                                "receives itself, so there are none to prove"):
        prove_comms(loads_csv(dumps_csv(s)))
    assert prove_comms(loads_csv(dumps_csv(s, "compute_comms"))).total == 8


def test_a_one_row_file_whose_last_cell_ends_in_csv_is_a_bad_cell(cli, tmp_path: Path) -> None:
    """Read from a file, a row is never taken for a path (the API's hint for loads_csv("x.csv")
    once made this a traceback)."""
    f = tmp_path / "one.csv"
    f.write_text("0F0,x.csv")
    code, _, err = cli("import-torch", f)
    assert code == 2 and "Traceback" not in err
    assert f"{f}:1:5: error: row 1, cell 2: 'x.csv' is not a torch action" in err
