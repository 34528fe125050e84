"""What the communication rules speak of: an instruction at its place (`Site`), how a
message names it and where it points (`Locator`), and a rule's `Finding`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from pipeir.backend.instructions import (
    Instr,
)
from pipeir.diagnostics import Span

Channel = tuple[int, int]  # (sender, receiver)
Key = tuple[str, int, int]  # (tensor, producing stage, micro-batch)


class Site(NamedTuple):
    """One communication or compute instruction of one rank: `ins` at `pc` in its program
    (for a post inside a batch, `ins` is the post and `pc` the batch's position).

    NOTE: a named tuple, not a frozen dataclass: the rules make one per instruction they
    look at, and a frozen dataclass's `__init__` (one `object.__setattr__` per field) was
    several times slower to build."""

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


@dataclass(frozen=True)
class Finding:
    message: str
    site: Site | None  # None: about no instruction (a rank's program is empty)
    notes: tuple[tuple[str, Site | None], ...] = ()
    near: Site | None = None  # with no site: where the missing instruction belongs
