"""Rule 1, *local* (the package NOTE): per rank in program order, every transfer and compute
is where its own rank's program allows it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

from pipeir.backend.commcheck.findings import Finding, Key, Site, what
from pipeir.backend.commcheck.programs import (
    COMPUTE_TYPES,
    SENDS,
    SINGLE_POSTS,
    Programs,
    is_send,
)
from pipeir.backend.instructions import (
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
    Recompute,
    Recv,
    Send,
    WaitRecv,
    WaitSend,
    WaitSends,
)

#: What may sit inside an overlapped pair, by exact type (`programs.py`'s NOTE).
_PAIRABLE = frozenset({*COMPUTE_TYPES, Load})
#: What sends on an activation (a forward) and an input gradient (a backward), by exact type.
_FORWARDS = frozenset({Forward, ForwardCheckpoint})
_BACKWARDS = frozenset({Backward, BackwardInput})


#: Per side (receives, then sends: indexed by "is a send"), the posts of each transfer not yet
#: waited for, as (rank, pc, post).
Outstanding = tuple[dict[Key, list[Site]], dict[Key, list[Site]]]


class Local(Programs):
    """Rule 1 over one set of programs."""

    def _placement(self, site: Site, c: Comm) -> Finding | None:
        """Stage, micro-batch and peer of a transfer against the placement."""
        tensor, stage, mb = c.key
        place, last, send = self.low.placement, self.last, is_send(c)
        dst = stage + 1 if tensor == "act" else stage - 1
        verb = "sends" if send else "receives"
        if not 0 <= stage <= last or not 0 <= dst <= last:
            missing = stage if not 0 <= stage <= last else dst
            return Finding(f"{verb} {what(c.key)}, but there is no stage {missing} "
                            f"(stages are 0 to {last})", site)
        if not 0 <= mb < self.mbs:
            return Finding(f"{verb} {what(c.key)}, but micro-batch {mb} is out of range "
                            f"(0 to {self.mbs - 1})", site)
        me, other = (stage, dst) if send else (dst, stage)
        if place[me] != site.rank:
            return Finding(f"{verb} {what(c.key)}, but the placement runs stage {me} on rank "
                            f"{place[me]}, not on rank {site.rank}", site)
        if place[other] == site.rank:
            return Finding(f"{verb} {what(c.key)}, but stages {min(stage, dst)} and "
                            f"{max(stage, dst)} both run on rank {site.rank}: the tensor is "
                            f"handed over locally, there is nothing to transfer", site)
        if c.peer != place[other]:
            return Finding(f"{verb} {what(c.key)} {'to' if send else 'from'} rank {c.peer}, "
                            f"but stage {other} runs on rank {place[other]}", site)
        return None

    def _compute_placement(self, site: Site) -> Iterator[Finding]:
        """A compute runs a stage placed on its rank, for a micro-batch that exists: without
        this, a compute that produces nothing another rank receives (stage 0's backward) could
        name any stage and pass."""
        ins = site.ins
        if not isinstance(ins, (Forward, Loss, Backward, BackwardInput, BackwardWeight,
                                Recompute)):  # COMPUTE, spelt out for the type checker
            return
        place, last = self.low.placement, self.last
        if not 0 <= ins.stage <= last:
            yield Finding(f"runs stage {ins.stage}, but there is no stage {ins.stage} "
                           f"(stages are 0 to {last})", site)
        elif place[ins.stage] != site.rank:
            yield Finding(f"runs stage {ins.stage}, but the placement runs stage {ins.stage} "
                           f"on rank {place[ins.stage]}, not on rank {site.rank}", site)
        if not 0 <= ins.mb < self.mbs:
            yield Finding(f"runs micro-batch {ins.mb}, which is out of range "
                           f"(0 to {self.mbs - 1})", site)

    def rule_local(self) -> Iterator[Finding]:
        # NOTE (speed): the look-ups of the fast path are inline (a transfer's placement, a
        # compute's input and output, a post's key): this rule visits every instruction of
        # every rank, and a method call or property per instruction was most of its time.
        # The helpers explain what the inline tests find wrong. A post waiting for its wait
        # is kept as a plain (rank, pc, post) tuple, made a `Site` only where a finding
        # names it, and a key's entry leaves `outstanding` with its last post. Posts waiting
        # for their wait are kept per side (`outstanding[send]`, by key): a (send, key) tuple
        # made and hashed per post and per wait was a fifth of the rule.
        place, last, mbs = self.low.placement, self.last, self.mbs
        key: Key
        for rank, prog in enumerate(self.low.programs):
            held: set[Key] = set()  # produced here and not yet freed
            freed: dict[Key, Site] = {}
            handed: set[Key] = set()
            received: set[Key] = set()
            outstanding: Outstanding = ({}, {})  # receives, sends: posted, not yet waited
            recvs_out, sends_out = outstanding
            for pc, ins in enumerate(prog):
                t = type(ins)
                if ins.paired and t not in _PAIRABLE:
                    yield Finding("sits inside an overlapped pair, whose two ops start "
                                   "together: only their compute may come between them",
                                   Site(rank, pc, ins))
                if t in SINGLE_POSTS:
                    cs: tuple[Comm, ...] = (ins,)  # type: ignore[assignment]
                elif t is Batch:
                    cs = ins.posts  # type: ignore[attr-defined]
                else:
                    cs = ()
                for c in cs:
                    ct = type(c)
                    tensor, stage, mb = key = (c.tensor, c.stage, c.mb)
                    send = ct in SENDS
                    dst = stage + 1 if tensor == "act" else stage - 1
                    if 0 <= stage <= last and 0 <= dst <= last and 0 <= mb < mbs:
                        me, other = (stage, dst) if send else (dst, stage)
                        placed = place[me] == rank and place[other] != rank and \
                            c.peer == place[other]
                    else:
                        placed = False
                    if not placed:
                        bad = self._placement(Site(rank, pc, c), c)
                        assert bad is not None
                        yield bad
                    elif send:
                        if key not in held:
                            yield from self._send_held(Site(rank, pc, c), key, held, freed)
                    elif key in recvs_out:
                        first = recvs_out[key][0]
                        yield Finding(f"receives {what(key)} a second time while the "
                                       f"first receive is still outstanding (torch: \"Recv "
                                       f"twice without executing\")", Site(rank, pc, c),
                                       (("the first receive", Site(*first)),))
                    if ct is Recv:  # blocking: posted and waited at once
                        received.add(key)
                    elif ct is not Send:
                        side = sends_out if send else recvs_out
                        entry = side.get(key)
                        if entry is None:
                            side[key] = [(rank, pc, c)]  # type: ignore[list-item]
                        else:
                            entry.append((rank, pc, c))  # type: ignore[arg-type]
                if t is WaitSend or t is WaitRecv:
                    send = t is WaitSend
                    key = (ins.tensor, ins.stage, ins.mb)  # type: ignore[attr-defined]
                    side = sends_out if send else recvs_out
                    posted = side.get(key)
                    if posted and posted[0][2].peer == ins.peer:  # type: ignore[attr-defined]
                        # (`_wait`'s way, inline: every wait passes here)
                        if len(posted) == 1:
                            del side[key]
                        else:
                            posted.pop(0)
                        if not send:
                            received.add(key)
                    else:
                        yield from self._wait(Site(rank, pc, ins), outstanding, received)
                elif t is WaitSends:  # every send posted so far is waited
                    sends_out.clear()
                elif t is Handoff:
                    key = (ins.tensor, ins.stage, ins.mb)  # type: ignore[attr-defined]
                    if key not in held:
                        yield from self._send_held(Site(rank, pc, ins), key, held, freed)
                    handed.add(key)
                elif t in COMPUTE_TYPES:
                    stage, mb = ins.stage, ins.mb  # type: ignore[attr-defined]
                    if not (0 <= stage <= last and place[stage] == rank and 0 <= mb < mbs):
                        yield from self._compute_placement(Site(rank, pc, ins))
                    # what it consumes from another stage (a forward the activation of
                    # the stage before, a backward the input gradient of the one after),
                    # handed over here or received from the producing rank
                    need: Key | None = None
                    if t in _FORWARDS:
                        if 0 < stage <= last:
                            need, src = ("act", stage - 1, mb), place[stage - 1]
                    elif t in _BACKWARDS and 0 <= stage < last:
                        need, src = ("grad", stage + 1, mb), place[stage + 1]
                    if need is not None and need not in (handed if src == rank else received):
                        yield from self._missing(Site(rank, pc, ins), need, src, outstanding)
                    if t in _FORWARDS:
                        if stage < last:
                            held.add(("act", stage, mb))
                    elif t in _BACKWARDS:
                        act = ("act", stage, mb)
                        if act in held:
                            held.discard(act)
                            freed[act] = Site(rank, pc, ins)
                        if stage > 0:
                            held.add(("grad", stage, mb))
            for send in (False, True):
                for key in sorted(outstanding[send]):
                    for post in outstanding[send][key]:
                        yield Finding(f"posts a {'send' if send else 'receive'} of "
                                      f"{what(key)} that is never waited for before the "
                                      f"program ends", Site(*post))

    def _wait(self, site: Site, outstanding: Outstanding, received: set[Key]
              ) -> Iterator[Finding]:
        ins = site.ins
        assert isinstance(ins, (WaitSend, WaitRecv))
        send = isinstance(ins, WaitSend)
        posted = outstanding[send].get(ins.key)
        if posted:
            post = Site(*posted.pop(0))
            if cast(Comm, post.ins).peer != ins.peer:  # (the run waits on the wait's peer)
                yield Finding(f"waits for {what(ins.key)} {'to' if send else 'from'} rank "
                              f"{ins.peer}, but its {'send' if send else 'receive'} was posted "
                              f"{'to' if send else 'from'} rank {cast(Comm, post.ins).peer}",
                              site, ((f"the {'send' if send else 'receive'}", post),))
        else:
            yield from self._not_posted(site, ins.key, send)
        if not send:
            received.add(ins.key)  # reported once, here, not again at its consumer

    def _not_posted(self, site: Site, key: Key, send: bool) -> Iterator[Finding]:
        kind = (ISend, Send) if send else (IRecv, Recv)

        def post(i: Instr) -> bool:
            return isinstance(i, kind) and i.key == key

        later = self.find(site.rank, post, site.pc + 1)
        noun = "send" if send else "receive"
        if later is not None:
            yield Finding(f"waits for {what(key)} before its {noun} is posted; the {noun} "
                           f"must come before the op that waits for it", site,
                           ((f"the {noun}, later on this rank", later),))
        else:
            yield Finding(f"waits for a transfer it never posted ({noun} of {what(key)})",
                           site)

    def _send_held(self, site: Site, key: Key, held: set[Key], freed: dict[Key, Site]
                   ) -> Iterator[Finding]:
        if key in held:
            return
        tensor, stage, mb = key
        kinds = (Forward,) if tensor == "act" else (Backward, BackwardInput)
        verb = "hands over" if isinstance(site.ins, Handoff) else "sends"

        def producer(i: Instr) -> bool:
            return isinstance(i, kinds) and i.stage == stage and i.mb == mb

        if key in freed:
            yield Finding(f"{verb} {what(key)} after the backward that frees it", site,
                           (("the backward", freed[key]),))
            return
        later = self.find(site.rank, producer, site.pc + 1)
        if later is not None:
            yield Finding(f"{verb} {what(key)} before the op that produces it; it must "
                           f"come after it", site, (("the producing op, later on this rank",
                                                     later),))
        else:
            yield Finding(f"{verb} {what(key)}, which no op before it on rank {site.rank} "
                           f"produces", site)

    def _missing(self, site: Site, key: Key, src: int, outstanding: Outstanding
                 ) -> Iterator[Finding]:
        """Why the compute at `site` lacks its input `key`, produced on rank `src`."""
        if src == site.rank:
            yield Finding(f"computes on {what(key)} before it is handed over on this rank",
                          site)
            return
        posted = outstanding[False].get(key)
        if posted:
            yield Finding(f"computes on {what(key)} without waiting for its receive", site,
                          (("the receive it must wait for", Site(*posted[0])),))
        else:
            yield from self._not_posted(site, key, send=False)
