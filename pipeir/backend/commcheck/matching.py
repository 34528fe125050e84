"""Rule 2 (the package NOTE): *matching* (each transfer sent and received exactly once, with
one tag), *computing* (every stage's forward, loss and backward per micro-batch, in order) and
*stepping* (one `zero-grad`, one `step`, and with data parallelism one reduction per stage)."""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import cast

from pipeir.backend.commcheck.findings import Channel, Finding, Key, Site, what
from pipeir.backend.commcheck.programs import COMPUTE_TYPES, Programs, Side
from pipeir.backend.instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Comm,
    Forward,
    ForwardCheckpoint,
    Instr,
    Load,
    Loss,
    Offload,
    OptimizerStep,
    Recompute,
    ReduceGrad,
    Reload,
    WaitReduce,
    ZeroGrad,
)

#: What `rule_compute` counts, by kind: F, FC (checkpointed), RC, OFF, RELOAD, L (the loss),
#: B, I, W.
_COMPUTE_KIND: dict[type[Instr], str] = {
    Forward: "F", ForwardCheckpoint: "FC", Recompute: "RC", Offload: "OFF", Reload: "RELOAD",
    Loss: "L", Backward: "B", BackwardInput: "I", BackwardWeight: "W"}
#: the compute kinds by number, and their numbers by instruction type (`rule_compute`)
_CODE_KIND: tuple[str, ...] = tuple(dict.fromkeys(_COMPUTE_KIND.values()))
_COMPUTE_CODE: dict[type[Instr], int] = {t: _CODE_KIND.index(k)
                                         for t, k in _COMPUTE_KIND.items()}
#: The compute sequences (kinds in program order) `rule_compute` takes without looking
#: further (`Matching._normal`): a forward, then B or I and W, each alone or with a
#: checkpoint's recompute or an offload and its reload; on the last stage a plain forward,
#: the loss and the backward.
_NORMAL: frozenset[tuple[int, ...]] = frozenset(
    tuple(_CODE_KIND.index(k) for k in (*fwd, *back))
    for fwd in (("F",), ("FC", "RC"), ("F", "OFF", "RELOAD")) for back in (("B",), ("I", "W")))
_NORMAL_LAST: frozenset[tuple[int, ...]] = frozenset(
    tuple(_CODE_KIND.index(k) for k in ("F", "L", *back)) for back in (("B",), ("I", "W")))
_WHY = "every stage runs one forward and one backward (B, or I then W) per micro-batch"
_NOUNS = {"F": "forward", "FC": "checkpointed forward", "RC": "recompute", "OFF": "offload",
          "RELOAD": "reload", "L": "loss", "B": "backward", "I": "input gradient (I)",
          "W": "weight gradient (W)"}



def _paired(sent: dict[Channel, Side], recvd: dict[Channel, Side]) -> bool:
    """Whether every channel's sends and receives name the same transfers, each once, in the
    same order, with the same tags: then `rule_matching` finds nothing (each expected
    transfer is sent once and received once or neither, and its two sides are a pair at one
    index, so their tags agree). Checked first, without the per-key index the findings need
    (a large program's proof peaked there)."""
    for ch in sent.keys() | recvd.keys():
        a, b = sent.get(ch), recvd.get(ch)
        if a is None or b is None or len(a) != len(b):
            return False
        keys = set()
        for tx, rx in zip(a.posts, b.posts):
            if tx.tensor != rx.tensor or tx.stage != rx.stage or tx.mb != rx.mb \
                    or tx.tag != rx.tag:
                return False
            keys.add((tx.tensor, tx.stage, tx.mb))
        if len(keys) != len(a):
            return False
    return True


class Matching(Programs):
    """Rules 2, 2b and 2c over one set of programs."""

    def rule_matching(self) -> Iterator[Finding]:
        sent, recvd = self.sides()
        if _paired(sent, recvd):
            return  # (what the checks below would find nothing in: see `_paired`)
        by_key: dict[tuple[bool, Channel, Key], list[Site]] = {}
        for send, table in ((True, sent), (False, recvd)):
            for ch, items in table.items():
                for site in items:
                    by_key.setdefault((send, ch, cast(Comm, site.ins).key), []).append(site)
        for ch, key in self.expected():
            sends = by_key.get((True, ch, key), [])
            recvs = by_key.get((False, ch, key), [])
            for mine, theirs, noun, other in ((sends, recvs, "send", "receive"),
                                              (recvs, sends, "receive", "send")):
                if len(mine) > 1:
                    yield Finding(f"{noun}s {what(key)} a second time: each transfer is "
                                   f"sent once and received once", mine[1],
                                   (("the first", mine[0]),))
                elif not mine and theirs:
                    side = ch[1] if noun == "receive" else ch[0]
                    verb = "receives" if noun == "receive" else "sends"
                    yield Finding(f"{'sends' if noun == 'receive' else 'receives'} "
                                   f"{what(key)}, but rank {side} never {verb} it: every "
                                   f"{other} needs exactly one matching {noun}", theirs[0])
            if len(sends) == 1 and len(recvs) == 1:
                tx, rx = sends[0].ins, recvs[0].ins
                assert isinstance(tx, Comm) and isinstance(rx, Comm)
                if tx.tag != rx.tag:
                    yield Finding(f"receives {what(key)} with tag {rx.tag}, but rank {ch[0]} "
                                   f"sends it with tag {tx.tag}: gloo matches a receive to the "
                                   "send of the same tag, so it would wait forever (NCCL "
                                   "ignores tags)", recvs[0], (("the send", sends[0]),))

    # -- rule 2b: every op computed --

    def rule_compute(self) -> Iterator[Finding]:
        """Each stage runs, for every micro-batch of every round, one forward (or one
        checkpointed forward and its recompute), the loss after it on the last stage only,
        scaled by 1/(m x rounds), and one backward after it: B, or I then W; an offload comes
        after a plain forward, its reload after it and before the backward; stage 0 loads
        its input and the last stage its target first, once. Without this a compute whose
        output no other rank receives (stage 0's backward, any W, a recompute, a reload)
        could be left out, or run twice, and still pass."""
        # NOTE: per (stage, micro-batch), its computes as ints packing (rank, pc, kind), in
        # program order; their sites are made only where that op is checked (`_sites`): a
        # large program's proof peaked at a dict of site lists per op. Computes of a stage or
        # micro-batch out of range are never looked at (other rules name them).
        # NOTE (memory): the packed ints of every op lie in one array, each op's together
        # (`start` says where: counted first, then placed in a second pass), not in a list
        # per op of int objects, which was the largest part of a large program's proof.
        stages, mbs = self.last + 1, self.mbs
        progs = self.low.programs
        start = array("q", bytes(8 * (stages * mbs + 1)))
        loads: dict[tuple[str, int], list[Site]] = {}
        for rank, prog in enumerate(progs):
            for pc, ins in enumerate(prog):
                if type(ins) in _COMPUTE_CODE:  # (each has a stage and a micro-batch)
                    s, mb = ins.stage, ins.mb  # type: ignore[attr-defined]
                    if 0 <= s < stages and 0 <= mb < mbs:
                        start[s * mbs + mb + 1] += 1
                elif type(ins) is Load:
                    loads.setdefault((ins.part, ins.mb), []).append(Site(rank, pc, ins))
        start = array("q", itertools.accumulate(start))
        runs = array("q", bytes(8 * start[-1]))
        put = array("q", start)  # where each op's next compute goes
        for rank, prog in enumerate(progs):
            for pc, ins in enumerate(prog):
                kind = _COMPUTE_CODE.get(type(ins))
                if kind is not None:
                    s, mb = ins.stage, ins.mb  # type: ignore[attr-defined]
                    if 0 <= s < stages and 0 <= mb < mbs:
                        at = s * mbs + mb
                        runs[put[at]] = ((rank << 32 | pc) << 4) | kind
                        put[at] += 1
        del put
        for s in range(self.last + 1):
            rank = self.low.placement[s]
            if not self.low.programs[rank]:
                yield Finding(f"rank {rank}'s program is empty, but the placement runs stage "
                               f"{s} there: {_WHY}", None)
                continue
            normal = _NORMAL_LAST if s == self.last else _NORMAL
            for mb in range(self.mbs):
                at = s * mbs + mb
                packed = runs[start[at]:start[at + 1]]
                if self._normal(s, mb, packed, normal, loads):
                    continue
                got = self._sites(packed)
                found = list(self._one_op(s, mb, rank, got, loads))
                yield from found[:1]  # the first thing wrong with this op
        for (part, mb), sites in sorted(loads.items()):
            stage = 0 if part == "input" else self.last
            if not 0 <= mb < self.mbs or sites[0].rank != self.low.placement[stage]:
                yield Finding(f"loads the {part} of micro-batch {mb}, which only stage "
                               f"{stage}'s forward of a micro-batch in 0 to {self.mbs - 1} uses"
                               f" (on rank {self.low.placement[stage]})", sites[0])

    def _normal(self, s: int, mb: int, packed: Sequence[int], normal: frozenset[tuple[int, ...]],
                loads: dict[tuple[str, int], list[Site]]) -> bool:
        """Whether an op's computes (packed by `rule_compute`) are one of the common correct
        sequences (`_NORMAL`), on one rank, with the loads and the loss scale `_one_op`
        wants: then `_one_op` would find nothing, and its sites are never made. Anything
        else goes to `_one_op` (tests/test_commcheck.py checks the two agree)."""
        if len(packed) < 2:
            return False
        rank = packed[0] >> 36
        kinds = []
        for x in packed:
            if x >> 36 != rank:
                return False
            kinds.append(x & 15)
        if tuple(kinds) not in normal:
            return False
        if s == 0 and not self._loaded("input", mb, rank, (packed[0] >> 4) & 0xFFFFFFFF, loads):
            return False
        if s == self.last:  # (a last stage's sequence is F, L, ...)
            pc = (packed[1] >> 4) & 0xFFFFFFFF
            scale = self.low.programs[rank][pc].scale  # type: ignore[attr-defined]
            if abs(scale * self.mbs - 1) > 1e-9 or not self._loaded("target", mb, rank, pc,
                                                                      loads):
                return False
        return True

    @staticmethod
    def _loaded(part: str, mb: int, rank: int, pc: int,
                loads: dict[tuple[str, int], list[Site]]) -> bool:
        """Whether `part` of micro-batch `mb` is loaded once, on `rank`, before `pc`."""
        sites = loads.get((part, mb))
        return sites is not None and len(sites) == 1 and sites[0].rank == rank and \
            sites[0].pc <= pc

    def _sites(self, packed: Iterable[int]) -> dict[str, list[Site]]:
        """An op's computes (packed by `rule_compute`) by kind, in program order."""
        got: dict[str, list[Site]] = {}
        progs = self.low.programs
        for x in packed:
            rank, pc = x >> 36, (x >> 4) & 0xFFFFFFFF
            got.setdefault(_CODE_KIND[x & 15], []).append(Site(rank, pc, progs[rank][pc]))
        return got

    def _one_op(self, s: int, mb: int, rank: int, got: dict[str, list[Site]],
                loads: dict[tuple[str, int], list[Site]]) -> Iterator[Finding]:
        name = f"stage {s}, micro-batch {mb}"
        for kind, sites in got.items():
            if len(sites) > 1:
                yield Finding(f"runs the {_NOUNS[kind]} of {name} a second time: each runs "
                               "once", sites[1], (("the first", sites[0]),))
        one = {k: sites[0] for k, sites in got.items()}
        fwd = one.get("F") or one.get("FC")
        back = [one[k] for k in ("B", "I", "W") if k in one]
        prog = self.low.programs[rank]  # (not empty: see `rule_compute`)
        anchor = fwd or (back[0] if back else None) or Site(rank, len(prog) - 1, prog[-1])
        if fwd is None:
            yield Finding(f"comes with no forward of {name} on rank {rank}: {_WHY}", anchor)
            return
        if "F" in one and "FC" in one:
            yield Finding(f"runs both a forward and a checkpointed forward of {name}: {_WHY}",
                           one["FC"])
        if not back:
            yield Finding(f"has no backward: rank {rank} never runs B, or I and W, of {name}; "
                           f"{_WHY}", fwd)
            return
        if "B" in one and ("I" in one or "W" in one):
            yield Finding(f"runs both B and I/W of {name}: {_WHY}", back[-1])
        elif "B" not in one and not ("I" in one and "W" in one):
            have, lack = ("I", "W") if "I" in one else ("W", "I")
            yield Finding(f"runs {have} of {name} without its {lack}: {_WHY}", one[have])
        yield from self._memory_ops(s, name, one, fwd, back[0])
        yield from self._loss(s, mb, name, one, fwd, back[0], loads)
        order = [one[k] for k in ("F", "FC", "L", "OFF", "RELOAD", "RC", "B", "I", "W")
                 if k in one]
        for a, b in itertools.pairwise(order):
            if a.pc > b.pc:
                yield Finding(f"runs after `{b.ins.mnemonic}` of {name}, which needs it "
                               "first (forward, loss, offload, reload, recompute, then B, or "
                               "I then W)", a, (("the one that needs it", b),))
                return

    def _memory_ops(self, s: int, name: str, one: dict[str, Site], fwd: Site, back: Site
                    ) -> Iterator[Finding]:
        """A checkpointed forward with its recompute (never on the last stage, whose output
        feeds the loss); an offload of a plain forward with its reload."""
        if "FC" in one and s == self.last:
            yield Finding(f"checkpoints the last stage's forward ({name}), whose output feeds "
                           "the loss", one["FC"])
        for first, then, lacks_then, lacks_first in (
                ("FC", "RC", f"keeps only its input, but {name} is never recomputed before its "
                 "backward", f"recomputes {name}, whose forward was not checkpointed"),
                ("OFF", "RELOAD", f"moves {name}'s activations to host memory, but nothing "
                 "reloads them for the backward", f"reloads {name}'s activations, which no "
                 "offload moved")):
            if first in one and then not in one:
                yield Finding(lacks_then, one[first])
            elif then in one and first not in one:
                yield Finding(lacks_first, one[then], (("its forward", fwd),))
        if "OFF" in one and "F" not in one:
            yield Finding(f"offloads {name}, whose forward keeps nothing to offload (a "
                           "checkpointed forward)", one["OFF"])

    def _loss(self, s: int, mb: int, name: str, one: dict[str, Site], fwd: Site, back: Site,
              loads: dict[tuple[str, int], list[Site]]) -> Iterator[Finding]:
        """The loss (and the target it needs) on the last stage only, scaled by 1/(m x
        rounds); stage 0's forward after its input's load."""
        loss = one.get("L")
        if s == self.last and loss is None:
            yield Finding(f"has no loss: the last stage computes the loss of {name} after "
                           "its forward and before its backward", fwd)
        if s != self.last and loss is not None:
            yield Finding(f"computes a loss on stage {s}, which is not the last stage "
                           f"({self.last})", loss)
        if s == self.last and loss is not None:
            scale = loss.ins.scale  # type: ignore[attr-defined]
            if abs(scale * self.mbs - 1) > 1e-9:
                yield Finding(f"scales the loss by {scale:g}, but the gradients of one "
                               f"big batch need 1/{self.mbs} (micro-batches x rounds)", loss)
        for part, stage, user in (("input", 0, fwd), ("target", self.last, loss)):
            if s != stage or user is None:
                continue
            sites = loads.get((part, mb), [])
            if len(sites) != 1 or sites[0].rank != user.rank or sites[0].pc > user.pc:
                how = "loads twice" if len(sites) > 1 else "loads only after it" \
                    if sites and sites[0].rank == user.rank else "never loads"
                yield Finding(f"needs the {part} of micro-batch {mb}, which rank {user.rank} "
                               f"{how}: it is loaded once, before", user)

    # -- rule 2c: one optimizer step --

    def rule_step(self) -> Iterator[Finding]:
        """Each program is one optimizer step: `zero-grad` once, before its first compute,
        and `step` once, after its last compute. With gradient reductions (data
        parallelism: any `reduce-grad` or `wait-reduce` at all) every stage reduces once, on
        its rank, after its last weight gradient (B or W), and waits for it once, after that
        and before the step. Otherwise, silently: a missing `zero-grad` adds gradients up
        across steps, a missing `step` never trains, a compute after it uses the new weights,
        and a stage left unreduced lets the replicas drift apart."""
        reducing = False
        for rank, prog in enumerate(self.low.programs):
            if not prog:  # (an empty program is `rule_compute`'s finding)
                continue
            # one pass per program, by exact type (`programs.py`'s NOTE): the first and last
            # compute, the first two `zero-grad`s and `step`s, and whether it reduces
            first = last = -1
            zeros: list[int] = []
            steps: list[int] = []
            for pc, i in enumerate(prog):
                t = type(i)
                if t in COMPUTE_TYPES:
                    if first < 0:
                        first = pc
                    last = pc
                elif t is ZeroGrad:
                    zeros.append(pc)
                elif t is OptimizerStep:
                    steps.append(pc)
                elif t is ReduceGrad or t is WaitReduce:
                    reducing = True
            yield from self._one_step(rank, prog, first, last, zeros, steps)
        if reducing:
            yield from self._reductions()

    def _one_step(self, rank: int, prog: Sequence[Instr], first: int, last: int,
                  zeros: list[int], steps: list[int]) -> Iterator[Finding]:
        """`rule_step` for one program (its first and last compute, -1 where it has none,
        and its `zero-grad`s and `step`s): its `zero-grad` and its `step`."""
        def at(pc: int) -> Site:
            return Site(rank, pc, prog[pc])

        if not zeros:
            yield Finding(f"rank {rank}'s program has no `zero-grad` (before its first "
                           "instruction, shown): each program is one optimizer step, and "
                           "starts by clearing the gradients", None, near=at(0))
        else:
            if len(zeros) > 1:
                yield Finding("clears the gradients a second time: each program is one "
                               "optimizer step", at(zeros[1]), (("the first", at(zeros[0])),))
            if 0 <= first < zeros[0]:
                yield Finding("clears the gradients after a compute of the same step: "
                               "`zero-grad` comes before every compute", at(zeros[0]),
                               (("the compute", at(first)),))
        if not steps:
            yield Finding(f"rank {rank}'s program has no `step` (after its last instruction, "
                           "shown): each program is one optimizer step, and ends by applying "
                           "it", None, near=at(len(prog) - 1))
        else:
            if len(steps) > 1:
                yield Finding("steps a second time: each program is one optimizer step",
                               at(steps[1]), (("the first", at(steps[0])),))
            if last > steps[0]:
                yield Finding("steps before a compute of the same step: `step` comes after "
                               "every compute", at(steps[0]), (("the compute", at(last)),))

    def _reductions(self) -> Iterator[Finding]:
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
                        yield Finding(f"names stage {ins.stage}, but there is no stage "
                                       f"{ins.stage} (stages are 0 to {last})", site)
                    elif place[ins.stage] != rank:
                        yield Finding(f"names stage {ins.stage}, which runs on rank "
                                       f"{place[ins.stage]}, not on rank {rank}", site)
                    else:
                        (reduce if isinstance(ins, ReduceGrad) else wait).setdefault(
                            ins.stage, []).append(site)
        for s in range(last + 1):
            r, w = reduce.get(s, []), wait.get(s, [])
            if not r:
                yield Finding(f"stage {s} has no `reduce-grad` on rank {place[s]}"
                               + (" (after its last weight gradient, shown)" if s in grad else "")
                               + ": with data parallelism every stage all-reduces its "
                               "gradients once, or the replicas drift apart", None,
                               near=grad.get(s))
                continue
            for verb, sites in (("reduces", r), ("waits for the reduction of", w)):
                if len(sites) > 1:
                    yield Finding(f"{verb} stage {s} a second time: once per step", sites[1],
                                   (("the first", sites[0]),))
            if s in grad and grad[s].pc > r[0].pc:
                yield Finding(f"reduces stage {s} before its last weight gradient, which "
                               "the all-reduce would miss", r[0],
                               (("the last weight gradient", grad[s]),))
            end = step.get(place[s], len(self.low.programs[place[s]]))
            if not w:
                yield Finding(f"is never waited for (`wait-reduce stage={s}` belongs before "
                               "`step`): the step could use gradients still being reduced", r[0])
            elif not r[0].pc < w[0].pc < end:
                yield Finding(f"waits for stage {s}'s reduction outside its place: after "
                               "`reduce-grad` and before `step`", w[0],
                               (("the reduce-grad", r[0]),))
