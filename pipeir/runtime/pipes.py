"""Point-to-point transfers between CPU ranks on one host, through pipes instead of gloo.

NOTE (why): a pipeline transfer between two CPU ranks on one host is a few kilobytes to a
few hundred, and what it costs is latency, not bandwidth: gloo carries it over loopback TCP
with a rendezvous (the receiver's "ready" message before the data) and two thread hand-offs
on the receiving side (gloo's event-loop thread reads it, then wakes the waiting rank).
Measured on the 2-core machine, 16 KB back and forth between two ranks that compute in
between: 228 us per round trip through gloo, 69-99 us through a pipe. In 1F1B every
micro-batch puts two transfers on the critical path (the activation out and its gradient
back), so this is most of what a small pipeline loses to communication.

One pipe per directed channel (sender, receiver), made as a FIFO in a directory the ranks
share and unlinked once both ends are open (nothing stays on disk, even if a rank dies).
A message is a header (tag, byte count) and the bytes. Sends are eager: the bytes go into
the pipe at once, and what does not fit waits in the sender's queue until its next wait
(a rank waits somewhere before its program ends). Receives match by tag, in any order: a
message that comes before its receive is posted is kept until it is. Every wait makes
progress on every channel (reads what arrived, writes what was queued), so a rank never
waits on a peer that waits on it to drain a pipe. A transfer too large for its pipe goes
through gloo instead (`carries`): the pipe would hold it only as fast as the sender waits.

What the proof assumes of sends holds: an isend never blocks, and a blocking send completes
no later than gloo's would. gloo's waits for the receive to be posted, which the receiver
does in blocking programs at its `recv`; this one waits at most for the receiver's next wait
on a transfer (that `recv` at the latest), which drains the pipe, and a transfer through a
pipe fits in an empty one. A peer that exits closes its ends: a receive from it fails at
once ("... closed its pipe"), a send to it fails with "Broken pipe"; a wait longer than the
process group's timeout fails too.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import select
import struct
import time
from collections import deque

import torch

_HEADER = struct.Struct("<qq")  # tag, byte count
_F_SETPIPE_SZ, _F_GETPIPE_SZ = 1031, 1032  # fcntl.F_SETPIPE_SZ (Python >= 3.10, Linux)
#: the pipe size asked for (Linux's default limit for an unprivileged process, fs.pipe-max-size)
PIPE_BYTES = 1 << 20


def _bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory as bytes, without a copy. The view does not keep
    the tensor alive: its transfer's `PipeWork` does."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("a pipe carries contiguous CPU tensors")
    n = t.nbytes
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class PipeWork:
    """A posted transfer; `wait` as a process group's work object."""

    __slots__ = ("_pipes", "buf", "done", "error", "what")

    def __init__(self, pipes: Pipes, buf: torch.Tensor, what: str):
        self._pipes = pipes
        self.buf = buf  # (the memory the transfer reads or writes)
        self.done = False
        self.error: str | None = None
        self.what = what  # for messages: "a receive from rank 1 (tag 3)"

    def wait(self) -> bool:
        if not self.done:
            self._pipes.progress(self)
        return True


class _In:
    """The receiving end of one channel."""

    __slots__ = ("capacity", "closed", "dest", "early", "fd", "got", "head", "posted", "src",
                 "tag", "work")

    def __init__(self, src: int, fd: int, capacity: int):
        self.src, self.fd, self.capacity = src, fd, capacity
        self.posted: dict[int, tuple[memoryview, PipeWork]] = {}
        self.early: dict[int, bytearray] = {}  # messages whose receive is not posted yet
        self.head = memoryview(bytearray(_HEADER.size))
        self.got = 0  # bytes read of the header, then of the payload
        self.dest: memoryview | None = None  # the payload's destination (None: a header)
        self.work: PipeWork | None = None  # the receive it completes (None: an early one)
        self.tag = 0
        self.closed = False


class _Out:
    """The sending end of one channel, with the sends the pipe could not take yet."""

    __slots__ = ("capacity", "closed", "dst", "fd", "polled", "queue")

    def __init__(self, dst: int, fd: int, capacity: int):
        self.dst, self.fd, self.capacity = dst, fd, capacity
        self.queue: deque[tuple[list[memoryview], PipeWork]] = deque()
        self.closed = False
        self.polled = False  # registered for POLLOUT (it has queued sends)


class Pipes:
    """This rank's pipe channels (see the module docstring)."""

    def __init__(self, rank: int, timeout_s: float):
        self.rank = rank
        self.timeout_s = timeout_s
        self._in: dict[int, _In] = {}
        self._out: dict[int, _Out] = {}
        self._by_fd: dict[int, _In | _Out] = {}
        self._poll = select.poll()

    # ---- set-up (`pipeir.runtime.dist.open_channels`) --------------------------------------
    def make_in(self, src: int, path: str) -> None:
        """Create the FIFO of channel (src, this rank) and open its reading end."""
        os.mkfifo(path, 0o600)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with contextlib.suppress(OSError):  # (a smaller pipe only routes more to gloo)
            fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
        self._in[src] = c = _In(src, fd, fcntl.fcntl(fd, _F_GETPIPE_SZ))
        self._by_fd[fd] = c
        self._poll.register(fd, select.POLLIN)

    def open_out(self, dst: int, path: str) -> None:
        """Open the writing end of channel (this rank, dst), whose reader has opened it."""
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        self._out[dst] = c = _Out(dst, fd, fcntl.fcntl(fd, _F_GETPIPE_SZ))
        self._by_fd[fd] = c

    def drop(self, src: int, dst: int) -> None:
        """Close channel (src, dst)'s end here, if open (a set-up that failed elsewhere)."""
        c = self._in.pop(src, None) if dst == self.rank else self._out.pop(dst, None)
        if c is not None:
            del self._by_fd[c.fd]
            with contextlib.suppress(KeyError):
                self._poll.unregister(c.fd)
            os.close(c.fd)

    def carries(self, kind: str, peer: int, nbytes: int) -> bool:
        """Whether a transfer of `nbytes` to / from `peer` goes through its pipe. Both ends
        decide alike: they read one pipe's size, and the byte counts of a matched send and
        receive are equal (the shape plan makes both)."""
        c = self._out.get(peer) if kind == "send" else self._in.get(peer)
        return c is not None and nbytes + _HEADER.size <= c.capacity

    def close(self) -> None:
        for fd in self._by_fd:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._in.clear()
        self._out.clear()
        self._by_fd.clear()

    # ---- transfers -------------------------------------------------------------------------
    def isend(self, buf: torch.Tensor, dst: int, tag: int) -> PipeWork:
        out = self._out[dst]
        data = _bytes(buf)
        work = PipeWork(self, buf, f"a send to rank {dst} (tag {tag})")
        if out.closed:
            raise RuntimeError(self._broken(out))
        out.queue.append(([memoryview(_HEADER.pack(tag, data.nbytes)), data], work))
        if len(out.queue) == 1:
            self._write(out)
        return work

    def irecv(self, buf: torch.Tensor, src: int, tag: int) -> PipeWork:
        c = self._in[src]
        dest = _bytes(buf)
        work = PipeWork(self, buf, f"a receive from rank {src} (tag {tag})")
        early = c.early.pop(tag, None)
        if early is not None:
            self._fill(c, tag, dest, memoryview(early))
            work.done = True
        else:
            c.posted[tag] = (dest, work)
            if c.closed:
                work.error = self._closed(c)
        return work

    def progress(self, work: PipeWork) -> None:
        """Move every channel on until `work` is done (reading what arrived, writing what
        was queued); a RuntimeError if it fails or the timeout passes first."""
        deadline = time.monotonic() + self.timeout_s
        while not work.done:
            if work.error is not None:
                raise RuntimeError(work.error)
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"timed out after {self.timeout_s:g} s waiting for "
                                   f"{work.what} on rank {self.rank}")
            for fd, _ in self._poll.poll(max(1, int(left * 1e3))):
                c = self._by_fd[fd]
                if isinstance(c, _In):
                    self._read(c)
                else:
                    self._write(c)
        if work.error is not None:
            raise RuntimeError(work.error)

    # ---- the channels' state machines ------------------------------------------------------
    def _write(self, out: _Out) -> None:
        """Write queued sends until the pipe is full; (un)register for POLLOUT."""
        q = out.queue
        while q:
            views, work = q[0]
            try:
                n = os.writev(out.fd, views)
            except BlockingIOError:
                break
            except BrokenPipeError:
                out.closed = True
                msg = self._broken(out)
                for _, w in q:
                    w.error = msg
                q.clear()
                break
            while views and n >= views[0].nbytes:
                n -= views.pop(0).nbytes
            if views:
                if n:
                    views[0] = views[0][n:]
                break
            work.done = True
            q.popleft()
        if bool(q) != out.polled:
            out.polled = bool(q)
            if q:
                self._poll.register(out.fd, select.POLLOUT)
            else:
                self._poll.unregister(out.fd)

    def _read(self, c: _In) -> None:
        """Read what the pipe holds: headers, then payloads into their receives' buffers
        (or kept, for a receive not posted yet)."""
        while True:
            dest = c.dest
            view = c.head if dest is None else dest
            if c.got < view.nbytes:
                try:
                    n = os.readv(c.fd, [view[c.got:]])
                except BlockingIOError:
                    return
                if n == 0:
                    self._close_in(c)
                    return
                c.got += n
                if c.got < view.nbytes:
                    continue
            if dest is None:  # a header: where its payload goes
                c.tag, nbytes = _HEADER.unpack(c.head)
                posted = c.posted.pop(c.tag, None)
                if posted is None:
                    c.dest, c.work = memoryview(bytearray(nbytes)), None
                elif posted[0].nbytes != nbytes:
                    posted[1].error = self._mismatch(c, c.tag, nbytes, posted[0].nbytes)
                    c.dest, c.work = memoryview(bytearray(nbytes)), None
                else:
                    c.dest, c.work = posted
                c.got = 0
                continue
            if c.work is not None:
                c.work.done = True
            else:  # posted while it was read, or not yet: kept until it is
                posted = c.posted.pop(c.tag, None)
                if posted is None:
                    c.early[c.tag] = dest.obj  # type: ignore[assignment]
                else:
                    try:
                        self._fill(c, c.tag, posted[0], dest)
                        posted[1].done = True
                    except RuntimeError as e:
                        posted[1].error = str(e)
            c.dest, c.work, c.got = None, None, 0

    def _fill(self, c: _In, tag: int, dest: memoryview, data: memoryview) -> None:
        if dest.nbytes != data.nbytes:
            raise RuntimeError(self._mismatch(c, tag, data.nbytes, dest.nbytes))
        dest[:] = data

    def _close_in(self, c: _In) -> None:
        c.closed = True
        with contextlib.suppress(KeyError):
            self._poll.unregister(c.fd)
        msg = self._closed(c)
        if c.work is not None:
            c.work.error = msg
        for _, w in c.posted.values():
            w.error = msg

    def _mismatch(self, c: _In, tag: int, sent: int, expected: int) -> str:
        return (f"rank {c.src} sent {sent} bytes with tag {tag}, rank {self.rank} expected "
                f"{expected}")

    def _broken(self, out: _Out) -> str:
        return (f"Broken pipe: rank {out.dst} closed its pipe from rank {self.rank} "
                "(did it fail?)")

    def _closed(self, c: _In) -> str:
        return (f"Connection closed by peer: rank {c.src} closed its pipe to rank "
                f"{self.rank} (did it fail?)")
