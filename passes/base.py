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
from pipeir.passes.context import DEFAULT_CONTEXT, CommModel, PassContext

if TYPE_CHECKING:
    from pipeir.backend.instructions import Instr, Lowered
    from pipeir.schedule import Schedule


class OptionError(UsageError):
    """A bad option value, raised by a pass's `__post_init__`; `option` names the field so a
    pipeline string can point at the value the user wrote."""

    def __init__(self, option: str, message: str):
        self.option = option
        super().__init__(message)


@dataclass(frozen=True)
class PassBase:
    """What every pass has, whatever it transforms: a name, a summary and its options."""

    name: ClassVar[str]  # kebab-case, e.g. "split-backward"
    summary: ClassVar[str]  # one line for `pipeirc passes`
    #: Whether the pass decides by the context's costs (`reorder`, `synth`): a command that
    #: runs it with no costs at all warns, since it then plans for the default unit costs.
    costed: ClassVar[bool] = False

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


@dataclass(frozen=True)
class Pass(PassBase):
    """A pass over the schedule IR: `run(schedule, ctx) -> Schedule`."""

    def run(self, schedule: Schedule, ctx: PassContext = DEFAULT_CONTEXT) -> Schedule:
        """Transform `schedule` into a new one (`ctx`: the costs to plan against)."""
        raise NotImplementedError(f"pass '{self.name}' does not define run()")


@dataclass(frozen=True)
class LoweredPass(PassBase):
    """A pass over lowered per-rank instruction programs (the backend's level), such as
    `overlap`: it runs after lowering, and `pipeir.backend.commcheck` proves its output."""

    #: The communication model the programs run under after this pass (None: unchanged).
    comm: ClassVar[CommModel | None] = None
    #: Whether the pass rewrites each rank's program on its own (`run_rank`), whatever the
    #: other ranks' say: then, as the first lowered pass, it runs on each program as
    #: lowering makes it, and the whole input is never held beside the whole output.
    rank_local: ClassVar[bool] = False

    def run(self, lowered: Lowered, ctx: PassContext = DEFAULT_CONTEXT) -> Lowered:
        """Transform `lowered` into new programs."""
        raise NotImplementedError(f"pass '{self.name}' does not define run()")

    def run_rank(self, program: tuple[Instr, ...]) -> tuple[Instr, ...]:
        """A rank-local pass's rewrite of one rank's program: `run` must give exactly these
        programs (under the communication model `comm`)."""
        raise NotImplementedError(f"pass '{self.name}' is not rank-local")


def format_value(value: object) -> str:
    """An option value as the pipeline string spells it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return str(value)
