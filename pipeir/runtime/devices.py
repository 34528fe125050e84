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


def choose(requested: str, gpus: int, local_world: int | None) -> tuple[str, str | None]:
    """Where ranks run on a host with `gpus` CUDA devices: ("cuda" | "cpu", a note for the
    user or None). `local_world`: the ranks `pipeirc run` starts on this host; None where
    they are not counted here (torchrun, another launcher: each host, even each process, may
    see its own devices, so CUDA is used wherever there is some, on LOCAL_RANK's device).

    NCCL cannot put two ranks of one group on one device, so where the ranks are counted,
    CUDA needs a device per rank. With fewer, `auto` runs on CPU with gloo and says why
    (rather than fail at the first collective); `cuda` is an error (ValueError). Every rank
    `pipeirc run` starts sees the same devices and environment, so all choose alike."""
    if requested == "cpu":
        return "cpu", None
    if gpus and (local_world is None or gpus >= local_world):
        return "cuda", None
    if requested == "cuda":
        need = "a CUDA device" if local_world is None else (
            f"as many CUDA devices as its {local_world} rank(s) (NCCL puts one rank on each)")
        raise ValueError(f"CUDA asked for (--device cuda or {ENV}=cuda), but this host needs "
                         f"{need}; {gpus} visible")
    if gpus:
        return "cpu", (f"{local_world} ranks on this host and {gpus} CUDA device(s): running "
                       "on CPU with gloo (NCCL needs a device per rank: run fewer ranks per "
                       f"host to use CUDA; {ENV}=cpu silences this note)")
    return "cpu", None
