"""Issue 37's user-code families: model files, `--model` modules, batch functions and pass
plugins that exit, raise, are interrupted, loop or print, hand-written and generated. Each must
end as one `error:` line naming the user's file and the line of the raise (exit 1, 130 for an
interrupt), and a plugin's prints must stay off a schedule written to stdout."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from abuse_kit.harness import OK, RUN2, Case, make_file

RUN_WITH = [*RUN2[:-2]]  # RUN2 without its --model
OPT = ["opt", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2"]

#: what the user code does -> (statement, exit code)
ACTS: dict[str, tuple[str, int]] = {
    "sys.exit(0)": ("import sys; sys.exit(0)", 1),
    "sys.exit(3)": ("import sys; sys.exit(3)", 1),
    "sys.exit('bye')": ("import sys; sys.exit('bye')", 1),
    "raise SystemExit": ("raise SystemExit", 1),
    "KeyboardInterrupt": ("raise KeyboardInterrupt", 130),
    "ValueError": ("raise ValueError('bad value')", 1),
    "1/0": ("x = 1 / 0", 1),
    "a missing import": ("import no_such_module_37", 1),
    "RecursionError": ("f = lambda: f(); f()", 1),
    "MemoryError": ("raise MemoryError", 1),
    "a broken exception": ("raise type('E', (Exception,), {'__str__': lambda s: 1/0})()", 1),
}

MODEL_AROUND = '''from pipeir.models import ModelSpec
from pipeir.models.mlp import small
{pad}
def spec():
    {in_spec}
    base = small()
    def batch(step):
        {in_batch}
        return base.batch(step)
    return ModelSpec(stage=base.stage, loss=base.loss, batch=batch)
'''

PLUGIN_AROUND = '''from dataclasses import dataclass
from typing import ClassVar
from pipeir.passes import Pass
{pad}
@dataclass(frozen=True)
class P(Pass):
    name: ClassVar[str] = "user-pass"
    summary: ClassVar[str] = "user code"

    def run(self, schedule, context):
        {in_run}
        return schedule
'''


def model(where: str, act: str, pad: int = 0) -> tuple[str, int]:
    """A model file doing `act` at `where` (import, spec, batch) -> (text, line of the act)."""
    text = MODEL_AROUND.format(pad="\n" * pad, in_spec="pass", in_batch="pass")
    lines = text.splitlines()
    at = {"import": 2, "spec": 4 + pad, "batch": 7 + pad}[where]
    indent = {"import": "", "spec": "    ", "batch": "        "}[where]
    if where == "import":
        lines.insert(at, act)
    else:
        lines[at] = indent + act
    return "\n".join(lines) + "\n", at + 1


def plugin(where: str, act: str, pad: int = 0) -> tuple[str, int]:
    """A plugin file doing `act` at `where` (import, run) -> (text, line of the act)."""
    text = PLUGIN_AROUND.format(pad="\n" * pad, in_run="pass")
    lines = text.splitlines()
    if where == "import":
        lines.insert(3, act)
        return "\n".join(lines) + "\n", 4
    at = 10 + pad
    lines[at] = "        " + act
    return "\n".join(lines) + "\n", at + 1


def _names(name: str, line: int, code: int) -> Callable[[Path, str, str], tuple[str, str] | None]:
    """The error names `name:line` (the raise), and nothing of the user's reached stdout."""
    def check(_: Path, out: str, err: str) -> tuple[str, str] | None:
        first = next((x for x in err.splitlines() if x.startswith("error: ")), "")
        if code and f"{name}:{line} while " not in first:
            return "unclear", f"the error does not name {name}:{line}: {first[:160]!r}"
        if "noise" in out:
            return "unclear", "user code's print reached stdout"
        return None
    return check


def _model_case(label: str, where: str, act: str, code: int, pad: int = 0,
                quick: bool = False) -> Case:
    text, line = model(where, act, pad)
    return Case(label, [*RUN_WITH, "--model", "m.py", "--steps", "1"], frozenset({code}),
                make_file("m.py", text), timeout=120, check=_names("m.py", line, code),
                quick=quick)


def _plugin_case(label: str, where: str, act: str, code: int, pad: int = 0,
                 quick: bool = False) -> Case:
    text, line = plugin(where, act, pad)
    return Case(label, [*OPT, "--pass-plugin", "p.py:P", "--passes", "user-pass"],
                frozenset({code}), make_file("p.py", text), timeout=60,
                check=_names("p.py", line, code), quick=quick)


def hand_cases() -> list[Case]:
    out = []
    for act, (stmt, code) in ACTS.items():
        out.append(_model_case(f"model file: {act} while importing", "import", stmt, code,
                               quick=act == "sys.exit(0)"))
        out.append(_model_case(f"model file: {act} in spec()", "spec", stmt, code))
        out.append(_plugin_case(f"pass plugin: {act} while importing", "import", stmt, code,
                                quick=act == "sys.exit(3)"))
        out.append(_plugin_case(f"pass plugin: {act} in run()", "run", stmt, code,
                                quick=act == "KeyboardInterrupt"))
    for act in ("ValueError", "sys.exit(3)", "KeyboardInterrupt"):
        stmt, code = ACTS[act]
        out.append(_model_case(f"batch function: {act}", "batch", stmt, code))
    module, line = model("import", "import sys; sys.exit(5)")
    out += [
        Case("--model module: sys.exit(5) while importing",
             [*RUN_WITH, "--model", "usermod37:spec"], frozenset({1}),
             make_file("usermod37.py", module), env={"PYTHONPATH": "."}, timeout=60,
             check=_names("usermod37.py", line, 1)),
        Case("model file: a syntax error", [*RUN_WITH, "--model", "m.py"], frozenset({1}),
             make_file("m.py", "def spec(:\n"), check=_names("m.py", 1, 1)),
        Case("model file: loops while importing (Ctrl-C)", [*RUN_WITH, "--model", "m.py"],
             frozenset({130}), make_file("m.py", "while True:\n    pass\n"),
             interrupt_after=20.0, timeout=60, check=_names("m.py", 1, 130)),
        Case("pass plugin: loops in run() (Ctrl-C)",
             [*OPT, "--pass-plugin", "p.py:P", "--passes", "user-pass"], frozenset({130}),
             make_file("p.py", plugin("run", "while True: pass")[0]), interrupt_after=20.0,
             timeout=60, check=_names("p.py", 11, 130)),
        Case("pass plugin: prints, opt writes the schedule to stdout",
             [*OPT, "--pass-plugin", "p.py:P", "--passes", "user-pass"], OK,
             make_file("p.py", plugin("run", "print('noise')")[0]),
             check=_names("p.py", 0, 0), quick=True),
        Case("pass plugin: prints while importing, opt -o -",
             [*OPT, "--pass-plugin", "p.py:P", "--passes", "user-pass,verify"], OK,
             make_file("p.py", plugin("import", "print('noise')")[0]),
             check=_names("p.py", 0, 0)),
    ]
    return out


def generated_cases(n: int, seed: int) -> list[Case]:
    """`n` random (where, what, how far down the file) combinations."""
    rnd = random.Random(seed + 37)
    out = []
    wheres = [("model", "import"), ("model", "spec"), ("model", "batch"), ("plugin", "import"),
              ("plugin", "run")]
    for i in range(n):
        (kind, where), act, pad = rnd.choice(wheres), rnd.choice(list(ACTS)), rnd.randrange(30)
        stmt, code = ACTS[act]
        label = f"generated user code #{i}: {kind} {act} in {where}, {pad} lines down"
        make = _model_case if kind == "model" else _plugin_case
        out.append(make(label, where, stmt, code, pad))
    return out
