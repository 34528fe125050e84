"""Pipeline settings -> PipelineConfig: `--set` wins over the file's `pipeline` block, which
wins over the schedule's own block of defaults, which wins over the built-in defaults.

The settings are only read here; `PipelineConfig.make` checks them, and its `ConfigError`
becomes a diagnostic at the setting it names (or a note that the setting took its default).
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeir.config import PIPELINE_KEYS, PLACEMENTS, ConfigError, PipelineConfig
from pipeir.diagnostics import Note, Span, UsageError, did_you_mean
from pipeir.frontend import ast
from pipeir.frontend.expressions import ExprCompiler
from pipeir.frontend.scope import Env, Value, value_scope

Spans = dict[str, Span | None]  # where each setting was given; None for --set


def file_settings(block: ast.PipelineBlock | None, overrides: Mapping[str, Value]
                  ) -> tuple[Env, Spans]:
    """The file's `pipeline` block under `--set`; ranks and microbatches must be given."""
    env: Env = {}
    spans: Spans = {}
    consts = ExprCompiler(None)
    for st in block.settings if block is not None else ():
        _check_key(st)
        if st.name in spans:
            raise UsageError(f"'{st.name}' is set twice", st.name_span,
                             (Note("first set here", spans[st.name]),))
        spans[st.name] = st.span
        try:
            env[st.name] = overrides[st.name] if st.name in overrides else \
                _setting_value(st, env, consts)
        except UsageError as e:
            if e.message.startswith("unknown name"):
                e.annotate(Note("a setting sees only the settings before it: the file's "
                                "`let`s and `def`s run once the pipeline is known (they may "
                                "use ranks), so they cannot size it"))
            raise
    for k in ("ranks", "microbatches"):
        if k in overrides:
            env[k], spans[k] = overrides[k], None
        if k not in env:
            where = block.span if block is not None else None
            raise UsageError(f"the pipeline does not say how many {k} there are: set "
                             f"'{k} = N' in the pipeline block or pass --set {k}=N", where)
    return env, spans


def schedule_defaults(block: ast.PipelineBlock, env: Env, spans: Spans, params: Env) -> None:
    """A schedule's own `pipeline { ... }` block: fills in what the file left unset. Its
    expressions see the settings so far and the schedule's parameters (`stages = ranks * v`)."""
    denv = {**env, **params}
    consts = ExprCompiler(None)
    for st in block.settings:
        if st.name not in env:
            _check_key(st)
            denv[st.name] = env[st.name] = _setting_value(st, denv, consts)
            spans[st.name] = st.span


def make_config(env: Env, spans: Spans, overrides: Mapping[str, Value]) -> PipelineConfig:
    """The config the settings describe, or a diagnostic at the setting that is wrong."""
    for k, v in overrides.items():
        if k in PIPELINE_KEYS:
            env[k], spans[k] = v, None
    try:
        return PipelineConfig.make(env["ranks"], env["microbatches"], env.get("stages"),
                                   env.get("placement", "loop"), env.get("memory_limit"),
                                   env.get("accumulate", 1))
    except ConfigError as e:
        key = _blame((e.key, *e.also), spans, overrides)
        span = spans.get(key)
        notes = () if span is not None or key in overrides else \
            (Note(f"'{key}' was not set, so it took its default"),)
        raise UsageError(str(e), span, notes) from None


def _blame(keys: tuple[str, ...], spans: Spans, overrides: Mapping[str, Value]) -> str:
    """Which of the settings an error names (most to blame first) to point at: the first that
    was given, with --set (the message then has no caret in the file) or in the file; else
    the first, which took its default."""
    return next((k for k in keys if k in overrides or spans.get(k) is not None), keys[0])


def _check_key(st: ast.Setting) -> None:
    if st.name not in PIPELINE_KEYS:
        raise UsageError(f"unknown pipeline setting '{st.name}'", st.name_span,
                         did_you_mean(st.name, PIPELINE_KEYS))


def _setting_value(st: ast.Setting, env: Env, consts: ExprCompiler) -> Value:
    if st.name == "placement" and isinstance(st.value, ast.Var) and st.value.name in PLACEMENTS:
        return st.value.name
    if st.name == "placement" and isinstance(st.value, ast.Var):
        raise UsageError(f"unknown placement '{st.value.name}'", st.value.span,
                         did_you_mean(st.value.name, PLACEMENTS)
                         or (Note("use loop, vshape, or a list of ranks"),))
    value: Value = consts.expr(st.value, value_scope(env))(dict(env), None)
    return value
