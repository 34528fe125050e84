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
``memory_w_bytes``              of ``memory_bytes``, what the weight gradient W still needs
                                after the input gradient I: I frees the rest, W this
                                (the Zero Bubble paper's M_W; default: all of
                                ``memory_bytes``, held until W; a whole B frees everything)
``stage.S.memory_w_bytes``      the same for stage S (`pipeirc profile` measures both)
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
mean ``stage.2.F = 1.5``. Two keys are metadata and ignored by the model: ``version`` (1 or
2: version 2 files may give ``memory_w_bytes``, and a pipeir that reads only version 1 says
so instead of "unknown cost"; a version 1 file holds every activation until W) and ``meta``
(a free-form table: device, model, date, how it was measured).

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

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Final

from pipeir.diagnostics import Span, UsageError, where_prefix
from pipeir.limits import plain_number
from pipeir.memmodel import WHOLE, StageMemory
from pipeir.ops import CHANNEL, MEMORY_KINDS, Op
from pipeir.sim.cost_files import read_cost_file
from pipeir.sim.cost_settings import (
    COMPUTE_KINDS,
    MAX_COST,
    MIN_BANDWIDTH,
    OP_KINDS,
    SIZE_KEYS,
    UNIT_NAME,
    Level,
    cost_fields,
    is_number,
    split_problem,
)
from pipeir.sim.lengths import LengthCost, split_length_settings


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
    memory_w_bytes: float | None = None  # None: all of memory_bytes (held until W)
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
    # (copied when made, so a caller's later edit of its dicts cannot bypass the checks;
    # left out of the hash, which the scalars give, as dicts have none)
    stage: Mapping[int, Mapping[str, float]] = field(default_factory=dict, hash=False)
    mb: Mapping[int, Mapping[str, float]] = field(default_factory=dict, hash=False)
    stage_mb: Mapping[tuple[int, int], Mapping[str, float]] = field(default_factory=dict,
                                                                    hash=False)
    unit: str | None = None
    _base: dict[str, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for f in fields(self):  # numpy's numbers as plain ones (printed, hashed and summed)
            if f.init:
                object.__setattr__(self, f.name, plain_number(getattr(self, f.name)))
        if self.unit is not None and not (isinstance(self.unit, str) and
                                          UNIT_NAME.fullmatch(self.unit)):
            raise ValueError(f"unit must be a name like \"ms\" (at most 16 characters, no "
                             f"quotes, spaces or backslashes), got {self.unit!r}")
        base: Level = {"F": self.F}
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
        for k in ("memory_bytes", "memory_w_bytes", "input_bytes"):
            if getattr(self, k) is not None:
                _check_time(k, getattr(self, k))
        for k in ("bandwidth", "dp_bandwidth", "host_bandwidth"):
            v = getattr(self, k)
            if v is not None and not (is_number(v) and MIN_BANDWIDTH <= v <= MAX_COST):
                raise ValueError(f"{k} must be a positive number from {MIN_BANDWIDTH:g} to "
                                 f"{MAX_COST:g}, got {v!r}")
        object.__setattr__(self, "_base", _defaults(base))
        for where, levels in (("stage", self.stage), ("mb", self.mb),
                              ("stage_mb", self.stage_mb)):
            if not isinstance(levels, Mapping):
                raise ValueError(f"{where} must map each {_KEYS[where]} to {{kind: time}}, "
                                 f"got {levels!r}")
            copied: dict[Any, dict[str, float]] = {}
            for key, level in levels.items():
                # (a key of another type never matches an op: silently no override)
                pair = where == "stage_mb"
                ok = (type(key) is tuple and len(key) == 2 and all(_index(x) for x in key)
                      if pair else _index(key))
                if not ok or not isinstance(level, Mapping):
                    raise ValueError(f"{where}[{key!r}]: {where} maps each {_KEYS[where]} "
                                     f"to {{kind: time}}, e.g. {_EXAMPLE[where]}")
                level = {k: plain_number(v) for k, v in level.items()}
                for k, v in level.items():
                    if k in SIZE_KEYS and where != "stage":
                        raise ValueError(f"{where}[{key}]: '{k}' is a size per stage, the same "
                                         f"for every micro-batch: give it in stage={{S: "
                                         f"{{'{k}': ...}}}}")
                    if k not in (*OP_KINDS, *SIZE_KEYS):
                        raise ValueError(f"{where}[{key}]: unknown cost '{k}'")
                    _check_time(f"{where}[{key}].{k}", v)
                copied[key] = level
            object.__setattr__(self, where, copied)
        for stage in (None, *self.stage):
            problem = self._split_problem(stage)
            if problem is not None:
                raise ValueError(problem)

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], where: str | None = None) -> CostModel:
        """From dotted settings, as `pipeir.load(...).costs` gives them (name -> (value,
        span)) or as a plain name -> value mapping. Errors point at the setting's span, or
        name `where` (e.g. "--set") for settings that have none."""
        if not isinstance(settings, Mapping):
            raise TypeError(f"CostModel.from_settings: expected a mapping of settings, e.g. "
                            f"{{'F': 1.0, 'stage.0.B': 3.0}}, got {type(settings).__name__}")
        items: dict[str, tuple[Any, Span | None]] = {}
        for k, v in settings.items():
            items[k] = v if isinstance(v, tuple) and len(v) == 2 and \
                (v[1] is None or isinstance(v[1], Span)) else (v, None)
        span = items["lengths"][1] if "lengths" in items else None
        items, lengths = split_length_settings(items, where)
        try:
            model = cls(**cost_fields(items, where=where))
        except ValueError as e:  # pragma: no cover - every value was checked already
            raise UsageError(f"{where_prefix(where, None)}{e}") from None
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
        try:  # (no test on the way: every op of a simulation passes here)
            kind, s, m = op.kind, op.stage, op.mb
        except AttributeError:
            raise TypeError(f"CostModel.cost: expected an op (e.g. pipeir.F(0, 0)), got "
                            f"{type(op).__name__} {op!r}") from None
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

    def weight_memory(self, stage: int) -> float | None:
        """Of `activation_memory(stage)`, the bytes W still needs after I (None: not given,
        so all of them)."""
        level = self.stage.get(stage)
        if level is not None and "memory_w_bytes" in level:
            return level["memory_w_bytes"]
        return self.memory_w_bytes

    def stage_memory(self, stage: int) -> StageMemory:
        """`stage`'s memory per micro-batch in bytes (`pipeir.memmodel`): what F saves, what
        W keeps after I, what a checkpointed forward keeps."""
        saved = self.activation_memory(stage) or 0.0
        w = self.weight_memory(stage)
        return StageMemory(saved, saved if w is None else min(w, saved),
                           self.input_memory(stage))

    def counted_memory(self, stage: int) -> StageMemory:
        """`stage`'s memory counted (`pipeir.memunit`): one activation per forward, of which
        W keeps the fraction `memory_w_bytes / memory_bytes` after I (all when not given)."""
        saved = self.activation_memory(stage)
        w = self.weight_memory(stage)
        if w is None or not saved:
            return WHOLE
        return StageMemory(1.0, min(1.0, w / saved))

    def op_memory(self) -> Callable[[Op], StageMemory]:
        """Each op's stage memory as this model tells it: in bytes (`stage_memory`) when it
        gives `memory_bytes`, else counted (`counted_memory`); asked once per stage."""
        measure = self.stage_memory if self.knows_memory else self.counted_memory
        table: dict[int, StageMemory] = {}

        def memory(op: Op) -> StageMemory:
            got = table.get(op.stage)
            if got is None:
                got = table[op.stage] = measure(op.stage)
            return got
        return memory

    @property
    def splits_memory(self) -> bool:
        """Whether an I frees part of an activation (`memory_w_bytes` is given)."""
        return self.memory_w_bytes is not None or any("memory_w_bytes" in lv
                                                      for lv in self.stage.values())

    def _split_problem(self, stage: int | None) -> str | None:
        """Why `memory_w_bytes` of `stage` (None: the top level) cannot be, or None."""
        if stage is None:
            w, saved, name = self.memory_w_bytes, self.memory_bytes, ""
        else:
            if "memory_w_bytes" not in self.stage[stage] and "memory_bytes" not in \
                    self.stage[stage]:
                return None
            w, saved, name = self.weight_memory(stage), self.activation_memory(stage), \
                f"stage.{stage}."
        return split_problem(name, w, saved)

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
        for k in ("memory_bytes", "memory_w_bytes", "input_bytes", "host_bandwidth"):
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


def expect_costs(value: object, where: str) -> CostModel | None:
    """`value` if it is a cost model or None; else a TypeError that says how to make one
    (checked where the API takes costs, as `schedule.expect_schedule` checks schedules)."""
    if value is None or isinstance(value, CostModel):
        return value
    hint = ""
    if isinstance(value, Mapping):
        hint = ": make one of settings with CostModel.from_settings({...})"
    elif isinstance(value, str | os.PathLike):
        hint = ": read a costs file with CostModel.load(path)"
    raise TypeError(f"{where}: expected a CostModel, got {type(value).__name__}{hint}")


def _defaults(base: Level) -> Level:
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


def _check_time(name: str, v: object) -> None:
    if not is_number(v) or v < 0:  # type: ignore[operator]
        raise ValueError(f"cost '{name}' must be a non-negative number, got {v!r}")
    if v > MAX_COST:  # type: ignore[operator]
        raise ValueError(f"cost '{name}' = {v:g} is out of range: it must be at most "
                         f"{MAX_COST:g} (times are summed over every op; choose another unit)")


def _index(x: object) -> bool:
    """A stage or micro-batch number."""
    return type(x) is int and x >= 0


_KEYS: Final = {"stage": "stage", "mb": "micro-batch", "stage_mb": "(stage, micro-batch)"}
_EXAMPLE: Final = {"stage": "{0: {'F': 2.0}}", "mb": "{3: {'F': 2.0}}",
                   "stage_mb": "{(0, 3): {'F': 2.0}}"}
