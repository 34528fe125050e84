"""The runtime: executes lowered programs on torch.distributed (the only package, with
pipeir.models, that imports torch). Generated rank files call methods of `Context`.

`Context` loads on first use (PEP 562): `pipeir.runtime.forkserver.prestart` must start the
fork server before the launcher imports torch."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeir.runtime.context import Context


def __getattr__(name: str) -> Any:
    if name == "Context":
        from pipeir.runtime.context import Context  # torch: see above

        return Context
    raise AttributeError(f"module 'pipeir.runtime' has no attribute '{name}'")


__all__ = ["Context"]
