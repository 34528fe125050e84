"""Per-micro-batch costs from sequence lengths, and lognormal lengths for benchmarks.

Micro-batches of packed variable-length sequences differ in cost. Rather than writing
``mb.M.F`` for every micro-batch, a cost file (or a `.sched` costs block, or ``--set``) says

==================  ===============================================================
``lengths``         one length per micro-batch, in micro-batch order: ``[512, 128, ...]``
``length_cost``     coefficients ``[a, b, c]`` of the cost shape a + b·len + c·len²
                    (1 to 3 numbers; default ``[0, 1]``: cost proportional to length)
``length_ref``      the length the plain per-kind and per-stage costs were measured at
                    (default: the mean of `lengths`)
==================  ===============================================================

and every op of micro-batch m costs its kind-and-stage cost times (`CostModel.with_lengths`)
``shape(lengths[m]) / shape(length_ref)``. The ratio form is deliberate: `pipeirc profile`
measures absolute times at one sequence length, and the coefficients only say how cost grows
with length (linear layers: b; attention: c), so the two compose without the user rescaling
anything. Costs given directly (``mb.M.K``, ``stage.S.mb.M.K``) win over derived ones.

Transfer sizes are not scaled: the simulator's activation bytes are per stage boundary, so a
long micro-batch's message costs what an average one does (a known simplification).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from pipeir.diagnostics import Span, UsageError, where_prefix

#: The settings this module reads out of a cost file before the cost model sees it.
LENGTH_KEYS: Final = ("lengths", "length_cost", "length_ref")

_Items = dict[str, tuple[Any, Span | None]]


@dataclass(frozen=True)
class LengthCost:
    """Micro-batch lengths and the cost shape a + b·len + c·len² that turns them into costs."""

    lengths: tuple[float, ...]
    coeffs: tuple[float, float, float] = (0.0, 1.0, 0.0)
    ref: float | None = None

    def __post_init__(self) -> None:
        # (a ValueError's second argument names the setting at fault, for its span)
        if not self.lengths:
            raise ValueError("lengths must list at least one micro-batch", "lengths")
        if any(not _finite(x) or x <= 0 for x in self.lengths):
            raise ValueError("every length must be a positive number", "lengths")
        if any(not _finite(x) or x < 0 for x in self.coeffs) or not any(self.coeffs):
            raise ValueError("length_cost coefficients must be non-negative and not all zero",
                             "length_cost")
        if self.ref is not None and (not _finite(self.ref) or self.ref <= 0):
            raise ValueError("length_ref must be a positive number", "length_ref")

    @property
    def reference(self) -> float:
        """The length the plain costs describe (given, or the mean length)."""
        return self.ref if self.ref is not None else sum(self.lengths) / len(self.lengths)

    def shape(self, length: float) -> float:
        a, b, c = self.coeffs
        return a + b * length + c * length * length

    def factors(self) -> list[float]:
        """Each micro-batch's cost relative to one of the reference length."""
        base = self.shape(self.reference)
        return [self.shape(x) / base for x in self.lengths]


def split_length_settings(items: Mapping[str, tuple[Any, Span | None]],
                          where: str | None = None) -> tuple[_Items, LengthCost | None]:
    """Take `lengths`, `length_cost` and `length_ref` out of cost settings (name -> (value,
    span)); returns the other settings and the length spec, or None when no lengths are set."""
    rest = {k: v for k, v in items.items() if k not in LENGTH_KEYS}
    got = {k: items[k] for k in LENGTH_KEYS if k in items}
    if not got:
        return rest, None
    if "lengths" not in got:
        name = next(iter(got))
        raise UsageError(f"{where_prefix(where, got[name][1])}'{name}' needs 'lengths' (one "
                         "length per micro-batch, e.g. lengths = [512, 128, 2048])",
                         got[name][1])
    lengths = _numbers("lengths", *got["lengths"], where)
    coeffs: tuple[float, float, float] = (0.0, 1.0, 0.0)
    if "length_cost" in got:
        c = _numbers("length_cost", *got["length_cost"], where)
        if len(c) > 3:
            raise UsageError(f"{where_prefix(where, got['length_cost'][1])}'length_cost' "
                             "takes 1 to 3 coefficients [a, b, c] (a + b*len + c*len^2), "
                             f"got {len(c)}",
                             got["length_cost"][1])
        coeffs = (c[0] if c else 0.0, c[1] if len(c) > 1 else 0.0,
                  c[2] if len(c) > 2 else 0.0)
    ref = None
    if "length_ref" in got:
        value, span = got["length_ref"]
        ref = _numbers("length_ref", (value,), span, where)[0]
    try:
        return rest, LengthCost(tuple(lengths), coeffs, ref)
    except ValueError as e:
        span = got[e.args[1]][1]
        raise UsageError(f"{where_prefix(where, span)}{e.args[0]}", span) from None


def parse_lengths(text: str, flag: str = "--lengths") -> tuple[float, ...]:
    """`--lengths 512,128,2048`: positive numbers separated by commas."""
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            x = float(part)
        except ValueError:
            raise UsageError(f"{flag} {text}: expected positive numbers separated by commas, "
                             f"got '{part}'") from None
        if not _finite(x) or x <= 0:
            raise UsageError(f"{flag} {text}: lengths must be positive, got '{part}'")
        out.append(x)
    return tuple(out)


def check_count(spec: LengthCost | None, microbatches: int, span: Span | None = None,
                where: str | None = None) -> None:
    """A UsageError (at `span`, the `lengths` setting) unless there is one length per
    micro-batch of the schedule: a shorter list would leave the rest at plain costs, a longer
    one would be cut, both silently."""
    if spec is not None and len(spec.lengths) != microbatches:
        raise UsageError(f"{where_prefix(where, span)}lengths gives {len(spec.lengths)} "
                         f"micro-batch lengths but the schedule has {microbatches} "
                         "micro-batches; give one per micro-batch", span)


def lognormal_lengths(n: int, seed: int, median: float = 512.0, sigma: float = 0.8,
                      lo: int = 16, hi: int = 8192) -> list[int]:
    """`n` sequence lengths drawn from a lognormal (the usual shape of packed-document
    lengths), clipped to [lo, hi]; the same `seed` gives the same lengths."""
    rnd = random.Random(seed)
    mu = math.log(median)
    return [int(min(hi, max(lo, round(rnd.lognormvariate(mu, sigma))))) for _ in range(n)]


def _numbers(name: str, value: Any, span: Span | None, where: str | None) -> list[float]:
    items = list(value) if isinstance(value, tuple | list) else [value]
    if not items or any(isinstance(x, bool) or not isinstance(x, int | float) or not _finite(x)
                        for x in items):
        raise UsageError(f"{where_prefix(where, span)}'{name}' must be a number or a list "
                         f"of numbers, got {value!r}", span)
    return [float(x) for x in items]


def _finite(x: float) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


__all__ = ["LENGTH_KEYS", "LengthCost", "check_count", "lognormal_lengths", "parse_lengths",
           "split_length_settings"]
