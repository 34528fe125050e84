"""The communication rules of lowered programs, and the proof that a program obeys them.

One rule set serves pipeir's own lowered programs (`check --lowered`, every `compile`) and
torch's `compute_comms` schedules, which `pipeir.interop.lowering` writes as lowered programs
exactly as `_PipelineScheduleRuntime` executes them (isend/irecv posted in file order, a wait
for the receive inside the compute that consumes it, every send waited at the end).

Semantics are the strictest a backend may have: posting (isend, irecv, a batch) never blocks;
a blocking send or receive, and a wait, complete only once the matching side is posted
(*rendezvous*); and point-to-point messages between two ranks are matched in the order they
are posted, whatever the tags (*per-pair FIFO*, as NCCL does, and gloo with torch's tag 0).

NOTE (the rules, in the order they are checked; each later rule assumes the earlier hold):

1. *Local*, per rank in program order: a tensor is sent only after the instruction producing
   it and while it is still held (an activation until its stage's backward of that
   micro-batch, when torch frees it); a compute that consumes a tensor from another rank
   comes after the wait for its receive, one from the same rank after its hand-off; a wait
   follows its post; a receive is not posted twice while the first is outstanding; stage,
   micro-batch and peer agree with the placement; inside an overlapped pair there is only
   the pair's compute.
2. *Matching*: every transfer the placement implies is sent exactly once and received
   exactly once, with the same tag on both sides (gloo matches by tag). *Computing*: every
   stage runs, per micro-batch, one forward, the loss on the last stage, and one backward
   (B, or I then W), in that order: a compute whose output no rank receives (stage 0's
   backward, a W) is otherwise unobserved by the other rules.
   *Stepping*: each program clears the gradients once before its computes and steps once
   after them; with gradient reductions, every stage reduces once after its last weight
   gradient and waits for it before the step.
3. *Order*: between each sender and receiver, sends and receives are posted in the same
   order. Two transfers posted in opposite orders either deadlock (blocking) or deliver each
   other's tensors (asynchronous): with equal shapes training silently goes wrong.
4. *Progress*: running all ranks abstractly, every program ends; otherwise the chain of
   ranks waiting on each other is named.

Posts inside a `batch` (torch's `batch_isend_irecv`) are posted in their listed order at the
batch's position, so all rules apply to them as to single posts.

Findings name the instruction (`Locator.name`) and point at its source (`Locator.span`): the
`.sched` op for pipeir's programs, the CSV cell for torch's, the instruction's `"i"` member
in a lowered JSON file (`check --lowered DIR/lowered.json`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pipeir import limits
from pipeir.backend.jsonspans import instruction_spans
from pipeir.backend.lower import (
    COMPUTE,
    Backward,
    BackwardInput,
    BackwardWeight,
    Batch,
    Comm,
    Forward,
    ForwardCheckpoint,
    Handoff,
    Instr,
    IRecv,
    ISend,
    Load,
    Loss,
    Lowered,
    Offload,
    OptimizerStep,
    Recompute,
    Recv,
    ReduceGrad,
    Reload,
    Send,
    WaitRecv,
    WaitReduce,
    WaitSend,
    ZeroGrad,
    from_json,
    lower,
)
from pipeir.diagnostics import Diagnostic, Note, Source, Span, UsageError, VerifyError

if TYPE_CHECKING:
    from pipeir.schedule import Schedule

Channel = tuple[int, int]  # (sender, receiver)
Key = tuple[str, int, int]  # (tensor, producing stage, micro-batch)


@dataclass(frozen=True)
class CommReport:
    """What the proof established: the number of transfers per (sender, receiver) pair."""

    transfers: dict[Channel, int]

    @property
    def total(self) -> int:
        return sum(self.transfers.values())


@dataclass(frozen=True)
class Site:
    """One communication or compute instruction of one rank: `ins` at `pc` in its program
    (for a post inside a batch, `ins` is the post and `pc` the batch's position)."""

    rank: int
    pc: int
    ins: Instr


class Locator(Protocol):
    """Names instructions and finds their source, for diagnostics."""

    def name(self, site: Site) -> str:
        """How a message names the instruction, e.g. "0SEND_F2 (rank 0, action 3)"."""
        ...  # pragma: no cover - protocol

    def span(self, site: Site) -> Span | None:
        """Where the instruction came from in the user's file, if known."""
        ...  # pragma: no cover - protocol


def describe(site: Site) -> str:
    """The instruction as the lowered text form shows it, with its origin."""
    ins = site.ins
    where = f" ({ins.op}, {ins.at})" if ins.at else (f" ({ins.op})" if ins.op else "")
    text = f"{ins.mnemonic} {ins.operands()}".rstrip()
    return f"rank {site.rank} at #{site.pc} `{text}`{where}"


@dataclass(frozen=True)
class PlainLocator:
    """Names an instruction by its position and text; spans only where `spans` knows the op
    (`op` strings of a schedule, `str(Op)`, to their `.sched` spans)."""

    spans: dict[str, Span] = field(default_factory=dict)

    def name(self, site: Site) -> str:
        return describe(site)

    def span(self, site: Site) -> Span | None:
        return self.spans.get(site.ins.op)


def what(key: Key) -> str:
    """A transfer in words: "the activation of stage 0, micro-batch 2"."""
    tensor, stage, mb = key
    noun = "activation" if tensor == "act" else "input gradient"
    return f"the {noun} of stage {stage}, micro-batch {mb}"


# ---- rule 1: local ------------------------------------------------------------------------------

#: What `rule_compute` counts, by kind: F, FC (checkpointed), RC, OFF, RELOAD, L (the loss),
#: B, I, W.
_COMPUTE_KIND: dict[type[Instr], str] = {
    Forward: "F", ForwardCheckpoint: "FC", Recompute: "RC", Offload: "OFF", Reload: "RELOAD",
    Loss: "L", Backward: "B", BackwardInput: "I", BackwardWeight: "W"}
_STAGED = (Forward, Recompute, Offload, Reload, Loss, Backward, BackwardInput, BackwardWeight)
_WHY = "every stage runs one forward and one backward (B, or I then W) per micro-batch"
_NOUNS = {"F": "forward", "FC": "checkpointed forward", "RC": "recompute", "OFF": "offload",
          "RELOAD": "reload", "L": "loss", "B": "backward", "I": "input gradient (I)",
          "W": "weight gradient (W)"}


def _is_send(c: Instr) -> bool:
    return isinstance(c, (Send, ISend, WaitSend))


def _posts(ins: Instr) -> tuple[Comm, ...]:
    if isinstance(ins, Batch):
        return ins.posts
    if isinstance(ins, (ISend, IRecv, Send, Recv)):
        return (ins,)
    return ()


@dataclass(frozen=True)
class _Finding:
    message: str
    site: Site | None  # None: about no instruction (a rank's program is empty)
    notes: tuple[tuple[str, Site | None], ...] = ()
    near: Site | None = None  # with no site: where the missing instruction belongs


class _Rules:
    """The rules over one set of programs; each `rule_*` yields findings."""

    def __init__(self, lowered: Lowered) -> None:
        self.low = lowered
        self.last = lowered.stages - 1
        self.mbs = lowered.microbatches * lowered.accumulate

    # -- helpers --

    def _inputs(self, ins: Instr) -> list[tuple[Key, int]]:
        """What a compute instruction consumes from another stage: (key, producing rank)."""
        place = self.low.placement
        if isinstance(ins, Forward) and 0 < ins.stage <= self.last:
            return [(("act", ins.stage - 1, ins.mb), place[ins.stage - 1])]
        if isinstance(ins, (Backward, BackwardInput)) and 0 <= ins.stage < self.last:
            return [(("grad", ins.stage + 1, ins.mb), place[ins.stage + 1])]
        return []

    def _output(self, ins: Instr) -> Key | None:
        """The tensor a compute instruction produces for another stage."""
        if isinstance(ins, Forward) and ins.stage < self.last:
            return ("act", ins.stage, ins.mb)
        if isinstance(ins, (Backward, BackwardInput)) and ins.stage > 0:
            return ("grad", ins.stage, ins.mb)
        return None

    def _find(self, rank: int, pred: Callable[[Instr], bool], start: int = 0) -> Site | None:
        for pc in range(start, len(self.low.programs[rank])):
            for ins in (self.low.programs[rank][pc], *_posts(self.low.programs[rank][pc])):
                if pred(ins):
                    return Site(rank, pc, ins)
        return None

    def _placement(self, site: Site, c: Comm) -> _Finding | None:
        """Stage, micro-batch and peer of a transfer against the placement."""
        tensor, stage, mb = c.key
        place, last, send = self.low.placement, self.last, _is_send(c)
        dst = stage + 1 if tensor == "act" else stage - 1
        verb = "sends" if send else "receives"
        if not 0 <= stage <= last or not 0 <= dst <= last:
            missing = stage if not 0 <= stage <= last else dst
            return _Finding(f"{verb} {what(c.key)}, but there is no stage {missing} "
                            f"(stages are 0 to {last})", site)
        if not 0 <= mb < self.mbs:
            return _Finding(f"{verb} {what(c.key)}, but micro-batch {mb} is out of range "
                            f"(0 to {self.mbs - 1})", site)
        me, other = (stage, dst) if send else (dst, stage)
        if place[me] != site.rank:
            return _Finding(f"{verb} {what(c.key)}, but the placement runs stage {me} on rank "
                            f"{place[me]}, not on rank {site.rank}", site)
        if place[other] == site.rank:
            return _Finding(f"{verb} {what(c.key)}, but stages {min(stage, dst)} and "
                            f"{max(stage, dst)} both run on rank {site.rank}: the tensor is "
                            f"handed over locally, there is nothing to transfer", site)
        if c.peer != place[other]:
            return _Finding(f"{verb} {what(c.key)} {'to' if send else 'from'} rank {c.peer}, "
                            f"but stage {other} runs on rank {place[other]}", site)
        return None

    def _compute_placement(self, site: Site) -> Iterator[_Finding]:
        """A compute runs a stage placed on its rank, for a micro-batch that exists: without
        this, a compute that produces nothing another rank receives (stage 0's backward) could
        name any stage and pass."""
        ins = site.ins
        if not isinstance(ins, (Forward, Loss, Backward, BackwardInput, BackwardWeight,
                                Recompute)):  # COMPUTE, spelt out for the type checker
            return
        place, last = self.low.placement, self.last
        if not 0 <= ins.stage <= last:
            yield _Finding(f"runs stage {ins.stage}, but there is no stage {ins.stage} "
                           f"(stages are 0 to {last})", site)
        elif place[ins.stage] != site.rank:
            yield _Finding(f"runs stage {ins.stage}, but the placement runs stage {ins.stage} "
                           f"on rank {place[ins.stage]}, not on rank {site.rank}", site)
        if not 0 <= ins.mb < self.mbs:
            yield _Finding(f"runs micro-batch {ins.mb}, which is out of range "
                           f"(0 to {self.mbs - 1})", site)

    def rule_local(self) -> Iterator[_Finding]:
        for rank, prog in enumerate(self.low.programs):
            held: set[Key] = set()  # produced here and not yet freed
            freed: dict[Key, Site] = {}
            handed: set[Key] = set()
            received: set[Key] = set()
            outstanding: dict[tuple[bool, Key], list[Site]] = {}  # posted, not yet waited
            for pc, ins in enumerate(prog):
                site = Site(rank, pc, ins)
                if ins.paired and not isinstance(ins, (*COMPUTE, Load)):
                    yield _Finding("sits inside an overlapped pair, whose two ops start "
                                   "together: only their compute may come between them", site)
                yield from self._compute_placement(site)
                for c in _posts(ins):
                    post = Site(rank, pc, c)
                    bad = self._placement(post, c)
                    send = _is_send(c)
                    if bad is not None:
                        yield bad
                    elif send:
                        yield from self._send_held(post, c.key, held, freed)
                    elif outstanding.get((False, c.key)):
                        yield _Finding(f"receives {what(c.key)} a second time while the "
                                       f"first receive is still outstanding (torch: \"Recv "
                                       f"twice without executing\")", post,
                                       (("the first receive", outstanding[(False, c.key)][0]),))
                    if isinstance(c, Recv):  # blocking: posted and waited at once
                        received.add(c.key)
                    elif not isinstance(c, Send):
                        outstanding.setdefault((send, c.key), []).append(post)
                if isinstance(ins, (WaitSend, WaitRecv)):
                    yield from self._wait(site, outstanding, received)
                if isinstance(ins, Handoff):
                    key: Key = (ins.tensor, ins.stage, ins.mb)
                    yield from self._send_held(site, key, held, freed)
                    handed.add(key)
                if isinstance(ins, COMPUTE):
                    yield from self._consumes(site, received, handed, outstanding)
                    if isinstance(ins, (Backward, BackwardInput)):
                        act = ("act", ins.stage, ins.mb)
                        if act in held:
                            held.discard(act)
                            freed[act] = site
                    out = self._output(ins)
                    if out is not None:
                        held.add(out)
            for (send, key), left in sorted(outstanding.items()):
                for post in left:
                    yield _Finding(f"posts a {'send' if send else 'receive'} of {what(key)} "
                                   f"that is never waited for before the program ends", post)

    def _wait(self, site: Site, outstanding: dict[tuple[bool, Key], list[Site]],
              received: set[Key]) -> Iterator[_Finding]:
        ins = site.ins
        assert isinstance(ins, (WaitSend, WaitRecv))
        send = isinstance(ins, WaitSend)
        posted = outstanding.get((send, ins.key))
        if posted:
            posted.pop(0)
        else:
            yield from self._not_posted(site, ins.key, send)
        if not send:
            received.add(ins.key)  # reported once, here, not again at its consumer

    def _not_posted(self, site: Site, key: Key, send: bool) -> Iterator[_Finding]:
        kind = (ISend, Send) if send else (IRecv, Recv)

        def post(i: Instr) -> bool:
            return isinstance(i, kind) and i.key == key

        later = self._find(site.rank, post, site.pc + 1)
        noun = "send" if send else "receive"
        if later is not None:
            yield _Finding(f"waits for {what(key)} before its {noun} is posted; the {noun} "
                           f"must come before the op that waits for it", site,
                           ((f"the {noun}, later on this rank", later),))
        else:
            yield _Finding(f"waits for a transfer it never posted ({noun} of {what(key)})",
                           site)

    def _send_held(self, site: Site, key: Key, held: set[Key], freed: dict[Key, Site]
                   ) -> Iterator[_Finding]:
        if key in held:
            return
        tensor, stage, mb = key
        kinds = (Forward,) if tensor == "act" else (Backward, BackwardInput)
        verb = "hands over" if isinstance(site.ins, Handoff) else "sends"

        def producer(i: Instr) -> bool:
            return isinstance(i, kinds) and i.stage == stage and i.mb == mb

        if key in freed:
            yield _Finding(f"{verb} {what(key)} after the backward that frees it", site,
                           (("the backward", freed[key]),))
            return
        later = self._find(site.rank, producer, site.pc + 1)
        if later is not None:
            yield _Finding(f"{verb} {what(key)} before the op that produces it; it must "
                           f"come after it", site, (("the producing op, later on this rank",
                                                     later),))
        else:
            yield _Finding(f"{verb} {what(key)}, which no op before it on rank {site.rank} "
                           f"produces", site)

    def _consumes(self, site: Site, received: set[Key], handed: set[Key],
                  outstanding: dict[tuple[bool, Key], list[Site]]) -> Iterator[_Finding]:
        for key, src in self._inputs(site.ins):
            if src == site.rank and key not in handed:
                yield _Finding(f"computes on {what(key)} before it is handed over on this "
                               f"rank", site)
            elif src != site.rank and key not in received:
                posted = outstanding.get((False, key))
                if posted:
                    yield _Finding(f"computes on {what(key)} without waiting for its "
                                   f"receive", site, (("the receive it must wait for",
                                                       posted[0]),))
                else:
                    yield from self._not_posted(site, key, send=False)

    # -- rule 2: matching --

    def sides(self) -> tuple[dict[Channel, list[tuple[Key, Site]]],
                             dict[Channel, list[tuple[Key, Site]]]]:
        """Per channel, the sends and the receives in posting order."""
        sent: dict[Channel, list[tuple[Key, Site]]] = {}
        recvd: dict[Channel, list[tuple[Key, Site]]] = {}
        for rank, prog in enumerate(self.low.programs):
            for pc, ins in enumerate(prog):
                for c in _posts(ins):
                    send = _is_send(c)
                    ch = (rank, c.peer) if send else (c.peer, rank)
                    (sent if send else recvd).setdefault(ch, []).append(
                        (c.key, Site(rank, pc, c)))
        return sent, recvd

    def expected(self) -> Iterator[tuple[Channel, Key]]:
        place = self.low.placement
        for s in range(self.last):
            if place[s] != place[s + 1]:
                for mb in range(self.mbs):
                    yield (place[s], place[s + 1]), ("act", s, mb)
                    yield (place[s + 1], place[s]), ("grad", s + 1, mb)

    def rule_matching(self) -> Iterator[_Finding]:
        sent, recvd = self.sides()
        by_key: dict[tuple[bool, Channel, Key], list[Site]] = {}
        for send, table in ((True, sent), (False, recvd)):
            for ch, items in table.items():
                for key, site in items:
                    by_key.setdefault((send, ch, key), []).append(site)
        for ch, key in self.expected():
            sends = by_key.get((True, ch, key), [])
            recvs = by_key.get((False, ch, key), [])
            for mine, theirs, noun, other in ((sends, recvs, "send", "receive"),
                                              (recvs, sends, "receive", "send")):
                if len(mine) > 1:
                    yield _Finding(f"{noun}s {what(key)} a second time: each transfer is "
                                   f"sent once and received once", mine[1],
                                   (("the first", mine[0]),))
                elif not mine and theirs:
                    side = ch[1] if noun == "receive" else ch[0]
                    verb = "receives" if noun == "receive" else "sends"
                    yield _Finding(f"{'sends' if noun == 'receive' else 'receives'} "
                                   f"{what(key)}, but rank {side} never {verb} it: every "
                                   f"{other} needs exactly one matching {noun}", theirs[0])
            if len(sends) == 1 and len(recvs) == 1:
                tx, rx = sends[0].ins, recvs[0].ins
                assert isinstance(tx, Comm) and isinstance(rx, Comm)
                if tx.tag != rx.tag:
                    yield _Finding(f"receives {what(key)} with tag {rx.tag}, but rank {ch[0]} "
                                   f"sends it with tag {tx.tag}: gloo matches a receive to the "
                                   "send of the same tag, so it would wait forever (NCCL "
                                   "ignores tags)", recvs[0], (("the send", sends[0]),))

    # -- rule 2b: every op computed --

    def rule_compute(self) -> Iterator[_Finding]:
        """Each stage runs, for every micro-batch of every round, one forward (or one
        checkpointed forward and its recompute), the loss after it on the last stage only,
        scaled by 1/(m x rounds), and one backward after it: B, or I then W; an offload comes
        after a plain forward, its reload after it and before the backward; stage 0 loads
        its input and the last stage its target first, once. Without this a compute whose
        output no other rank receives (stage 0's backward, any W, a recompute, a reload)
        could be left out, or run twice, and still pass."""
        runs: dict[tuple[int, int], dict[str, list[Site]]] = {}
        loads: dict[tuple[str, int], list[Site]] = {}
        for rank, prog in enumerate(self.low.programs):
            for pc, ins in enumerate(prog):
                kind = _COMPUTE_KIND.get(type(ins))
                if kind is not None and isinstance(ins, _STAGED):
                    runs.setdefault((ins.stage, ins.mb), {}).setdefault(kind, []).append(
                        Site(rank, pc, ins))
                elif isinstance(ins, Load):
                    loads.setdefault((ins.part, ins.mb), []).append(Site(rank, pc, ins))
        for s in range(self.last + 1):
            rank = self.low.placement[s]
            if not self.low.programs[rank]:
                yield _Finding(f"rank {rank}'s program is empty, but the placement runs stage "
                               f"{s} there: {_WHY}", None)
                continue
            for mb in range(self.mbs):
                found = list(self._one_op(s, mb, rank, runs.get((s, mb), {}), loads))
                yield from found[:1]  # the first thing wrong with this op
        for (part, mb), sites in sorted(loads.items()):
            stage = 0 if part == "input" else self.last
            if not 0 <= mb < self.mbs or sites[0].rank != self.low.placement[stage]:
                yield _Finding(f"loads the {part} of micro-batch {mb}, which only stage "
                               f"{stage}'s forward of a micro-batch in 0 to {self.mbs - 1} uses"
                               f" (on rank {self.low.placement[stage]})", sites[0])

    def _one_op(self, s: int, mb: int, rank: int, got: dict[str, list[Site]],
                loads: dict[tuple[str, int], list[Site]]) -> Iterator[_Finding]:
        name = f"stage {s}, micro-batch {mb}"
        for kind, sites in got.items():
            if len(sites) > 1:
                yield _Finding(f"runs the {_NOUNS[kind]} of {name} a second time: each runs "
                               "once", sites[1], (("the first", sites[0]),))
        one = {k: sites[0] for k, sites in got.items()}
        fwd = one.get("F") or one.get("FC")
        back = [one[k] for k in ("B", "I", "W") if k in one]
        prog = self.low.programs[rank]  # (not empty: see `rule_compute`)
        anchor = fwd or (back[0] if back else None) or Site(rank, len(prog) - 1, prog[-1])
        if fwd is None:
            yield _Finding(f"comes with no forward of {name} on rank {rank}: {_WHY}", anchor)
            return
        if "F" in one and "FC" in one:
            yield _Finding(f"runs both a forward and a checkpointed forward of {name}: {_WHY}",
                           one["FC"])
        if not back:
            yield _Finding(f"has no backward: rank {rank} never runs B, or I and W, of {name}; "
                           f"{_WHY}", fwd)
            return
        if "B" in one and ("I" in one or "W" in one):
            yield _Finding(f"runs both B and I/W of {name}: {_WHY}", back[-1])
        elif "B" not in one and not ("I" in one and "W" in one):
            have, lack = ("I", "W") if "I" in one else ("W", "I")
            yield _Finding(f"runs {have} of {name} without its {lack}: {_WHY}", one[have])
        yield from self._memory_ops(s, name, one, fwd, back[0])
        yield from self._loss(s, mb, name, one, fwd, back[0], loads)
        order = [one[k] for k in ("F", "FC", "L", "OFF", "RELOAD", "RC", "B", "I", "W")
                 if k in one]
        for a, b in itertools.pairwise(order):
            if a.pc > b.pc:
                yield _Finding(f"runs after `{b.ins.mnemonic}` of {name}, which needs it "
                               "first (forward, loss, offload, reload, recompute, then B, or "
                               "I then W)", a, (("the one that needs it", b),))
                return

    def _memory_ops(self, s: int, name: str, one: dict[str, Site], fwd: Site, back: Site
                    ) -> Iterator[_Finding]:
        """A checkpointed forward with its recompute (never on the last stage, whose output
        feeds the loss); an offload of a plain forward with its reload."""
        if "FC" in one and s == self.last:
            yield _Finding(f"checkpoints the last stage's forward ({name}), whose output feeds "
                           "the loss", one["FC"])
        for first, then, lacks_then, lacks_first in (
                ("FC", "RC", f"keeps only its input, but {name} is never recomputed before its "
                 "backward", f"recomputes {name}, whose forward was not checkpointed"),
                ("OFF", "RELOAD", f"moves {name}'s activations to host memory, but nothing "
                 "reloads them for the backward", f"reloads {name}'s activations, which no "
                 "offload moved")):
            if first in one and then not in one:
                yield _Finding(lacks_then, one[first])
            elif then in one and first not in one:
                yield _Finding(lacks_first, one[then], (("its forward", fwd),))
        if "OFF" in one and "F" not in one:
            yield _Finding(f"offloads {name}, whose forward keeps nothing to offload (a "
                           "checkpointed forward)", one["OFF"])

    def _loss(self, s: int, mb: int, name: str, one: dict[str, Site], fwd: Site, back: Site,
              loads: dict[tuple[str, int], list[Site]]) -> Iterator[_Finding]:
        """The loss (and the target it needs) on the last stage only, scaled by 1/(m x
        rounds); stage 0's forward after its input's load."""
        loss = one.get("L")
        if s == self.last and loss is None:
            yield _Finding(f"has no loss: the last stage computes the loss of {name} after "
                           "its forward and before its backward", fwd)
        if s != self.last and loss is not None:
            yield _Finding(f"computes a loss on stage {s}, which is not the last stage "
                           f"({self.last})", loss)
        if s == self.last and loss is not None:
            scale = loss.ins.scale  # type: ignore[attr-defined]
            if abs(scale * self.mbs - 1) > 1e-9:
                yield _Finding(f"scales the loss by {scale:g}, but the gradients of one "
                               f"big batch need 1/{self.mbs} (micro-batches x rounds)", loss)
        for part, stage, user in (("input", 0, fwd), ("target", self.last, loss)):
            if s != stage or user is None:
                continue
            sites = loads.get((part, mb), [])
            if len(sites) != 1 or sites[0].rank != user.rank or sites[0].pc > user.pc:
                how = "loads twice" if len(sites) > 1 else "loads only after it" \
                    if sites and sites[0].rank == user.rank else "never loads"
                yield _Finding(f"needs the {part} of micro-batch {mb}, which rank {user.rank} "
                               f"{how}: it is loaded once, before", user)

    # -- rule 2c: one optimizer step --

    def rule_step(self) -> Iterator[_Finding]:
        """Each program is one optimizer step: `zero-grad` once, before its first compute,
        and `step` once, after its last compute. With gradient reductions (data
        parallelism: any `reduce-grad` or `wait-reduce` at all) every stage reduces once, on
        its rank, after its last weight gradient (B or W), and waits for it once, after that
        and before the step. Otherwise, silently: a missing `zero-grad` adds gradients up
        across steps, a missing `step` never trains, a compute after it uses the new weights,
        and a stage left unreduced lets the replicas drift apart."""
        for rank, prog in enumerate(self.low.programs):
            if prog:  # (an empty program is `rule_compute`'s finding)
                yield from self._one_step(rank, prog)
        if any(isinstance(i, (ReduceGrad, WaitReduce)) for p in self.low.programs for i in p):
            yield from self._reductions()

    def _one_step(self, rank: int, prog: Sequence[Instr]) -> Iterator[_Finding]:
        """`rule_step` for one program: its `zero-grad` and its `step`."""
        def at(pc: int) -> Site:
            return Site(rank, pc, prog[pc])

        computes = [pc for pc, i in enumerate(prog) if isinstance(i, COMPUTE)]
        zeros = [pc for pc, i in enumerate(prog) if isinstance(i, ZeroGrad)]
        steps = [pc for pc, i in enumerate(prog) if isinstance(i, OptimizerStep)]
        if not zeros:
            yield _Finding(f"rank {rank}'s program has no `zero-grad` (before its first "
                           "instruction, shown): each program is one optimizer step, and "
                           "starts by clearing the gradients", None, near=at(0))
        else:
            if len(zeros) > 1:
                yield _Finding("clears the gradients a second time: each program is one "
                               "optimizer step", at(zeros[1]), (("the first", at(zeros[0])),))
            if computes and computes[0] < zeros[0]:
                yield _Finding("clears the gradients after a compute of the same step: "
                               "`zero-grad` comes before every compute", at(zeros[0]),
                               (("the compute", at(computes[0])),))
        if not steps:
            yield _Finding(f"rank {rank}'s program has no `step` (after its last instruction, "
                           "shown): each program is one optimizer step, and ends by applying "
                           "it", None, near=at(len(prog) - 1))
        else:
            if len(steps) > 1:
                yield _Finding("steps a second time: each program is one optimizer step",
                               at(steps[1]), (("the first", at(steps[0])),))
            if computes and computes[-1] > steps[0]:
                yield _Finding("steps before a compute of the same step: `step` comes after "
                               "every compute", at(steps[0]), (("the compute", at(computes[-1])),))

    def _reductions(self) -> Iterator[_Finding]:
        """`rule_step`'s gradient reductions: one pass over the programs, then per stage."""
        place, last = self.low.placement, self.last
        reduce: dict[int, list[Site]] = {}
        wait: dict[int, list[Site]] = {}
        grad: dict[int, Site] = {}  # stage -> its last weight gradient
        step: dict[int, int] = {}  # rank -> its first `step`
        for rank, prog in enumerate(self.low.programs):
            for pc, ins in enumerate(prog):
                site = Site(rank, pc, ins)
                if isinstance(ins, (Backward, BackwardWeight)):
                    grad[ins.stage] = site
                elif isinstance(ins, OptimizerStep):
                    step.setdefault(rank, pc)
                elif isinstance(ins, (ReduceGrad, WaitReduce)):
                    if not 0 <= ins.stage <= last:
                        yield _Finding(f"names stage {ins.stage}, but there is no stage "
                                       f"{ins.stage} (stages are 0 to {last})", site)
                    elif place[ins.stage] != rank:
                        yield _Finding(f"names stage {ins.stage}, which runs on rank "
                                       f"{place[ins.stage]}, not on rank {rank}", site)
                    else:
                        (reduce if isinstance(ins, ReduceGrad) else wait).setdefault(
                            ins.stage, []).append(site)
        for s in range(last + 1):
            r, w = reduce.get(s, []), wait.get(s, [])
            if not r:
                yield _Finding(f"stage {s} has no `reduce-grad` on rank {place[s]}"
                               + (" (after its last weight gradient, shown)" if s in grad else "")
                               + ": with data parallelism every stage all-reduces its "
                               "gradients once, or the replicas drift apart", None,
                               near=grad.get(s))
                continue
            for verb, sites in (("reduces", r), ("waits for the reduction of", w)):
                if len(sites) > 1:
                    yield _Finding(f"{verb} stage {s} a second time: once per step", sites[1],
                                   (("the first", sites[0]),))
            if s in grad and grad[s].pc > r[0].pc:
                yield _Finding(f"reduces stage {s} before its last weight gradient, which "
                               "the all-reduce would miss", r[0],
                               (("the last weight gradient", grad[s]),))
            end = step.get(place[s], len(self.low.programs[place[s]]))
            if not w:
                yield _Finding(f"is never waited for (`wait-reduce stage={s}` belongs before "
                               "`step`): the step could use gradients still being reduced", r[0])
            elif not r[0].pc < w[0].pc < end:
                yield _Finding(f"waits for stage {s}'s reduction outside its place: after "
                               "`reduce-grad` and before `step`", w[0],
                               (("the reduce-grad", r[0]),))

    # -- rule 3: order --

    def rule_order(self) -> Iterator[_Finding]:
        sent, recvd = self.sides()
        for ch in sorted(set(sent) | set(recvd)):
            a, b = sent.get(ch, []), recvd.get(ch, [])
            for k, ((x, sx), (y, ry)) in enumerate(zip(a, b)):
                if x == y:
                    continue
                sy = next(s for key, s in a if key == y)
                rx = next(s for key, s in b if key == x)
                yield _Finding(
                    f"receives {what(y)} from rank {ch[0]}, which sends {what(x)} first: the "
                    f"two transfers cross (rank {ch[0]} -> rank {ch[1]}: transfer #{k} is sent "
                    f"as {_key(x)} but received as {_key(y)}). Point-to-point messages "
                    f"between two ranks are matched in posting order (NCCL, and gloo with "
                    f"torch's tag 0), so each receive gets the other's tensor (async: wrong "
                    f"training or a shape error; blocking: a deadlock)", ry,
                    ((f"rank {ch[0]} sends {what(x)} first", sx),
                     (f"then {what(y)}", sy),
                     (f"rank {ch[1]} receives {what(x)} only later", rx)))
                break


def _key(k: Key) -> str:
    return f"{k[0]} of stage {k[1]} mb {k[2]}"


# ---- rule 4: progress ---------------------------------------------------------------------------

def _run(lowered: Lowered) -> tuple[list[int], Callable[[int], Comm | None]]:
    """Execute all ranks abstractly; the final pcs and, per rank, what it waits on.

    Each post gets its index in its channel's queue; a blocking call or wait is done once the
    other side has posted the same index (rules 2 and 3 made the indices agree)."""
    progs = lowered.programs
    n = len(progs)
    counts: dict[tuple[bool, Channel], int] = {}
    index: dict[tuple[int, int, int], int] = {}  # (rank, pc, j) -> queue index
    handle: list[dict[tuple[bool, Key], int]] = [{} for _ in range(n)]
    pc = [0] * n

    def channel(rank: int, c: Comm) -> tuple[bool, Channel]:
        send = _is_send(c)
        return send, ((rank, c.peer) if send else (c.peer, rank))

    def number(rank: int, at: int, j: int, c: Comm) -> int:
        if (rank, at, j) not in index:
            ch = channel(rank, c)
            index[(rank, at, j)] = counts.get(ch, 0)
            counts[ch] = index[(rank, at, j)] + 1
        return index[(rank, at, j)]

    def blocked_on(rank: int) -> tuple[Comm, int] | None:
        ins = progs[rank][pc[rank]]
        if isinstance(ins, (Send, Recv)):
            return ins, number(rank, pc[rank], 0, ins)
        if isinstance(ins, (WaitSend, WaitRecv)):
            return ins, handle[rank][(isinstance(ins, WaitSend), ins.key)]
        return None

    def done(rank: int, c: Comm, k: int) -> bool:
        send, ch = channel(rank, c)
        return counts.get((not send, ch), 0) > k

    moved = True
    while moved:
        moved = False
        for r in range(n):
            while pc[r] < len(progs[r]):
                w = blocked_on(r)
                if w is not None and not done(r, *w):
                    break
                ins = progs[r][pc[r]]
                if not isinstance(ins, (Send, Recv)):
                    for j, c in enumerate(_posts(ins)):
                        handle[r][(_is_send(c), c.key)] = number(r, pc[r], j, c)
                pc[r] += 1
                moved = True

    def waits_on(rank: int) -> Comm | None:
        w = blocked_on(rank) if pc[rank] < len(progs[rank]) else None
        return w[0] if w is not None else None

    return pc, waits_on


def _explain(lowered: Lowered, pc: list[int], stuck: list[int],
             waits_on: Callable[[int], Comm | None], loc: Locator) -> Diagnostic:
    progs = lowered.programs
    chain: list[int] = [stuck[0]]
    while True:
        c = waits_on(chain[-1])
        nxt = c.peer if c is not None else None
        if nxt is None or nxt in chain:
            if nxt is not None:
                chain.append(nxt)
            break
        chain.append(nxt)
    notes = []
    for a in chain[:-1] if len(chain) > 1 else chain:
        c = waits_on(a)
        peer = c.peer if c is not None else None
        tail = (f"; rank {peer} is at #{pc[peer]} `{progs[peer][pc[peer]].mnemonic}`"
                if peer is not None and pc[peer] < len(progs[peer])
                else f"; rank {peer} has finished" if peer is not None else "")
        site = Site(a, pc[a], progs[a][pc[a]])
        notes.append(Note(f"{describe(site)} waits for rank {peer}{tail}", loc.span(site)))
    cycle = " -> ".join(f"rank {r}" for r in chain)
    first = Site(chain[0], pc[chain[0]], progs[chain[0]][pc[chain[0]]])
    return Diagnostic(f"lowered programs of '{lowered.name}' deadlock under rendezvous "
                      f"semantics: {cycle}", loc.span(first), tuple(notes))


# ---- the proof ----------------------------------------------------------------------------------

def _diagnostic(f: _Finding, loc: Locator) -> Diagnostic:
    notes = tuple(Note(f"{text}: {loc.name(s)}" if s is not None else text,
                       loc.span(s) if s is not None else None) for text, s in f.notes)
    if f.site is None:
        return Diagnostic(f.message, loc.span(f.near) if f.near is not None else None, notes)
    return Diagnostic(f"{loc.name(f.site)} {f.message}", loc.span(f.site), notes)


#: The most findings of one rule reported: past them the rest say the same thing again.
MAX_FINDINGS = 50


def check_comm(lowered: Lowered, locator: Locator | None = None) -> CommReport:
    """Prove that `lowered` obeys the communication rules (module NOTE) and cannot deadlock;
    raise VerifyError(check="comm") with one diagnostic per finding of the first rule that
    fails otherwise."""
    loc: Locator = locator if locator is not None else PlainLocator()
    rules = _Rules(lowered)
    for rule in (rules.rule_local, rules.rule_matching, rules.rule_compute,
                 rules.rule_step, rules.rule_order):
        found = list(itertools.islice(rule(), MAX_FINDINGS + 1))
        if found:
            shown = [_diagnostic(f, loc) for f in found[:MAX_FINDINGS]]
            if len(found) > MAX_FINDINGS:
                shown.append(Diagnostic(f"... and more like these (the first {MAX_FINDINGS} "
                                        "are shown)", None, ()))
            raise VerifyError(shown, check="comm")
    pc, waits_on = _run(lowered)
    stuck = [r for r in range(len(lowered.programs)) if pc[r] < len(lowered.programs[r])]
    if stuck:
        raise VerifyError(_explain(lowered, pc, stuck, waits_on, loc), check="comm")
    sent, _ = rules.sides()
    return CommReport({ch: len(q) for ch, q in sorted(sent.items())})


def summary(lowered: Lowered, report: CommReport) -> str:
    kind = "asynchronous (overlap)" if lowered.overlap else "blocking"
    return (f"lowered ok: {report.total} {kind} transfers over {len(report.transfers)} rank "
            f"pairs; deadlock-free under rendezvous semantics with per-peer FIFO matching")


def schedule_locator(schedule: Schedule) -> PlainLocator:
    """Points findings in `schedule`'s lowered programs at the ops' `.sched` spans."""
    spans = {}
    for op in schedule.graph.nodes:
        span = schedule.span_of(op)
        if span is not None:
            spans[str(op)] = span
    return PlainLocator(spans)


def check_schedule(schedule: Schedule) -> str:
    """Lower `schedule` (blocking communication) and prove it; a one-line summary."""
    lowered = lower(schedule)
    return summary(lowered, check_comm(lowered, schedule_locator(schedule)))


def check_json(path: str) -> str:
    """Prove the lowered programs in a `lowered.json` file; `path: summary`. A file that is
    not lowered programs (bad JSON, or a field of the wrong shape or type) is a UsageError
    naming the field (`from_json`), never a traceback from the rules."""
    text = limits.read_input(path, "lowered-program JSON").text
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: not a readable JSON file: {e}") from None
    except ValueError:  # Python refuses integers of more than 4,300 digits
        raise UsageError(f"{path}: not a readable JSON file: a number with thousands of "
                         "digits (integers are 64-bit)") from None
    except RecursionError:
        raise UsageError(f"{path}: not a readable JSON file: nested too deeply") from None
    lowered = from_json(data, path)
    return f"{path}: {summary(lowered, check_comm(lowered, JsonLocator(Source(path, text))))}"


@dataclass
class JsonLocator:
    """Names an instruction as `describe` does; points at its `"i"` member in `source`, a
    lowered JSON file (`jsonspans`), found only when a finding needs it."""

    source: Source
    _spans: dict[tuple[int, int], Span] | None = field(default=None, init=False)

    def name(self, site: Site) -> str:
        return describe(site)

    def span(self, site: Site) -> Span | None:
        if self._spans is None:
            self._spans = instruction_spans(self.source)
        return self._spans.get((site.rank, site.pc))
