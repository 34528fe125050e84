"""The communication rules against ground truth from outside the checker.

* A corpus of torch schedule CSVs (torch's own files for all its schedule classes, both
  formats, p in {2, 4}, and seeded one-change mutants of them; `fixtures/torch_corpus.py`)
  is judged by an independent event simulation of torch's runtime (`fixtures/torch_oracle.py`):
  pipeir must reject exactly the files the oracle says fail, with a located diagnostic.
* A fixed sample was run under torch's real `_PipelineScheduleRuntime` on gloo
  (`fixtures/label_with_torch.py`, labels and files in `fixtures/torch_labels.json`): pipeir
  and the oracle must both agree with every label. Two files run live here.
* The same faults injected into pipeir's own lowered programs are rejected by the same rules.
"""

from __future__ import annotations

import json
import random
import re
import sys
from dataclasses import replace
from functools import cache
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import pipeir
from pipeir.backend.commcheck import Key, check_comm, schedule_locator, what
from pipeir.backend.instructions import (
    COMPUTE,
    Backward,
    BackwardInput,
    BackwardWeight,
    Batch,
    Comm,
    Forward,
    Instr,
    IRecv,
    ISend,
    Load,
    Loss,
    Lowered,
    OptimizerStep,
    Recv,
    ReduceGrad,
    Send,
    WaitRecv,
    WaitReduce,
    WaitSend,
    WaitSends,
    ZeroGrad,
    tag_of,
)
from pipeir.backend.lower import lower
from pipeir.diagnostics import PipeirError, VerifyError
from pipeir.interop.check import check_csv
from pipeir.passes.overlap import Overlap
from pipeir.testing import configs, schedules

sys.path.insert(0, str(Path(__file__).parent))
from fixtures.torch_corpus import CLASSES, Entry, corpus
from fixtures.torch_oracle import run as oracle

LABELS = Path(__file__).parent / "fixtures" / "torch_labels.json"
LOCATED = re.compile(r"^(?P<file>.+?):(?P<line>\d+):(?P<col>\d+): error: ")


@cache
def _corpus() -> tuple[Entry, ...]:
    return tuple(corpus())


def pipeir_verdict(e: Entry, tmp: Path) -> tuple[bool, str, int]:
    """(accepted, first diagnostic line, exit code) of `pipeirc check` on one file."""
    path = tmp / f"{e.digest}.csv"
    path.write_text(e.text)
    try:
        check_csv(str(path), microbatches=e.microbatches)
    except PipeirError as err:
        return False, err.render().splitlines()[0], err.exit_code
    return True, "", 0


def test_the_corpus_is_large_and_covers_every_class_format_and_operator() -> None:
    entries = _corpus()
    assert len(entries) >= 400
    assert {e.torch_class for e in entries} == set(CLASSES)
    assert {(e.format, e.ranks) for e in entries} == {(f, p) for f in ("compute_only",
                                                                       "compute_comms")
                                                      for p in (2, 4)}
    ops = {e.mutation.split()[0] for e in entries if e.mutation}
    assert ops == {"swap", "hoist", "sink", "drop", "duplicate", "stage", "microbatch", "move"}


def test_pipeir_agrees_with_the_oracle_on_the_whole_corpus(tmp_path: Path) -> None:
    """Every file the oracle says torch fails on is rejected with exit 1 and a diagnostic
    at a CSV line and column; every file it says torch runs correctly is accepted."""
    missed, alarms, unlocated = [], [], []
    verdicts = set()
    for e in _corpus():
        truth, why = oracle(e.text, e.format, e.ranks, e.stages, e.microbatches)
        verdicts.add(truth)
        ok, first, code = pipeir_verdict(e, tmp_path)
        if truth == "ok" and not ok:
            alarms.append((e.name, first))
        elif truth != "ok" and ok:
            missed.append((e.name, truth, why))
        elif not ok and (code != 1 or not LOCATED.match(first)):
            unlocated.append((e.name, code, first))
    assert verdicts == {"ok", "raises", "hangs", "wrong", "redundant"}
    assert missed == [] and alarms == [] and unlocated == []


def _labels() -> list[dict[str, object]]:
    data = json.loads(LABELS.read_text())
    assert data["backend"] == "gloo" and data["steps"] == 2
    return data["labels"]  # type: ignore[no-any-return]


def _entry(label: dict[str, object]) -> Entry:
    return Entry(str(label["name"]), str(label["torch_class"]), str(label["format"]),
                 int(label["ranks"]), int(label["stages"]),  # type: ignore[arg-type]
                 int(label["microbatches"]), tuple(label["placement"]),  # type: ignore[arg-type]
                 str(label["text"]), str(label["mutation"]))


def test_pipeir_and_the_oracle_agree_with_torchs_own_runtime(tmp_path: Path) -> None:
    labels = _labels()
    assert len(labels) >= 100
    assert {lb["verdict"] for lb in labels} == {"ok", "raises", "hangs", "wrong", "redundant"}
    assert {lb["torch_class"] for lb in labels} == set(CLASSES)
    wrong = []
    for lb in labels:
        e = _entry(lb)
        valid = lb["verdict"] == "ok"
        accepted = pipeir_verdict(e, tmp_path)[0]
        simulated = oracle(e.text, e.format, e.ranks, e.stages, e.microbatches)[0] == "ok"
        if accepted != valid or simulated != valid:
            wrong.append((e.name, lb["verdict"], accepted, simulated))
    assert wrong == []


# ---- the example, end to end --------------------------------------------------------

GPIPE_EARLY_SEND = (
    "0F0,0SEND_F0,0F1,0SEND_F1,0SEND_F2,0F2,0F3,0SEND_F3,0RECV_B0,0B0,0RECV_B1,0B1,0RECV_B2,"
    "0B2,0RECV_B3,0B3,0REDUCE_GRAD\n"
    "1RECV_F0,1F0,1RECV_F1,1F1,1RECV_F2,1F2,1RECV_F3,1F3,1B0,1SEND_B0,1B1,1SEND_B1,1B2,"
    "1SEND_B2,1B3,1SEND_B3,1REDUCE_GRAD\n")


def test_a_send_before_its_forward_is_rejected_naming_both(cli, tmp_path: Path) -> None:
    f = tmp_path / "gpipe.csv"
    f.write_text(GPIPE_EARLY_SEND)
    code, out, err = cli("check", f, "--microbatches", "4")
    assert code == 1 and out == ""
    assert err.startswith(f"{f}:1:27: error: 0SEND_F2 (rank 0, action 5 of its row, column 27) "
                          f"sends the activation of stage 0, micro-batch 2 before the op that "
                          f"produces it; it must come after it\n")
    assert (f"{f}:1:36: note: the producing op, later on this rank: 0F2 (rank 0, action 6 of "
            f"its row, column 36)") in err
    assert "Traceback" not in err
    f.write_text(GPIPE_EARLY_SEND.replace("0SEND_F2,0F2", "0F2,0SEND_F2"))
    code, out, err = cli("check", f, "--microbatches", "4")
    assert code == 0, err
    assert "comms ok: 8 transfers over 2 rank pairs" in out


def test_crossing_transfers_are_named(cli, tmp_path: Path) -> None:
    """Rank 1 posts the receives of micro-batches 0 and 1 in the opposite order: gloo hands
    it micro-batch 0's activation as micro-batch 1's (torch trains on the wrong tensors)."""
    f = tmp_path / "cross.csv"
    f.write_text(GPIPE_EARLY_SEND.replace("0SEND_F2,0F2", "0F2,0SEND_F2")
                 .replace("1RECV_F0,1F0,1RECV_F1", "1RECV_F1,1RECV_F0,1F0"))
    code, _, err = cli("check", f)
    assert code == 1
    assert err.startswith(f"{f}:2:1: error: 1RECV_F1 (rank 1, action 1 of its row, column 1) "
                          f"receives the activation of stage 0, micro-batch 1 from rank 0, "
                          f"which sends the activation of stage 0, micro-batch 0 first: the "
                          f"two transfers cross")
    mb = "the activation of stage 0, micro-batch"
    assert f"{f}:1:5: note: rank 0 sends {mb} 0 first: 0SEND_F0" in err
    assert f"{f}:1:18: note: then {mb} 1: 0SEND_F1" in err
    assert f"{f}:2:10: note: rank 1 receives {mb} 0 only later: 1RECV_F0" in err


def test_reduce_grad_must_follow_the_last_backward(cli, tmp_path: Path) -> None:
    f = tmp_path / "reduce.csv"
    good = GPIPE_EARLY_SEND.replace("0SEND_F2,0F2", "0F2,0SEND_F2")
    f.write_text(good.replace("1B3,1SEND_B3,1REDUCE_GRAD", "1REDUCE_GRAD,1B3,1SEND_B3"))
    code, _, err = cli("check", f)
    assert code == 1
    assert err.startswith(f"{f}:2:92: error: 1REDUCE_GRAD (rank 1, action 15 of its row, column "
                          f"92) comes before 1B3 (rank 1, action 16 of its row, column 105)")
    f.write_text(good.replace(",0REDUCE_GRAD", ""))
    code, _, err = cli("check", f)
    assert code == 1 and "stage 0 has no 0REDUCE_GRAD on rank 0" in err


@pytest.mark.parametrize("torch_class", CLASSES)
def test_torchs_own_files_pass_or_fail_for_a_named_reason(torch_class: str,
                                                          tmp_path: Path) -> None:
    """Every file torch writes for a class passes, except 1F1B's visualiser order, which
    torch's own runtime refuses too (the last rank is one micro-batch ahead)."""
    bases = [e for e in _corpus() if e.torch_class == torch_class and not e.mutation]
    assert {e.format for e in bases} >= {"compute_only"}
    for e in bases:
        ok, first, _ = pipeir_verdict(e, tmp_path)
        if torch_class == "1F1B":
            assert not ok and ": error: " in first
        else:
            assert ok, (e.name, first)


@pytest.mark.mp
def test_a_few_files_live_under_torchs_runtime() -> None:
    """The labelling harness itself, on two files: a valid one trains, the issue's example
    fails at once (KeyError in SEND_F). Both steps run on 2 gloo processes."""
    pytest.importorskip("torch")
    from fixtures.label_with_torch import label

    good = next(e for e in _corpus() if e.name == "GPipe-p2-m4-compute_comms")
    assert label(good)["verdict"] == "ok"
    bad = replace(good, text=GPIPE_EARLY_SEND.replace("\n", "\r\n"), name="early-send")
    got = label(bad)
    assert got["verdict"] == "raises" and "KeyError" in got["why"], got


# ---- the same faults in pipeir's own lowered programs --------------------------------------

FAULTS = ("send-before-producer", "wait-after-consumer", "drop", "duplicate", "retarget",
          "cross")


def _comms(low: Lowered, kinds: tuple[type, ...]) -> list[tuple[int, int]]:
    return [(r, k) for r, prog in enumerate(low.programs) for k, ins in enumerate(prog)
            if isinstance(ins, kinds)]


def _producer(prog: tuple[Instr, ...], key: Key) -> int | None:
    tensor, stage, mb = key
    kinds = (Forward,) if tensor == "act" else (Backward, BackwardInput)
    return next((k for k, i in enumerate(prog) if isinstance(i, kinds)
                 and i.stage == stage and i.mb == mb), None)


def _consumer(prog: tuple[Instr, ...], key: Key, after: int) -> int | None:
    tensor, stage, mb = key
    want = (stage + 1) if tensor == "act" else (stage - 1)
    kinds = (Forward,) if tensor == "act" else (Backward, BackwardInput)
    return next((k for k in range(after, len(prog)) if isinstance(prog[k], kinds)
                 and prog[k].stage == want and prog[k].mb == mb), None)  # type: ignore[attr-defined]


def _with(low: Lowered, rank: int, prog: list[Instr]) -> Lowered:
    progs = list(low.programs)
    progs[rank] = tuple(prog)
    return replace(low, programs=tuple(progs))


def inject(low: Lowered, fault: str, rnd: random.Random
           ) -> tuple[Lowered, tuple[Key, ...]] | None:
    """`low` with one fault of kind `fault`, and the transfers it breaks (None: not here)."""
    if fault in ("send-before-producer", "retarget", "cross"):
        sites = _comms(low, (Send, ISend))
    elif fault == "wait-after-consumer":
        sites = _comms(low, (WaitRecv,))
    else:  # (a second `wait-sends` waits for nothing: harmless, not a fault)
        sites = _comms(low, (Send, ISend, IRecv, WaitRecv, WaitSend,
                             *((WaitSends,) if fault == "drop" else ())))
    if not sites:
        return None
    r, k = rnd.choice(sites)
    prog = list(low.programs[r])
    ins = prog[k]
    if isinstance(ins, WaitSends):  # dropped: the sends it waited for are never waited
        prog.pop(k)
        sent = [c.key for i in prog[:k] for c in (i.posts if isinstance(i, Batch) else (i,))
                if isinstance(c, ISend)]
        return _with(low, r, prog), tuple(sent)
    assert isinstance(ins, Comm)
    if fault == "send-before-producer":
        p = _producer(low.programs[r], ins.key)
        assert p is not None and p < k
        prog.insert(p, prog.pop(k))
    elif fault == "wait-after-consumer":
        c = _consumer(low.programs[r], ins.key, k)
        assert c is not None
        prog.insert(c, prog.pop(k))
    elif fault == "drop":
        prog.pop(k)
    elif fault == "duplicate":
        prog.insert(k + 1, ins)
    elif fault == "retarget":
        others = [m for m in range(low.microbatches * low.accumulate) if m != ins.mb]
        if not others:
            return None
        prog[k] = replace(ins, mb=rnd.choice(others))
        return _with(low, r, prog), (ins.key, prog[k].key)  # type: ignore[attr-defined]
    else:  # two sends to the same peer, swapped
        same = [j for j in range(len(prog)) if j != k and isinstance(prog[j], type(ins))
                and prog[j].peer == ins.peer]  # type: ignore[attr-defined]
        if not same:
            return None
        j = rnd.choice(same)
        prog[j], prog[k] = prog[k], prog[j]
        return _with(low, r, prog), (ins.key, prog[k].key)  # type: ignore[attr-defined]
    return _with(low, r, prog), (ins.key,)


@given(schedules(configs(max_ranks=4, max_microbatches=4, max_chunks=2, min_ranks=2)),
       st.booleans(), st.sampled_from(FAULTS), st.randoms(use_true_random=False))
def test_faults_injected_into_lowered_programs_are_rejected(schedule, overlap: bool,
                                                            fault: str,
                                                            rnd: random.Random) -> None:
    low = lower(schedule)
    if overlap:
        low = Overlap().run(low)
        assume(fault != "cross")  # posts there are batched per peer; swapped below instead
    check_comm(low)
    got = inject(low, fault, rnd)
    assume(got is not None)
    assert got is not None
    bad, keys = got
    with pytest.raises(VerifyError) as e:
        check_comm(bad, schedule_locator(schedule))
    assert e.value.check == "comm"
    text = e.value.render()
    assert any(what(k) in text for k in keys) or "deadlock" in text, text
    assert "Traceback" not in text


@given(schedules(configs(max_ranks=4, max_microbatches=4, max_chunks=2, min_ranks=2)),
       st.booleans(), st.sampled_from((*FAULTS, "tag", "twice", "none")),
       st.randoms(use_true_random=False))
def test_the_matching_rules_shortcut_finds_what_its_full_check_finds(
        schedule, overlap: bool, fault: str, rnd: random.Random) -> None:
    """`rule_matching` skips its per-key index where every channel's two sides pair up
    (`matching._paired`); the oracle is the full check it skips, on the same programs: the
    same findings, in the same order, for sound programs and for every injected fault (a
    changed tag, and a transfer sent and received twice, included)."""
    from pipeir.backend.commcheck import matching

    low = lower(schedule)
    if overlap:
        low = Overlap().run(low)
    if fault == "tag":
        sites = _comms(low, (Send, ISend))
        r, k = rnd.choice(sites)
        prog = list(low.programs[r])
        prog[k] = replace(prog[k], tag=prog[k].tag + 1)  # type: ignore[attr-defined]
        low = _with(low, r, prog)
    elif fault == "twice":  # both sides posted twice: the two sides still pair up
        r, k = rnd.choice(_comms(low, (Send, ISend)))
        tx = low.programs[r][k]
        assert isinstance(tx, Comm)
        rx = next(((q, j) for q, j in _comms(low, (Recv, IRecv))
                   if low.programs[q][j].key == tx.key), None)  # type: ignore[attr-defined]
        assume(rx is not None)
        assert rx is not None
        low = _with(low, r, [*low.programs[r][:k + 1], tx, *low.programs[r][k + 1:]])
        q, j = rx
        low = _with(low, q, [*low.programs[q][:j + 1], low.programs[q][j],
                             *low.programs[q][j + 1:]])
    elif fault != "none":
        got = inject(low, fault, rnd)
        assume(got is not None)
        assert got is not None
        low = got[0]

    def findings() -> list[tuple[str, object]]:
        return [(f.message, f.site) for f in matching.Matching(low).rule_matching()]
    fast = findings()
    with mock.patch.object(matching, "_paired", lambda sent, recvd: False):
        assert fast == findings()
    if fault == "tag":
        assert fast and "with tag" in fast[0][0]
    if fault == "twice":
        assert fast and "a second time" in fast[0][0]


@given(schedules(configs(max_ranks=4, max_microbatches=4, max_chunks=2, min_ranks=2)),
       st.sampled_from(("", "split-backward", "recompute{all=true}", "offload{budget=1}")),
       st.sampled_from(("none", "drop", "twice", "move", "mb", "scale", "load", "late")),
       st.randoms(use_true_random=False))
def test_the_compute_rules_shortcut_finds_what_its_full_check_finds(
        schedule, pipeline: str, fault: str, rnd: random.Random) -> None:
    """`rule_compute` takes the common correct compute sequences without looking further
    (`Matching._normal`); the oracle is the full per-op check it skips (`_one_op`), on the
    same programs: the same findings, in order, for sound programs and for computes and
    loads dropped, doubled, moved or changed, a load just after its use, and a loss scaled
    wrongly."""
    from pipeir.backend.commcheck import matching
    from pipeir.passes import PassContext, PassManager, parse_pipeline
    from pipeir.sim import CostModel

    if pipeline:
        try:
            schedule = PassManager(parse_pipeline(pipeline),
                                   context=PassContext(CostModel())).run(schedule)
        except PipeirError:
            assume(False)
    low = lower(schedule)
    if fault != "none":
        kinds = (Load,) if fault in ("load", "late") else (Loss,) if fault == "scale" \
            else COMPUTE
        where = [(r, k) for r, prog in enumerate(low.programs) for k, i in enumerate(prog)
                 if isinstance(i, kinds)]
        assume(where)
        r, k = rnd.choice(where)
        prog = list(low.programs[r])
        ins = prog[k]
        if fault in ("drop", "load"):
            del prog[k]
        elif fault == "twice":
            prog.insert(rnd.randrange(len(prog) + 1), ins)
        elif fault == "move":
            prog.insert(rnd.randrange(len(prog) + 1), prog.pop(k))
        elif fault == "late":  # just after the compute that needs it
            j = next(j for j in range(k + 1, len(prog)) if isinstance(prog[j], COMPUTE))
            prog.insert(j, prog.pop(k))
        elif fault == "mb":
            prog[k] = replace(ins, mb=ins.mb + 1)  # type: ignore[call-arg]
        else:
            prog[k] = replace(ins, scale=2 * ins.scale)  # type: ignore[attr-defined, call-arg]
        low = _with(low, r, prog)

    def findings() -> list[tuple[str, object, object]]:
        return [(f.message, f.site, f.notes) for f in matching.Matching(low).rule_compute()]
    fast = findings()
    with mock.patch.object(matching.Matching, "_normal", lambda *args: False):
        assert fast == findings()
    if fault in ("drop", "twice", "scale", "load", "late"):
        assert fast


@given(schedules(configs(max_ranks=3, max_microbatches=4, min_ranks=2, min_microbatches=2)))
def test_crossed_receives_in_a_batch_are_named(schedule) -> None:
    low = Overlap().run(lower(schedule))
    batches = [(r, k) for r, prog in enumerate(low.programs) for k, i in enumerate(prog)
               if isinstance(i, Batch) and len({p.key for p in i.posts
                                                if isinstance(p, IRecv)}) > 1]
    assume(batches)
    r, k = batches[0]
    prog = list(low.programs[r])
    b = prog[k]
    assert isinstance(b, Batch)
    recvs = [i for i, p in enumerate(b.posts) if isinstance(p, IRecv)]
    posts = list(b.posts)
    i, j = recvs[0], next((x for x in recvs[1:] if posts[x].peer == posts[recvs[0]].peer),
                          None) or -1
    assume(j >= 0)
    posts[i], posts[j] = posts[j], posts[i]
    prog[k] = replace(b, posts=tuple(posts))
    with pytest.raises(VerifyError, match="the two transfers cross"):
        check_comm(_with(low, r, prog))


def test_lowered_findings_point_at_the_sched_op() -> None:
    s = pipeir.library.get("1f1b", 2, 2)
    low = lower(s)
    r, k = _comms(low, (Send,))[0]
    prog = list(low.programs[r])
    p = _producer(low.programs[r], prog[k].key)  # type: ignore[attr-defined]
    assert p is not None
    prog.insert(p, prog.pop(k))
    with pytest.raises(VerifyError) as e:
        check_comm(_with(low, r, prog), schedule_locator(s))
    d = e.value.diagnostics[0]
    assert d.span is not None and d.span.file.endswith("1f1b.sched")
    assert "before the op that produces it" in d.message


COMPUTES = (Forward, Backward, BackwardInput, BackwardWeight, Loss)


@given(schedules(configs(max_ranks=3, max_microbatches=3, max_chunks=2)), st.booleans(),
       st.randoms(use_true_random=False))
def test_a_compute_left_out_or_run_twice_is_rejected(schedule, twice: bool,
                                                     rnd: random.Random) -> None:
    """The fault is known from the mutation, not from the checker: one compute instruction
    (forward, loss, B, I or W) removed or repeated. Removing one whose output no rank
    receives (stage 0's backward, any W, a loss) used to pass."""
    low = lower(schedule)
    sites = [(r, k) for r, prog in enumerate(low.programs) for k, i in enumerate(prog)
             if type(i) in COMPUTES]
    r, k = rnd.choice(sites)
    prog = list(low.programs[r])
    ins = prog[k]
    if twice:
        prog.insert(k + 1, ins)
    else:
        prog.pop(k)
    with pytest.raises(VerifyError) as e:
        check_comm(_with(low, r, prog), schedule_locator(schedule))
    text = e.value.render()
    stage, mb = ins.stage, ins.mb  # type: ignore[attr-defined]
    assert f"stage {stage}, micro-batch {mb}" in text, text


def test_compute_findings_say_what_is_missing_or_out_of_order() -> None:
    low = lower(pipeir.library.get("1f1b", 2, 2))
    prog = list(low.programs[0])
    b = next(k for k, i in enumerate(prog) if isinstance(i, Backward))
    f = next(k for k, i in enumerate(prog) if isinstance(i, Forward))
    with pytest.raises(VerifyError) as e:
        check_comm(_with(low, 0, prog[:b] + prog[b + 1:]))
    assert e.value.message == (
        f"rank 0 at #{f} `forward stage=0 mb=0` (F(0,0), {prog[f].at}) has no backward: rank "
        "0 never runs B, or I and W, of stage 0, micro-batch 0; every stage runs one forward "
        "and one backward (B, or I then W) per micro-batch")
    split = lower(pipeir.compile(pipeir.library.get("1f1b", 2, 2), "split-backward").schedule)
    prog = list(split.programs[0])
    w = next(k for k, i in enumerate(prog) if isinstance(i, BackwardWeight))
    with pytest.raises(VerifyError, match=r"runs I of stage 0, micro-batch \d without its W"):
        check_comm(_with(split, 0, prog[:w] + prog[w + 1:]))
    last = list(low.programs[1])
    loss = next(k for k, i in enumerate(last) if isinstance(i, Loss))
    back = next(k for k, i in enumerate(last) if isinstance(i, Backward))
    last.insert(back + 1, last.pop(loss))
    with pytest.raises(VerifyError, match=r"`loss .*runs after `backward` of stage 1, "
                                          r"micro-batch 0, which needs it first"):
        check_comm(_with(low, 1, last))
    alone = lower(pipeir.library.get("1f1b", 1, 2))
    with pytest.raises(VerifyError) as e:
        check_comm(replace(alone, programs=((),)))
    assert e.value.message == ("rank 0's program is empty, but the placement runs stage 0 "
                               "there: every stage runs one forward and one backward (B, or I "
                               "then W) per micro-batch")


def _dropped(prog: list[Instr], kind: type) -> list[Instr]:
    return [i for i in prog if not isinstance(i, kind)]


def _moved(prog: list[Instr], kind: type, to: int) -> list[Instr]:
    """`prog` with its first `kind` instruction moved to index `to` (of the shortened list)."""
    k = next(k for k, i in enumerate(prog) if isinstance(i, kind))
    rest = prog[:k] + prog[k + 1:]
    return [*rest[:to], prog[k], *rest[to:]]


# each fault is a mutation of rank 0's program (1F1B, 2 ranks, I + W, dp-reduce), and the
# finding it must produce; the fault is known from the mutation, not from the checker
STEP_FAULTS = [
    (lambda p: _dropped(p, ZeroGrad), r"rank 0's program has no `zero-grad` \(before its first "
     r"instruction, shown\): each program is one optimizer step, and starts by clearing"),
    (lambda p: _dropped(p, OptimizerStep), "rank 0's program has no `step`"),
    (lambda p: _moved(p, ZeroGrad, 4), r"`zero-grad` clears the gradients after a compute of "
     r"the same step"),
    (lambda p: [*p, OptimizerStep()], r"`step` steps a second time: each program is one "
     r"optimizer step"),
    (lambda p: _moved(p, OptimizerStep, 12), r"`step` steps before a compute of the same step"),
    (lambda p: _dropped(p, ReduceGrad), r"stage 0 has no `reduce-grad` on rank 0 \(after its "
     r"last weight gradient, shown\): with data parallelism every stage all-reduces its "
     r"gradients once"),
    (lambda p: _moved(p, ReduceGrad, 12), r"`reduce-grad stage=0` .*reduces stage 0 before its "
     r"last weight gradient"),
    (lambda p: _dropped(p, WaitReduce), r"`reduce-grad stage=0` .*is never waited for"),
    (lambda p: _moved(p, WaitReduce, len(p) - 1), r"`wait-reduce stage=0` .*waits for stage "
     r"0's reduction outside its place: after `reduce-grad` and before `step`"),
    (lambda p: [replace(i, stage=1) if isinstance(i, ReduceGrad) else i for i in p],
     r"`reduce-grad stage=1` .*names stage 1, which runs on rank 1, not on rank 0"),
    (lambda p: [replace(i, stage=7) if isinstance(i, WaitReduce) else i for i in p],
     r"`wait-reduce stage=7` .*names stage 7, but there is no stage 7 \(stages are 0 to 1\)"),
]


@pytest.mark.parametrize(("mutate", "message"), STEP_FAULTS)
def test_a_program_is_one_optimizer_step_with_every_stage_reduced(mutate, message: str
                                                                   ) -> None:
    """A dropped `zero-grad`, `step` or `reduce-grad` runs and trains wrongly without a word
    (gradients add up across steps, nothing trains, replicas drift apart); all are named."""
    s = pipeir.compile(pipeir.library.get("1f1b", 2, 2), "split-backward,dp-reduce").schedule
    low = lower(s)
    check_comm(low)
    with pytest.raises(VerifyError, match=message):
        check_comm(_with(low, 0, mutate(list(low.programs[0]))))



def test_waits_for_reductions_that_no_program_starts_are_rejected() -> None:
    s = pipeir.compile(pipeir.library.get("1f1b", 2, 2), "dp-reduce").schedule
    low = lower(s)
    bare = replace(low, programs=tuple(tuple(_dropped(list(p), ReduceGrad))
                                       for p in low.programs))
    with pytest.raises(VerifyError) as e:
        check_comm(bare)
    assert [d.message.split(" (")[0] for d in e.value.diagnostics] == [
        "stage 0 has no `reduce-grad` on rank 0", "stage 1 has no `reduce-grad` on rank 1"]


def test_a_send_and_its_receive_carry_the_same_tag() -> None:
    """gloo pairs a receive with the send of its tag: a send with another tag leaves both
    waiting (a gloo timeout, tried by hand), which the order rules, blind to tags, passed."""
    low = lower(pipeir.library.get("1f1b", 2, 2))
    prog = list(low.programs[0])
    k = next(k for k, i in enumerate(prog) if isinstance(i, Send))
    prog[k] = replace(prog[k], tag=99)  # type: ignore[call-arg]
    with pytest.raises(VerifyError) as e:
        check_comm(_with(low, 0, prog))
    d = e.value.diagnostics[0]
    assert d.message.startswith("rank 1 at #1 `irecv tensor=act stage=0 mb=0 peer=0 tag=0` ")
    assert d.message.endswith(
        " receives the activation of stage 0, micro-batch 0 with tag 0, but rank 0 sends it "
        "with tag 99: gloo matches a receive to the send of the same tag, so it would wait "
        "forever (NCCL ignores tags)")
    assert d.notes[0].message.startswith(f"the send: rank 0 at #{k} `send tensor=act stage=0 ")


def test_check_lowered_points_at_the_instruction_in_the_json_file(cli, tmp_path: Path
                                                                  ) -> None:
    out = tmp_path / "gen"
    assert cli("compile", "--schedule", "1f1b", "--ranks", 2, "--microbatches", 2, "-o",
               out)[0] == 0
    path = out / "lowered.json"
    data = json.loads(path.read_text())
    prog = data["programs"][0]["table"]
    drop = next(k for k, row in enumerate(prog) if row[0] == "backward")
    fwd = next(k for k, row in enumerate(prog) if row[0] == "forward")
    del prog[drop]
    text = json.dumps(data, indent=1) + "\n"
    path.write_text(text)
    line = text.splitlines().index('     "forward",') + 1  # rank 0's first forward
    code, _, err = cli("check", "--lowered", path)
    assert code == 1
    assert err.startswith(f"{path}:{line}:6: error: rank 0 at #{fwd} `forward stage=0 mb=0` "
                          "(F(0,0), ")
    assert "has no backward" in err and '\n         "forward",\n' in err


def test_findings_of_one_rule_are_capped() -> None:
    """Sixty stage-0 backwards left out are sixty findings: the first 50 are shown, then one
    line says there are more (a header of 100,000 micro-batches printed a million lines)."""
    from pipeir.backend.commcheck import MAX_FINDINGS

    low = lower(pipeir.library.get("1f1b", 2, 60))
    prog = [i for i in low.programs[0] if not isinstance(i, Backward)]
    with pytest.raises(VerifyError) as e:
        check_comm(_with(low, 0, prog))
    found = e.value.diagnostics
    assert len(found) == MAX_FINDINGS + 1 == 51
    assert all("has no backward" in d.message for d in found[:-1])
    assert found[-1].message == "... and more like these (the first 50 are shown)"


@pytest.mark.parametrize("indent", [None, 1])
def test_instruction_spans_find_each_mnemonic_in_any_layout(indent: int | None) -> None:
    """The walk behind `check --lowered`'s locations: keys in reverse order (a program's
    table before its origins), compact or indented, CRLF line ends; a batch's posts, rows
    inside a row, are not instructions of the program."""
    from pipeir.backend.commcheck import instruction_spans
    from pipeir.backend.program_io import to_json
    from pipeir.diagnostics import Source

    def reverse(x: object) -> object:
        if isinstance(x, dict):
            return {k: reverse(v) for k, v in reversed(list(x.items()))}
        return [reverse(v) for v in x] if isinstance(x, list) else x

    low = Overlap().run(lower(pipeir.library.get("1f1b", 2, 3)))
    data = reverse(to_json(low))
    text = json.dumps(data, indent=indent).replace("\n", "\r\n")
    spans = instruction_spans(Source("x.json", text))
    tables = [prog["table"] for prog in data["programs"]]  # type: ignore[index]
    assert set(spans) == {(r, k) for r, table in enumerate(tables) for k in range(len(table))}
    assert any(row[0] == "batch" for table in tables for row in table)
    lines = text.split("\n")
    for (r, k), span in spans.items():
        line = lines[span.line - 1]
        assert line[span.col - 1:span.end_col - 1] == json.dumps(tables[r][k][0])


@pytest.mark.parametrize("peer", [3, 2])
def test_a_wait_names_the_peer_its_post_names(peer: int) -> None:
    """A wait's peer is the side the abstract run waits on: one out of range crashed the run
    (an IndexError from `check --lowered`), and one of another rank was never compared with
    its post's. Both are a finding at the wait, pointing at the post."""
    low = Overlap().run(lower(pipeir.library.get("1f1b", 3, 3)))
    prog = list(low.programs[1])
    k = next(k for k, i in enumerate(prog) if isinstance(i, WaitRecv) and i.peer == 0)
    prog[k] = replace(prog[k], peer=peer)  # type: ignore[call-arg]
    with pytest.raises(VerifyError) as e:
        check_comm(_with(low, 1, prog))
    d = e.value.diagnostics[0]
    assert d.message.startswith(f"rank 1 at #{k} `wait-recv tensor=act stage=0 mb=")
    assert re.search(f" waits for the activation of stage 0, micro-batch [0-9] from rank {peer}, "
                     "but its receive was posted from rank 0$", d.message)
    assert d.notes[0].message.startswith("the receive: rank 1 at #")


def _three_ranks(rank1_first: Instr | None) -> Lowered:
    """1F1B on 3 ranks, one micro-batch, sends waited by `wait-sends`; `rank1_first`: rank 1
    posts it (a blocking receive) before anything else."""
    def tag(tensor: str, stage: int) -> int:
        return tag_of(tensor, stage, 0, 3)  # type: ignore[arg-type]
    r0 = (ZeroGrad(), Load(0, "input"), Forward(0, 0), ISend("act", 0, 0, 1, tag("act", 0)),
          WaitSends(), Recv("grad", 1, 0, 1, tag("grad", 1)), Backward(0, 0), OptimizerStep())
    r1 = (ZeroGrad(), *((rank1_first,) if rank1_first else ()),
          Recv("act", 0, 0, 0, tag("act", 0)), Forward(1, 0), ISend("act", 1, 0, 2, tag("act", 1)),
          *(() if rank1_first else (Recv("grad", 2, 0, 2, tag("grad", 2)),)),
          Backward(1, 0), ISend("grad", 1, 0, 0, tag("grad", 1)), WaitSends(), OptimizerStep())
    r2 = (ZeroGrad(), Recv("act", 1, 0, 1, tag("act", 1)), Forward(2, 0), Load(0, "target"),
          Loss(2, 0, 1.0), Backward(2, 0), ISend("grad", 2, 0, 1, tag("grad", 2)),
          WaitSends(), OptimizerStep())
    return Lowered("three", 3, 3, 1, 1, (0, 1, 2), (r0, r1, r2), overlap=True)


def test_wait_sends_waits_for_the_receive_of_every_send_posted_before_it() -> None:
    """`wait-sends` completes once every send posted before it is received: the abstract run
    follows it like the waits it replaces, a deadlock through it names the peer it waits on,
    and a send posted after it is a send never waited for."""
    check_comm(_three_ranks(None))
    # rank 1 blocks on rank 2's gradient before it receives rank 0's activation: rank 0 waits
    # in `wait-sends` for that receive, rank 2 for rank 1's activation
    with pytest.raises(VerifyError) as e:
        check_comm(_three_ranks(Recv("grad", 2, 0, 2, tag_of("grad", 2, 0, 3))))
    d = e.value.diagnostics[0]
    assert d.message.endswith("deadlock under rendezvous semantics: rank 0 -> rank 1 -> "
                              "rank 2 -> rank 1"), d.message
    assert d.notes[0].message == ("rank 0 at #4 `wait-sends` waits for rank 1; rank 1 is at "
                                  "#1 `recv`")
    low = _three_ranks(None)
    r2 = list(low.programs[2])
    assert isinstance(r2[6], ISend) and r2[7] == WaitSends()
    r2[6], r2[7] = r2[7], r2[6]  # the send after the wait
    with pytest.raises(VerifyError) as e:
        check_comm(_with(low, 2, r2))
    assert [x.message for x in e.value.diagnostics] == [
        "rank 2 at #7 `isend tensor=grad stage=2 mb=0 peer=1 tag=5` posts a send of the input "
        "gradient of stage 2, micro-batch 0 that is never waited for before the program ends"]
