"""Models for the runtime: the `ModelSpec` interface (a model cut into stages by hand), the
`ModuleSpec` one (an unsplit `nn.Module` that pipeir cuts), and the built-ins `mlp` and
`transformer` (a tiny language model), both on synthetic data."""

from pipeir.models.module import ModuleSpec, split
from pipeir.models.spec import BUILTINS, ModelSpec, build_stage, resolve

__all__ = ["BUILTINS", "ModelSpec", "ModuleSpec", "build_stage", "resolve", "split"]
