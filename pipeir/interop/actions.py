"""torch.distributed.pipelining's actions: one cell of its schedule CSV.

torch writes a schedule as one CSV row per rank and one action per cell (`_dump_csv`):
`{stage}{type}{mb}` such as `2F0`, `0I3`, `1W3`, `0SEND_F1`, `1RECV_B0`; `{stage}{type}`
for `UNSHARD`, `RESHARD` and `REDUCE_GRAD`; `(0F7;7B3)OVERLAP_F_B` for ops a rank runs
together; an empty cell is an idle step.

The grammar is re-implemented here (from `_Action.from_str`) so that importing stays free of
torch. It is stricter than torch's, which uses `re.match` and so reads `2F0xyz` as `2F0`:
anything but a whole action is an error naming what is wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal

from pipeir import limits
from pipeir.ops import Op

Format = Literal["compute_only", "compute_comms"]
FORMATS: Final = ("compute_only", "compute_comms")

COMPUTE: Final = ("F", "B", "I", "W")
COMMS: Final = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
#: Not compute and not communication: UNSHARD/RESHARD matter only to FSDP; REDUCE_GRAD
#: also divides a stage's gradients by the micro-batch count (`pipeir.interop.check`).
BOOKKEEPING: Final = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
OVERLAP: Final = "OVERLAP_F_B"

_ACTION = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)"
                     r"(\d*)")


@dataclass(frozen=True)
class Action:
    """One torch action. `sub` holds the ops of an OVERLAP_F_B (whose stage is -1)."""

    stage: int
    kind: str
    mb: int | None = None
    sub: tuple[Action, ...] = ()

    def __str__(self) -> str:
        """torch's spelling (`_Action.__repr__`), which `parse_action` reads back."""
        if self.kind == OVERLAP:
            return f"({';'.join(map(str, self.sub))}){OVERLAP}"
        return f"{self.stage}{self.kind}{'' if self.mb is None else self.mb}"

    @property
    def op(self) -> Op:
        """The compute op of an F/B/I/W action."""
        assert self.kind in COMPUTE and self.mb is not None
        return Op(self.kind, self.stage, self.mb)  # type: ignore[arg-type]


def parse_action(text: str) -> Action | None:
    """Read one cell: None for an empty (idle) cell; ValueError saying what is wrong."""
    if not isinstance(text, str):
        raise TypeError(f"parse_action: expected an action's text such as '0F1', got "
                        f"{type(text).__name__}")
    text = text.strip()
    if not text:
        return None
    if text.startswith("("):
        close = text.find(")")
        if close < 0:
            raise ValueError(f"'{text}': '(' without ')'")
        kind = text[close + 1:]
        if kind != OVERLAP:
            raise ValueError(f"'{text}': a group of actions must end in ){OVERLAP}, "
                             f"got ')'{kind!r}")
        subs = [parse_action(part) for part in text[1:close].split(";")]
        parts = tuple(a for a in subs if a is not None)
        if len(parts) != 2 or any(a.kind not in COMPUTE for a in parts):
            raise ValueError(f"'{text}': {OVERLAP} must group exactly two compute actions "
                             f"(F, B, I or W)")
        return Action(-1, OVERLAP, None, parts)
    m = _ACTION.fullmatch(text)
    if m is None:
        raise ValueError(f"'{text}' is not a torch action; expected {{stage}}{{type}}{{mb}} "
                         f"such as 2F0, 0I3, 1SEND_F1, 0REDUCE_GRAD or (0F7;7B3){OVERLAP}")
    stage, kind, mb = limits.to_int(m[1]), m[2], m[3]
    if kind in BOOKKEEPING:
        return Action(stage, kind, limits.to_int(mb) if mb else None)
    if not mb:
        raise ValueError(f"'{text}': {kind} needs a micro-batch number, e.g. {stage}{kind}0")
    return Action(stage, kind, limits.to_int(mb))


