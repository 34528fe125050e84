"""The one-line progress display of long commands (issue 11): drawn on a terminal only, and
fed by tune (per candidate), compile (per phase) and profile (per stage)."""

from __future__ import annotations

import io
from pathlib import Path

import pipeir
from pipeir.passes import PassManager, Phases, parse_pipeline
from pipeir.progress import Progress
from pipeir.search.tune import search
from pipeir.sim import CostModel

REPO = Path(__file__).parent.parent


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_one_line_on_a_terminal_and_erases_it() -> None:
    tty = Terminal()
    with Progress("tune", tty) as show:
        show("candidate 1/2")
        show("candidate 2/2")
    text = tty.getvalue()
    assert text.startswith("\rtune: candidate 1/2  [0 s]\x1b[K\rtune: candidate 2/2")
    assert text.endswith("\r\x1b[K") and "\n" not in text


def test_progress_is_silent_off_a_terminal() -> None:
    pipe = io.StringIO()
    with Progress("tune", pipe) as show:
        show("candidate 1/2")
    assert pipe.getvalue() == ""


def test_tune_reports_every_candidate() -> None:
    seen: list[str] = []
    result = search(CostModel(F=1, B=2, latency=0.1), 2, [4], max_v=2, progress=seen.append)
    assert len(seen) == len(result.ranked) + len(result.over_limit)
    assert seen[0].startswith("candidate 1/") and seen[-1].startswith(f"candidate {len(seen)}/")


def test_compile_reports_its_phases() -> None:
    seen: list[str] = []
    s = pipeir.library.get("1f1b", 2, 4)
    PassManager(parse_pipeline("split-backward,overlap"),
                instruments=[Phases(seen.append)]).compile(s)
    assert seen == ["verifying 16 ops", "pass 1 of 2, 'split-backward'", "lowering 24 ops",
                    "pass 2 of 2, 'overlap'", seen[-1]]
    assert seen[-1].startswith("proving ") and seen[-1].endswith(" instructions deadlock-free")


def test_commands_print_no_progress_into_a_pipe(cli, tmp_path: Path) -> None:
    code, _, err = cli("compile", REPO / "examples" / "1f1b.sched", "-o", tmp_path / "out")
    assert code == 0 and err == ""
