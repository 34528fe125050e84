"""Cost settings: the dotted names a cost can be given under (`F`, `stage.3.B`, `mb.2.F`,
`latency`, ...; the table is in `pipeir.sim.costs`), and their checking into the keyword
arguments of a `CostModel`.

Settings come from a `.sched` file's `costs { }` block, a cost file (`pipeir.sim.cost_files`)
or `--set`; every name and value is checked here, once, with the setting's span, so that the
model itself only ever sees valid numbers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from pipeir import limits
from pipeir.diagnostics import Note, Span, UsageError, did_you_mean, where_prefix
from pipeir.ops import KINDS, MEMORY_KINDS, Kind
from pipeir.sim.lengths import LENGTH_KEYS

#: Settings that hold a time per op, and the settings about transfers and memory.
OP_KINDS = KINDS
COMPUTE_KINDS: tuple[Kind, ...] = ("F", "B", "I", "W")  # the kinds with a default time
COMM_KEYS = ("latency", "bandwidth", "dp", "dp_latency", "dp_bandwidth", "host_latency",
             "host_bandwidth")
SIZE_KEYS = ("activation_bytes", "memory_bytes", "memory_w_bytes", "param_bytes", "input_bytes")
#: The cost file versions read: 2 may give `memory_w_bytes` (1 files hold everything until W).
VERSIONS = (1, 2)
META_KEYS = ("version", "meta", "unit")
TOP_KEYS = (*OP_KINDS, *COMM_KEYS, *SIZE_KEYS, *META_KEYS, *LENGTH_KEYS)

Level = dict[str, float]  # kind (or size key) -> value, as written at one level


def is_number(v: object) -> bool:
    """A finite int or float, not a bool (JSON and TOML give all three)."""
    return (isinstance(v, int | float) and not isinstance(v, bool)
            and (isinstance(v, int) or math.isfinite(v)))


#: The range of a cost value. NOTE: the simulator adds times over every op and tune scales
#: them, so a finite 1e308 still overflows to inf and then NaN (a timeline's column index,
#: a plot's axis); within these bounds a sum over 10**9 ops and bytes / bandwidth stay finite.
MAX_COST = 1e15
MIN_BANDWIDTH = 1e-15


UNIT_NAME = re.compile(r'[^\s"\\\x00-\x1f\x7f]{1,16}')
#: (an index is written as Python's int() would print it, in ASCII digits without a leading
#: zero: "00" or an Arabic-Indic digit was the same stage as "0" by another name, and escaped
#: the check for a cost given twice)
_INDEX = r"(0|[1-9][0-9]*)"
_LOOSE = re.compile(r"^(stage|mb)\.\d+\.((mb)\.\d+\.)?\w+$")  # (any digits: to say so)
_INDEXED = re.compile(rf"^(stage)\.{_INDEX}\.(mb)\.{_INDEX}\.(\w+)$|^(stage|mb)\.{_INDEX}\.(\w+)$")


def _known_names(name: str) -> list[str]:
    """Names to suggest for a misspelt `name`, with its own indices (stage.3.Q -> stage.3.F)."""
    nums = [*re.findall(r"\d+", name), "0", "0"]
    s, m = nums[0], nums[1]
    return [*TOP_KEYS, *(f"stage.{s}.{k}" for k in (*OP_KINDS, *SIZE_KEYS)),
            *(f"mb.{s}.{k}" for k in OP_KINDS), *(f"stage.{s}.mb.{m}.{k}" for k in OP_KINDS)]


def cost_fields(items: Mapping[str, tuple[Any, Span | None]], where: str | None
                ) -> dict[str, Any]:
    """The keyword arguments of `CostModel` that dotted settings (name -> (value, span))
    give, every name and value checked; errors point at the setting's span, or name `where`
    (e.g. "--set") for settings that have none."""
    stage: dict[int, Level] = {}
    mb: dict[int, Level] = {}
    stage_mb: dict[tuple[int, int], Level] = {}
    unit: str | None = None
    for name, (value, span) in items.items():
        if name in ("meta",) or name.startswith("meta."):
            continue
        if name == "version":
            if value not in VERSIONS or not is_number(value):
                raise UsageError(f"{where_prefix(where, span)}cost file version {value!r} is not "
                                 "supported (this pipeir reads versions 1 and 2)", span)
            continue
        if name == "unit":
            # NOTE: printed back into `.sched` costs blocks and every report, so a short
            # word: no quotes, backslashes, spaces or control characters
            if not isinstance(value, str) or not UNIT_NAME.fullmatch(value):
                raise UsageError(f"{where_prefix(where, span)}'unit' must be a name like \"ms\" "
                                 f"(at most 16 characters, no quotes, spaces or backslashes), "
                                 f"got {value!r}", span)
            unit = value
            continue
        try:
            key, level, allowed = _classify(name, stage, mb, stage_mb)
        except ValueError as e:  # an index past 64 bits
            raise UsageError(f"{where_prefix(where, span)}cost '{_short(name)}': {e}",
                             span) from None
        if key is None or level is None or key not in allowed:
            raise UsageError(f"{where_prefix(where, span)}unknown cost '{name}'", span,
                             did_you_mean(name, _known_names(name)) or
                             (Note("costs are F, B, I, W, FC, RC, OFF, RELOAD, latency, "
                                   "bandwidth, activation_bytes, memory_bytes, memory_w_bytes, "
                                   "input_bytes, "
                                   "host_latency, host_bandwidth, param_bytes, dp, dp_latency, "
                                   "dp_bandwidth, and stage.S.K, mb.M.K, stage.S.mb.M.K for K "
                                   "in those op kinds"),))
        v = _number(name, value, span, where,
                    positive=name in ("bandwidth", "dp_bandwidth", "dp", "host_bandwidth"))
        if name == "dp" and v != int(v):
            raise UsageError(f"{where_prefix(where, span)}cost 'dp' (data-parallel replicas) "
                             f"must be a positive integer, got {value}", span)
        level[key] = v
    _check_split(items, stage, where)
    return dict(
            F=_top(items, "F", 1.0), B=_top(items, "B", None), I=_top(items, "I", None),
            W=_top(items, "W", None), latency=_top(items, "latency", 0.0),
            bandwidth=_top(items, "bandwidth", None),
            activation_bytes=_top(items, "activation_bytes", 0.0),
            memory_bytes=_top(items, "memory_bytes", None),
            memory_w_bytes=_top(items, "memory_w_bytes", None),
            param_bytes=_top(items, "param_bytes", 0.0), dp=int(_top(items, "dp", 1)),
            dp_latency=_top(items, "dp_latency", None),
            dp_bandwidth=_top(items, "dp_bandwidth", None),
            input_bytes=_top(items, "input_bytes", None),
            host_latency=_top(items, "host_latency", 0.0),
            host_bandwidth=_top(items, "host_bandwidth", None),
            **{k: _top(items, k, None) for k in MEMORY_KINDS},
            stage=stage, mb=mb, stage_mb=stage_mb, unit=unit)


def split_problem(prefix: str, w: float | None, saved: float | None) -> str | None:
    """Why `prefix`memory_w_bytes = `w` cannot go with `saved` bytes a forward saves (None:
    it can). W keeps part of what its forward saved, never more."""
    if w is None:
        return None
    if saved is None:
        return (f"cost '{prefix}memory_w_bytes' needs memory_bytes: it is the part of the "
                "bytes a forward saves that W still needs after I")
    if w > saved:
        return (f"cost '{prefix}memory_w_bytes' = {w:g} is more than {prefix}memory_bytes = "
                f"{saved:g}: W keeps part of what its forward saved, never more")
    return None


def _check_split(items: Mapping[str, tuple[Any, Span | None]], stage: Mapping[int, Level],
                 where: str | None) -> None:
    """Every stage's `memory_w_bytes` within its `memory_bytes` (`split_problem`), the error
    at the setting that breaks it."""
    def top(name: str) -> float | None:
        got = items.get(name)
        return None if got is None else float(got[0])

    def span(*names: str) -> Span | None:
        return next((items[n][1] for n in names if n in items), None)
    checks = [("", top("memory_w_bytes"), top("memory_bytes"),
               span("memory_w_bytes", "memory_bytes"))]
    for s, level in sorted(stage.items()):
        if "memory_w_bytes" in level or "memory_bytes" in level:
            p = f"stage.{s}."
            checks.append((p, level.get("memory_w_bytes", top("memory_w_bytes")),
                           level.get("memory_bytes", top("memory_bytes")),
                           span(p + "memory_w_bytes", p + "memory_bytes", "memory_w_bytes")))
    for prefix, w, saved, at in checks:
        problem = split_problem(prefix, w, saved)
        if problem is not None:
            raise UsageError(f"{where_prefix(where, at)}{problem}", at)


def _top(items: Mapping[str, tuple[Any, Span | None]], name: str, default: Any) -> Any:
    got = items.get(name)
    return default if got is None else float(got[0])


def _short(name: str) -> str:
    return name if len(name) <= 40 else name[:37] + "..."


def _classify(name: str, stage: dict[int, Level], mb: dict[int, Level],
              stage_mb: dict[tuple[int, int], Level]
              ) -> tuple[str | None, Level | None, tuple[str, ...]]:
    """Which level a dotted name writes to, the key within it, and the keys allowed there."""
    if name in (*OP_KINDS, *COMM_KEYS, *SIZE_KEYS):
        return name, {}, (name,)
    m = _INDEXED.match(name)
    if m is None:
        loose = _LOOSE.match(name)
        if loose is not None:
            canonical = ".".join(str(int(p)) if p.isdigit() else p for p in name.split("."))
            raise ValueError(f"write it as '{canonical}' (indices in plain digits, without a "
                             f"leading zero: one stage under two names escaped the check for "
                             f"a cost given twice)")
        return None, None, ()
    if m.group(1):
        k = (limits.to_int(m.group(2)), limits.to_int(m.group(4)))
        return m.group(5), stage_mb.setdefault(k, {}), OP_KINDS
    idx = limits.to_int(m.group(7))
    if m.group(6) == "stage":
        return m.group(8), stage.setdefault(idx, {}), (*OP_KINDS, *SIZE_KEYS)
    return m.group(8), mb.setdefault(idx, {}), OP_KINDS


def _number(name: str, value: Any, span: Span | None, where: str | None,
            positive: bool) -> float:
    if not is_number(value):
        raise UsageError(f"{where_prefix(where, span)}cost '{name}' must be a number, got "
                         f"{show_value(value)}", span)
    if value < 0 or (positive and value == 0):
        need = "positive" if positive else "non-negative"
        raise UsageError(f"{where_prefix(where, span)}cost '{name}' must be {need}, "
                         f"got {show_value(value)}", span)
    if value > MAX_COST or (positive and value < MIN_BANDWIDTH):
        bound = f"at most {MAX_COST:g}" if value > MAX_COST else f"at least {MIN_BANDWIDTH:g}"
        raise UsageError(f"{where_prefix(where, span)}cost '{name}' = {show_value(value)} is "
                         f"out of range: it must be {bound} (times are summed over every op; "
                         "choose another unit)", span)
    return float(value)


def show_value(v: Any) -> str:
    """A value as an error message shows it, never a huge repr."""
    if isinstance(v, str):
        return f"the text {v!r}"
    if isinstance(v, tuple | list):
        return "a list"
    if isinstance(v, dict):
        return "a table"
    if isinstance(v, int) and abs(v) > 10**18:  # repr() of a huge int is slow, then refused
        return f"an integer of about {int(v.bit_length() * 0.30103) + 1} digits"
    return repr(v)
