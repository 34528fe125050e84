"""Interop with torch.distributed.pipelining, in one place: its schedule CSVs and action lists
read into pipeir (`reader`, grammar in `actions`), pipeir schedules written as CSVs torch
loads (`writer`), and the proof that torch's `_PipelineScheduleRuntime` runs a CSV correctly
(`check`, through `lowering`, which writes torch's execution of a row as pipeir lowered
instructions so that `pipeir.backend.commcheck`'s one rule set judges both).

Nothing here imports torch.
"""

from pipeir.interop.actions import FORMATS, Action, parse_action
from pipeir.interop.check import check_csv, prove_comms
from pipeir.interop.reader import Imported, from_torch_actions, load_csv, loads_csv
from pipeir.interop.writer import comms_actions, compute_actions, dumps_csv

__all__ = ["FORMATS", "Action", "Imported", "check_csv", "comms_actions", "compute_actions",
           "dumps_csv", "from_torch_actions", "load_csv", "loads_csv", "parse_action",
           "prove_comms"]
