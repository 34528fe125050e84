"""Names and values: what the elaborator knows about a name while compiling (its scope), and
what it holds while running (values, closures and the run context).

NOTE: compiled code is a tree of closures. Each takes the value environment (`Env`, name ->
value) and the run context (`RunContext`, or None where only constants are computed: pipeline
settings, parameter defaults) as explicit arguments; the environment holds only the
language's own values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from pipeir import limits
from pipeir.config import PipelineConfig, spell, type_name
from pipeir.diagnostics import Note, PipeirError, Span, UsageError
from pipeir.ops import OP_ARITY
from pipeir.schedule import ScheduleBuilder

Value = int | float | bool | str | tuple[Any, ...]
Env = dict[str, Any]


# ---- compile time: scopes --------------------------------------------------------------------
@dataclass(frozen=True)
class Binding:
    """What a name is: a value, a function (`def f(x) = e`), a macro (`def g(x) { ... }`),
    a built-in function or an op; with where it was defined and how many arguments it takes."""

    kind: str  # "value" | "func" | "macro" | "builtin" | "op"
    span: Span | None
    arity: int | tuple[int, int] = 0  # exact, or (min, max)


@dataclass
class Scope:
    """The names visible at one point of the program. Names never shadow: defining a name
    that is visible already is an error, so a typo'd redefinition cannot hide a value."""

    names: dict[str, Binding] = field(default_factory=dict)
    parent: Scope | None = None
    in_rank: bool = False

    def lookup(self, name: str) -> Binding | None:
        s: Scope | None = self
        while s is not None:
            b = s.names.get(name)
            if b is not None:
                return b
            s = s.parent
        return None

    def all_names(self) -> set[str]:
        out: set[str] = set()
        s: Scope | None = self
        while s is not None:
            out |= set(s.names)
            s = s.parent
        return out

    def define(self, name: str, binding: Binding, span: Span) -> None:
        if name in BUILTINS or name in CONSTANTS:  # (looked up after every scope)
            raise UsageError(f"'{name}' is a built-in name; pick another name", span)
        prev = self.lookup(name)
        if prev is not None:
            where = (Note(f"'{name}' is defined here", prev.span),) if prev.span else ()
            raise UsageError(f"'{name}' is already defined; pick another name", span, where)
        self.names[name] = binding

    def child(self, in_rank: bool | None = None) -> Scope:
        return Scope({}, self, self.in_rank if in_rank is None else in_rank)


def value_scope(names: Iterable[str]) -> Scope:
    """A scope of plain values (settings, parameters), none of them defined in the file."""
    return Scope({k: Binding("value", None) for k in names})


BUILTINS: Final[dict[str, Binding]] = {
    "min": Binding("builtin", None, (1, 1 << 30)),
    "max": Binding("builtin", None, (1, 1 << 30)),
    "abs": Binding("builtin", None, 1),
    "owner": Binding("builtin", None, 1),
    "local_stage": Binding("builtin", None, 2),
    "num_local_stages": Binding("builtin", None, 1),
    **{k: Binding("op", None, n) for k, n in OP_ARITY.items()},
}

CONSTANTS: Final[dict[str, bool]] = {"true": True, "false": False}


# ---- run time: context, closures, values -----------------------------------------------------
@dataclass
class RunContext:
    """One elaboration's mutable state: where ops go, which rank is running, and the budgets
    that turn a runaway loop or recursion into a diagnostic."""

    builder: ScheduleBuilder
    config: PipelineConfig
    rank: int | None = None
    iterations: int = 0
    depth: int = 0
    calls: int = 0
    rank_note: str = ""

    @functools.cached_property
    def max_calls(self) -> int:
        """Function and macro calls one elaboration may make (`pipeir.limits`); read on every
        call, so worked out once."""
        c = self.config
        return limits.CALLS_BASE + limits.CALLS_PER_PAIR * c.stages * c.microbatches


ExprFn = Callable[[Env, "RunContext | None"], Any]
StmtFn = Callable[[Env, RunContext], None]


@dataclass
class Closure:
    """A function (`expr`) or macro (`body`) with the environment it was defined in."""

    params: tuple[str, ...]
    env: Env
    expr: ExprFn | None
    body: StmtFn | None
    span: Span
    name: str = ""
    memo: dict[Any, Any] = field(default_factory=dict)  # a function's values (`invoke`)


def invoke(fn: Closure, args: list[Any], ctx: RunContext | None, span: Span) -> Any:
    """Call a function or macro, counting the nesting depth against MAX_DEPTH and the calls
    against the run's budget (`pipeir.limits`).

    NOTE (memo): a function (`def f(x) = expr`) is pure: an expression over its parameters
    and names bound once (names never shadow or change; a `def` inside a loop or a rank
    block makes a new closure each time it runs), so its value for integer arguments is kept
    on its closure and a second call with them returns it without running (or counting:
    the budget bounds work done). Every rank calls interleaved 1F1B's `chunk_mb(k)` for the
    same k: elaborating p = 64 went from 2.0 to 1.5 s. Only ints are keys: `1`, `1.0` and
    `true` are equal keys in a dict, not equal values in the language."""
    # (one parameter, most calls, set alone: a dict update from a zip cost twice the copy,
    # and a large schedule makes a call or two per op)
    key: Any = _MISS
    if ctx is not None and fn.expr is not None:  # a function: its value can be kept
        if len(args) == 1:
            if type(args[0]) is int:
                key = args[0]
        elif all(type(a) is int for a in args):
            key = tuple(args)
        if key is not _MISS:
            hit = fn.memo.get(key, _MISS)
            if hit is not _MISS:
                return hit
    env = fn.env.copy()
    params = fn.params
    if len(params) == 1:
        env[params[0]] = args[0]
    else:
        env.update(zip(params, args))
    if ctx is None:  # constant contexts (settings): the nesting guard bounds recursion there
        return fn.expr(env, None) if fn.expr is not None else None
    depth = ctx.depth = ctx.depth + 1
    made = ctx.calls = ctx.calls + 1
    if depth > limits.MAX_DEPTH:
        ctx.depth -= 1
        raise UsageError(f"{_what(fn)} nest deeper than {limits.MAX_DEPTH} calls; is a recursion "
                         "missing its base case?", span)
    if made > ctx.max_calls:
        ctx.depth -= 1
        raise UsageError(
            f"the schedule calls {_what(fn)} more than {ctx.max_calls:,} times "
            f"({limits.CALLS_BASE:,} + {limits.CALLS_PER_PAIR} per (stage, micro-batch) pair); "
            "does a function call itself (or another) twice per level? Each such level doubles "
            "the calls", span)
    try:
        if fn.expr is not None:
            v = fn.expr(env, ctx)
            if key is not _MISS:
                fn.memo[key] = v
            return v
        assert fn.body is not None
        fn.body(env, ctx)
    except PipeirError as e:  # an error in the body points there: say which call ran it
        d = e.diagnostics[0]
        calls = [n.span for n in d.notes if n.message.startswith(_CALLED)]
        # (a recursion's calls are one place: named once)
        if len(calls) < MAX_CALL_NOTES and span != d.span and span not in calls:
            e.annotate(Note(f"{_CALLED} '{fn.name}' here", span))
        raise
    finally:
        ctx.depth -= 1
    return None


_MISS: Final = object()


def _what(fn: Closure) -> str:
    return "functions" if fn.expr is not None else "macros"


_CALLED = "in the call of"
#: How many enclosing calls an error names (a recursion would name each of its levels).
MAX_CALL_NOTES = 4


def want_int(v: object, span: Span, what: str) -> int:
    """`v` if it is an integer (not a boolean), else a diagnostic at `span`."""
    if type(v) is not int:
        raise UsageError(f"{what} must be an integer, got {type_name(v)} ({spell(v)})", span)
    return v
