"""Where ranks run: CUDA or CPU, chosen from the devices a host has and `PIPEIR_DEVICE`.

Torch-free (the launcher sets and checks the choice without importing torch): the ranks ask
`pipeir.runtime.dist.device_kind`, which counts the CUDA devices and applies `choose`.
"""

from __future__ import annotations

import os
from typing import Final

#: the environment variable ranks read; `pipeirc run --device` and `profile --device` set it
ENV: Final = "PIPEIR_DEVICE"
MODES: Final = ("auto", "cpu", "cuda")


def mode() -> str:
    """The requested mode (`auto` unless `ENV` says otherwise); a bad value is a ValueError."""
    value = os.environ.get(ENV, "auto")
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r}: expected auto, cpu or cuda")
    return value


def choose(requested: str, gpus: int, local_world: int) -> tuple[str, str | None]:
    """Where `local_world` ranks on a host with `gpus` CUDA devices run: ("cuda" | "cpu", a
    note for the user or None). NCCL cannot put two ranks of one group on one device, so
    CUDA needs a device per local rank. With fewer, `auto` runs on CPU with gloo and says why
    (rather than fail at the first collective); `cuda` is an error (ValueError). Every rank
    of a host sees the same devices and environment, so all choose alike."""
    if requested == "cpu":
        return "cpu", None
    if gpus and gpus >= local_world:
        return "cuda", None
    if requested == "cuda":
        raise ValueError(f"CUDA asked for (--device cuda or {ENV}=cuda), but {local_world} "
                         f"rank(s) on this host need as many CUDA devices (NCCL puts one rank "
                         f"on each); {gpus} visible")
    if gpus:
        return "cpu", (f"{local_world} ranks on this host and {gpus} CUDA device(s): running "
                       "on CPU with gloo (NCCL needs a device per rank: run fewer ranks per "
                       f"host to use CUDA; {ENV}=cpu silences this note)")
    return "cpu", None
