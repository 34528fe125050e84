"""The schedule library: classic schedules written in the `.sched` language itself.

Each `NAME.sched` file here defines one schedule; `get(NAME, ranks=..., microbatches=...,
**params)` instantiates it. Names match with '-' and '_' interchangeable, and a schedule can be
named by its file (`1f1b`) or by its definition (`one_f_one_b`).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from importlib.resources import files
from typing import Any, Final

from pipeir.config import PIPELINE_KEYS
from pipeir.diagnostics import Note, Source, UsageError, did_you_mean
from pipeir.frontend import ast
from pipeir.frontend.elaborate import Definition, Elaborated, Library, Value, elaborate
from pipeir.frontend.parser import parse_source
from pipeir.schedule import Schedule


def _norm(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"a library schedule is named by a string, e.g. '1f1b', got {name!r}")
    return name.replace("-", "_").lower()


@cache
def _files() -> dict[str, str]:
    """Canonical name -> file name, for every library schedule."""
    out = {}
    for entry in files(__name__).iterdir():
        if entry.name.endswith(".sched"):
            out[entry.name[: -len(".sched")]] = entry.name
    return dict(sorted(out.items()))


def names() -> tuple[str, ...]:
    """The canonical names of the library schedules."""
    return tuple(_files())


@cache
def _load(canonical: str) -> Definition:
    fname = _files()[canonical]
    text = files(__name__).joinpath(fname).read_text(encoding="utf-8")
    module = parse_source(Source(f"<library>/{fname}", text))
    defs = [i for i in module.items if isinstance(i, ast.ScheduleDef)]
    assert len(defs) == 1, f"library file {fname} must define exactly one schedule"
    return Definition(canonical, module, defs[0])


def find(name: str) -> Definition | None:
    """Library schedule `name` (by file or definition name), or None.

    NOTE: the one lookup. The frontend (for `schedule = NAME` in a file), the CLI's
    `--schedule` and `get` all come through here, so they agree on what a name means.
    """
    key = _norm(name)
    for canonical in _files():
        if _norm(canonical) == key or _norm(_load(canonical).schedule.name) == key:
            return _load(canonical)
    return None


def require(name: str) -> Definition:
    """Library schedule `name`; an error with a "did you mean" when there is none."""
    found = find(name)
    if found is None:
        raise unknown_schedule(name)
    return found


#: The library as the frontend sees it, for `elaborate(..., library=LIBRARY)`.
LIBRARY: Final = Library(find, names)


def canonical_name(name: str) -> str | None:
    """The library's name for `name` (by file or definition name), or None."""
    found = find(name)
    return None if found is None else found.name


def params(name: str) -> tuple[str, ...]:
    """The parameters a library schedule takes (besides ranks and microbatches)."""
    return require(name).params


def instantiate(definition: Definition, overrides: Mapping[str, Value],
                arguments: Mapping[str, Value]) -> Elaborated:
    """A library schedule with pipeline settings (`overrides`, as `--set` gives them) and
    arguments for its parameters."""
    return elaborate(definition.module, library=LIBRARY, overrides=overrides,
                     use=(definition.schedule.name, arguments))


def get(name: str, ranks: int, microbatches: int, **kwargs: Any) -> Schedule:
    """Instantiate library schedule `name`, e.g. `get("interleaved-1f1b", 4, 8, v=2)`.

    Keyword arguments are the schedule's parameters or pipeline settings (stages, placement,
    memory_limit, accumulate).
    """
    found = require(name)
    settable = [k for k in PIPELINE_KEYS if k not in ("ranks", "microbatches")]
    for k in kwargs:  # (named as a keyword here, not as `--set k`, which elaboration says)
        if k not in found.params and k not in settable:
            raise UsageError(f"library.get({name!r}, ...): {k}= is neither a parameter of "
                             f"{name} ({', '.join(found.params) or 'it has none'}) nor a "
                             f"pipeline setting ({', '.join(settable)})", None,
                             did_you_mean(k, [*found.params, *settable]))
    sched_kw: dict[str, Value] = {k: v for k, v in kwargs.items() if k in found.params}
    overrides: dict[str, Value] = {k: v for k, v in kwargs.items() if k not in found.params}
    overrides.update(ranks=ranks, microbatches=microbatches)
    return instantiate(found, overrides, sched_kw).schedule


#: torch.distributed.pipelining's schedule classes and the library schedule each one runs, so a
#: torch user's `ZBVZeroBubble` (or `ScheduleZBVZeroBubble`) gets "did you mean 'zb-v'?".
#: ScheduleInterleavedZeroBubble has no library twin (its order is torch's own).
TORCH_CLASSES: Final = {
    "Schedule1F1B": "1f1b",
    "ScheduleDualPipeV": "dualpipe-v",
    "ScheduleGPipe": "gpipe",
    "ScheduleInterleaved1F1B": "interleaved-1f1b",
    "ScheduleLoopedBFS": "looped-bfs",
    "ScheduleZBVZeroBubble": "zb-v",
}


def suggest(name: str) -> tuple[Note, ...]:
    """A "did you mean" for a name the library does not have: the library's twin of a torch
    schedule class (with or without its `Schedule` prefix), else the closest library name."""
    def key(n: str) -> str:
        return _norm(n).removeprefix("schedule").replace("_", "")

    for cls, ours in TORCH_CLASSES.items():
        if key(cls) == key(name):
            return (Note(f"did you mean '{ours}'? (torch's {cls})"),)
    return did_you_mean(name, names())


def unknown_schedule(name: str) -> UsageError:
    """The error for a name the library does not have, with a "did you mean"."""
    return UsageError(f"unknown library schedule '{name}'; the library has "
                      f"{', '.join(names())}", None, suggest(name))
