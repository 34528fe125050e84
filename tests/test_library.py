"""The library schedules: written in .sched, checked against torch.distributed.pipelining's own
orders (the live oracle) and against the textbook memory figures."""

from __future__ import annotations

import warnings

import pytest

import pipeir
from pipeir import library


def _torch_order(name: str, p: int, m: int, v: int | None) -> list[list[str]] | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

        try:
            ops = get_schedule_ops(name, p, m, num_stages_per_rank=v)
        except (ValueError, AssertionError, RuntimeError, ZeroDivisionError):
            return None  # torch does not admit this combination
    return [[str(a) for a in rank if a is not None and "REDUCE_GRAD" not in str(a)]
            for rank in ops]


@pytest.mark.parametrize(("torch_name", "ours", "v"), [
    ("GPipe", "gpipe", None),
    ("Interleaved1F1B", "interleaved-1f1b", 2), ("Interleaved1F1B", "interleaved-1f1b", 3),
])
def test_library_matches_torch_orders(torch_name: str, ours: str, v: int | None) -> None:
    compared = 0
    for p in (2, 3, 4, 8):
        for m in (1, 2, 3, 4, 6, 8, 9, 12, 16):
            theirs = _torch_order(torch_name, p, m, v)
            if theirs is None:
                continue
            sched = library.get(ours, p, m, **({"v": v} if v else {}))
            got = [[f"{o.stage}{o.kind}{o.mb}" for o in prog] for prog in sched.programs]
            assert got == theirs, f"{ours} p={p} m={m} v={v} differs from torch's {torch_name}"
            compared += 1
    assert compared >= 20


def test_1f1b_matches_torch_except_its_broken_last_rank() -> None:
    """torch's Schedule1F1B.pipeline_order (used only for visualisation) shifts the last rank's
    micro-batches by one: F(p-1, 0) is missing and F(p-1, m) is out of range. pipeir agrees on
    every other rank and rejects torch's order with a range error."""
    for p, m in ((2, 4), (3, 5), (4, 8)):
        theirs = _torch_order("1F1B", p, m, None)
        assert theirs is not None
        sched = library.get("1f1b", p, m)
        got = [[f"{o.stage}{o.kind}{o.mb}" for o in prog] for prog in sched.programs]
        assert got[:-1] == theirs[:-1]
        progs = [[pipeir.Op(a[a.index("F") if "F" in a else a.index("B")],  # type: ignore[arg-type]
                            int(a[:1]), int(a[2:])) for a in rank] for rank in theirs]
        torch_sched = pipeir.Schedule.from_programs(sched.config, progs)
        with pytest.raises(pipeir.VerifyError) as e:
            pipeir.verify(torch_sched)
        assert e.value.check == "range"
        assert f"F({p - 1},{m}): micro-batch {m} is out of range" in e.value.render()


@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_1f1b_and_gpipe_memory(p: int, m: int) -> None:
    one = pipeir.verify(library.get("1f1b", p, m)).peak_activations
    assert one == tuple(min(p - r, m) for r in range(p))
    gp = pipeir.verify(library.get("gpipe", p, m)).peak_activations
    assert gp == (m,) * p


def test_interleaved_shape() -> None:
    s = library.get("interleaved-1f1b", 4, 8, v=2)
    assert (s.config.stages, s.config.placement) == (8, (0, 1, 2, 3, 0, 1, 2, 3))
    assert len(s) == 2 * 8 * 8
    pipeir.verify(s)


def test_library_names_and_aliases() -> None:
    assert set(library.names()) >= {"gpipe", "1f1b", "interleaved-1f1b"}
    assert library.get("one_f_one_b", 2, 2) == library.get("1f1b", 2, 2)
    assert library.get("interleaved_1f1b", 2, 4, v=2) == library.get("interleaved-1f1b", 2, 4)
    assert library.params("interleaved-1f1b") == ("v",)


def test_one_lookup_serves_files_the_cli_and_get() -> None:
    """`schedule = NAME` in a file, `--schedule NAME` and `get(NAME)` all go through
    library.find, so a name means the same schedule everywhere."""
    found = library.find("One-F-One-B")
    assert found is not None and found.name == "1f1b" and found.schedule.name == "one_f_one_b"
    assert library.find("interleaved_1f1b") is library.require("interleaved-1f1b")
    assert library.find("1f1c") is None and library.canonical_name("1f1c") is None
    head = "pipeline { ranks = 4  microbatches = 8 }\n"
    for name in library.names():
        kw = {"v": 2} if "v" in library.require(name).params else {}
        uses = ", ".join(f"{k} = {v}" for k, v in kw.items())
        via_file = pipeir.parse(head + f"schedule = {name}({uses})")
        via_get = library.get(name, 4, 8, **kw)
        via_cli = library.instantiate(library.require(name), {"ranks": 4, "microbatches": 8},
                                      kw).schedule
        assert via_file == via_get == via_cli, name


def test_the_frontend_sees_only_the_library_it_is_given() -> None:
    from pipeir.frontend.elaborate import NO_LIBRARY, elaborate
    from pipeir.frontend.parser import parse_source

    module = parse_source(pipeir.diagnostics.Source(
        "<string>", "pipeline { ranks = 2  microbatches = 2 }\nschedule = 1f1b"))
    assert elaborate(module, library=library.LIBRARY).schedule == library.get("1f1b", 2, 2)
    with pytest.raises(pipeir.UsageError, match="unknown schedule '1f1b'"):
        elaborate(module, library=NO_LIBRARY)


def test_unknown_library_schedule_suggests() -> None:
    with pytest.raises(pipeir.UsageError) as e:
        library.get("1f1c", 2, 2)
    assert "did you mean '1f1b'" in e.value.render()


def test_library_requirements_are_diagnostics() -> None:
    with pytest.raises(pipeir.UsageError) as e:
        library.get("interleaved-1f1b", 4, 9, v=2)
    assert "multiple of" in e.value.message
    assert "microbatches = 9, rounds = 2" in e.value.render()
    with pytest.raises(pipeir.UsageError, match="one stage per rank"):
        library.get("1f1b", 2, 2, stages=4)
