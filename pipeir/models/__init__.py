"""Models for the runtime: the `ModelSpec` interface (a model cut into stages by hand), the
`ModuleSpec` one (an unsplit `nn.Module` that pipeir cuts), `Splittable` models cut at named
points, and the built-ins `mlp`, `transformer` (a tiny language model) and `heavy-lm` (one whose
embedding and head outweigh a block), all on synthetic data."""

from pipeir.models.causal_lm import causal_lm
from pipeir.models.module import ModuleSpec, split
from pipeir.models.refs import resolve, resolve_splittable
from pipeir.models.spec import BUILTINS, ModelSpec, build_stage

__all__ = ["BUILTINS", "ModelSpec", "ModuleSpec", "build_stage", "causal_lm", "resolve",
           "resolve_splittable", "split"]
