"""Syntax tree -> Schedule. Resolves names statically (so a typo is reported even in a branch
that never runs), compiles expressions and statements to closures, then runs them per rank.

Semantics in brief: integers are Python ints (`//` and `%` floor), comparisons give booleans,
`for i in a .. b` counts a, a+1, ..., b-1 (a > b is an error), names never shadow (a second
`let x` in reach of the first is an error), `def f(x) = expr` is a function and
`def g(x) { ... }` a macro that emits ops. Ops are emitted in the rank block that runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from pipeir._gc import paused_gc
from pipeir._nesting import nesting_guard
from pipeir.config import PLACEMENTS, ConfigError, PipelineConfig, named_placement
from pipeir.diagnostics import Note, Source, Span, UsageError, did_you_mean
from pipeir.frontend import ast
from pipeir.ops import KINDS, Op
from pipeir.schedule import Schedule, ScheduleBuilder

Value = int | float | bool | str | tuple[Any, ...]
Env = dict[str, Any]
ExprFn = Callable[[Env], Any]
StmtFn = Callable[[Env, "_Ctx"], None]

#: Pipeline settings a file may give, with what they mean (for messages and `--set`).
PIPELINE_KEYS: Final[dict[str, str]] = {
    "ranks": "number of ranks (pipeline-parallel degree)",
    "microbatches": "micro-batches per schedule round",
    "stages": "model chunks; defaults to ranks",
    "placement": "loop, vshape, or a list of ranks, one per stage",
    "memory_limit": "most in-flight activations per rank (stage x micro-batch units)",
    "accumulate": "schedule rounds per optimizer step",
}
MAX_ITERATIONS: Final = 20_000_000
MAX_DEPTH: Final = 200

#: Resolves a schedule name to (the module defining it, the definition), or None.
Resolver = Callable[[str], "tuple[ast.Module, ast.ScheduleDef] | None"]


def _norm(name: str) -> str:
    return name.replace("-", "_").lower()


# ---- compile-time scopes ---------------------------------------------------------------------
@dataclass(frozen=True)
class _Binding:
    kind: str  # "value" | "func" | "macro" | "builtin" | "op"
    span: Span | None
    arity: int | tuple[int, int] = 0  # exact, or (min, max)


@dataclass
class _Scope:
    names: dict[str, _Binding] = field(default_factory=dict)
    parent: _Scope | None = None
    in_rank: bool = False

    def lookup(self, name: str) -> _Binding | None:
        s: _Scope | None = self
        while s is not None:
            b = s.names.get(name)
            if b is not None:
                return b
            s = s.parent
        return None

    def all_names(self) -> set[str]:
        out: set[str] = set()
        s: _Scope | None = self
        while s is not None:
            out |= set(s.names)
            s = s.parent
        return out

    def define(self, name: str, binding: _Binding, span: Span) -> None:
        prev = self.lookup(name)
        if prev is not None:
            where = (Note(f"'{name}' is defined here", prev.span),) if prev.span else ()
            what = "a built-in name" if prev.kind in ("builtin", "op") else "already defined"
            raise UsageError(f"'{name}' is {what}; pick another name", span, where)
        self.names[name] = binding

    def child(self, in_rank: bool | None = None) -> _Scope:
        return _Scope({}, self, self.in_rank if in_rank is None else in_rank)


_BUILTINS: Final[dict[str, _Binding]] = {
    "min": _Binding("builtin", None, (1, 1 << 30)),
    "max": _Binding("builtin", None, (1, 1 << 30)),
    "abs": _Binding("builtin", None, 1),
    "owner": _Binding("builtin", None, 1),
    "local_stage": _Binding("builtin", None, 2),
    "num_local_stages": _Binding("builtin", None, 1),
    **{k: _Binding("op", None, 2) for k in KINDS},
}


_CONSTANTS: Final[dict[str, bool]] = {"true": True, "false": False}


# ---- run-time context ------------------------------------------------------------------------
@dataclass
class _Ctx:
    builder: ScheduleBuilder
    config: PipelineConfig
    rank: int | None = None
    iterations: int = 0
    depth: int = 0
    rank_note: str = ""


@dataclass
class _Closure:
    params: tuple[str, ...]
    env: Env
    expr: ExprFn | None
    body: StmtFn | None
    span: Span


def _type_name(v: object) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            tuple: "a list"}.get(type(v), type(v).__name__)


def _want_int(v: object, span: Span, what: str) -> int:
    if type(v) is not int:
        raise UsageError(f"{what} must be an integer, got {_type_name(v)} ({_show(v)})", span)
    return v


def _show(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, tuple):
        return "[" + ", ".join(_show(x) for x in v) + "]"
    return str(v)


# ---- expressions -------------------------------------------------------------------------------
class _Compiler:
    """Compiles syntax to closures. One per elaboration (it knows the config)."""

    def __init__(self, config: PipelineConfig | None):
        self.config = config

    def expr(self, e: ast.Expr, scope: _Scope) -> ExprFn:
        if isinstance(e, ast.Num | ast.Str):
            v = e.value
            return lambda env: v
        if isinstance(e, ast.Var):
            return self._var(e, scope)
        if isinstance(e, ast.ListLit):
            items = [self.expr(x, scope) for x in e.items]
            return lambda env: tuple(f(env) for f in items)
        if isinstance(e, ast.Unary):
            return self._unary(e, scope)
        if isinstance(e, ast.BinOp):
            return self._binop(e, scope)
        if isinstance(e, ast.Call):
            return self._call(e, scope)
        raise AssertionError(e)  # pragma: no cover

    def _var(self, e: ast.Var, scope: _Scope) -> ExprFn:
        b = scope.lookup(e.name) or _BUILTINS.get(e.name)
        if b is None and e.name in _CONSTANTS:
            const = _CONSTANTS[e.name]
            return lambda env: const
        if b is None:
            raise UsageError(f"unknown name '{e.name}'", e.span,
                             did_you_mean(e.name, scope.all_names() | set(_BUILTINS)))
        if b.kind != "value":
            raise UsageError(f"'{e.name}' is a function; call it with arguments", e.span)
        name = e.name
        return lambda env: env[name]

    def _unary(self, e: ast.Unary, scope: _Scope) -> ExprFn:
        f = self.expr(e.operand, scope)
        span = e.operand.span
        if e.op == "not":
            def not_(env: Env) -> bool:
                v = f(env)
                if type(v) is not bool:
                    raise UsageError(f"'not' needs a boolean, got {_type_name(v)}", span)
                return not v
            return not_

        def neg(env: Env) -> Any:
            v = f(env)
            if type(v) not in (int, float):
                raise UsageError(f"'-' needs a number, got {_type_name(v)}", span)
            return -v
        return neg

    def _binop(self, e: ast.BinOp, scope: _Scope) -> ExprFn:
        lf, rf = self.expr(e.left, scope), self.expr(e.right, scope)
        op, lspan, rspan = e.op, e.left.span, e.right.span
        if op in ("and", "or"):
            def logic(env: Env) -> bool:
                a = lf(env)
                if type(a) is not bool:
                    raise UsageError(f"'{op}' needs booleans, got {_type_name(a)}", lspan)
                if (op == "and" and not a) or (op == "or" and a):
                    return a
                b = rf(env)
                if type(b) is not bool:
                    raise UsageError(f"'{op}' needs booleans, got {_type_name(b)}", rspan)
                return b
            return logic
        fn = _ARITH[op]
        if op in ("==", "!="):
            return lambda env: fn(lf(env), rf(env))

        def arith(env: Env) -> Any:
            a, b = lf(env), rf(env)
            ta, tb = type(a), type(b)
            if ta is int and tb is int:
                if b == 0 and op in ("//", "%", "/"):
                    raise UsageError("division by zero", rspan,
                                     (Note(f"the right-hand side of '{op}' is 0"),))
                return fn(a, b)
            if ta not in (int, float):
                raise UsageError(f"'{op}' needs numbers, got {_type_name(a)} ({_show(a)})",
                                 lspan)
            if tb not in (int, float):
                raise UsageError(f"'{op}' needs numbers, got {_type_name(b)} ({_show(b)})",
                                 rspan)
            if b == 0 and op in ("//", "%", "/"):
                raise UsageError("division by zero", rspan)
            return fn(a, b)
        return arith

    def _call(self, e: ast.Call, scope: _Scope) -> ExprFn:
        b = self._callee(e.name, e.name_span, len(e.args), e.span, scope)
        args = [self.expr(a, scope) for a in e.args]
        if b.kind == "op":
            raise UsageError(f"{e.name}(...) is an op, not a value; ops are statements", e.span)
        if b.kind == "macro":
            raise UsageError(f"'{e.name}' is a block macro and gives no value; "
                             f"use 'def {e.name}(...) = expr' for a function", e.span)
        if b.kind == "builtin":
            return self._builtin(e, args)
        name, span = e.name, e.span

        def call(env: Env) -> Any:
            return _invoke(env[name], [a(env) for a in args], env.get("__ctx__"), span)
        return call

    def _builtin(self, e: ast.Call, args: list[ExprFn]) -> ExprFn:
        name, spans = e.name, [a.span for a in e.args]
        config = self.config
        if name in ("min", "max"):
            pick = min if name == "min" else max

            def minmax(env: Env) -> Any:
                vals = [a(env) for a in args]
                for v, sp in zip(vals, spans):
                    if type(v) not in (int, float):
                        raise UsageError(f"{name}() needs numbers, got {_type_name(v)}", sp)
                return pick(vals)
            return minmax
        if name == "abs":
            return lambda env: abs(_want_int(args[0](env), spans[0], "abs()'s argument"))
        if config is None:
            raise UsageError(f"{name}() needs the pipeline; it is not available here", e.span)
        if name == "owner":
            def owner(env: Env) -> int:
                s = _want_int(args[0](env), spans[0], "the stage")
                if not 0 <= s < config.stages:
                    raise UsageError(f"owner({s}): stage out of range 0..{config.stages - 1}",
                                     spans[0])
                return config.placement[s]
            return owner
        if name == "num_local_stages":
            def nls(env: Env) -> int:
                r = _want_int(args[0](env), spans[0], "the rank")
                if not 0 <= r < config.ranks:
                    raise UsageError(f"rank {r} out of range 0..{config.ranks - 1}", spans[0])
                return len(config.stages_of(r))
            return nls

        def local_stage(env: Env) -> int:
            r = _want_int(args[0](env), spans[0], "the rank")
            c = _want_int(args[1](env), spans[1], "the chunk")
            if not 0 <= r < config.ranks:
                raise UsageError(f"rank {r} out of range 0..{config.ranks - 1}", spans[0])
            owned = config.stages_of(r)
            if not 0 <= c < len(owned):
                raise UsageError(f"rank {r} has {len(owned)} stages; chunk {c} is out of range",
                                 spans[1])
            return owned[c]
        return local_stage

    def _callee(self, name: str, name_span: Span, nargs: int, span: Span,
                scope: _Scope) -> _Binding:
        b = scope.lookup(name) or _BUILTINS.get(name)
        if b is None:
            candidates = {n for n in scope.all_names()
                          if (x := scope.lookup(n)) and x.kind != "value"} | set(_BUILTINS)
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

    # ---- statements ------------------------------------------------------------------------
    def block(self, stmts: tuple[ast.Stmt, ...], scope: _Scope) -> StmtFn:
        fns = [self.stmt(s, scope) for s in stmts]
        if len(fns) == 1:
            return fns[0]

        def run(env: Env, ctx: _Ctx) -> None:
            for f in fns:
                f(env, ctx)
        return run

    def stmt(self, s: ast.Stmt, scope: _Scope) -> StmtFn:
        if isinstance(s, ast.CallStmt):
            return self._call_stmt(s, scope)
        if isinstance(s, ast.For):
            return self._for(s, scope)
        if isinstance(s, ast.Let):
            f = self.expr(s.value, scope)
            scope.define(s.name, _Binding("value", s.name_span), s.name_span)
            name = s.name

            def let(env: Env, ctx: _Ctx) -> None:
                env[name] = f(env)
            return let
        if isinstance(s, ast.If):
            return self._if(s, scope)
        if isinstance(s, ast.RankEach | ast.RankOne):
            return self._rank(s, scope)
        if isinstance(s, ast.FuncDef):
            return self.funcdef(s, scope)
        if isinstance(s, ast.Require):
            return self._require(s, scope)
        if isinstance(s, ast.Overlap):
            return self._overlap(s, scope)
        if isinstance(s, ast.PipelineBlock):
            raise UsageError("a 'pipeline' block here can only come first in a schedule "
                             "definition", s.span)
        raise AssertionError(s)  # pragma: no cover

    def _call_stmt(self, s: ast.CallStmt, scope: _Scope) -> StmtFn:
        b = self._callee(s.name, s.name_span, len(s.args), s.span, scope)
        args = [self.expr(a, scope) for a in s.args]
        span = s.span
        if b.kind == "op":
            kind = s.name
            sf, mf = args
            sspan, mspan = s.args[0].span, s.args[1].span

            def emit(env: Env, ctx: _Ctx) -> None:
                st, mb = sf(env), mf(env)
                if type(st) is not int:
                    _want_int(st, sspan, "the stage")
                if type(mb) is not int:
                    _want_int(mb, mspan, "the micro-batch")
                if ctx.rank is None:
                    raise UsageError(f"{kind}({st},{mb}) is outside any 'rank' block; "
                                     "ops run on a rank: 'rank r { ... }'", span)
                ctx.builder.add(ctx.rank, Op(kind, st, mb), span)  # type: ignore[arg-type]
            return emit
        if b.kind in ("func", "builtin"):
            raise UsageError(f"'{s.name}' computes a value; a statement here must be an op or "
                             "a block macro (def name(...) { ... })", s.span)
        name = s.name

        def call(env: Env, ctx: _Ctx) -> None:
            _invoke(env[name], [a(env) for a in args], ctx, span)
        return call

    def _overlap(self, s: ast.Overlap, scope: _Scope) -> StmtFn:
        ops = []
        for call in (s.first, s.second):
            b = self._callee(call.name, call.name_span, len(call.args), call.span, scope)
            if b.kind != "op":
                raise UsageError(f"'overlap' pairs two ops (F, B, I, W); '{call.name}' is not "
                                 "an op", call.name_span)
            sf, mf = (self.expr(a, scope) for a in call.args)
            ops.append((call.name, sf, mf, call.args[0].span, call.args[1].span, call.span))
        span = s.span

        def overlap(env: Env, ctx: _Ctx) -> None:
            made = []
            for kind, sf, mf, sspan, mspan, ospan in ops:
                made.append((Op(kind, _want_int(sf(env), sspan, "the stage"),  # type: ignore[arg-type]
                                _want_int(mf(env), mspan, "the micro-batch")), ospan))
            if ctx.rank is None:
                raise UsageError("'overlap' is outside any 'rank' block", span)
            (a, aspan), (b, bspan) = made
            ctx.builder.add_pair(ctx.rank, a, b, aspan, bspan)
        return overlap

    def _for(self, s: ast.For, scope: _Scope) -> StmtFn:
        start, stop = self.expr(s.start, scope), self.expr(s.stop, scope)
        if isinstance(s.start, ast.Num) and isinstance(s.stop, ast.Num) and \
                s.start.value == s.stop.value:
            raise UsageError(f"empty range {s.start.value} .. {s.stop.value}: the loop never "
                             "runs", s.range_span)
        inner = scope.child()
        inner.define(s.var, _Binding("value", s.var_span), s.var_span)
        body = self.block(s.body, inner)
        var, rspan = s.var, s.range_span
        sspan, espan = s.start.span, s.stop.span

        def loop(env: Env, ctx: _Ctx) -> None:
            a = _want_int(start(env), sspan, "a range bound")
            b = _want_int(stop(env), espan, "a range bound")
            if a > b:
                raise UsageError(f"reversed range {a} .. {b}: the start is after the end",
                                 rspan, (Note("ranges count up: 'for i in a .. b' runs "
                                              "a, a+1, ..., b-1"),))
            ctx.iterations += b - a
            if ctx.iterations > MAX_ITERATIONS:
                raise UsageError(f"this loop takes the schedule past {MAX_ITERATIONS:,} "
                                 "iterations; is a bound wrong?", rspan)
            for i in range(a, b):
                env[var] = i
                body(env, ctx)
        return loop

    def _if(self, s: ast.If, scope: _Scope) -> StmtFn:
        cond = self.expr(s.cond, scope)
        then = self.block(s.then, scope.child())
        orelse = self.block(s.orelse, scope.child()) if s.orelse else None
        cspan = s.cond.span

        def if_(env: Env, ctx: _Ctx) -> None:
            c = cond(env)
            if type(c) is not bool:
                raise UsageError(f"a condition must be true or false, got {_type_name(c)} "
                                 f"({_show(c)})", cspan)
            if c:
                then(env, ctx)
            elif orelse is not None:
                orelse(env, ctx)
        return if_

    def _rank(self, s: ast.RankEach | ast.RankOne, scope: _Scope) -> StmtFn:
        if scope.in_rank:
            raise UsageError("'rank' blocks cannot be nested", s.span)
        inner = scope.child(in_rank=True)
        if isinstance(s, ast.RankEach):
            inner.define(s.var, _Binding("value", s.var_span), s.var_span)
            body = self.block(s.body, inner)
            var = s.var

            def each(env: Env, ctx: _Ctx) -> None:
                for r in range(ctx.config.ranks):
                    local = dict(env)
                    local[var] = r
                    ctx.rank, ctx.rank_note = r, f"while elaborating rank {var} = {r}"
                    body(local, ctx)
                ctx.rank, ctx.rank_note = None, ""
            return each
        rank_fn = self.expr(s.rank, scope)
        body = self.block(s.body, inner)
        rspan = s.rank.span

        def one(env: Env, ctx: _Ctx) -> None:
            r = _want_int(rank_fn(env), rspan, "the rank")
            if not 0 <= r < ctx.config.ranks:
                raise UsageError(f"rank {r} is out of range: ranks are 0..{ctx.config.ranks - 1}",
                                 rspan)
            ctx.rank, ctx.rank_note = r, f"while elaborating rank {r}"
            body(dict(env), ctx)
            ctx.rank, ctx.rank_note = None, ""
        return one

    def funcdef(self, s: ast.FuncDef, scope: _Scope) -> StmtFn:
        kind = "func" if s.expr is not None else "macro"
        scope.define(s.name, _Binding(kind, s.name_span, len(s.params)), s.name_span)
        inner = scope.child()
        seen: set[str] = set()
        for p in s.params:
            if p in seen:
                raise UsageError(f"parameter '{p}' appears twice", s.name_span)
            seen.add(p)
            inner.define(p, _Binding("value", s.name_span), s.name_span)
        expr = self.expr(s.expr, inner) if s.expr is not None else None
        body = self.block(s.body or (), inner) if s.body is not None else None
        name, params, span = s.name, s.params, s.span

        def define(env: Env, ctx: _Ctx | None) -> None:
            closure = _Closure(params, {}, expr, body, span)
            closure.env = env  # late binding: sees names defined later in the same scope
            env[name] = closure
        return define  # type: ignore[return-value]

    def _require(self, s: ast.Require, scope: _Scope) -> StmtFn:
        cond = self.expr(s.cond, scope)
        msg, span = s.message, s.span
        names = sorted({n for n in _var_names(s.cond) if (b := scope.lookup(n)) and
                        b.kind == "value"})

        def require(env: Env, ctx: _Ctx) -> None:
            c = cond(env)
            if type(c) is not bool:
                raise UsageError(f"'require' needs a condition, got {_type_name(c)}", span)
            if not c:
                where = ", ".join(f"{n} = {_show(env[n])}" for n in names if n in env)
                raise UsageError(f"requirement failed: {msg}" if msg else
                                 "requirement failed", span,
                                 (Note(f"here {where}"),) if where else ())
        return require


def _var_names(e: ast.Expr) -> list[str]:
    if isinstance(e, ast.Var):
        return [e.name]
    if isinstance(e, ast.BinOp):
        return _var_names(e.left) + _var_names(e.right)
    if isinstance(e, ast.Unary):
        return _var_names(e.operand)
    if isinstance(e, ast.Call | ast.ListLit):
        return [n for a in (e.args if isinstance(e, ast.Call) else e.items)
                for n in _var_names(a)]
    return []


_ARITH: Final[dict[str, Callable[[Any, Any], Any]]] = {
    "+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
    "//": lambda a, b: a // b, "%": lambda a, b: a % b, "/": lambda a, b: a / b,
    "<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b,
}


def _invoke(fn: _Closure, args: list[Any], ctx: _Ctx | None, span: Span) -> Any:
    env = dict(fn.env)
    env.update(zip(fn.params, args))
    if ctx is None:  # constant contexts (settings): the nesting guard bounds recursion there
        return fn.expr(env) if fn.expr is not None else None
    ctx.depth += 1
    if ctx.depth > MAX_DEPTH:
        what = "functions" if fn.expr is not None else "macros"
        raise UsageError(f"{what} nest deeper than {MAX_DEPTH} calls; is a recursion "
                         "missing its base case?", span)
    try:
        if fn.expr is not None:
            return fn.expr(env)
        assert fn.body is not None
        fn.body(env, ctx)
    finally:
        ctx.depth -= 1
    return None


# ---- the whole file ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Elaborated:
    """A schedule and what else the file said (its cost settings, for the simulator)."""

    schedule: Schedule
    costs: dict[str, tuple[Any, Span | None]]


def elaborate(module: ast.Module, *, overrides: Mapping[str, Value] | None = None,
              resolver: Resolver | None = None,
              use: tuple[str, Mapping[str, Value]] | None = None) -> Elaborated:
    """Turn a parsed file into a schedule.

    `overrides` (from `--set`) replace pipeline settings or schedule parameters; `use` picks
    a schedule by name with parameters, as `schedule = name(k = v)` in the file would.
    """
    with paused_gc(), nesting_guard(module.span.file):
        return _elaborate(module, overrides, resolver, use)


def _elaborate(module: ast.Module, overrides: Mapping[str, Value] | None,
               resolver: Resolver | None,
               use: tuple[str, Mapping[str, Value]] | None) -> Elaborated:
    overrides = dict(overrides or {})
    pipeline = _single(module, ast.PipelineBlock, "pipeline")
    uses = [i for i in module.items if isinstance(i, ast.ScheduleUse)]
    if len(uses) > 1:
        raise UsageError("a file can instantiate only one schedule", uses[1].span,
                         (Note("the first is here", uses[0].span),))
    defs = [i for i in module.items if isinstance(i, ast.ScheduleDef)]
    _no_duplicate_defs(defs)
    resolve = resolver or _library_resolver

    # 1. which schedule, from which module
    if use is not None:
        name, kw = use[0], dict(use[1])
        found = _find(name, module, defs) or resolve(name)
        if found is None:
            raise UsageError(f"unknown schedule '{name}'", None,
                             did_you_mean(name, [d.name for d in defs] + _library_names()))
        kwargs: dict[str, tuple[Value, Span | None]] = {k: (v, None) for k, v in kw.items()}
        use_span: Span | None = None
    elif uses:
        u = uses[0]
        found = _find(u.name, module, defs) or resolve(u.name)
        if found is None:
            raise UsageError(f"unknown schedule '{u.name}'", u.name_span,
                             did_you_mean(u.name, [d.name for d in defs] + _library_names()))
        kwargs = {}
        consts = _Compiler(None)
        for a in u.args:
            if a.name in kwargs:
                raise UsageError(f"argument '{a.name}' is given twice", a.span)
            kwargs[a.name] = (consts.expr(a.value, _Scope())({}), a.span)
        use_span = u.span
    else:
        if not defs:
            span = module.span
            raise UsageError("no schedule: define one with 'schedule NAME { ... }' or use one "
                             "from the library with 'schedule = NAME'", span)
        if len(defs) > 1:
            raise UsageError(f"the file defines {len(defs)} schedules; say which one runs with "
                             f"'schedule = {defs[0].name}'", defs[1].name_span)
        found = (module, defs[0])
        kwargs, use_span = {}, None
    def_module, sdef = found

    # 2. the pipeline config: --set > the file's block > the schedule's defaults > built-ins
    env: Env = {}
    spans: dict[str, Span | None] = {}
    params = {p.name: p for p in sdef.params}
    for k in overrides:
        if k not in PIPELINE_KEYS and k not in params:
            raise UsageError(f"--set {k}: unknown setting; settable here are "
                             f"{', '.join(list(PIPELINE_KEYS) + list(params))}", None,
                             did_you_mean(k, list(PIPELINE_KEYS) + list(params)))
    consts = _Compiler(None)
    if pipeline is not None:
        _settings(pipeline, env, spans, overrides, consts)
    for k in ("ranks", "microbatches"):
        if k in overrides:
            env[k], spans[k] = overrides[k], None
        if k not in env:
            where = pipeline.span if pipeline is not None else None
            raise UsageError(f"the pipeline does not say how many {k} there are: set "
                             f"'{k} = N' in the pipeline block or pass --set {k}=N", where)

    # 3. schedule parameters
    penv: Env = {}
    for pname, p in params.items():
        if pname in PIPELINE_KEYS:
            raise UsageError(f"a schedule parameter cannot be called '{pname}': that is a "
                             "pipeline setting", p.span)
        if pname in overrides:
            penv[pname] = overrides[pname]
        elif pname in kwargs:
            penv[pname] = kwargs[pname][0]
        elif p.default is not None:
            penv[pname] = consts.expr(p.default, _const_scope(env))(dict(env))
        else:
            raise UsageError(f"schedule '{sdef.name}' needs a value for parameter '{pname}'",
                             use_span or sdef.name_span,
                             (Note(f"give it: schedule = {sdef.name}({pname} = ...)"),))
    for k, (_, kspan) in kwargs.items():
        if k not in params:
            raise UsageError(f"schedule '{sdef.name}' has no parameter '{k}'", kspan or use_span,
                             did_you_mean(k, params))
    body = list(sdef.body)
    first = body[0] if body else None
    if isinstance(first, ast.PipelineBlock):
        defaults = first
        body.pop(0)
        denv = {**env, **penv}
        for st in defaults.settings:
            if st.name not in env:
                _check_key(st)
                denv[st.name] = env[st.name] = _setting_value(st, denv, consts)
                spans[st.name] = st.span
    config = _make_config(env, spans, overrides)

    # 4. compile and run the schedule body
    comp = _Compiler(config)
    gscope = _Scope()
    genv: Env = {"ranks": config.ranks, "microbatches": config.microbatches,
                 "stages": config.stages, **penv}
    for n in genv:
        gscope.define(n, _Binding("value", None), sdef.span)
    ctx = _Ctx(ScheduleBuilder(config, sdef.name, sdef.name_span), config)
    genv["__ctx__"] = ctx
    try:
        for item in def_module.items:
            if isinstance(item, ast.Let | ast.FuncDef):
                comp.stmt(item, gscope)(genv, ctx)
        comp.block(tuple(body), gscope.child())(genv, ctx)
    except UsageError as e:
        d = e.diagnostics[0]
        extra = [Note(ctx.rank_note)] if ctx.rank_note else []
        if def_module is not module and use_span is not None:
            extra.append(Note(f"in library schedule '{sdef.name}', used here", use_span))
        if extra:
            raise UsageError(d.message, d.span, (*d.notes, *extra)) from None
        raise
    if def_module is module:
        uenv, uscope = genv, gscope
    else:  # the user's own constants and functions, for their costs block (and their errors)
        uscope = _Scope()
        uenv = {k: v for k, v in genv.items() if k not in ("__ctx__",)
                and not isinstance(v, _Closure)}
        for n in uenv:
            uscope.define(n, _Binding("value", None), sdef.span)
        uenv["__ctx__"] = ctx
        for item in module.items:
            if isinstance(item, ast.Let | ast.FuncDef):
                comp.stmt(item, uscope)(uenv, ctx)
    costs = _costs(module, uenv, comp, uscope)
    return Elaborated(ctx.builder.build(), costs)


#: Schedules larger than this many (stage, micro-batch) pairs are refused up front: building
#: one would take minutes and gigabytes (p=64, v=4, m=512 is 131,072 pairs).
MAX_PAIRS: Final = 4_000_000


def _single(module: ast.Module, cls: type, what: str) -> Any:
    found = [i for i in module.items if isinstance(i, cls)]
    if len(found) > 1:
        raise UsageError(f"a file can have only one '{what}' block", found[1].span,
                         (Note("the first is here", found[0].span),))
    return found[0] if found else None


def _no_duplicate_defs(defs: list[ast.ScheduleDef]) -> None:
    seen: dict[str, ast.ScheduleDef] = {}
    for d in defs:
        if _norm(d.name) in seen:
            raise UsageError(f"schedule '{d.name}' is defined twice", d.name_span,
                             (Note("the first definition is here", seen[_norm(d.name)].name_span),))
        seen[_norm(d.name)] = d


def _find(name: str, module: ast.Module, defs: list[ast.ScheduleDef]
          ) -> tuple[ast.Module, ast.ScheduleDef] | None:
    for d in defs:
        if _norm(d.name) == _norm(name):
            return module, d
    return None


def _library_resolver(name: str) -> tuple[ast.Module, ast.ScheduleDef] | None:
    from pipeir import library  # the language's standard library, itself written in .sched

    return library.resolve(name)


def _library_names() -> list[str]:
    from pipeir import library

    return list(library.names())


def _const_scope(env: Env) -> _Scope:
    return _Scope({k: _Binding("value", None) for k in env})


def _check_key(st: ast.Setting) -> None:
    if st.name not in PIPELINE_KEYS:
        raise UsageError(f"unknown pipeline setting '{st.name}'", st.name_span,
                         did_you_mean(st.name, PIPELINE_KEYS))


def _setting_value(st: ast.Setting, env: Env, comp: _Compiler) -> Value:
    if st.name == "placement" and isinstance(st.value, ast.Var) and st.value.name in PLACEMENTS:
        return st.value.name
    if st.name == "placement" and isinstance(st.value, ast.Var):
        raise UsageError(f"unknown placement '{st.value.name}'", st.value.span,
                         did_you_mean(st.value.name, PLACEMENTS)
                         or (Note("use loop, vshape, or a list of ranks"),))
    value: Value = comp.expr(st.value, _const_scope(env))(dict(env))
    return value


def _settings(block: ast.PipelineBlock, env: Env, spans: dict[str, Span | None],
              overrides: Mapping[str, Value], comp: _Compiler) -> None:
    for st in block.settings:
        _check_key(st)
        if st.name in spans:
            raise UsageError(f"'{st.name}' is set twice", st.name_span,
                             (Note("first set here", spans[st.name]),))
        spans[st.name] = st.span
        env[st.name] = overrides[st.name] if st.name in overrides else \
            _setting_value(st, env, comp)


def _make_config(env: Env, spans: dict[str, Span | None],
                 overrides: Mapping[str, Value]) -> PipelineConfig:
    for k, v in overrides.items():
        if k in PIPELINE_KEYS:
            env[k], spans[k] = v, None
    ranks: Any = env["ranks"]
    stages: Any = env.get("stages", ranks)
    try:
        placement = env.get("placement", "loop")
        mbs = env["microbatches"]
        for key, val in (("ranks", ranks), ("stages", stages), ("microbatches", mbs)):
            if type(val) is not int or val < 1:
                raise ConfigError(key, f"{key} must be a positive integer, got {_show(val)}")
        if stages * mbs > MAX_PAIRS or ranks > MAX_PAIRS:
            raise ConfigError("stages" if "stages" in spans else "microbatches",
                              f"{stages} stages x {mbs} micro-batches on {ranks} ranks is too "
                              f"large: pipeir handles up to {MAX_PAIRS:,} (stage, micro-batch) "
                              "pairs")
        if isinstance(placement, str):
            placement = named_placement(placement, stages, ranks)
        elif not isinstance(placement, tuple):
            raise ConfigError("placement", f"placement must be loop, vshape or a list of ranks, "
                                           f"got {_show(placement)}")
        return PipelineConfig(ranks, env["microbatches"], stages, placement,
                              env.get("memory_limit"), env.get("accumulate", 1))
    except ConfigError as e:
        span = spans.get(e.key)
        notes = () if span is not None or e.key in overrides else \
            (Note(f"'{e.key}' was not set, so it took its default"),)
        raise UsageError(str(e), span, notes) from None


def _costs(module: ast.Module, genv: Env, comp: _Compiler, scope: _Scope
           ) -> dict[str, tuple[Any, Span | None]]:
    out: dict[str, tuple[Any, Span | None]] = {}
    _single(module, ast.CostsBlock, "costs")
    for item in module.items:
        if isinstance(item, ast.CostsBlock):
            for st in item.settings:
                if st.name in out:
                    raise UsageError(f"cost '{st.name}' is set twice", st.name_span,
                                     (Note("first set here", out[st.name][1]),))
                out[st.name] = (comp.expr(st.value, scope)(genv), st.span)
    return out


def parse_override(text: str) -> tuple[str, Value]:
    """`--set name=value`: value is an integer, a number, a name (loop, vshape) or a list."""
    if "=" not in text:
        raise UsageError(f"--set {text}: expected NAME=VALUE")
    name, raw = (x.strip() for x in text.split("=", 1))
    return name, _literal(raw, f"--set {text}")


def _literal(raw: str, where: str) -> Value:
    if raw in ("true", "false"):
        return raw == "true"
    if raw.startswith("[") and raw.endswith("]"):
        inner = raw[1:-1].strip()
        return tuple(_literal(x.strip(), where) for x in inner.split(",")) if inner else ()
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    if raw.isidentifier():
        return raw
    raise UsageError(f"{where}: cannot read '{raw}' (expected an integer, a number, a name "
                     "or a list [a, b, ...])")


__all__ = ["PIPELINE_KEYS", "Elaborated", "Source", "elaborate", "parse_override"]
