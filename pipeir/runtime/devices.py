"""Where ranks run: CUDA or CPU, chosen from the devices a host has and `PIPEIR_DEVICE`.

Torch-free (the launcher sets and checks the choice without importing torch): the ranks ask
`pipeir.runtime.dist.device_kind`, which counts the CUDA devices and applies `choose`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

#: the environment variable ranks read; `pipeirc run --device` and `profile --device` set it
ENV: Final = "PIPEIR_DEVICE"
MODES: Final = ("auto", "cpu", "cuda")


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The environment variable `name`, one of `choices` (the first where it is unset or
    empty); another value is a ValueError naming them: the runtime's switches
    (`PIPEIR_DEVICE`, `PIPEIR_P2P_GROUPS`, `PIPEIR_P2P_PIPES`) read alike."""
    value = os.environ.get(name) or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected {', '.join(choices[:-1])} or "
                         f"{choices[-1]}")
    return value


def mode() -> str:
    """The requested mode (`auto` unless `ENV` says otherwise); a bad value is a
    ValueError."""
    return env_choice(ENV, MODES)


def choose(requested: str, gpus: int, local_world: int | None, fallback: bool = True
           ) -> tuple[str, str | None]:
    """Where ranks run on a host with `gpus` CUDA devices: ("cuda" | "cpu", a note for the
    user or None). `local_world`: the ranks started on this host (None: not known, e.g. a
    launcher that sets no LOCAL_WORLD_SIZE, where each process may see devices of its own:
    CUDA wherever there is some).

    NCCL cannot put two ranks of one group on one device, so CUDA needs a device per rank.
    With fewer, `auto` runs on CPU with gloo and says why when `fallback` (`pipeirc run`
    starts every rank itself, so all of them choose alike); otherwise (torchrun: other hosts
    may have enough and choose CUDA, and the world would mix backends) it is an error, as
    `cuda` always is (ValueError)."""
    if requested == "cpu":
        return "cpu", None
    if gpus and (local_world is None or gpus >= local_world):
        return "cuda", None
    if requested == "cuda":
        need = "a CUDA device" if local_world is None else (
            f"as many CUDA devices as its {local_world} rank(s) (NCCL puts one rank on each)")
        raise ValueError(f"CUDA asked for (--device cuda or {ENV}=cuda), but this host needs "
                         f"{need}; {gpus} visible")
    if gpus and not fallback:
        raise ValueError(f"{local_world} ranks on this host and {gpus} CUDA device(s): NCCL "
                         f"needs a device per rank; start at most {gpus} per host, or set "
                         f"{ENV}=cpu to train on CPU with gloo")
    if gpus:
        return "cpu", (f"{local_world} ranks on this host and {gpus} CUDA device(s): running "
                       "on CPU with gloo (NCCL needs a device per rank: run fewer ranks per "
                       f"host to use CUDA; {ENV}=cpu silences this note)")
    return "cpu", None


def local_world(env: Mapping[str, str]) -> int | None:
    """The ranks on this host as torchrun says (LOCAL_WORLD_SIZE), None where unset."""
    value = env.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else None
