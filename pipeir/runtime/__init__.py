"""The runtime: executes lowered programs on torch.distributed (the only package, with
pipeir.models, that imports torch). Generated rank files call methods of `Context`."""

from pipeir.runtime.context import Context

__all__ = ["Context"]
