"""argparse value types for the two command lines: `pipeirc` and the `main.py` a compiled
program runs under torchrun (`pipeir.runtime.torchrun`), which must not import `cli/`."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (`float()` alone lets nan, inf and -1 through, and
    a timeout of nan reaches torch as a c10d error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


#: The longest timeout accepted: c10d keeps timeouts in int64 milliseconds, and Python's
#: timedelta overflows long before float does.
MAX_TIMEOUT_S = 10**7


def timeout_seconds(text: str) -> float:
    """argparse type: a timeout in seconds, positive and at most MAX_TIMEOUT_S."""
    value = positive_float(text)
    if value > MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"at most {MAX_TIMEOUT_S:g} seconds, got {text}")
    return value
