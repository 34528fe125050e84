"""pipeirc export-weights: a `run --save` checkpoint as one unsplit state_dict."""

from __future__ import annotations

import argparse

from pipeir.diagnostics import EXIT_OK

ORDER = 135
NAME = "export-weights"
HELP = ("write a `run --save` checkpoint as one state_dict with the model's own parameter "
        "names (.pt or .safetensors), which loads into the unsplit module")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="DIR", help="the --save directory (its newest "
                   "checkpoint) or one step-N directory")
    p.add_argument("--model", required=True, metavar="REF",
                   help="the model the checkpoint trained (as run --model)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.pt|OUT.safetensors")


def run(args: argparse.Namespace) -> int:
    from pipeir.models.spec import load
    from pipeir.runtime.export import export

    n = export(args.checkpoint, load(args.model), args.output)
    print(f"wrote {n} tensors to {args.output}")
    return EXIT_OK
