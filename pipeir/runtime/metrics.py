"""Per-step training metrics for `pipeirc run`: throughput on the progress line and, with
`--metrics FILE`, one JSON object per step (JSON lines)."""

from __future__ import annotations

import json
from typing import IO, Any

from pipeir.runtime.launch import StepReport


def metrics(rep: StepReport) -> dict[str, Any]:
    """loss, time (s), samples/s, tokens/s (None unless the spec counts tokens), lr, the
    global gradient norm before clipping, skipped (fp16 overflow)."""
    info, t = rep.info, rep.time
    tokens = info.get("tokens")
    return {"step": rep.step + 1, "loss": rep.loss, "time_s": t,
            "samples_per_s": info["samples"] / t if t > 0 and "samples" in info else None,
            "tokens_per_s": tokens / t if t > 0 and tokens is not None else None,
            "lr": info.get("lr"), "grad_norm": info.get("grad_norm"),
            "skipped": bool(info.get("skipped", False))}


def describe(m: dict[str, Any]) -> str:
    """The throughput and optimizer part of a progress line."""
    parts = []
    if m["samples_per_s"] is not None:
        parts.append(f"{m['samples_per_s']:9.1f} samples/s")
    if m["tokens_per_s"] is not None:
        parts.append(f"{m['tokens_per_s']:9.1f} tokens/s")
    if m["lr"] is not None:
        parts.append(f"lr {m['lr']:.3g}")
    if m["grad_norm"] is not None:
        parts.append(f"grad norm {m['grad_norm']:.3g}")
    if m["skipped"]:
        parts.append("skipped (fp16 overflow)")
    return "  ".join(parts)


class MetricsFile:
    """`--metrics FILE`: one JSON line per step, flushed as it comes (so it can be followed
    with `tail -f`). Opened at the first step, so a run that fails before one leaves an
    existing file as it was and creates none."""

    def __init__(self, path: str | None):
        self.path = path
        self.out: IO[str] | None = None

    def write(self, m: dict[str, Any]) -> None:
        if self.path is None:
            return
        if self.out is None:
            self.out = open(self.path, "w")  # noqa: SIM115
        self.out.write(json.dumps(m) + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.out is not None:
            self.out.close()
