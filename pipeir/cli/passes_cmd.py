"""pipeirc passes: list the passes a pipeline string can name, with options and summaries."""

from __future__ import annotations

import argparse
import dataclasses
import sys

ORDER = 80
NAME = "passes"
HELP = "list the available passes with their options"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pass-plugin", action="append", default=[], metavar="MODULE:CLASS",
                   help="also list a pass from a module or a .py file")


def run(args: argparse.Namespace) -> int:
    from pipeir.diagnostics import UsageError
    from pipeir.passes import registry
    from pipeir.passes.base import LoweredPass, PassBase, format_value
    from pipeir.passes.pipeline import options_of

    classes: list[tuple[type[PassBase], str]] = []
    for name, target in registry.targets().items():
        try:
            classes.append((registry.load_target(target, name), ""))
        except UsageError as e:
            if name not in registry.BUILTINS:  # a broken plugin says so; a built-in whose
                print(f"warning: {e.message}", file=sys.stderr)  # module is absent is skipped
            continue
    for name, target in registry.shadowed_plugins().items():
        print(f"warning: {registry.shadow_warning(name, target)}", file=sys.stderr)
    for spec in args.pass_plugin:
        classes.append((registry.load_plugin(spec), f" (from {spec})"))
    for cls, origin in classes:
        opts = []
        for o in options_of(cls):
            default = "" if o.default is dataclasses.MISSING else f" = {format_value(o.default)}"
            opts.append(f"{o.name}: {o.type_text}{default}")
        level = "  [lowered]" if issubclass(cls, LoweredPass) else ""
        print(f"{cls.name}" + ("{" + ", ".join(opts) + "}" if opts else "") + level + origin)
        print(f"    {cls.summary}")
    return 0
