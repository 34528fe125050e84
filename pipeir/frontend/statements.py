"""Statements -> closures that emit ops into the run context's schedule builder.

`for i in a .. b` counts a, a+1, ..., b-1 (a > b is an error), names never shadow (a second
`let x` in reach of the first is an error), `def f(x) = expr` is a function and
`def g(x) { ... }` a macro that emits ops. Ops are emitted in the rank block that runs them.
"""

from __future__ import annotations

from pipeir import limits
from pipeir.config import spell, type_name
from pipeir.diagnostics import Note, UsageError
from pipeir.frontend import ast
from pipeir.frontend.expressions import ExprCompiler
from pipeir.frontend.scope import (
    Binding,
    Closure,
    Env,
    RunContext,
    Scope,
    StmtFn,
    invoke,
    want_int,
)
from pipeir.ops import NO_MB, OP_ARITY, Op


class Compiler(ExprCompiler):
    """Compiles statements (and, inherited, expressions). One per elaboration: it knows the
    config, so pipeline built-ins check their arguments against it."""

    def block(self, stmts: tuple[ast.Stmt, ...], scope: Scope) -> StmtFn:
        """A block as one closure (a single statement needs no loop around it)."""
        fns = [self.stmt(s, scope) for s in stmts]
        if len(fns) == 1:
            return fns[0]

        def run(env: Env, ctx: RunContext) -> None:
            for f in fns:
                f(env, ctx)
        return run

    def stmt(self, s: ast.Stmt, scope: Scope) -> StmtFn:
        """`s` as a closure; `let` and `def` add their names to `scope` as they compile."""
        if isinstance(s, ast.CallStmt):
            return self._call_stmt(s, scope)
        if isinstance(s, ast.For):
            return self._for(s, scope)
        if isinstance(s, ast.Let):
            f = self.expr(s.value, scope)
            scope.define(s.name, Binding("value", s.name_span), s.name_span)
            name = s.name

            def let(env: Env, ctx: RunContext) -> None:
                env[name] = f(env, ctx)
            return let
        if isinstance(s, ast.If):
            return self._if(s, scope)
        if isinstance(s, ast.RankEach | ast.RankOne):
            return self._rank(s, scope)
        if isinstance(s, ast.FuncDef):
            return self._funcdef(s, scope)
        if isinstance(s, ast.Require):
            return self._require(s, scope)
        if isinstance(s, ast.Overlap):
            return self._overlap(s, scope)
        if isinstance(s, ast.PipelineBlock):
            raise UsageError("a 'pipeline' block here can only come first in a schedule "
                             "definition", s.span)
        raise AssertionError(s)  # pragma: no cover

    def _call_stmt(self, s: ast.CallStmt, scope: Scope) -> StmtFn:
        b = self.callee(s.name, s.name_span, len(s.args), s.span, scope)
        args = [self.expr(a, scope) for a in s.args]
        span = s.span
        if b.kind == "op":
            kind = s.name
            sf, mf = args if len(args) == 2 else (args[0], lambda env, ctx: NO_MB)  # R(s)
            sspan, mspan = s.args[0].span, s.args[-1].span

            def emit(env: Env, ctx: RunContext) -> None:
                st, mb = sf(env, ctx), mf(env, ctx)
                if type(st) is not int:
                    want_int(st, sspan, "the stage")
                if type(mb) is not int:
                    want_int(mb, mspan, "the micro-batch")
                if ctx.rank is None:
                    raise UsageError(f"{Op(kind, st, mb)} is outside any 'rank' block; "  # type: ignore[arg-type]
                                     "ops run on a rank: 'rank r { ... }'", span)
                ctx.builder.add(ctx.rank, Op(kind, st, mb), span)  # type: ignore[arg-type]
            return emit
        if b.kind in ("func", "builtin"):
            raise UsageError(f"'{s.name}' computes a value; a statement here must be an op or "
                             "a block macro (def name(...) { ... })", s.span)
        name = s.name

        def call(env: Env, ctx: RunContext) -> None:
            invoke(env[name], [a(env, ctx) for a in args], ctx, span)
        return call

    def _overlap(self, s: ast.Overlap, scope: Scope) -> StmtFn:
        ops = []
        for call in (s.first, s.second):
            b = self.callee(call.name, call.name_span, len(call.args), call.span, scope)
            if b.kind != "op" or OP_ARITY[call.name] != 2:
                raise UsageError(f"'overlap' pairs two ops (F, B, I, W); '{call.name}' is not "
                                 "one of them", call.name_span)
            sf, mf = (self.expr(a, scope) for a in call.args)
            ops.append((call.name, sf, mf, call.args[0].span, call.args[1].span, call.span))
        span = s.span

        def overlap(env: Env, ctx: RunContext) -> None:
            made = []
            for kind, sf, mf, sspan, mspan, ospan in ops:
                made.append((Op(kind, want_int(sf(env, ctx), sspan, "the stage"),  # type: ignore[arg-type]
                                want_int(mf(env, ctx), mspan, "the micro-batch")), ospan))
            if ctx.rank is None:
                raise UsageError("'overlap' is outside any 'rank' block", span)
            (a, aspan), (b, bspan) = made
            ctx.builder.add_pair(ctx.rank, a, b, aspan, bspan)
        return overlap

    def _for(self, s: ast.For, scope: Scope) -> StmtFn:
        start, stop = self.expr(s.start, scope), self.expr(s.stop, scope)
        if isinstance(s.start, ast.Num) and isinstance(s.stop, ast.Num) and \
                s.start.value == s.stop.value:
            raise UsageError(f"empty range {s.start.value} .. {s.stop.value}: the loop never "
                             "runs", s.range_span)
        inner = scope.child()
        inner.define(s.var, Binding("value", s.var_span), s.var_span)
        body = self.block(s.body, inner)
        var, rspan = s.var, s.range_span
        sspan, espan = s.start.span, s.stop.span

        def loop(env: Env, ctx: RunContext) -> None:
            a = want_int(start(env, ctx), sspan, "a range bound")
            b = want_int(stop(env, ctx), espan, "a range bound")
            if a > b:
                raise UsageError(f"reversed range {a} .. {b}: the start is after the end",
                                 rspan, (Note("ranges count up: 'for i in a .. b' runs "
                                              "a, a+1, ..., b-1"),))
            ctx.iterations += b - a
            if ctx.iterations > limits.MAX_ITERATIONS:
                raise UsageError(f"this loop takes the schedule past {limits.MAX_ITERATIONS:,} "
                                 "iterations; is a bound wrong?", rspan)
            for i in range(a, b):
                env[var] = i
                body(env, ctx)
        return loop

    def _if(self, s: ast.If, scope: Scope) -> StmtFn:
        cond = self.expr(s.cond, scope)
        then = self.block(s.then, scope.child())
        orelse = self.block(s.orelse, scope.child()) if s.orelse else None
        cspan = s.cond.span

        def if_(env: Env, ctx: RunContext) -> None:
            c = cond(env, ctx)
            if type(c) is not bool:
                raise UsageError(f"a condition must be true or false, got {type_name(c)} "
                                 f"({spell(c)})", cspan)
            if c:
                then(env, ctx)
            elif orelse is not None:
                orelse(env, ctx)
        return if_

    def _rank(self, s: ast.RankEach | ast.RankOne, scope: Scope) -> StmtFn:
        if scope.in_rank:
            raise UsageError("'rank' blocks cannot be nested", s.span)
        inner = scope.child(in_rank=True)
        if isinstance(s, ast.RankEach):
            inner.define(s.var, Binding("value", s.var_span), s.var_span)
            body = self.block(s.body, inner)
            var = s.var

            def each(env: Env, ctx: RunContext) -> None:
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

        def one(env: Env, ctx: RunContext) -> None:
            r = want_int(rank_fn(env, ctx), rspan, "the rank")
            if not 0 <= r < ctx.config.ranks:
                raise UsageError(f"rank {r} is out of range: ranks are 0 to {ctx.config.ranks - 1}",
                                 rspan)
            ctx.rank, ctx.rank_note = r, f"while elaborating rank {r}"
            body(dict(env), ctx)
            ctx.rank, ctx.rank_note = None, ""
        return one

    def _funcdef(self, s: ast.FuncDef, scope: Scope) -> StmtFn:
        kind = "func" if s.expr is not None else "macro"
        scope.define(s.name, Binding(kind, s.name_span, len(s.params)), s.name_span)
        inner = scope.child()
        seen: set[str] = set()
        for p in s.params:
            if p in seen:
                raise UsageError(f"parameter '{p}' appears twice", s.name_span)
            seen.add(p)
            inner.define(p, Binding("value", s.name_span), s.name_span)
        expr = self.expr(s.expr, inner) if s.expr is not None else None
        body = self.block(s.body or (), inner) if s.body is not None else None
        name, params, span = s.name, s.params, s.span

        def define(env: Env, ctx: RunContext) -> None:
            closure = Closure(params, {}, expr, body, span, name)
            closure.env = env  # late binding: sees names defined later in the same scope
            env[name] = closure
        return define

    def _require(self, s: ast.Require, scope: Scope) -> StmtFn:
        cond = self.expr(s.cond, scope)
        msg, span = s.message, s.span
        names = sorted({n for n in _var_names(s.cond) if (b := scope.lookup(n)) and
                        b.kind == "value"})

        def require(env: Env, ctx: RunContext) -> None:
            c = cond(env, ctx)
            if type(c) is not bool:
                raise UsageError(f"'require' needs a condition, got {type_name(c)}", span)
            if not c:
                where = ", ".join(f"{n} = {spell(env[n])}" for n in names if n in env)
                raise UsageError(f"requirement failed: {msg}" if msg else
                                 "requirement failed", span,
                                 (Note(f"here {where}"),) if where else ())
        return require


def _var_names(e: ast.Expr) -> list[str]:
    """The names an expression reads, for a failed `require`'s note."""
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
