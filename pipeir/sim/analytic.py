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


def zb_idle(name: str, p: int, F: float = 1.0, I: float = 1.0,  # noqa: E741
            W: float = 1.0) -> float | None:
    """The zero-bubble papers' *bubble time*: the idle time of a rank between its first op and
    its last (Qi et al., 2024, Table 1; `1f1b` for comparison), or None for other schedules.

    1F1B (p-1)(F+I+W); ZB-H1 (p-1)(F+I-W); ZB-H2 (p-1)(F+I-2W), zero when F = I = W (the
    parallelogram; it needs m >= 2p - 1); ZB-V zero when F = I = W (each chunk costing F, I,
    W) and m >= 2p - 1. The paper derives them for comparable F, I and W (W no larger than
    F) and free communication; tests/test_zero_bubble.py checks them against the simulator.
    """
    if name == "1f1b":
        return (p - 1) * (F + I + W)
    if name == "zb-h1":
        return (p - 1) * (F + I - W)
    if name == "zb-h2":
        return (p - 1) * max(0.0, F + I - 2 * W)
    if name == "zb-v" and F == I == W:
        return 0.0
    return None


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
    if name == "looped-bfs":
        if m < p:
            return Analytic(None, None, "the closed form for looped BFS needs m >= p")
        # GPipe over v*m chunk-micro-batches of cost 1/v: the same bubble as interleaved 1F1B,
        # but every rank holds all v*m activations
        return Analytic(interleaved_bubble(p, m, v), v * m)
    # NOTE: the zero-bubble figures below assume F = I = W = 1 and B = 2 (bubble.py's costs).
    # A step then lasts m(F+I+W) plus the ramp the last rank waits through, (p-1)(F+I-W) for
    # ZB-H1 and (p-1)F for ZB-H2 (its ranks have no gap from first op to last).
    if name == "zb-h1":
        if m < p:  # the warm-up never fills: p = 4, m = 1 idles 66.7 %, not 50 %
            return Analytic(None, None, "ZB-H1's closed form needs m >= p")
        return Analytic((p - 1) / (3 * m + p - 1), min(p, m))
    if name == "zb-h2":
        if m < 2 * p - 1:
            return Analytic(None, None, "ZB-H2's parallelogram needs m >= 2p - 1")
        return Analytic((p - 1) / (3 * m + p - 1), 2 * p - 1)
    if name == "zb-v":
        if m < 2 * p - 1:
            return Analytic(None, None, "ZB-V's closed form needs m >= 2p - 1")
        # two chunks of F = I = W = 1 per rank, no gap on any rank: only the ramp, (p-1)F;
        # peak 2p chunk activations (p stages' worth, 1F1B's rank 0)
        return Analytic((p - 1) / (6 * m + p - 1), 2 * p)
    return Analytic(None, None, f"no closed form for '{name}'")
