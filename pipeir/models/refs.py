"""What `--model` names: a ModelSpec (`pipeir.models.spec.resolve`), a model that can be cut
at named points (`resolve_splittable`), or one cut there (`REF@POINT,POINT...`, what
`pipeirc run --plan` hands every rank). The one resolver the runtime and the CLI call.
"""

from __future__ import annotations

import importlib.util

from pipeir.diagnostics import UsageError, did_you_mean
from pipeir.models import spec as specs
from pipeir.models.spec import ModelSpec
from pipeir.models.splittable import Splittable
from pipeir.usercode import import_module

#: Built-in models that can be cut anywhere -> "module:function".
SPLITTABLE: dict[str, str] = {
    "transformer": "pipeir.models.transformer:splittable",
    "heavy-lm": "pipeir.models.heavy_lm:splittable",
}


def resolve(ref: str) -> ModelSpec:
    """`specs.resolve`, and `REF@POINT,POINT...`: the Splittable REF cut at those points."""
    if not isinstance(ref, str):
        raise TypeError(f"a model reference is a string (a built-in name, 'file.py:fn' or "
                        f"'module:fn'), got {type(ref).__name__}")
    base, at, points = ref.rpartition("@")
    if at and "/" not in points:  # (not a directory named x@y)
        named = [p.strip() for p in points.split(",") if p.strip()]
        if not named:
            raise UsageError(f"model {ref!r} names no split point after '@': give "
                             f"{base}@POINT,POINT..., or {base} alone")
        return resolve_splittable(base).at(named)
    return specs.resolve(ref)


def check_name(ref: str) -> None:
    """Refuse a bare word that is neither a built-in nor an importable module, as `resolve`
    does, without importing anything: `pipeirc run` calls it before its model check, which
    waits for the fork server's import of torch (seconds), so a mistyped built-in is
    reported at once. Anything else is left to `resolve`."""
    base = ref.rpartition("@")[0] or ref
    if (base.isidentifier() and base not in specs.BUILTINS and base not in SPLITTABLE
            and importlib.util.find_spec(base) is None):
        # (the module does not exist: importing it fails at once, with resolve's message)
        import_module(base, f"--model '{ref}'", did_you_mean(base, specs.BUILTINS))


def resolve_splittable(ref: str) -> Splittable:
    """The `Splittable` `ref` names: a built-in (`transformer`, `heavy-lm`) or a function
    returning one. A ModelSpec is refused: it is already cut, by stage number, and cannot be
    cut elsewhere."""
    got = specs.call_factory(ref, SPLITTABLE.get(ref, specs.BUILTINS.get(ref, ref)))
    if isinstance(got, Splittable):
        return got
    what = ("a ModelSpec, already cut into stages by number" if isinstance(got, ModelSpec)
            else type(got).__name__)
    raise UsageError(f"--model '{ref}': returned {what}; planning and --plan need a model "
                     f"that can be cut at named points (built-ins: {', '.join(SPLITTABLE)}, "
                     "or a function returning a pipeir.models.splittable.Splittable)")
