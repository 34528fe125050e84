"""Models for the runtime: the `ModelSpec` interface, `Splittable` models cut at named points,
and the built-ins `mlp`, `transformer` (a tiny language model) and `heavy-lm` (one whose
embedding and head outweigh a block), all on synthetic data."""

from pipeir.models.refs import resolve, resolve_splittable
from pipeir.models.spec import BUILTINS, ModelSpec, build_stage

__all__ = ["BUILTINS", "ModelSpec", "build_stage", "resolve", "resolve_splittable"]
