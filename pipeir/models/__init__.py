"""Models for the runtime: the `ModelSpec` interface and the built-ins `mlp` and
`transformer` (a tiny language model), both on synthetic data."""

from pipeir.models.spec import BUILTINS, ModelSpec, build_stage, resolve

__all__ = ["BUILTINS", "ModelSpec", "build_stage", "resolve"]
