"""The cost model: how long each op takes, what a transfer costs, how much memory it holds.

Costs are written as *settings*, one dotted name per value, the same in a `.sched` file's
`costs { }` block, in a JSON or TOML cost file (`pipeirc simulate --costs FILE`, the format
`pipeirc profile` writes) and in `--set` on the command line:

==============================  ==========================================================
``F``, ``B``, ``I``, ``W``      time of one op of that kind (defaults: F = 1, I = W = 1,
                                B = I + W, so B = 2; setting only B splits it evenly)
``stage.S.K``                   kind K on stage S (e.g. ``stage.3.F = 1.5``)
``mb.M.K``                      kind K for micro-batch M, every stage (variable lengths)
``stage.S.mb.M.K``              kind K of micro-batch M on stage S
``latency``                     fixed time per cross-rank transfer (default 0)
``bandwidth``                   bytes per time unit of a link (default: infinite)
``activation_bytes``            bytes crossing a stage boundary: the output of stage S
                                going forward, and its gradient coming back (default 0)
``stage.S.activation_bytes``    the same for the boundary after stage S
``memory_bytes``                bytes of activations one micro-batch keeps on a stage from
                                its F until its backward frees them (enables peak_bytes)
``stage.S.memory_bytes``        the same for stage S
``param_bytes``                 bytes of one stage's weight gradients, all-reduced by its
                                R op under data parallelism (default 0)
``stage.S.param_bytes``         the same for stage S (`pipeirc profile` measures it)
``dp``                          data-parallel replicas D (default 1: R ops cost nothing)
``dp_latency``, ``dp_bandwidth``  the link between replicas (default: ``latency``,
                                ``bandwidth``)
``input_bytes``                 bytes of a stage's input, which a checkpointed forward FC
                                keeps until its backward (default: the activation_bytes of
                                the boundary before the stage; 0 for the first stage)
``stage.S.input_bytes``         the same for stage S
``host_latency``                fixed time of one offload (OFF) or reload (RELOAD) on the
                                rank's copy channel (default 0)
``host_bandwidth``              bytes per time unit between device and host memory: an OFF
                                or RELOAD takes ``host_latency + memory_bytes /
                                host_bandwidth`` (default: infinite)
``FC``, ``RC``                  a checkpointed forward and its recompute cost an F unless set
``OFF``, ``RELOAD``             set to override the time from the host bandwidth
``unit``                        the time unit, for display only (e.g. "ms"; default none)
``lengths``, ``length_cost``,   per-micro-batch costs from sequence lengths
``length_ref``                  (see `pipeir.sim.lengths`)
==============================  ==========================================================

The most specific setting wins: stage+micro-batch, then micro-batch, then stage, then the
kind's default. At each level a B that is not given but whose I and W both are costs I + W.
A transfer between stages on the same rank is free; otherwise it takes
``latency + activation_bytes / bandwidth``. A gradient reduction R(s) is a ring all-reduce
over the D replicas: ``2(D-1) * dp_latency + 2(D-1)/D * param_bytes / dp_bandwidth``.

A cost file is a JSON object or TOML document of those names. Nested tables are joined with
dots, so TOML's ``[stage.2]`` / ``F = 1.5`` and JSON's ``{"stage": {"2": {"F": 1.5}}}`` both
mean ``stage.2.F = 1.5``. Two keys are metadata and ignored by the model: ``version`` (must
be 1) and ``meta`` (a free-form table: device, model, date, how it was measured).

    # costs.toml
    version = 1
    unit = "ms"
    F = 1.0
    I = 1.0
    W = 0.8
    latency = 0.05
    bandwidth = 25e6          # bytes per ms
    activation_bytes = 8e6
    [stage.3]
    F = 1.4                   # the stage with the LM head is slower
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeir import limits
from pipeir.diagnostics import Note, Source, Span, UsageError, did_you_mean, where_prefix
from pipeir.ops import CHANNEL, KINDS, MEMORY_KINDS, Kind, Op
from pipeir.sim.lengths import LENGTH_KEYS, LengthCost, split_length_settings

#: Settings that hold a time per op, and the settings about transfers and memory.
OP_KINDS = KINDS
COMPUTE_KINDS: tuple[Kind, ...] = ("F", "B", "I", "W")  # the kinds with a default time
COMM_KEYS = ("latency", "bandwidth", "dp", "dp_latency", "dp_bandwidth", "host_latency",
             "host_bandwidth")
SIZE_KEYS = ("activation_bytes", "memory_bytes", "param_bytes", "input_bytes")
META_KEYS = ("version", "meta", "unit")
TOP_KEYS = (*OP_KINDS, *COMM_KEYS, *SIZE_KEYS, *META_KEYS, *LENGTH_KEYS)

_Level = dict[str, float]  # kind (or size key) -> value, as written at one level


@dataclass(frozen=True)
class CostModel:
    """Op times, transfer costs and activation sizes for the simulator.

    Plain keywords give the defaults (`CostModel(F=1, B=3)`); `stage`, `mb` and `stage_mb`
    map stage, micro-batch or (stage, micro-batch) to `{kind: time}` overrides. Build one from
    settings with `from_settings`, from a file with `load`.
    """

    F: float = 1.0
    B: float | None = None
    I: float | None = None  # noqa: E741 - the paper's name for the op
    W: float | None = None
    latency: float = 0.0
    bandwidth: float | None = None
    activation_bytes: float = 0.0
    memory_bytes: float | None = None
    param_bytes: float = 0.0
    dp: int = 1
    dp_latency: float | None = None  # None: `latency`
    dp_bandwidth: float | None = None  # None: `bandwidth`
    input_bytes: float | None = None
    host_latency: float = 0.0
    host_bandwidth: float | None = None
    FC: float | None = None
    RC: float | None = None
    OFF: float | None = None
    RELOAD: float | None = None
    stage: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    mb: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    stage_mb: Mapping[tuple[int, int], Mapping[str, float]] = field(default_factory=dict)
    unit: str | None = None
    _base: dict[str, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        base: _Level = {"F": self.F}
        # (a memory op's time follows another's unless set: FC, RC an F; OFF, RELOAD the copy)
        for kind in ("B", "I", "W", *MEMORY_KINDS):
            v = getattr(self, kind)
            if v is not None:
                base[kind] = v
        for k, v in base.items():
            _check_time(k, v)
        for k in ("latency", "activation_bytes", "param_bytes", "host_latency"):
            _check_time(k, getattr(self, k))
        if self.dp_latency is not None:
            _check_time("dp_latency", self.dp_latency)
        if type(self.dp) is not int or self.dp < 1:
            raise ValueError(f"dp must be a positive integer, got {self.dp!r}")
        for k in ("memory_bytes", "input_bytes"):
            if getattr(self, k) is not None:
                _check_time(k, getattr(self, k))
        for k in ("bandwidth", "dp_bandwidth", "host_bandwidth"):
            v = getattr(self, k)
            if v is not None and not (_is_number(v) and v > 0):
                raise ValueError(f"{k} must be a positive number, got {v!r}")
        object.__setattr__(self, "_base", _defaults(base))
        for where, levels in (("stage", self.stage), ("mb", self.mb),
                              ("stage_mb", self.stage_mb)):
            for key, level in levels.items():
                for k, v in level.items():
                    if k not in (*OP_KINDS, *SIZE_KEYS):
                        raise ValueError(f"{where}[{key}]: unknown cost '{k}'")
                    _check_time(f"{where}[{key}].{k}", v)

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], where: str | None = None) -> CostModel:
        """From dotted settings, as `pipeir.load(...).costs` gives them (name -> (value,
        span)) or as a plain name -> value mapping. Errors point at the setting's span, or
        name `where` (e.g. "--set") for settings that have none."""
        items: dict[str, tuple[Any, Span | None]] = {}
        for k, v in settings.items():
            items[k] = v if isinstance(v, tuple) and len(v) == 2 and \
                (v[1] is None or isinstance(v[1], Span)) else (v, None)
        span = items["lengths"][1] if "lengths" in items else None
        items, lengths = split_length_settings(items, where)
        model = _build(items, where=where)
        if lengths is None:
            return model
        try:
            return model.with_lengths(lengths)
        except ValueError as e:  # a derived cost out of range
            raise UsageError(f"{where_prefix(where, span)}{e}", span) from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostModel:
        """From a JSON (`.json`) or TOML (any other name) cost file; see the module docstring."""
        return cls.from_settings(read_cost_file(path))

    # ---- queries --------------------------------------------------------------------------
    def cost(self, op: Op) -> float:
        """How long `op` takes (a reduction: `allreduce_time` of its stage; an OFF or
        RELOAD: on the rank's copy channel)."""
        kind, s, m = op.kind, op.stage, op.mb
        if kind == "R":
            return self.allreduce_time(s)
        v = self._given(kind, s, m)
        if v is not None:
            return v
        base = self._base.get(kind)
        if base is not None:
            return base
        if kind in CHANNEL:
            return self.copy_time(s)
        return self.cost(Op("F", s, m))  # FC and RC run the stage's forward

    def copy_time(self, stage: int) -> float:
        """Time to move one micro-batch's saved activations of `stage` between device and
        host memory (an OFF or a RELOAD)."""
        t = self.host_latency
        if self.host_bandwidth is not None:
            t += (self.activation_memory(stage) or 0.0) / self.host_bandwidth
        return t

    def _given(self, kind: str, s: int, m: int) -> float | None:
        """`kind`'s time as an override level sets it (None: the default applies)."""
        if self.stage_mb:
            v = _pick(self.stage_mb.get((s, m)), kind)
            if v is not None:
                return v
        if self.mb:
            v = _pick(self.mb.get(m), kind)
            if v is not None:
                return v
        if self.stage:
            v = _pick(self.stage.get(s), kind)
            if v is not None:
                return v
        return None

    def boundary_bytes(self, stage: int) -> float:
        """Bytes of the tensor crossing the boundary between `stage` and `stage + 1`."""
        level = self.stage.get(stage)
        if level is not None and "activation_bytes" in level:
            return level["activation_bytes"]
        return self.activation_bytes

    def transfer_time(self, src_stage: int, dst_stage: int, same_rank: bool = False) -> float:
        """Time to move a tensor from `src_stage` to `dst_stage` (neighbours, either way).

        Free when both stages live on the same rank (`same_rank`) or are the same stage.
        """
        if same_rank or src_stage == dst_stage:
            return 0.0
        t = self.latency
        if self.bandwidth is not None:
            t += self.boundary_bytes(min(src_stage, dst_stage)) / self.bandwidth
        return t

    def stage_param_bytes(self, stage: int) -> float:
        """Bytes of stage `stage`'s weight gradients (what its R op all-reduces)."""
        level = self.stage.get(stage)
        if level is not None and "param_bytes" in level:
            return level["param_bytes"]
        return self.param_bytes

    def allreduce_time(self, stage: int) -> float:
        """A ring all-reduce of stage `stage`'s gradients over `dp` replicas: 2(D-1) steps,
        each paying the dp link's latency, moving 2(D-1)/D of the bytes in all. Zero when
        D = 1 (nothing to reduce)."""
        d = self.dp
        if d <= 1:
            return 0.0
        latency = self.latency if self.dp_latency is None else self.dp_latency
        bandwidth = self.bandwidth if self.dp_bandwidth is None else self.dp_bandwidth
        t = 2 * (d - 1) * latency
        if bandwidth is not None:
            t += 2 * (d - 1) / d * self.stage_param_bytes(stage) / bandwidth
        return t

    def activation_memory(self, stage: int) -> float | None:
        """Bytes one micro-batch's activations hold on `stage`, or None when unknown."""
        level = self.stage.get(stage)
        if level is not None and "memory_bytes" in level:
            return level["memory_bytes"]
        return self.memory_bytes

    def input_memory(self, stage: int) -> float:
        """Bytes of `stage`'s input, which a checkpointed forward keeps (see the table)."""
        level = self.stage.get(stage)
        if level is not None and "input_bytes" in level:
            return level["input_bytes"]
        if self.input_bytes is not None:
            return self.input_bytes
        return self.boundary_bytes(stage - 1) if stage > 0 else 0.0

    @property
    def knows_memory(self) -> bool:
        """Whether activation sizes are given, so peak memory can be told in bytes."""
        return self.memory_bytes is not None or any("memory_bytes" in lv
                                                    for lv in self.stage.values())

    def scaled(self, factor: float) -> CostModel:
        """Every op time multiplied by `factor` (chunks of an interleaved model are 1/v)."""
        def lv(d: Mapping[Any, Mapping[str, float]]) -> dict[Any, dict[str, float]]:
            return {k: {n: x * factor if n in OP_KINDS else x for n, x in v.items()}
                    for k, v in d.items()}
        b = {k: x * factor for k, x in self._base.items()}
        return replace(self, F=b["F"], B=b["B"], I=b["I"], W=b["W"], FC=b.get("FC"),
                       RC=b.get("RC"), OFF=b.get("OFF"), RELOAD=b.get("RELOAD"),
                       stage=lv(self.stage), mb=lv(self.mb), stage_mb=lv(self.stage_mb))

    def with_lengths(self, spec: LengthCost) -> CostModel:
        """This model with per-micro-batch costs derived from `spec` (see
        `pipeir.sim.lengths`); costs the model already gives per micro-batch are kept."""
        factors = spec.factors()
        mb = {m: dict(level) for m, level in self.mb.items()}
        stage_mb = {k: dict(level) for k, level in self.stage_mb.items()}
        # the kinds with a time of their own (FC, RC, OFF, RELOAD that are not set follow an
        # F, scaled here, or a copy of bytes, which like transfers is not)
        kinds = [*COMPUTE_KINDS, *(k for k in MEMORY_KINDS if k in self._base)]
        for m, f in enumerate(factors):
            level = mb.setdefault(m, {})
            for k in kinds:
                level.setdefault(k, self.cost(Op(k, -1, -1)) * f)
            given = self.mb.get(m) or {}
            for s, slevel in self.stage.items():
                sl = stage_mb.setdefault((s, m), {})
                for k in OP_KINDS:
                    # NOTE: only what the stage level itself decides (an explicit mb.M.K still
                    # wins, and a B derived from I + W stays derived)
                    if k not in given and _pick(slevel, k) is not None:
                        sl.setdefault(k, self.cost(Op(k, s, -1)) * f)
        derived = [*((mb_, lv) for mb_, lv in mb.items()),
                   *((mb_, lv) for (_, mb_), lv in stage_mb.items())]
        for mb_, lv in derived:
            for name, x in lv.items():
                if not x <= MAX_COST:  # also nan: a length so long its cost overflows
                    cost = f"a cost of {x:g}, over {MAX_COST:g}" if math.isfinite(x) \
                        else "a cost too large to compute"
                    raise ValueError(f"micro-batch {mb_}'s length gives {name} {cost}; are "
                                     "the lengths or length_cost too large?")
        return replace(self, mb=mb, stage_mb={k: v for k, v in stage_mb.items() if v})

    def settings(self) -> dict[str, float | str]:
        """The model as dotted settings (what a cost file holds), defaults included."""
        out: dict[str, float | str] = dict(self._base)
        out["latency"] = self.latency
        if self.bandwidth is not None:
            out["bandwidth"] = self.bandwidth
        out["activation_bytes"] = self.activation_bytes
        if self.param_bytes:
            out["param_bytes"] = self.param_bytes
        if self.dp != 1:
            out["dp"] = self.dp
        if self.dp_latency is not None:
            out["dp_latency"] = self.dp_latency
        if self.dp_bandwidth is not None:
            out["dp_bandwidth"] = self.dp_bandwidth
        for k in ("memory_bytes", "input_bytes", "host_bandwidth"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        if self.host_latency:
            out["host_latency"] = self.host_latency
        for s, level in sorted(self.stage.items()):
            out.update({f"stage.{s}.{k}": v for k, v in level.items()})
        for m, level in sorted(self.mb.items()):
            out.update({f"mb.{m}.{k}": v for k, v in level.items()})
        for (s, m), level in sorted(self.stage_mb.items()):
            out.update({f"stage.{s}.mb.{m}.{k}": v for k, v in level.items()})
        if self.unit:
            out["unit"] = self.unit
        return out


def _defaults(base: _Level) -> _Level:
    """The one rule for backward costs. Of B, I and W, what is not given follows from what
    is: B = I + W; a B given alone splits evenly; a B with one half gives the other half;
    with no B, I and W default to 1 (so B = 2)."""
    out = dict(base)
    if "B" not in out:
        out.setdefault("I", 1.0)
        out.setdefault("W", 1.0)
        out["B"] = out["I"] + out["W"]
    elif "I" in out and "W" not in out:
        out["W"] = max(0.0, out["B"] - out["I"])
    elif "W" in out and "I" not in out:
        out["I"] = max(0.0, out["B"] - out["W"])
    else:
        out.setdefault("I", out["B"] / 2)
        out.setdefault("W", out["B"] / 2)
    return out


def _pick(level: Mapping[str, float] | None, kind: str) -> float | None:
    """`kind`'s cost as one override level decides it, or None to fall through. A level
    decides B only when it gives B, or both halves (then B = I + W, as in `_defaults`)."""
    if level is None:
        return None
    v = level.get(kind)
    if v is None and kind == "B" and "I" in level and "W" in level:
        return level["I"] + level["W"]
    return v


def _is_number(v: object) -> bool:
    return (isinstance(v, int | float) and not isinstance(v, bool)
            and (isinstance(v, int) or math.isfinite(v)))


#: The range of a cost value. NOTE: the simulator adds times over every op and tune scales
#: them, so a finite 1e308 still overflows to inf and then NaN (a timeline's column index,
#: a plot's axis); within these bounds a sum over 10**9 ops and bytes / bandwidth stay finite.
MAX_COST = 1e15
MIN_BANDWIDTH = 1e-15


def _check_time(name: str, v: object) -> None:
    if not _is_number(v) or v < 0:  # type: ignore[operator]
        raise ValueError(f"cost '{name}' must be a non-negative number, got {v!r}")


# ---- settings -> model ---------------------------------------------------------------------
_UNIT = re.compile(r'[^\s"\\\x00-\x1f\x7f]{1,16}')
_INDEXED = re.compile(r"^(stage)\.(\d+)\.(mb)\.(\d+)\.(\w+)$|^(stage|mb)\.(\d+)\.(\w+)$")


def _known_names(name: str) -> list[str]:
    """Names to suggest for a misspelt `name`, with its own indices (stage.3.Q -> stage.3.F)."""
    nums = [*re.findall(r"\d+", name), "0", "0"]
    s, m = nums[0], nums[1]
    return [*TOP_KEYS, *(f"stage.{s}.{k}" for k in (*OP_KINDS, *SIZE_KEYS)),
            *(f"mb.{s}.{k}" for k in OP_KINDS), *(f"stage.{s}.mb.{m}.{k}" for k in OP_KINDS)]


def _build(items: Mapping[str, tuple[Any, Span | None]], where: str | None) -> CostModel:
    stage: dict[int, _Level] = {}
    mb: dict[int, _Level] = {}
    stage_mb: dict[tuple[int, int], _Level] = {}
    unit: str | None = None
    for name, (value, span) in items.items():
        if name in ("meta",) or name.startswith("meta."):
            continue
        if name == "version":
            if value != 1:
                raise UsageError(f"{where_prefix(where, span)}cost file version {value!r} is not "
                                 "supported (this pipeir reads version 1)", span)
            continue
        if name == "unit":
            # NOTE: printed back into `.sched` costs blocks and every report, so a short
            # word: no quotes, backslashes, spaces or control characters
            if not isinstance(value, str) or not _UNIT.fullmatch(value):
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
                                   "bandwidth, activation_bytes, memory_bytes, input_bytes, "
                                   "host_latency, host_bandwidth, param_bytes, dp, dp_latency, "
                                   "dp_bandwidth, and stage.S.K, mb.M.K, stage.S.mb.M.K for K "
                                   "in those op kinds"),))
        v = _number(name, value, span, where,
                    positive=name in ("bandwidth", "dp_bandwidth", "dp", "host_bandwidth"))
        if name == "dp" and v != int(v):
            raise UsageError(f"{where_prefix(where, span)}cost 'dp' (data-parallel replicas) "
                             f"must be a positive integer, got {value}", span)
        level[key] = v
    try:
        return CostModel(
            F=_top(items, "F", 1.0), B=_top(items, "B", None), I=_top(items, "I", None),
            W=_top(items, "W", None), latency=_top(items, "latency", 0.0),
            bandwidth=_top(items, "bandwidth", None),
            activation_bytes=_top(items, "activation_bytes", 0.0),
            memory_bytes=_top(items, "memory_bytes", None),
            param_bytes=_top(items, "param_bytes", 0.0), dp=int(_top(items, "dp", 1)),
            dp_latency=_top(items, "dp_latency", None),
            dp_bandwidth=_top(items, "dp_bandwidth", None),
            input_bytes=_top(items, "input_bytes", None),
            host_latency=_top(items, "host_latency", 0.0),
            host_bandwidth=_top(items, "host_bandwidth", None),
            **{k: _top(items, k, None) for k in MEMORY_KINDS},
            stage=stage, mb=mb, stage_mb=stage_mb, unit=unit)
    except ValueError as e:  # pragma: no cover - every value was checked above
        raise UsageError(f"{where_prefix(where, None)}{e}") from None


def _top(items: Mapping[str, tuple[Any, Span | None]], name: str, default: Any) -> Any:
    got = items.get(name)
    return default if got is None else float(got[0])


def _short(name: str) -> str:
    return name if len(name) <= 40 else name[:37] + "..."


def _classify(name: str, stage: dict[int, _Level], mb: dict[int, _Level],
              stage_mb: dict[tuple[int, int], _Level]
              ) -> tuple[str | None, _Level | None, tuple[str, ...]]:
    """Which level a dotted name writes to, the key within it, and the keys allowed there."""
    if name in (*OP_KINDS, *COMM_KEYS, *SIZE_KEYS):
        return name, {}, (name,)
    m = _INDEXED.match(name)
    if m is None:
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
    if not _is_number(value):
        raise UsageError(f"{where_prefix(where, span)}cost '{name}' must be a number, got "
                         f"{_show(value)}", span)
    if value < 0 or (positive and value == 0):
        need = "positive" if positive else "non-negative"
        raise UsageError(f"{where_prefix(where, span)}cost '{name}' must be {need}, "
                         f"got {_show(value)}", span)
    if value > MAX_COST or (positive and value < MIN_BANDWIDTH):
        bound = f"at most {MAX_COST:g}" if value > MAX_COST else f"at least {MIN_BANDWIDTH:g}"
        raise UsageError(f"{where_prefix(where, span)}cost '{name}' = {_show(value)} is out of "
                         f"range: it must be {bound} (times are summed over every op; choose "
                         "another unit)", span)
    return float(value)


def _show(v: Any) -> str:
    if isinstance(v, str):
        return f"the text {v!r}"
    if isinstance(v, tuple | list):
        return "a list"
    if isinstance(v, dict):
        return "a table"
    if isinstance(v, int) and abs(v) > 10**18:  # repr() of a huge int is slow, then refused
        return f"an integer of about {int(v.bit_length() * 0.30103) + 1} digits"
    return repr(v)


# ---- cost files ----------------------------------------------------------------------------
def read_cost_file(path: str | os.PathLike[str]) -> dict[str, tuple[Any, Span | None]]:
    """A JSON or TOML cost file as dotted settings, each with the span of its key when it can
    be found in the text (so errors point at the line)."""
    p = Path(path)
    src = limits.read_input(p, "cost file (JSON or TOML)")
    data = _parse_json(src) if p.suffix.lower() == ".json" else _parse_toml(src)
    if not isinstance(data, dict):
        raise UsageError("a cost file must be a JSON object or a TOML table, "
                         f"got {_show(data)}", Span(src, 1, 1, 1, 2))
    flat: dict[str, Any] = {}
    twice = _flatten(data, "", flat)
    if twice is not None:
        raise UsageError(f"cost '{twice}' is given twice, once as a dotted key and once in a "
                         "table (the file would keep one without a word)",
                         _find_key(src, twice) or Span(src, 1, 1, 1, 2))
    if flat.get("version", 1) == 1 and \
            all(k in ("version", "meta") or k.startswith("meta.") for k in flat):  # wrong file?
        raise UsageError("the cost file sets no costs; leave --costs out for the defaults "
                         "(F = 1, B = 2, free links)", Span(src, 1, 1, 1, 2))
    return {k: (v, _find_key(src, k)) for k, v in flat.items()}


class _Duplicate(ValueError):
    def __init__(self, key: str):
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys differ: `json` keeps the last of two silently (TOML refuses)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


def _parse_json(src: Source) -> Any:
    try:
        return json.loads(src.text, object_pairs_hook=_unique)
    except _Duplicate as e:
        found = list(re.finditer(re.escape(json.dumps(e.key)) + r"\s*:", src.text))
        at = found[1].start() if len(found) > 1 else 0
        line = src.text.count("\n", 0, at) + 1
        col = at - (src.text.rfind("\n", 0, at) + 1) + 1
        raise UsageError(f"cost '{e.key}' is given twice in one object (JSON would keep the "
                         "last without a word)", Span(src, line, col, line,
                                                      col + len(json.dumps(e.key)))) from None
    except json.JSONDecodeError as e:
        raise UsageError(f"malformed JSON cost file: {e.msg}",
                         Span(src, e.lineno, e.colno, e.lineno, e.colno + 1)) from None
    except ValueError:  # Python refuses to convert integers of over 4300 digits
        raise _too_long(src) from None


def _too_long(src: Source) -> UsageError:
    return UsageError(f"{src.name}: a number has too many digits to read; costs must be at "
                      f"most {MAX_COST:g}")


def _parse_toml(src: Source) -> Any:
    try:
        import tomllib  # Python 3.11+
    except ImportError:  # pragma: no cover - Python 3.10
        raise UsageError(f"{src.name}: TOML cost files need Python 3.11; use JSON "
                         "(a .json file) instead") from None
    try:
        return tomllib.loads(src.text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        m = re.search(r"\(at line (\d+), column (\d+)\)", msg)
        if m is None:
            raise UsageError(f"{src.name}: malformed TOML cost file: {msg}") from None
        line, col = int(m.group(1)), int(m.group(2))
        raise UsageError(f"malformed TOML cost file: {msg[:m.start()].strip()}",
                         Span(src, line, col, line, col + 1)) from None
    except ValueError:  # Python refuses to convert integers of over 4300 digits
        raise _too_long(src) from None


def _flatten(data: Mapping[str, Any], prefix: str, out: dict[str, Any]) -> str | None:
    """Nested tables into dotted names in `out`; the first name given twice (`"stage.1.F"`
    beside `[stage.1] F`), if any."""
    for k, v in data.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and name != "meta":
            twice = _flatten(v, name + ".", out)
            if twice is not None:
                return twice
        elif name in out:
            return name
        else:
            out[name] = v
    return None


def _find_key(src: Source, name: str) -> Span | None:
    """Best effort: where a dotted name's last part is written, found by looking for each part
    after the previous one (`[stage.1]` then `F =`; `"stage": {"1": {"F": ...`); None rather
    than a wrong line when the parts cannot be found in order."""
    parts = name.split(".")
    pos = 0
    for part in parts[:-1]:
        m = re.compile(r'(?<![\w-])"?' + re.escape(part) + r'"?(?![\w-])').search(src.text, pos)
        if m is None:
            return None
        pos = m.end()
    last = re.escape(parts[-1])
    m = re.compile(r'(?<![\w-])("' + last + r'"\s*:|' + last + r'\s*=|"' + last + r'"\s*=)'
                   ).search(src.text, pos)
    if m is None:
        return None
    return src.span(m.start(), m.start() + len(m.group(0).rstrip(":= \t")))
