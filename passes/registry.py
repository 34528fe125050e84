"""Where passes come from: built-ins, installed plugins, and `--pass-plugin` files.

Names map to lazy "module:Class" loaders so listing or parsing a pipeline never imports a pass
it does not use (and a plugin that fails to import only breaks pipelines that name it).
Third-party packages register passes under the entry-point group `pipeir.passes`:

    [project.entry-points."pipeir.passes"]
    delay-w = "my_package.module:DelayW"
"""

from __future__ import annotations

import dataclasses
from importlib.metadata import entry_points
from pathlib import Path
from typing import Final

from pipeir._importing import import_file
from pipeir.diagnostics import Note, UsageError, did_you_mean
from pipeir.passes.base import PassBase
from pipeir.usercode import import_module

#: The entry-point group third-party packages register passes under.
ENTRY_POINT_GROUP: Final = "pipeir.passes"

#: Built-in passes: name -> "module:Class". "overlap" is a LoweredPass (backend level).
BUILTINS: Final[dict[str, str]] = {
    "interleave": "pipeir.passes.interleave:Interleave",
    "split-backward": "pipeir.passes.split_backward:SplitBackward",
    "merge-backward": "pipeir.passes.merge_backward:MergeBackward",
    "verify": "pipeir.passes.verify:Verify",
    "overlap": "pipeir.passes.overlap:Overlap",
    "reorder": "pipeir.passes.reorder:Reorder",
    "dp-reduce": "pipeir.passes.dp_reduce:DpReduce",
    "recompute": "pipeir.passes.memory:Recompute",
    "offload": "pipeir.passes.memory:Offload",
    "synth": "pipeir.search.synth_pass:Synth",
}


def plugin_targets() -> dict[str, str]:
    """Installed third-party passes: name -> "module:Class" (built-in names win; see
    `shadowed_plugins` for the ones that lose)."""
    out: dict[str, str] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in BUILTINS:
            out.setdefault(ep.name, ep.value)
    return dict(sorted(out.items()))


def shadowed_plugins() -> dict[str, str]:
    """Installed passes registered under a built-in name: name -> "module:Class". They are
    never used (a package must not silently change what `interleave` means), and the CLI
    warns about them, so their authors and users learn why."""
    return dict(sorted((ep.name, ep.value) for ep in entry_points(group=ENTRY_POINT_GROUP)
                       if ep.name in BUILTINS))


def shadow_warning(name: str, target: str) -> str:
    """The one message for an installed pass that a built-in shadows."""
    return (f"installed pass '{name}' ({target}) has the name of a built-in pass and is "
            "ignored; register it under another name")


def targets() -> dict[str, str]:
    """Every known pass name (built-in, then installed plugins) -> its "module:Class"."""
    return {**BUILTINS, **plugin_targets()}


def names() -> tuple[str, ...]:
    """Every registered pass name, importable or not (see `available` for the working ones)."""
    return tuple(targets())


def get(name: str) -> type[PassBase]:
    """The pass class registered as `name`; a UsageError for unknown or broken passes."""
    target = targets().get(name)
    if target is None:
        raise UsageError(f"unknown pass '{name}'", None,
                         (*did_you_mean(name, names()),
                          Note(f"passes: {', '.join(available())}")))
    return load_target(target, name)


def available() -> tuple[str, ...]:
    """The registered names whose class imports, e.g. for listings (a pass whose module is
    missing, such as a backend pass not installed, is left out instead of crashing)."""
    out = []
    for name, target in targets().items():
        try:
            load_target(target, name)
        except UsageError:
            continue
        out.append(name)
    return tuple(out)


def load_target(target: str, name: str | None = None) -> type[PassBase]:
    """Import "module:Class" (a dotted module) and check it is a pass called `name`."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"pass target '{target}' is not of the form module:Class")
    module = import_module(module_name, f"pass '{name or target}'")
    return _check_class(module, attr, target, name)


def load_plugin(spec: str) -> type[PassBase]:
    """Load a pass for `--pass-plugin`: "package.module:Class" or "path/to/file.py:Class".

    A file is imported under a private module name (so two plugin files with the same stem do
    not collide) and registered in sys.modules, which dataclasses and type hints need.
    """
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise UsageError(f"--pass-plugin '{spec}': expected module:Class or file.py:Class")
    if not where.endswith(".py"):
        cls = load_target(spec)
    else:
        module = import_file(Path(where), "pipeir_plugin", f"--pass-plugin '{spec}'")
        cls = _check_class(module, attr, spec, None)
    if cls.name in BUILTINS and BUILTINS[cls.name] != spec:
        raise UsageError(f"--pass-plugin '{spec}': the pass calls itself '{cls.name}', the "
                         "name of a built-in pass; give its `name` another value",
                         notes=[Note(f"the built-in '{cls.name}' is {BUILTINS[cls.name]}")])
    return cls


def _check_class(module: object, attr: str, target: str, name: str | None) -> type[PassBase]:
    cls = getattr(module, attr, None)
    if cls is None:
        raise UsageError(f"pass target '{target}': the module has no attribute '{attr}'")
    if not (isinstance(cls, type) and issubclass(cls, PassBase) and dataclasses.is_dataclass(cls)):
        raise UsageError(f"pass target '{target}' is not a Pass (or LoweredPass) subclass "
                         "declared with @dataclass(frozen=True)")
    cls_name = getattr(cls, "name", None)
    if not isinstance(cls_name, str) or not cls_name:
        raise UsageError(f"pass target '{target}' has no `name` class variable")
    if name is not None and cls_name != name:
        raise UsageError(f"pass target '{target}' is registered as '{name}' but calls itself "
                         f"'{cls_name}'; the entry-point name and the class's `name` must agree")
    return cls
