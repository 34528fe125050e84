"""Point-to-point through pipes (`pipeir.runtime.pipes`): the transport's semantics, driven
as two ranks in one process (a thread each where both must move at once), and training
through it and through gloo against single-process training."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import pipeir
from pipeir.runtime.launch import launch
from pipeir.runtime.pipes import Pipes
from tests.runtime_helpers import TIMEOUT, assert_matches_reference, runtime_job

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="pipes are the Linux CPU transport")
MODELS = Path(__file__).parent / "pipes_models.py"


@pytest.fixture
def channel(tmp_path: Path) -> Iterator[tuple[Pipes, Pipes]]:
    """(receiver rank 0, sender rank 1) joined by channel (1, 0)."""
    rx, tx = Pipes(0, timeout_s=5.0), Pipes(1, timeout_s=5.0)
    rx.make_in(1, str(tmp_path / "1-0"))
    tx.open_out(0, str(tmp_path / "1-0"))
    yield rx, tx
    rx.close()
    tx.close()


def _in_thread(fn: object) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()  # type: ignore[operator]
        except BaseException as e:  # (reported by the test)
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, errors


def test_receives_match_sends_by_tag_in_any_order_and_an_early_message_waits(
        channel: tuple[Pipes, Pipes]) -> None:
    rx, tx = channel
    sent = {5: torch.randn(3, 4), 7: torch.arange(6, dtype=torch.bfloat16),
            9: torch.tensor([True, False, True]), 11: torch.empty(0), 13: torch.tensor(2.5)}
    for tag, t in sent.items():
        assert tx.isend(t, 0, tag).wait()
    # received in another order than sent; 5 arrives before its receive is posted
    for tag in (7, 13, 11, 9, 5):
        buf = torch.empty_like(sent[tag])
        rx.irecv(buf, 1, tag).wait()
        assert torch.equal(buf, sent[tag]), tag


def test_a_receive_posted_before_its_message_gets_it_and_a_size_mismatch_is_named(
        channel: tuple[Pipes, Pipes]) -> None:
    rx, tx = channel
    buf = torch.zeros(16)
    work = rx.irecv(buf, 1, 3)
    assert not work.done
    x = torch.randn(16)
    tx.isend(x, 0, 3)
    work.wait()
    assert torch.equal(buf, x)
    mismatch = "rank 1 sent 16 bytes with tag {}, rank 0 expected 8"
    w = rx.irecv(torch.zeros(2), 1, 4)  # posted first
    tx.isend(torch.ones(4), 0, 4)
    with pytest.raises(RuntimeError, match=mismatch.format(4)):
        w.wait()
    tx.isend(torch.ones(4), 0, 6)  # arrives early: read while waiting for tag 7
    tx.isend(torch.ones(1), 0, 7)
    rx.irecv(torch.zeros(1), 1, 7).wait()
    with pytest.raises(RuntimeError, match=mismatch.format(6)):
        rx.irecv(torch.zeros(2), 1, 6)


def test_sends_larger_than_the_pipe_complete_as_the_receiver_reads(
        channel: tuple[Pipes, Pipes]) -> None:
    """An isend never blocks: what the pipe cannot take waits in the sender's queue and goes
    in while the sender waits, as the receiver drains the pipe."""
    rx, tx = channel
    n = _capacity(tx, "send", 0) * 6 // 10 // 4  # floats: 3 sends of 0.6 pipe each
    xs = [torch.randn(n) for _ in range(3)]
    works = [tx.isend(x, 0, i) for i, x in enumerate(xs)]
    assert works[0].done and not works[2].done  # the third could not go in yet
    bufs = [torch.empty_like(x) for x in xs]

    def receive() -> None:
        for i in reversed(range(3)):  # (the last first: the others arrive early)
            rx.irecv(bufs[i], 1, i).wait()

    t, errors = _in_thread(receive)
    for w in works:
        w.wait()
    t.join(10)
    assert not errors and not t.is_alive()
    for x, b in zip(xs, bufs):
        assert torch.equal(x, b)


def test_a_peer_that_closes_fails_the_wait_at_once_and_a_silent_one_after_the_timeout(
        tmp_path: Path) -> None:
    rx, tx = Pipes(0, timeout_s=0.3), Pipes(1, timeout_s=0.3)
    rx.make_in(1, str(tmp_path / "1-0"))
    tx.open_out(0, str(tmp_path / "1-0"))
    try:
        with pytest.raises(RuntimeError, match=r"^timed out after 0.3 s waiting for a "
                                               r"receive from rank 1 \(tag 3\) on rank 0$"):
            rx.irecv(torch.zeros(1), 1, 3).wait()
        tx.isend(torch.ones(2), 0, 3)  # half of what rank 0 expects, then rank 1 exits
        tx.close()
        with pytest.raises(RuntimeError, match=r"^Connection closed by peer: rank 1 closed "
                                               r"its pipe to rank 0 \(did it fail\?\)$"):
            rx.irecv(torch.zeros(2), 1, 3).wait()  # (the message it sent arrives whole)
            rx.irecv(torch.zeros(1), 1, 4).wait()
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            rx.irecv(torch.zeros(1), 1, 5).wait()  # (posted after it closed)
    finally:
        rx.close()
    rx2, tx2 = Pipes(0, timeout_s=5), Pipes(1, timeout_s=5)
    rx2.make_in(1, str(tmp_path / "again"))
    tx2.open_out(0, str(tmp_path / "again"))
    rx2.close()
    with pytest.raises(RuntimeError, match=r"^Broken pipe: rank 0 closed its pipe from rank 1"):
        tx2.isend(torch.ones(1), 0, 1).wait()
    with pytest.raises(RuntimeError, match="Broken pipe"):
        tx2.isend(torch.ones(1), 0, 2)
    tx2.close()


def _capacity(pipes: Pipes, kind: str, peer: int) -> int:
    """The largest transfer `carries` lets through the channel, found through it alone."""
    lo, hi = -1, 1 << 30
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if pipes.carries(kind, peer, mid) else (lo, mid - 1)
    return lo


def test_both_ends_of_a_channel_route_a_transfer_alike(channel: tuple[Pipes, Pipes]) -> None:
    """`carries`: a transfer goes through the pipe on both ends or on neither (the receiver
    reads the same pipe's size as the sender), up to the pipe's size less a header (1 MB
    where the system lets a process grow a pipe that far, as Linux's default does); a
    channel without a pipe carries nothing."""
    rx, tx = channel
    cap = _capacity(rx, "recv", 1)
    assert cap == _capacity(tx, "send", 0) >= (1 << 16) - 16
    if Path("/proc/sys/fs/pipe-max-size").read_text().strip() == str(1 << 20):
        assert cap == (1 << 20) - 16
    for n in (0, 1000, cap - 1, cap, cap + 1, 2 * cap):
        assert rx.carries("recv", 1, n) == tx.carries("send", 0, n) == (n <= cap)
    assert not rx.carries("send", 1, 8) and not tx.carries("recv", 0, 8)
    assert not rx.carries("recv", 2, 8)


@pytest.mark.mp
@pytest.mark.parametrize("pipes", ["auto", "off"])
def test_training_through_pipes_or_gloo_equals_one_process(
        pipes: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (pipes between CPU ranks of one host) and `PIPEIR_P2P_PIPES=off` (gloo):
    the ranks have pipes exactly when allowed (the model's stages check, after the channels
    open), and both train as one process, overlapped and blocking; a hand-off larger than a
    pipe goes through gloo in the same run."""
    lib = pipeir.library
    jobs = [runtime_job(lib.get("1f1b", 2, 4), "overlap", 2, model=f"{MODELS}:probed"),
            runtime_job(lib.get("interleaved-1f1b", 2, 4, v=2), None, 2,
                        model=f"{MODELS}:probed"),
            runtime_job(lib.get("zb-v", 2, 4), "overlap", 2, model=f"{MODELS}:probed"),
            runtime_job(lib.get("1f1b", 2, 2), "overlap", 2, model=f"{MODELS}:big")]
    monkeypatch.setenv("PIPEIR_P2P_PIPES", pipes)  # (each rank takes the launcher's)
    result = launch(jobs, 2, timeout_s=TIMEOUT * 2)
    assert_matches_reference(jobs, result)


def test_a_channel_that_cannot_open_is_left_to_gloo_and_nothing_stays_on_disk(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`dist.open_channels` on rank 0 of two whose peer never makes its FIFO (a stand-in
    process group: the collectives see rank 0's answers only): rank 0's own FIFO opens, the
    send end to rank 1 cannot, so the channels of that call close again and go to gloo, and
    the temporary directory is gone either way."""
    import tempfile
    from types import SimpleNamespace

    from pipeir.runtime import dist as pdist

    made: list[str] = []
    real = tempfile.mkdtemp

    def mkdtemp(prefix: str) -> str:
        made.append(real(prefix=prefix, dir=tmp_path))
        return made[-1]

    fake = SimpleNamespace(
        get_rank=lambda: 0, get_world_size=lambda: 2,
        all_gather_object=lambda out, obj: out.__setitem__(slice(None), [obj] * len(out)),
        broadcast_object_list=lambda objs, src: None, all_reduce=lambda t: None,
        is_initialized=lambda: False)
    monkeypatch.setattr(pdist, "dist", fake)
    monkeypatch.setattr(pdist.tempfile, "mkdtemp", mkdtemp)
    monkeypatch.delenv("PIPEIR_P2P_PIPES", raising=False)
    monkeypatch.delenv("PIPEIR_P2P_GROUPS", raising=False)
    try:
        pdist.open_channels([(0, 1), (1, 0)], torch.device("cpu"))
        pipes = pdist.pipes()
        assert pipes is not None and len(made) == 1
        for kind, peer in (("send", 1), ("recv", 1)):
            assert not pipes.carries(kind, peer, 8)
        assert not Path(made[0]).exists()
    finally:
        pdist.shutdown()
    assert pdist.pipes() is None


def test_pipes_are_for_cpu_ranks_unless_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """`PIPEIR_P2P_PIPES`: auto (the default) on CPU, never on CUDA, off, or a clear error."""
    from pipeir.runtime import dist as pdist

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.delenv("PIPEIR_P2P_PIPES", raising=False)
    assert (pdist.use_pipes(cpu), pdist.use_pipes(cuda)) == (True, False)
    monkeypatch.setenv("PIPEIR_P2P_PIPES", "off")
    assert not pdist.use_pipes(cpu)
    monkeypatch.setenv("PIPEIR_P2P_PIPES", "of")
    with pytest.raises(ValueError, match="PIPEIR_P2P_PIPES='of': expected auto or off"):
        pdist.use_pipes(cpu)
