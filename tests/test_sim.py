"""The simulator through its Python API: the closed forms, the cost model, comm models,
memory, the critical path, deadlocks, and an independent longest-path reference."""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import networkx as nx
import pytest

import pipeir
from pipeir import B, F, I, PipelineConfig, Schedule, UsageError, VerifyError, W
from pipeir.sim import CostModel, simulate
from pipeir.sim.analytic import analytic, interleaved_bubble, one_f_one_b_bubble

REPO = Path(__file__).parent.parent


def lib(name: str, p: int, m: int, **kw: int) -> Schedule:
    return pipeir.library.get(name, ranks=p, microbatches=m, **kw)


def reference_makespan(s: Schedule, costs: CostModel, latency: float = 0.0) -> float:
    """Longest path through program-order and data edges, written against the public graph
    API only (overlapped model, every cross-rank edge costs `latency`)."""
    end: dict[pipeir.Op, float] = {}
    for op in nx.topological_sort(s.graph):
        t = 0.0
        for p in s.graph.predecessors(op):
            hop = latency if s.rank_of(p) != s.rank_of(op) else 0.0
            t = max(t, end[p] + hop)
        end[op] = t + costs.cost(op)
    return max(end.values())


# ---- the closed forms ---------------------------------------------------------------------------
@pytest.mark.parametrize(("p", "m", "percent"), [(4, 8, 27.3), (4, 16, 15.8), (8, 16, 30.4),
                                                 (8, 32, 17.9)])
def test_1f1b_bubble_matches_the_issue_figures(p: int, m: int, percent: float) -> None:
    r = simulate(lib("1f1b", p, m))
    assert math.isclose(r.bubble, (p - 1) / (m + p - 1))
    assert round(100 * r.bubble, 1) == percent
    assert r.peak_activations == tuple(range(p, 0, -1))


@pytest.mark.parametrize(("f", "b"), [(1.0, 2.0), (1.0, 1.0), (0.3, 2.7), (2.0, 1.0)])
@pytest.mark.parametrize(("p", "m"), [(4, 8), (8, 16), (3, 5)])
def test_1f1b_and_gpipe_bubble_hold_for_any_f_b_ratio(f: float, b: float, p: int, m: int) -> None:
    costs = CostModel(F=f, B=b)
    for name in ("1f1b", "gpipe"):
        r = simulate(lib(name, p, m), costs)
        assert math.isclose(r.bubble, one_f_one_b_bubble(p, m)), name
        assert math.isclose(r.makespan, (m + p - 1) * (f + b)), name
        assert math.isclose(r.bubble_vs_ideal, (p - 1) / m), name


def test_gpipe_holds_every_microbatch_1f1b_only_p() -> None:
    assert simulate(lib("gpipe", 4, 16)).peak_activations == (16,) * 4
    assert max(simulate(lib("1f1b", 4, 16)).peak_activations) == 4
    assert analytic("gpipe", 4, 16).peak_activations == 16
    assert analytic("1f1b", 4, 16).peak_activations == 4


@pytest.mark.parametrize(("p", "m", "v"), [(4, 8, 2), (4, 16, 4), (8, 16, 2), (2, 6, 3),
                                           (8, 32, 4)])
def test_interleaved_bubble_with_chunk_costs_1_over_v(p: int, m: int, v: int) -> None:
    r = simulate(lib("interleaved-1f1b", p, m, v=v), CostModel(F=1 / v, B=2 / v))
    assert math.isclose(r.bubble, (p - 1) / (v * m + p - 1))
    assert math.isclose(r.bubble, interleaved_bubble(p, m, v))


def test_interleaving_beats_1f1b_only_when_chunks_are_cheaper() -> None:
    one = simulate(lib("1f1b", 4, 8))
    inter_cheap = simulate(lib("interleaved-1f1b", 4, 8, v=2), CostModel(F=0.5, B=1.0))
    inter_full = simulate(lib("interleaved-1f1b", 4, 8, v=2))
    assert inter_cheap.bubble < one.bubble
    assert inter_full.makespan > one.makespan


def test_analytic_declines_what_it_cannot_predict() -> None:
    assert analytic("interleaved-1f1b", 4, 6, 2).bubble is None
    assert "multiple of p" in analytic("interleaved-1f1b", 4, 6, 2).reason
    assert analytic("zero-bubble", 4, 8).bubble is None


# ---- the result ----------------------------------------------------------------------------------
def test_result_fields_are_consistent() -> None:
    s = lib("1f1b", 4, 8)
    r = simulate(s)
    assert set(r.start) == set(r.end) == set(s)
    assert r.makespan == 33.0
    assert r.busy == (24.0,) * 4 and r.idle == (9.0,) * 4
    assert r.start[F(0, 0)] == 0.0 and r.end[F(0, 0)] == 1.0
    assert r.start[F(3, 0)] == 3.0  # one forward per stage ahead of it
    assert r.start[B(3, 0)] == 4.0
    assert r.utilisation == (24 / 33,) * 4
    assert r.peak_time == (3.0, 3.0, 3.0, 3.0)  # each rank peaks at its last warm-up forward
    assert r.peak_bytes is None
    # every cross-rank data edge is one transfer, with the right ranks
    assert len(r.transfers) == 2 * 3 * 8
    for t in r.transfers:
        assert t.src_rank == s.rank_of(t.src) != t.dst_rank == s.rank_of(t.dst)
        assert t.start == r.end[t.src] and t.end == t.start  # free communication


def test_critical_path_is_a_chain_that_explains_the_makespan() -> None:
    s = lib("1f1b", 4, 8)
    r = simulate(s, CostModel(F=1, B=2, latency=0.5))
    path = r.critical_path
    assert path[0] == F(0, 0) and r.end[path[-1]] == r.makespan
    for a, b in itertools.pairwise(path):
        assert s.graph.has_edge(a, b), (a, b)
    hops = sum(0.5 for a, b in itertools.pairwise(path) if s.rank_of(a) != s.rank_of(b))
    assert math.isclose(r.critical_path_time + hops, r.makespan)


def test_zero_cost_schedule_has_no_bubble() -> None:
    r = simulate(lib("1f1b", 2, 2), CostModel(F=0, B=0))
    assert r.makespan == 0 and r.bubble == 0 and r.bubble_vs_ideal == 0


# ---- communication -------------------------------------------------------------------------------
def test_latency_delays_only_cross_rank_dependencies() -> None:
    s = lib("1f1b", 4, 8)
    r = simulate(s, CostModel(F=1, B=2, latency=0.25))
    assert r.start[F(1, 0)] == 1.25
    assert r.start[B(3, 0)] == r.end[F(3, 0)]  # same rank: free
    assert math.isclose(r.makespan, reference_makespan(s, CostModel(F=1, B=2), 0.25))


def test_same_rank_stages_exchange_for_free() -> None:
    s = lib("interleaved-1f1b", 2, 4, v=2)  # stages 0, 2 on rank 0; 1, 3 on rank 1
    cm = CostModel(F=1, B=2, latency=10)
    assert cm.transfer_time(1, 2) == 10
    assert cm.transfer_time(1, 2, same_rank=True) == 0
    assert cm.transfer_time(2, 2) == 0
    r = simulate(s, cm)
    assert r.start[B(3, 0)] == r.end[F(3, 0)]


def test_bandwidth_and_activation_bytes() -> None:
    cm = CostModel(latency=1.0, bandwidth=100.0, activation_bytes=50.0,
                   stage={1: {"activation_bytes": 200.0}})
    assert cm.transfer_time(0, 1) == 1.5
    assert cm.transfer_time(1, 0) == 1.5  # the gradient coming back is the same size
    assert cm.transfer_time(1, 2) == 3.0
    r = simulate(lib("1f1b", 3, 2), cm)
    sizes = {(t.src.stage, t.dst.stage): t.bytes for t in r.transfers}
    assert sizes[0, 1] == sizes[1, 0] == 50 and sizes[1, 2] == sizes[2, 1] == 200


def test_blocking_sends_occupy_the_sender() -> None:
    s = lib("1f1b", 4, 8)
    cm = CostModel(F=1, B=2, latency=0.5)
    over, block = simulate(s, cm), simulate(s, cm, comm="blocking")
    assert block.comm == "blocking" and over.comm == "overlapped"
    assert over.sending == (0.0,) * 4
    assert block.sending == (8 * 0.5, 16 * 0.5, 16 * 0.5, 8 * 0.5)  # one send per F/B edge
    assert block.start[F(0, 1)] == 1.5  # rank 0 sent F(0,0)'s output before starting F(0,1)
    assert over.start[F(0, 1)] == 1.0
    assert block.makespan > over.makespan
    assert block.busy == over.busy


def test_with_free_communication_the_comm_models_agree() -> None:
    s = lib("interleaved-1f1b", 4, 8, v=2)
    assert simulate(s).makespan == simulate(s, comm="blocking").makespan


def test_unknown_comm_model_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="unknown communication model 'async'"):
        simulate(lib("1f1b", 2, 2), comm="async")


# ---- memory --------------------------------------------------------------------------------------
def test_peak_bytes_follow_per_stage_sizes() -> None:
    cm = CostModel(memory_bytes=10.0, stage={0: {"memory_bytes": 100.0}})
    r = simulate(lib("1f1b", 2, 4), cm)
    assert r.peak_activations == (2, 1)
    assert r.peak_bytes == (200.0, 10.0)


def test_split_backward_frees_memory_at_w() -> None:
    cfg = PipelineConfig.make(ranks=1, microbatches=2)
    s = Schedule.from_programs(cfg, [[F(0, 0), F(0, 1), I(0, 0), I(0, 1), W(0, 0), W(0, 1)]])
    r = simulate(s, CostModel(F=1, I=1, W=3))
    assert r.peak_activations == (2,)
    assert r.makespan == 2 + 2 + 6
    assert pipeir.verify(s).peak_activations == r.peak_activations


# ---- errors --------------------------------------------------------------------------------------
def test_deadlocking_schedule_raises_instead_of_hanging() -> None:
    cfg = PipelineConfig.make(ranks=2, microbatches=1)
    s = Schedule.from_programs(cfg, [[B(0, 0), F(0, 0)], [F(1, 0), B(1, 0)]])
    with pytest.raises(VerifyError, match="deadlock") as e:
        simulate(s)
    assert e.value.check == "deadlock"


def test_incomplete_schedule_still_simulates() -> None:
    cfg = PipelineConfig.make(ranks=2, microbatches=2)
    s = Schedule.from_programs(cfg, [[F(0, 0), F(0, 1)], [F(1, 0), F(1, 1)]])
    assert simulate(s).makespan == 3.0


# ---- the cost model ------------------------------------------------------------------------------
def test_cost_defaults_and_b_from_i_plus_w() -> None:
    d = CostModel()
    assert [d.cost(op) for op in (F(0, 0), B(0, 0), I(0, 0), W(0, 0))] == [1, 2, 1, 1]
    cm = CostModel(F=1.5, I=1.25, W=0.5)
    assert cm.cost(B(0, 0)) == 1.75
    assert CostModel(B=3).cost(I(0, 0)) == 1.5
    assert CostModel(F=2, B=5).cost(B(1, 1)) == 5
    assert CostModel(I=1, W=2).cost(B(1, 1)) == 3


def test_most_specific_cost_wins() -> None:
    cm = CostModel.from_settings({"F": 1, "stage.1.F": 2, "mb.3.F": 3, "stage.1.mb.3.F": 4,
                                  "stage.2.I": 1, "stage.2.W": 2})
    assert cm.cost(F(0, 0)) == 1
    assert cm.cost(F(1, 0)) == 2
    assert cm.cost(F(0, 3)) == 3
    assert cm.cost(F(1, 3)) == 4
    assert cm.cost(B(2, 0)) == 3  # I + W at the stage level
    assert cm.cost(B(0, 0)) == 2


def test_costs_block_of_a_sched_file() -> None:
    text = ("pipeline { ranks = 2 microbatches = 2 }\n"
            "costs { F = 2 B = 3 stage.1.F = 2.5 mb.1.B = 4 latency = 0.5 }\n"
            "schedule = 1f1b\n")
    elab = pipeir.load(text)
    cm = CostModel.from_settings(elab.costs)
    assert cm.cost(F(1, 0)) == 2.5 and cm.cost(B(0, 1)) == 4 and cm.latency == 0.5
    assert simulate(elab.schedule, cm).start[F(1, 0)] == 2.5


def test_bad_cost_in_sched_points_at_its_span() -> None:
    text = "pipeline { ranks = 2 microbatches = 2 }\ncosts {\n  F = 1\n  Bw = 2\n}\n" \
           "schedule = 1f1b\n"
    with pytest.raises(UsageError) as e:
        CostModel.from_settings(pipeir.load(text).costs)
    d = e.value.diagnostics[0]
    assert d.message == "unknown cost 'Bw'"
    assert d.span is not None and (d.span.line, d.span.col) == (4, 3)
    assert "did you mean 'B'?" in e.value.render()


@pytest.mark.parametrize(("settings", "message"), [
    ({"F": -1}, "cost 'F' must be non-negative, got -1"),
    ({"bandwidth": 0}, "cost 'bandwidth' must be positive"),
    ({"F": "fast"}, "cost 'F' must be a number, got the text 'fast'"),
    ({"stage.x.F": 1}, "unknown cost 'stage.x.F'"),
    ({"mb.1.activation_bytes": 1}, "unknown cost 'mb.1.activation_bytes'"),
    ({"version": 3}, "version 3 is not supported (this pipeir reads versions 1 and 2)"),
    ({"unit": 'm"s\n'}, "'unit' must be a name like \"ms\" (at most 16 characters"),
    ({"unit": "milliseconds-ish!"}, "'unit' must be a name like"),
    ({"lengths": [1e200, 1], "length_cost": [0, 0, 1]},
     "micro-batch 0's length gives F a cost too large to compute"),
    ({"lengths": [1e12, 1], "length_cost": [0, 0, 1], "length_ref": 1e-6},
     "micro-batch 0's length gives F a cost of 1e+36, over 1e+15"),
])
def test_bad_settings_are_usage_errors(settings: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        CostModel.from_settings(settings)


def test_a_unit_prints_back_into_a_costs_block_that_parses() -> None:
    """What a cost file may call its unit, `print` writes into a costs block that re-parses
    (a quote or a newline in it once made `opt -o` write a file `check` refused)."""
    s = pipeir.library.get("1f1b", 2, 2)
    text = pipeir.printer.print_schedule(s, {"unit": "µs"})
    assert CostModel.from_settings(pipeir.load(text).costs).unit == "µs"


def test_length_costs_point_at_the_lengths() -> None:
    text = ("pipeline { ranks = 2 microbatches = 2 }\ncosts {\n  F = 1\n"
            "  lengths = [1e200, 1.0]\n  length_cost = [0, 0, 1]\n}\nschedule = 1f1b\n")
    with pytest.raises(UsageError) as e:
        CostModel.from_settings(pipeir.load(text).costs)
    d = e.value.diagnostics[0]
    assert d.span is not None and (d.span.line, d.span.col) == (4, 3), e.value.render()


def test_constructor_rejects_negative_costs() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        CostModel(F=-1)
    with pytest.raises(ValueError, match="unknown cost"):
        CostModel(stage={0: {"X": 1.0}})


def test_cost_files_json_and_toml_mean_the_same(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('version = 1\nunit = "ms"\nF = 1.5\n[stage.2]\nF = 3\n'
                    '[meta]\ndevice = "x"\n')
    js = tmp_path / "c.json"
    js.write_text('{"version": 1, "unit": "ms", "F": 1.5, "stage": {"2": {"F": 3}},'
                  ' "meta": {"device": "x"}}')
    flat = tmp_path / "flat.json"
    flat.write_text('{"unit": "ms", "F": 1.5, "stage.2.F": 3}')
    models = [CostModel.load(p) for p in (toml, js, flat)]
    assert models[0] == models[1] == models[2]
    assert models[0].cost(F(2, 0)) == 3 and models[0].unit == "ms"


def test_example_cost_files_load() -> None:
    for path in sorted((REPO / "examples" / "costs").glob("*.*")):
        if path.suffix in (".toml", ".json"):
            assert CostModel.load(path).cost(F(0, 0)) > 0
        else:
            elab = pipeir.load(path)
            simulate(elab.schedule, CostModel.from_settings(elab.costs))


def test_settings_round_trip() -> None:
    cm = CostModel.from_settings({"F": 1, "B": 3, "stage.1.F": 2, "mb.0.B": 4,
                                  "stage.0.mb.1.F": 5, "latency": 0.1, "bandwidth": 10,
                                  "memory_bytes": 7, "unit": "ms"})
    again = CostModel.from_settings(cm.settings())
    assert again.settings() == cm.settings()
    ops = [F(0, 0), F(1, 0), B(0, 0), B(1, 0), F(0, 1), I(0, 1), W(1, 1)]
    assert [again.cost(op) for op in ops] == [cm.cost(op) for op in ops] == [1, 2, 4, 4, 5, 1.5,
                                                                             1.5]


def test_scaled_divides_op_times_not_comm() -> None:
    cm = CostModel(F=2, B=4, latency=1, stage={0: {"F": 6.0}}).scaled(0.5)
    assert cm.cost(F(1, 0)) == 1 and cm.cost(F(0, 0)) == 3 and cm.latency == 1
