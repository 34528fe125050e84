"""Closed-form bubble and memory figures for the library schedules, to check the simulator.

The formulas hold for uniform op costs (every F the same, every B the same) and free
communication; interleaved 1F1B also assumes each of the v chunks costs 1/v of a full
stage, and m a multiple of p (Narayanan et al., 2021, section 2.2).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Analytic:
    """What theory predicts for a schedule, or why it predicts nothing."""

    bubble: float | None  # idle fraction of the step, 1 - busy / (ranks x makespan)
    peak_activations: int | None  # on the busiest rank, in stage x micro-batch units
    reason: str = ""  # why `bubble` is None


def one_f_one_b_bubble(p: int, m: int) -> float:
    """1F1B and GPipe: (p - 1) / (m + p - 1)."""
    return (p - 1) / (m + p - 1)


def interleaved_bubble(p: int, m: int, v: int) -> float:
    """Interleaved 1F1B with chunks of cost 1/v: (p - 1) / (v m + p - 1)."""
    return (p - 1) / (v * m + p - 1)


def analytic(name: str, p: int, m: int, v: int = 1) -> Analytic:
    """The closed form for library schedule `name` (canonical name, e.g. "1f1b")."""
    if name == "gpipe":
        return Analytic(one_f_one_b_bubble(p, m), m)
    if name == "1f1b":
        return Analytic(one_f_one_b_bubble(p, m), min(p, m))
    if name == "interleaved-1f1b":
        if m % p:
            return Analytic(None, None, "the closed form for interleaved 1F1B needs m a "
                                        "multiple of p")
        return Analytic(interleaved_bubble(p, m, v), None)
    return Analytic(None, None, f"no closed form for '{name}'")
