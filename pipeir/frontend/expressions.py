"""Expressions -> closures. Names are resolved here, at compile time, so a typo is reported
even in a branch that never runs; types are checked when the closure runs.

Integers are Python ints (`//` and `%` floor), `/` gives a decimal, comparisons give booleans,
`and`/`or` short-circuit and want booleans.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any, Final, NoReturn

from pipeir import limits
from pipeir.config import PipelineConfig, spell, type_name
from pipeir.diagnostics import Note, Span, UsageError, did_you_mean
from pipeir.frontend import ast
from pipeir.frontend.scope import (
    BUILTINS,
    CONSTANTS,
    Binding,
    Env,
    ExprFn,
    RunContext,
    Scope,
    invoke,
    want_int,
)

#: (the `operator` module's functions, not lambdas: a Python-level call less per arithmetic op)
_ARITH: Final[dict[str, Callable[[Any, Any], Any]]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv,
    "%": operator.mod, "/": operator.truediv, "<": operator.lt, "<=": operator.le,
    ">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne,
}
#: the operators whose result on two ints is an int, kept within ±MAX_INT
_INT_RESULT: Final = frozenset({"+", "-", "*", "//", "%"})
Ctx = RunContext | None


def _operand(e: ast.Expr, scope: Scope, side: str, names: dict[str, Any]) -> str:
    """How a generated operator reads its operand `e` (whose closure `names` holds as
    `{side}f`): a number as a constant, a variable from the environment, else its closure."""
    if isinstance(e, ast.Num):
        names[f"{side}c"] = e.value
        return f"{side}c"
    if isinstance(e, ast.Var):
        b = scope.lookup(e.name) or BUILTINS.get(e.name)
        if b is not None and b.kind == "value":  # (as `_var` reads it)
            names[f"{side}n"] = e.name
            return f"env[{side}n]"
    return f"{side}f(env, ctx)"


class ExprCompiler:
    """Compiles expressions. Without a config (pipeline settings, parameter defaults) the
    built-ins that need the pipeline (`owner`, `local_stage`, ...) are errors."""

    def __init__(self, config: PipelineConfig | None):
        self.config = config

    def expr(self, e: ast.Expr, scope: Scope) -> ExprFn:
        """`e` as a closure over (environment, run context); names resolve in `scope` now."""
        if isinstance(e, ast.Num | ast.Str):
            v = e.value
            return lambda env, ctx: v
        if isinstance(e, ast.Var):
            return self._var(e, scope)
        if isinstance(e, ast.ListLit):
            items = [self.expr(x, scope) for x in e.items]
            return lambda env, ctx: tuple(f(env, ctx) for f in items)
        if isinstance(e, ast.Unary):
            return self._unary(e, scope)
        if isinstance(e, ast.BinOp):
            return self._binop(e, scope)
        if isinstance(e, ast.Call):
            return self._call(e, scope)
        raise AssertionError(e)  # pragma: no cover

    def _var(self, e: ast.Var, scope: Scope) -> ExprFn:
        b = scope.lookup(e.name) or BUILTINS.get(e.name)
        if b is None and e.name in CONSTANTS:
            const = CONSTANTS[e.name]
            return lambda env, ctx: const
        if b is None:
            raise UsageError(f"unknown name '{e.name}'", e.span,
                             did_you_mean(e.name, scope.all_names() | set(BUILTINS)))
        if b.kind != "value":
            raise UsageError(f"'{e.name}' is a function; call it with arguments", e.span)
        name = e.name
        return lambda env, ctx: env[name]

    def _unary(self, e: ast.Unary, scope: Scope) -> ExprFn:
        f = self.expr(e.operand, scope)
        span = e.operand.span
        if e.op == "not":
            def not_(env: Env, ctx: Ctx) -> bool:
                v = f(env, ctx)
                if type(v) is not bool:
                    raise UsageError(f"'not' needs a boolean, got {type_name(v)}", span)
                return not v
            return not_

        def neg(env: Env, ctx: Ctx) -> Any:
            v = f(env, ctx)
            if type(v) not in (int, float):
                raise UsageError(f"'-' needs a number, got {type_name(v)}", span)
            return -v
        return neg

    def _binop(self, e: ast.BinOp, scope: Scope) -> ExprFn:
        lf, rf = self.expr(e.left, scope), self.expr(e.right, scope)
        op, lspan, rspan, espan = e.op, e.left.span, e.right.span, e.span
        if op in ("and", "or"):
            def logic(env: Env, ctx: Ctx) -> bool:
                a = lf(env, ctx)
                if type(a) is not bool:
                    raise UsageError(f"'{op}' needs booleans, got {type_name(a)}", lspan)
                if (op == "and" and not a) or (op == "or" and a):
                    return a
                b = rf(env, ctx)
                if type(b) is not bool:
                    raise UsageError(f"'{op}' needs booleans, got {type_name(b)}", rspan)
                return b
            return logic
        fn = _ARITH[op]
        if op in ("==", "!="):
            def equal(env: Env, ctx: Ctx) -> Any:
                a, b = lf(env, ctx), rf(env, ctx)
                if (type(a) is bool) != (type(b) is bool):  # Python's True == 1 is not ours
                    other = type_name(b if type(a) is bool else a)
                    raise UsageError(f"'{op}' compares a boolean with {other} "
                                     f"({spell(a)} {op} {spell(b)})", espan)
                return fn(a, b)
            return equal
        top = limits.MAX_INT
        division = op in ("//", "%", "/")

        def zero() -> NoReturn:
            raise UsageError("division by zero", rspan,
                             (Note(f"the right-hand side of '{op}' is 0"),))

        def overflow(a: int, b: int) -> NoReturn:
            raise UsageError(f"integer overflow: {a} {op} {b} is outside the 64-bit "
                             f"range (at most {limits.MAX_INT:,} in magnitude)", espan)

        def mixed(a: Any, b: Any) -> Any:  # (not two ints)
            if type(a) not in (int, float):
                raise UsageError(f"'{op}' needs numbers, got {type_name(a)} ({spell(a)})", lspan)
            if type(b) not in (int, float):
                raise UsageError(f"'{op}' needs numbers, got {type_name(b)} ({spell(b)})", rspan)
            if b == 0 and division:
                raise UsageError("division by zero", rspan)
            r = fn(a, b)
            if type(r) is float and not math.isfinite(r):  # (an inf, or a NaN after it)
                raise UsageError(f"number overflow: {spell(a)} {op} {spell(b)} is beyond a "
                                 f"64-bit float (about 1.8e308 in magnitude)", espan)
            return r

        # NOTE (speed): arithmetic is most of elaborating a large schedule (interleaved 1F1B's
        # `chunk_mb(k)` per op), so each operator gets a function generated for its operands
        # (as `dataclasses` generates `__init__`): the operator itself, not a call, and an
        # operand that is a variable or a number read inline, not through its closure. Only
        # two ints take that path; anything else goes through `mixed`'s checks.
        names: dict[str, Any] = {"lf": lf, "rf": rf, "zero": zero, "overflow": overflow,
                                 "mixed": mixed, "low": -top, "top": top}
        code = [
            "def arith(env, ctx):",
            f"    a = {_operand(e.left, scope, 'l', names)}",
            f"    b = {_operand(e.right, scope, 'r', names)}",
            "    if type(a) is int and type(b) is int:",
            *(["        if b == 0: zero()"] if division else []),
            f"        r = a {op} b",
            *(["        if not low <= r <= top: overflow(a, b)"] if op in _INT_RESULT else []),
            "        return r",
            "    return mixed(a, b)"]
        exec("\n".join(code), names)
        return names["arith"]  # type: ignore[no-any-return]

    def _call(self, e: ast.Call, scope: Scope) -> ExprFn:
        b = self.callee(e.name, e.name_span, len(e.args), e.span, scope)
        args = [self.expr(a, scope) for a in e.args]
        if b.kind == "op":
            raise UsageError(f"{e.name}(...) is an op, not a value; ops are statements", e.span)
        if b.kind == "macro":
            raise UsageError(f"'{e.name}' is a block macro and gives no value; "
                             f"use 'def {e.name}(...) = expr' for a function", e.span)
        if b.kind == "builtin":
            return self._builtin(e, args)
        name, span = e.name, e.span

        def call(env: Env, ctx: Ctx) -> Any:
            return invoke(env[name], [a(env, ctx) for a in args], ctx, span)
        return call

    def _builtin(self, e: ast.Call, args: list[ExprFn]) -> ExprFn:
        name, spans = e.name, [a.span for a in e.args]
        if name in ("min", "max"):
            pick = min if name == "min" else max

            def minmax(env: Env, ctx: Ctx) -> Any:
                vals = [a(env, ctx) for a in args]
                for v, sp in zip(vals, spans):
                    if type(v) not in (int, float):
                        raise UsageError(f"{name}() needs numbers, got {type_name(v)}", sp)
                return pick(vals)
            return minmax
        if name == "abs":
            def absolute(env: Env, ctx: Ctx) -> Any:
                v = args[0](env, ctx)
                if type(v) not in (int, float):
                    raise UsageError(f"abs() needs a number, got {type_name(v)}", spans[0])
                return abs(v)  # (no overflow: integers are kept within ±MAX_INT)
            return absolute
        if self.config is None:
            raise UsageError(f"{name}() needs the pipeline; it is not available here", e.span)
        return _pipeline_builtin(name, args, spans, self.config)

    def callee(self, name: str, name_span: Span, nargs: int, span: Span,
               scope: Scope) -> Binding:
        """What a call's name refers to, with its argument count checked."""
        b = scope.lookup(name) or BUILTINS.get(name)
        if b is None:
            candidates = {n for n in scope.all_names()
                          if (x := scope.lookup(n)) and x.kind != "value"} | set(BUILTINS)
            raise UsageError(f"unknown function '{name}'", name_span,
                             did_you_mean(name, candidates))
        if b.kind == "value":
            raise UsageError(f"'{name}' is a value, not a function", name_span)
        lo, hi = (b.arity, b.arity) if isinstance(b.arity, int) else b.arity
        if not lo <= nargs <= hi:
            want = f"{lo}" if lo == hi else f"at least {lo}"
            what = {"op": " (stage, micro-batch)"}.get(b.kind, "")
            raise UsageError(f"{name} takes {want} argument{'s' if lo != 1 else ''}{what}, "
                             f"got {nargs}", span)
        return b


def _pipeline_builtin(name: str, args: list[ExprFn], spans: list[Span],
                      config: PipelineConfig) -> ExprFn:
    """`owner(stage)`, `num_local_stages(rank)` and `local_stage(rank, chunk)`."""
    if name == "owner":
        def owner(env: Env, ctx: Ctx) -> int:
            s = want_int(args[0](env, ctx), spans[0], "the stage")
            if not 0 <= s < config.stages:
                raise UsageError(f"owner({s}): stage out of range 0 to {config.stages - 1}",
                                 spans[0])
            return config.placement[s]
        return owner
    if name == "num_local_stages":
        def nls(env: Env, ctx: Ctx) -> int:
            r = want_int(args[0](env, ctx), spans[0], "the rank")
            if not 0 <= r < config.ranks:
                raise UsageError(f"rank {r} out of range 0 to {config.ranks - 1}", spans[0])
            return len(config.stages_of(r))
        return nls

    def local_stage(env: Env, ctx: Ctx) -> int:
        r = want_int(args[0](env, ctx), spans[0], "the rank")
        c = want_int(args[1](env, ctx), spans[1], "the chunk")
        if not 0 <= r < config.ranks:
            raise UsageError(f"rank {r} out of range 0 to {config.ranks - 1}", spans[0])
        owned = config.stages_of(r)
        if not 0 <= c < len(owned):
            raise UsageError(f"rank {r} has {len(owned)} stages; chunk {c} is out of range",
                             spans[1])
        return owned[c]
    return local_stage
