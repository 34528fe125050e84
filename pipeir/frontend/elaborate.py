"""Syntax tree -> Schedule: pick the schedule a file runs, settle its pipeline and parameters,
then compile its body (`statements`, `expressions`) and run it once per rank.

The parts: `scope` (names, values, the run context), `expressions`, `statements`,
`pipeline` (settings -> PipelineConfig); this module puts them together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from pipeir._gc import paused_gc
from pipeir._nesting import nesting_guard
from pipeir.config import PIPELINE_KEYS
from pipeir.diagnostics import Note, Span, UsageError, did_you_mean
from pipeir.frontend import ast
from pipeir.frontend.expressions import ExprCompiler
from pipeir.frontend.pipeline import file_settings, make_config, schedule_defaults
from pipeir.frontend.scope import (
    BUILTINS,
    CONSTANTS,
    Closure,
    Env,
    RunContext,
    Scope,
    Value,
    value_scope,
)
from pipeir.frontend.statements import Compiler
from pipeir.schedule import Schedule, ScheduleBuilder


@dataclass(frozen=True)
class Elaborated:
    """A schedule and what else the file said (its cost settings, for the simulator)."""

    schedule: Schedule
    costs: dict[str, tuple[Any, Span | None]]


@dataclass(frozen=True)
class Definition:
    """A schedule definition and the module around it (whose constants and functions it
    sees). `name` is what it is called by: its library name, or its name in the file."""

    name: str
    module: ast.Module
    schedule: ast.ScheduleDef

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.schedule.params)


@dataclass(frozen=True)
class Library:
    """Where `schedule = NAME` looks after the file's own definitions. The caller hands it
    in (`pipeir.library.LIBRARY`): the library is written in this language, so the frontend
    does not import it."""

    find: Callable[[str], Definition | None]
    names: Callable[[], Iterable[str]]


#: For text that may only use its own definitions.
NO_LIBRARY: Final = Library(lambda name: None, tuple)

Kwargs = dict[str, tuple[Value, Span | None]]  # schedule arguments, with where they were given


def elaborate(module: ast.Module, *, library: Library,
              overrides: Mapping[str, Value] | None = None,
              use: tuple[str, Mapping[str, Value]] | None = None) -> Elaborated:
    """Turn a parsed file into a schedule.

    `overrides` (from `--set`) replace pipeline settings or schedule parameters; `use` picks
    a schedule by name with parameters, as `schedule = name(k = v)` in the file would.
    """
    with paused_gc(), nesting_guard(module.span.file):
        return _elaborate(module, library, dict(overrides or {}), use)


def _elaborate(module: ast.Module, library: Library, overrides: dict[str, Value],
               use: tuple[str, Mapping[str, Value]] | None) -> Elaborated:
    pipeline = _single(module, ast.PipelineBlock, "pipeline")
    found, kwargs, use_span = _choose(module, library, use)
    sdef = found.schedule
    params = {p.name: p for p in sdef.params}
    for k in overrides:
        if k not in PIPELINE_KEYS and k not in params:
            raise UsageError(f"--set {k}: unknown setting; settable here are "
                             f"{', '.join(list(PIPELINE_KEYS) + list(params))}", None,
                             did_you_mean(k, list(PIPELINE_KEYS) + list(params)))
    env, spans = file_settings(pipeline, overrides)
    penv = _parameters(sdef, overrides, kwargs, env, use_span)
    body = sdef.body
    ctx: RunContext | None = None
    try:
        # (a library schedule's own pipeline block, e.g. stages = ranks * v, is checked here
        # too: its errors point into the library, so they also name the user's call)
        if body and isinstance(body[0], ast.PipelineBlock):
            schedule_defaults(body[0], env, spans, penv)
            body = body[1:]
        config = make_config(env, spans, overrides)
        comp = Compiler(config)
        ctx = RunContext(ScheduleBuilder(config, sdef.name, sdef.name_span), config)
        genv: Env = {"ranks": config.ranks, "microbatches": config.microbatches,
                     "stages": config.stages, **penv}
        gscope = value_scope(genv)
        _run_items(found.module, genv, gscope, comp, ctx)
        comp.block(body, gscope.child())(genv, ctx)
    except UsageError as e:
        d = e.diagnostics[0]
        extra = [Note(ctx.rank_note)] if ctx is not None and ctx.rank_note else []
        # the call is named for an error inside the library: one pointing there, or one
        # without a place raised by its body (not a bad --set checked with the settings)
        inside = d.span.source is not module.span.source if d.span is not None \
            else ctx is not None
        if found.module is not module and use_span is not None and inside:
            extra.append(Note(f"in library schedule '{found.name}', used here", use_span))
        if extra:
            raise UsageError(d.message, d.span, (*d.notes, *extra)) from None
        raise
    if found.module is not module:  # the user's own constants and functions, for their costs
        genv = {k: v for k, v in genv.items() if not isinstance(v, Closure)}
        gscope = value_scope(genv)
        _run_items(module, genv, gscope, comp, ctx)
    schedule = ctx.builder.build()
    if found.module is not module and use_span is not None:
        schedule.used_as = (found.name, use_span)
    return Elaborated(schedule, _costs(module, genv, comp, gscope, ctx))


def _choose(module: ast.Module, library: Library, use: tuple[str, Mapping[str, Value]] | None
            ) -> tuple[Definition, Kwargs, Span | None]:
    """Which schedule runs (from the file or the library), its arguments, and where the file
    said so."""
    uses = [i for i in module.items if isinstance(i, ast.ScheduleUse)]
    if len(uses) > 1:
        raise UsageError("a file can instantiate only one schedule", uses[1].span,
                         (Note("the first is here", uses[0].span),))
    defs = [i for i in module.items if isinstance(i, ast.ScheduleDef)]
    _no_duplicate_defs(defs)
    if use is not None:
        return (_find(use[0], None, module, defs, library),
                {k: (v, None) for k, v in use[1].items()}, None)
    if uses:
        u = uses[0]
        found = _find(u.name, u.name_span, module, defs, library)
        kwargs: Kwargs = {}
        consts = ExprCompiler(None)
        for a in u.args:
            if a.name in kwargs:
                raise UsageError(f"argument '{a.name}' is given twice", a.span)
            kwargs[a.name] = (consts.expr(a.value, Scope())({}, None), a.span)
        return found, kwargs, u.span
    if not defs:
        raise UsageError("no schedule: define one with 'schedule NAME { ... }' or use one "
                         "from the library with 'schedule = NAME'", module.span)
    if len(defs) > 1:
        raise UsageError(f"the file defines {len(defs)} schedules; say which one runs with "
                         f"'schedule = {defs[0].name}'", defs[1].name_span)
    return Definition(defs[0].name, module, defs[0]), {}, None


def _find(name: str, span: Span | None, module: ast.Module, defs: list[ast.ScheduleDef],
          library: Library) -> Definition:
    """The file's definition of `name`, else the library's: a file shadows the library."""
    for d in defs:
        if _norm(d.name) == _norm(name):
            return Definition(d.name, module, d)
    found = library.find(name)
    if found is None:
        raise UsageError(f"unknown schedule '{name}'", span,
                         did_you_mean(name, [d.name for d in defs] + list(library.names())))
    return found


def _parameters(sdef: ast.ScheduleDef, overrides: Mapping[str, Value], kwargs: Kwargs,
                env: Env, use_span: Span | None) -> Env:
    """Each parameter's value: `--set`, else the argument, else the default (which may use
    the pipeline settings)."""
    penv: Env = {}
    consts = ExprCompiler(None)
    params: dict[str, ast.Param] = {}
    for p in sdef.params:
        if p.name in BUILTINS or p.name in CONSTANTS:
            raise UsageError(f"'{p.name}' is a built-in name; pick another name", p.span)
        if p.name in params:
            raise UsageError(f"parameter '{p.name}' appears twice", p.span,
                             (Note(f"the first '{p.name}' is here", params[p.name].span),))
        params[p.name] = p
    for name, p in params.items():
        if name in PIPELINE_KEYS:
            raise UsageError(f"a schedule parameter cannot be called '{name}': that is a "
                             "pipeline setting", p.span)
        if name in overrides:
            penv[name] = overrides[name]
        elif name in kwargs:
            penv[name] = kwargs[name][0]
        elif p.default is not None:
            penv[name] = consts.expr(p.default, value_scope(env))(dict(env), None)
        else:
            raise UsageError(f"schedule '{sdef.name}' needs a value for parameter '{name}'",
                             use_span or sdef.name_span,
                             (Note(f"give it: schedule = {sdef.name}({name} = ...)"),))
    for k, (_, kspan) in kwargs.items():
        if k not in params:
            raise UsageError(f"schedule '{sdef.name}' has no parameter '{k}'", kspan or use_span,
                             did_you_mean(k, params))
    return penv


def _run_items(module: ast.Module, env: Env, scope: Scope, comp: Compiler,
               ctx: RunContext) -> None:
    """A module's top-level `let`s and `def`s, into `env` and `scope`."""
    for item in module.items:
        if isinstance(item, ast.Let | ast.FuncDef):
            comp.stmt(item, scope)(env, ctx)


def _costs(module: ast.Module, env: Env, comp: Compiler, scope: Scope, ctx: RunContext
           ) -> dict[str, tuple[Any, Span | None]]:
    out: dict[str, tuple[Any, Span | None]] = {}
    _single(module, ast.CostsBlock, "costs")
    for item in module.items:
        if isinstance(item, ast.CostsBlock):
            for st in item.settings:
                if st.name in out:
                    raise UsageError(f"cost '{st.name}' is set twice", st.name_span,
                                     (Note("first set here", out[st.name][1]),))
                out[st.name] = (comp.expr(st.value, scope)(env, ctx), st.span)
    return out


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


def _norm(name: str) -> str:
    """Schedule names match with '-' and '_' interchangeable, in any case."""
    return name.replace("-", "_").lower()


__all__ = ["NO_LIBRARY", "Definition", "Elaborated", "Library", "Value", "elaborate"]
