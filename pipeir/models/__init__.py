"""Models for the runtime: the `ModelSpec` interface (a model cut into stages by hand), the
`ModuleSpec` one (an unsplit `nn.Module` that pipeir cuts), `Splittable` models cut at named
points, and the built-ins `mlp`, `transformer` (a tiny language model) and `heavy-lm` (one whose
embedding and head outweigh a block), all on synthetic data.

NOTE (start-up): `ModuleSpec`, `split` and `causal_lm` import `pipeir.models.module`, which
imports `torch.distributed.pipelining` and with it `torch._dynamo` (1.7 s of every rank's start-up).
They load on first use (PEP 562), so a run whose model is a `ModelSpec` never pays for them.
"""

import importlib
from typing import TYPE_CHECKING, Any

from pipeir.models.refs import resolve, resolve_splittable
from pipeir.models.spec import BUILTINS, ModelSpec, build_stage

if TYPE_CHECKING:
    from pipeir.models.causal_lm import causal_lm
    from pipeir.models.module import ModuleSpec, split

_LAZY = {"ModuleSpec": "module", "split": "module", "causal_lm": "causal_lm"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"pipeir.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'pipeir.models' has no attribute '{name}'")


__all__ = ["BUILTINS", "ModelSpec", "ModuleSpec", "build_stage", "causal_lm", "resolve",
           "resolve_splittable", "split"]
