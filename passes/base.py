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

import functools
import inspect
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Union, get_args, get_origin

from pipeir import limits
from pipeir.backend.program_io import expect_lowered
from pipeir.diagnostics import UsageError
from pipeir.limits import plain_number
from pipeir.passes.context import DEFAULT_CONTEXT, CommModel, PassContext
from pipeir.schedule import Schedule, expect_schedule
from pipeir.sim.costs import CostModel

if TYPE_CHECKING:
    from pipeir.backend.instructions import Instr, Lowered
    from pipeir.backend.split import Split


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

    def __post_init__(self) -> None:
        check_options(self)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A pass's own `__post_init__` (its range checks) runs after the type checks, so
        it compares numbers, not a string given for one (`Reorder(budget_ms="5")`), even
        when it does not call the base's."""
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__post_init__")
        if own is None or getattr(own, "checks_options", False):
            return

        @functools.wraps(own)
        def post_init(self: PassBase, *args: Any, **kwargs: Any) -> None:  # (InitVars too)
            check_options(self)
            own(self, *args, **kwargs)
        post_init.checks_options = True  # type: ignore[attr-defined]
        cls.__post_init__ = post_init  # type: ignore[method-assign]

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


def _checked_run(cls: type[PassBase], expect: Callable[[object, str], object]) -> None:
    """Wrap `cls`'s own `run` so that a wrong argument fails at the call, named, not as an
    AttributeError inside the pass (`Interleave(v=2).run("1f1b")`, `Reorder().run(s,
    CostModel())`): passes are public and run on their own, not only by the pass manager."""
    own = cls.__dict__.get("run")
    if own is None or getattr(own, "checks_arguments", False):
        return
    # (its own parameter names: `run(schedule=s, ctx=c)` is a call as good as positional)
    names = [p.name for p in inspect.signature(own).parameters.values()][1:3]

    @functools.wraps(own)
    def run(self: PassBase, *args: Any, **kwargs: Any) -> Any:
        where = f"{getattr(self, 'name', type(self).__name__)}.run"
        given = [*args, *(kwargs[n] for n in names[len(args):] if n in kwargs)]
        if given:
            expect(given[0], where)
        ctx = given[1] if len(given) > 1 else None
        if ctx is not None and not isinstance(ctx, PassContext):
            hint = ": give PassContext(costs=...)" if isinstance(ctx, CostModel) else ""
            raise TypeError(f"{where}(ctx=...): expected a PassContext, got "
                            f"{type(ctx).__name__}{hint}")
        return own(self, *args, **kwargs)
    run.checks_arguments = True  # type: ignore[attr-defined]
    cls.run = run  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Pass(PassBase):
    """A pass over the schedule IR: `run(schedule, ctx) -> Schedule`."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _checked_run(cls, expect_schedule)

    def run(self, schedule: Schedule, ctx: PassContext = DEFAULT_CONTEXT) -> Schedule:
        """Transform `schedule` into a new one (`ctx`: the costs to plan against)."""
        raise NotImplementedError(f"pass '{self.name}' does not define run()")


@dataclass(frozen=True)
class LoweredPass(PassBase):
    """A pass over lowered per-rank instruction programs (the backend's level), such as
    `overlap`: it runs after lowering, and `pipeir.backend.commcheck` proves its output."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _checked_run(cls, expect_lowered)

    #: The communication model the programs run under after this pass (None: unchanged).
    comm: ClassVar[CommModel | None] = None
    #: Whether the pass rewrites each rank's program on its own (`run_rank`), whatever the
    #: other ranks' say: then, as the first lowered pass, it runs on each program as
    #: lowering makes it, and the whole input is never held beside the whole output.
    rank_local: ClassVar[bool] = False

    def run(self, lowered: Lowered, ctx: PassContext = DEFAULT_CONTEXT) -> Lowered:
        """Transform `lowered` into new programs."""
        raise NotImplementedError(f"pass '{self.name}' does not define run()")

    #: Whether a rank-local pass places every receive itself and reads nothing else of where
    #: they were, nor their order across peers (`overlap`): then it defines `run_split`, and
    #: lowering hands it each program split (`pipeir.backend.split`) without making the
    #: program.
    splits: ClassVar[bool] = False

    def run_rank(self, program: tuple[Instr, ...]) -> tuple[Instr, ...]:
        """A rank-local pass's rewrite of one rank's program: `run` must give exactly these
        programs (under the communication model `comm`)."""
        raise NotImplementedError(f"pass '{self.name}' is not rank-local")

    def run_split(self, split: Split) -> tuple[Instr, ...]:
        """`run_rank` of the program `split` was made from (`splits`)."""
        raise NotImplementedError(f"pass '{self.name}' does not take split programs")


def check_options(p: PassBase) -> None:
    """Every option of `p` has its annotated type, by `convert`'s rules for a pipeline string
    (`pipeir.passes.pipeline`): `recompute{all=false}` is False, and `Recompute(all="false")`
    in Python, a true string, once recomputed every forward. Checked as a pass is made, so
    a pass run on its own (`Recompute(...).run(schedule)`) is held to it too."""
    hints = _hints(type(p))
    for f in fields(p):
        if f.name in hints:
            value = plain_number(getattr(p, f.name))  # (numpy's numbers as Python's)
            if value is not getattr(p, f.name):
                object.__setattr__(p, f.name, value)
            check_value(value, hints[f.name],
                        f"option '{f.name}' of pass '{getattr(p, 'name', type(p).__name__)}'")


def _hints(cls: type) -> dict[str, Any]:
    found = _HINTS.get(cls)
    if found is None:
        try:
            found = typing.get_type_hints(cls)
        except (NameError, TypeError):  # (a user's pass whose annotations do not resolve here)
            found = {}
        _HINTS[cls] = found
    return found


#: each pass class's resolved annotations, once (passes are made in tune's and synth's loops)
_HINTS: dict[type, dict[str, Any]] = {}


def check_value(value: Any, hint: Any, what: str) -> None:
    """`convert`'s rules on a value given in Python (types it cannot spell are left alone)."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        args = get_args(hint)
        if value is None and type(None) in args:
            return
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            check_value(value, rest[0], what)
        return
    if origin is Literal:
        if value not in get_args(hint) or type(value) is bool:
            choices = ", ".join(str(a) for a in get_args(hint))
            raise UsageError(f"{what} must be one of {choices}, got {value!r}")
    elif hint is bool:
        if type(value) is not bool:
            raise UsageError(f"{what} must be True or False, got {value!r}")
    elif hint is int:
        if type(value) is not int:
            raise UsageError(f"{what} must be an integer, got {value!r}")
        if limits.int_overflow(value):
            raise UsageError(f"{what} is out of range: integers are 64-bit, at most "
                             f"{limits.MAX_INT:,}")
    elif hint is float:
        if type(value) is int and limits.int_overflow(value):  # (isfinite would raise)
            raise UsageError(f"{what} is out of range: at most {limits.MAX_INT:,}")
        if type(value) not in (int, float) or not math.isfinite(value):
            raise UsageError(f"{what} must be a finite number, got {value!r}")
    elif hint is str and type(value) is not str:
        raise UsageError(f"{what} must be a string, got {value!r}")


def format_value(value: object) -> str:
    """An option value as the pipeline string spells it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return str(value)
