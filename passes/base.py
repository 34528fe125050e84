"""The pass contract: a pass is a frozen dataclass whose fields are its options.

One class gives both spellings of a pass: the Python API (`Interleave(v=2)`) and the pipeline
string (`interleave{v=2}`); `pipeir.passes.pipeline` reads the field annotations to parse and
check option values, so a pass never parses its own options.

NOTE (invariants every schedule-level pass keeps): it returns a *new* Schedule (schedules are
immutable), it does not change what work is done except as its summary says (the verifier
checks completeness after every pass by default), and it raises `UsageError` with a message
that says what would work when its input is outside what it accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

from pipeir.diagnostics import UsageError

if TYPE_CHECKING:
    from pipeir.schedule import Schedule


class OptionError(UsageError):
    """A bad option value, raised by a pass's `__post_init__`; `option` names the field so a
    pipeline string can point at the value the user wrote."""

    def __init__(self, option: str, message: str):
        self.option = option
        super().__init__(message)


@dataclass(frozen=True)
class Pass:
    """Base class of every pass; subclasses are frozen dataclasses whose fields are options."""

    name: ClassVar[str]  # kebab-case, e.g. "split-backward"
    summary: ClassVar[str]  # one line for `pipeirc passes`
    #: "schedule": `run(Schedule) -> Schedule`; "lowered": works on lowered per-rank programs
    #: (the backend runs those; the schedule pass manager skips them with a clear message).
    level: ClassVar[str] = "schedule"
    #: Properties the input must have / the output is guaranteed to have, e.g. "complete",
    #: "verified", "split" (backwards are I + W), "merged" (backwards are B). Documentation
    #: for users and for pipelines; the pass manager's verify-each is what enforces validity.
    requires: ClassVar[tuple[str, ...]] = ()
    guarantees: ClassVar[tuple[str, ...]] = ()

    def run(self, schedule: Schedule) -> Schedule:
        """Transform `schedule` into a new one. Subclasses at level "schedule" override this."""
        raise NotImplementedError(f"pass '{self.name}' does not transform schedules "
                                  f"(level {self.level})")

    def options(self) -> dict[str, Any]:
        """The option values of this instance, by field name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def spec(self) -> str:
        """This pass in pipeline-string form, e.g. `interleave{v=2,placement=loop}`;
        options at their default are left out so the spelling stays short."""
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.default is not value and f.default != value:
                parts.append(f"{f.name}={format_value(value)}")
        return self.name + ("{" + ",".join(parts) + "}" if parts else "")

    def __str__(self) -> str:
        return self.spec()


def format_value(value: object) -> str:
    """An option value as the pipeline string spells it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return str(value)
