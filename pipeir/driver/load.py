"""Naming and loading a schedule with its costs: FILE or a library schedule, overrides that
are pipeline settings or costs, a cost file that replaces the costs block; what is suspicious
comes back as warnings."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipeir import library, limits
from pipeir.config import PipelineConfig
from pipeir.diagnostics import Diagnostic, Note, Source, Span, UsageError, did_you_mean
from pipeir.frontend.elaborate import Elaborated, Value, elaborate
from pipeir.frontend.parser import parse_source
from pipeir.passes.context import UNIT_COSTS
from pipeir.schedule import Schedule
from pipeir.sim import CostModel
from pipeir.sim.cost_files import read_cost_file
from pipeir.sim.cost_settings import TOP_KEYS
from pipeir.sim.lengths import check_count, split_length_settings

#: Cost settings as read from a costs block, a cost file or `--set`: value and where it was.
Settings = dict[str, tuple[Any, Span | None]]

COST_NAMES = ", ".join((*TOP_KEYS, "stage.S.K", "mb.M.K", "stage.S.mb.M.K"))


@dataclass(frozen=True)
class ScheduleRef:
    """What names the schedules to load: `.sched` files, or a library schedule with its
    sizes (`library`, `ranks`, `microbatches` and optionally `v`), never both."""

    files: tuple[str | Source, ...] = ()  # a Source: text with its name (a plan's schedule)
    library: str | None = None
    ranks: int | None = None
    microbatches: int | None = None
    v: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.files, str | os.PathLike):
            raise TypeError(f"ScheduleRef(files=...): expected a tuple of files, got "
                            f"{type(self.files).__name__}: ScheduleRef(files=({self.files!r},))")
        object.__setattr__(self, "files", tuple(self.files))


@dataclass(frozen=True)
class Loaded:
    """A schedule and the cost model it is planned under. `elaborated.costs` holds the
    settings used (the costs block, or the cost file, with `--set` costs on top), so a
    command that prints the schedule writes the costs it used."""

    elaborated: Elaborated
    costs: CostModel
    warnings: tuple[Diagnostic, ...] = ()

    @property
    def schedule(self) -> Schedule:
        return self.elaborated.schedule


def read_source(path: str | os.PathLike[str]) -> Source:
    """Read a `.sched` file; unreadable or non-UTF-8 files are usage errors, not tracebacks."""
    return limits.read_input(path, ".sched file")


def source_of(src: str | os.PathLike[str] | Source) -> Source:
    """A path (a PathLike, or a one-line string naming a `.sched` or existing file), text,
    or a `Source` already (text with the name its diagnostics give)."""
    if isinstance(src, Source):
        return src
    if isinstance(src, os.PathLike):
        return read_source(src)
    if not isinstance(src, str):
        raise TypeError(f"expected a .sched file's path or its text, got {type(src).__name__}")
    if "{" not in src and src.isprintable():  # (every schedule's text has a block)
        if src.strip() in library.names() and not os.path.exists(src):
            raise UsageError(f"'{src.strip()}' is a library schedule, not a file or text: "
                             f"pipeir.library.get({src.strip()!r}, ranks, microbatches)")
        if src.endswith(".sched") or os.path.exists(src) or "/" in src or os.sep in src or \
                re.fullmatch(r"\S+\.\w{1,8}", src):  # a path, mistyped or not
            return read_source(src)
    return Source("<string>", src)


def load_source(src: str | os.PathLike[str] | Source, *,
                overrides: Mapping[str, Value] | None = None,
                use: tuple[str, Mapping[str, Value]] | None = None) -> Elaborated:
    """Parse and elaborate a `.sched` file (a path) or text; keeps the file's cost settings."""
    return elaborate(parse_source(source_of(src)), library=library.LIBRARY,
                     overrides=overrides, use=use)


def is_cost_setting(name: str) -> bool:
    """Whether an override name is a cost (F, stage.2.F, latency, ...), not a pipeline
    setting or schedule parameter."""
    return name in TOP_KEYS or name.startswith(("stage.", "mb."))


def split_costs(overrides: Mapping[str, Value]) -> tuple[dict[str, Value], Settings]:
    """Overrides as (pipeline settings and parameters, cost settings)."""
    meta = next((k for k in overrides if k in ("version", "meta") or k.startswith("meta.")), None)
    if meta is not None:  # (a cost file's own fields: as --set they changed nothing)
        raise UsageError(f"--set {meta}: '{meta}' describes a cost file, it is not a cost; "
                         f"--set takes costs and pipeline settings")
    settings = {k: v for k, v in overrides.items() if not is_cost_setting(k)}
    costs: Settings = {k: (v, None) for k, v in overrides.items() if is_cost_setting(k)}
    return settings, costs


def load_schedules(ref: ScheduleRef, overrides: Mapping[str, Value] | None = None
                   ) -> list[Elaborated]:
    """Every schedule `ref` names, elaborated (files in order). A cost among `overrides`
    is refused: the caller has no use for costs (`load_with_costs` takes them)."""
    if not isinstance(ref, ScheduleRef):
        hint = (f": ScheduleRef(files=({ref!r},)) names a file" if isinstance(ref, str)
                else "")
        raise TypeError(f"load_schedules: expected a ScheduleRef, got "
                        f"{type(ref).__name__}{hint}")
    overrides = dict(overrides or {})
    try:
        return _load_schedules(ref, overrides)
    except UsageError as e:
        for k, v in overrides.items():
            if is_cost_setting(k) and e.message.startswith(f"--set {k}: unknown setting"):
                raise UsageError(f"--set {k}={override_text(v)}: '{k}' is a cost, and this "
                                 "command uses none (simulate, plot, check, print, opt, "
                                 "compile and run take costs)") from None
        raise


def _load_schedules(ref: ScheduleRef, overrides: dict[str, Value]) -> list[Elaborated]:
    if ref.library is not None:
        if ref.files:
            raise UsageError("give either FILE or --schedule, not both")
        if ref.ranks is None or ref.microbatches is None:
            raise UsageError("--schedule needs --ranks P and --microbatches M")
        found = library.require(ref.library)
        kw: dict[str, Value] = {}
        if ref.v is not None:
            if "v" not in found.params:
                raise UsageError(f"--v: library schedule '{found.name}' has no chunks parameter v")
            kw["v"] = ref.v
        for flag in ("ranks", "microbatches", "v"):
            if flag in overrides and getattr(ref, flag) is not None:
                raise UsageError(f"--set {flag}=... and --{flag} disagree about who decides; "
                                 "give one of them")
        overrides.update(ranks=ref.ranks, microbatches=ref.microbatches)
        return [library.instantiate(found, overrides, kw)]
    if not ref.files:
        raise UsageError("no schedule given: pass a .sched FILE, or --schedule NAME "
                         "--ranks P --microbatches M")
    for flag in ("ranks", "microbatches", "v"):
        if getattr(ref, flag) is not None:
            raise UsageError(f"--{flag} goes with --schedule; with a FILE, use --set {flag}=N")
    for f in ref.files:
        if isinstance(f, Source):
            continue
        if str(f).lower().endswith(".csv"):
            raise UsageError(f"{f}: this is a torch schedule CSV: use `pipeirc import-torch "
                             f"{f} -o FILE.sched` first (check and export-torch read it too)")
        _library_name(str(f))
    return [load_source(f if isinstance(f, Source) else Path(f), overrides=overrides)
            for f in ref.files]


def _library_name(f: str) -> None:
    """FILE that is no file but names a library schedule (`pipeirc run 1f1b`): the error
    shows the flags that name it, which a first-time user cannot guess from "no such file"."""
    found = library.find(f) if not Path(f).exists() else None
    if found is not None:
        v = " --v V" if "v" in found.params else ""
        raise UsageError(f"{f}: no such .sched file", notes=(Note(
            f"'{found.name}' is a library schedule: use --schedule {found.name} --ranks P "
            f"--microbatches M{v}"),))


def load_with_costs(ref: ScheduleRef, overrides: Mapping[str, Value] | None = None,
                    costs_file: str | None = None) -> Loaded:
    """The schedule `ref` names and its cost model: its costs block, or `costs_file`
    instead, with the costs among `overrides` on top. The schedule's `costs` become those
    settings (less the cost file's free-form `meta` table, which a costs block cannot
    hold)."""
    rest, cost_sets = split_costs(overrides or {})
    try:
        elab = load_schedules(ref, rest)[0]
    except UsageError as e:
        raise with_cost_names(e, rest) from None
    settings: Settings = read_cost_file(costs_file) if costs_file else dict(elab.costs)
    CostModel.from_settings(cost_sets, where="--set")  # so --set errors name --set
    merged = {**settings, **cost_sets}
    costs = CostModel.from_settings(merged)
    warnings: list[Diagnostic] = []
    if costs_file and elab.costs:
        warnings.append(_replaced(costs_file, elab, costs))
    _, spec = split_length_settings(merged)
    if spec is not None:
        check_count(spec, elab.schedule.config.microbatches, merged["lengths"][1],
                    "--set" if "lengths" in cost_sets else costs_file)
    warnings += unused_costs(elab.schedule.config, merged)
    written = {k: v for k, v in merged.items() if k != "meta" and not k.startswith("meta.")}
    return Loaded(replace(elab, costs=written), costs, tuple(warnings))


def costs_for(target: Schedule | Elaborated, costs: CostModel | None) -> CostModel:
    """The costs a schedule is planned under when the caller gives a schedule: `costs`, else
    the costs block of a loaded file (as `pipeirc compile FILE` reads it), else the unit
    costs (the very `UNIT_COSTS` object, so that cost-driven passes warn that they have
    none)."""
    if costs is not None:
        return costs
    if isinstance(target, Elaborated) and target.costs:
        return CostModel.from_settings(target.costs)
    return UNIT_COSTS


def override_text(value: Value) -> str:
    """An override's value as `--set` spells it (`1.5`, `vshape`, `[1, 2]`, `true`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(override_text(x) for x in value) + "]"
    return str(value)


def with_cost_names(e: UsageError, names: Iterable[str]) -> UsageError:
    """An unknown --set name may be a misspelt cost: say that costs are settable too."""
    d = e.diagnostics[0]
    for name in names:
        if d.message.startswith(f"--set {name}: unknown setting"):
            candidates = [*TOP_KEYS, *(f"stage.0.{k}" for k in "FBIW")]
            notes = d.notes or did_you_mean(name, candidates)
            return UsageError(f"{d.message}; or a cost: {COST_NAMES}", d.span, notes)
    return e


def infer_ranks(costs: CostModel) -> int | None:
    """The number of stages a cost file describes, when it has per-stage costs."""
    keys = [*costs.stage, *(s for s, _ in costs.stage_mb)]
    return max(keys) + 1 if keys else None


def _replaced(path: str, elab: Elaborated, costs: CostModel) -> Diagnostic:
    """A cost file replaces a schedule file's own costs block: say so, and say why it is
    likely wrong when the cost file describes fewer stages than the schedule has (what
    `pipeirc tune -o` writes is costs per chunk, rescaled from the cost file, for that
    schedule alone)."""
    stages = elab.schedule.config.stages
    described = infer_ranks(costs)
    why = ""
    if described is not None and described < stages:
        why = (f"; {path} describes {described} stages but the schedule has {stages}: if "
               "`pipeirc tune` wrote this file, its costs block holds the per-chunk costs it "
               "ranked by, so simulate it without --costs")
    n = len(elab.costs)
    return Diagnostic(f"--costs {path} replaces the schedule file's own costs block "
                      f"({n} setting{'s' if n != 1 else ''}){why}", severity="warning")


def unused_costs(config: PipelineConfig, costs: Settings | CostModel) -> list[Diagnostic]:
    """A cost for a stage or micro-batch the pipeline does not have changes nothing: usually a
    typo, sometimes a sweep (`--set microbatches=4` on a file with per-micro-batch costs).
    The command line and the front door (`pipeir.compile`, `pipeir.simulate`) warn of it."""
    settings: Settings = costs if not isinstance(costs, CostModel) else {
        k: (v, None) for k, v in costs.settings().items()}
    stages, microbatches = config.stages, config.microbatches
    out = []
    for name, (_, span) in settings.items():
        parts = name.split(".")
        for key, count in (("stage", stages), ("mb", microbatches)):
            if key in parts[:-1]:
                i = parts.index(key)
                idx = parts[i + 1] if i + 1 < len(parts) else ""
                if idx.isdigit() and (len(idx) > 18 or int(idx) >= count):
                    out.append(Diagnostic(
                        f"cost '{name}' names {key} {idx}, but the pipeline has {count} "
                        f"({key} 0 to {count - 1}); it is ignored", span, severity="warning"))
    return out
