"""The .sched language: what programs mean (elaboration), through the public API."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import pipeir
from pipeir import B, F, I, W


def progs(text: str, **overrides: object) -> list[list[str]]:
    s = pipeir.parse(text, overrides=overrides or None)  # type: ignore[arg-type]
    return [[str(op) for op in p] for p in s.programs]


HEAD = "pipeline { ranks = 2  microbatches = 3 }\n"


def test_loops_lets_and_arithmetic() -> None:
    got = progs(HEAD + """
    schedule s {
        rank r {
            let n = microbatches
            for i in 0 .. n { F(r, (i * 7 + 3) % n) }
            for i in 0 .. n { B(r, n - 1 - i) }
        }
    }""")
    assert got[0] == ["F(0,0)", "F(0,1)", "F(0,2)", "B(0,2)", "B(0,1)", "B(0,0)"]
    assert got[1][0] == "F(1,0)"


def test_floor_division_and_modulo_follow_python() -> None:
    got = progs("pipeline { ranks = 1  microbatches = 2 }\n"
                "schedule s { rank r { F(0, -1 // 2 + 1)  F(0, -3 % 2)  B(0, 0) B(0, 1) } }")
    assert got[0][:2] == ["F(0,0)", "F(0,1)"]


def test_if_else_chains_comparisons_and_booleans() -> None:
    got = progs("pipeline { ranks = 3  microbatches = 1 }\n" """
    schedule s {
        rank r {
            if r == 0 and not (r > 0) { F(r, 0) B(r, 0) }
            else if r == 1 or r >= 5 { F(r, 0)  B(r, 0) }
            else { F(r, 0)  B(r, 0) }
        }
    }""")
    assert got == [["F(0,0)", "B(0,0)"], ["F(1,0)", "B(1,0)"], ["F(2,0)", "B(2,0)"]]


def test_functions_and_macros() -> None:
    got = progs(HEAD + """
    def twice(x) = 2 * x
    def fwd_bwd(s, i) { F(s, i)  B(s, i) }
    schedule s {
        def half(x) = twice(x) // 4
        rank r {
            def here(i) { fwd_bwd(r, i) }
            for i in 0 .. microbatches { here(half(twice(i))) }
        }
    }""")
    assert got[1] == ["F(1,0)", "B(1,0)", "F(1,1)", "B(1,1)", "F(1,2)", "B(1,2)"]


def test_min_max_abs_owner_local_stage() -> None:
    got = progs("""
    pipeline { ranks = 2  microbatches = 1  stages = 4  placement = vshape }
    schedule s {
        rank r {
            require owner(local_stage(r, 1)) == r, "local_stage is on its rank"
            require num_local_stages(r) == 2
            F(local_stage(r, min(0, 5)), abs(0))
            F(local_stage(r, max(1, 0)), 0)
            B(local_stage(r, 1), 0)
            B(local_stage(r, 0), 0)
        }
    }""")
    assert got[0] == ["F(0,0)", "F(3,0)", "B(3,0)", "B(0,0)"]  # vshape: rank 0 owns 0 and 3
    assert got[1] == ["F(1,0)", "F(2,0)", "B(2,0)", "B(1,0)"]


def test_explicit_rank_blocks_concatenate() -> None:
    got = progs("""
    pipeline { ranks = 2  microbatches = 1 }
    schedule s {
        rank r { F(r, 0) }
        rank 1 { B(1, 0) }
        rank (ranks - 2) { B(0, 0) }
    }""")
    assert got == [["F(0,0)", "B(0,0)"], ["F(1,0)", "B(1,0)"]]


def test_placement_list_and_stages_setting() -> None:
    s = pipeir.parse("""
    pipeline { ranks = 2  microbatches = 1  stages = 3  placement = [0, 1, 1] }
    schedule s { rank 0 { F(0,0) B(0,0) } rank 1 { F(1,0) F(2,0) B(2,0) B(1,0) } }""")
    assert s.config.placement == (0, 1, 1)
    pipeir.verify(s)


def test_overrides_replace_settings_and_parameters() -> None:
    text = "pipeline { ranks = 4  microbatches = 8 }\nschedule = interleaved-1f1b(v = 2)"
    s = pipeir.parse(text, overrides={"ranks": 2, "v": 3})
    assert (s.config.ranks, s.config.stages) == (2, 6)
    assert s == pipeir.library.get("interleaved-1f1b", 2, 8, v=3)


def test_pipeline_from_overrides_alone() -> None:
    s = pipeir.parse("schedule = 1f1b", overrides={"ranks": 3, "microbatches": 4})
    assert s == pipeir.library.get("1f1b", 3, 4)


def test_schedule_parameters_and_defaults() -> None:
    text = HEAD + """
    schedule s(first = 0, n) {
        rank r { for i in first .. n { F(r, i) } for i in first .. n { B(r, i) } }
    }
    schedule = s(n = microbatches)
    """
    with pytest.raises(pipeir.UsageError, match="unknown name 'microbatches'"):
        pipeir.parse(text)  # arguments are constants: the pipeline is not known yet
    s = pipeir.parse(text.replace("n = microbatches", "n = 3"))
    assert len(s) == 12


def test_missing_parameter_is_reported() -> None:
    with pytest.raises(pipeir.UsageError, match="needs a value for parameter 'n'"):
        pipeir.parse(HEAD + "schedule s(n) { rank r { } }")


def test_two_definitions_need_a_choice() -> None:
    text = HEAD + "schedule a { rank r { } }\nschedule b { rank r { } }\n"
    with pytest.raises(pipeir.UsageError, match="defines 2 schedules"):
        pipeir.parse(text)
    with pytest.raises(pipeir.VerifyError):  # chosen, but empty: incomplete
        pipeir.verify(pipeir.parse(text + "schedule = b"))


def test_local_definition_shadows_library() -> None:
    text = HEAD + """
    schedule gpipe { rank r { for i in 0 .. 3 { F(r, i) B(r, i) } } }
    schedule = gpipe"""
    assert pipeir.parse(text).program(0)[:2] == (F(0, 0), B(0, 0))


def test_split_backward_ops() -> None:
    s = pipeir.parse("pipeline { ranks = 1  microbatches = 1 }\n"
                     "schedule s { rank r { F(0,0) I(0,0) W(0,0) } }")
    assert s.program(0) == (F(0, 0), I(0, 0), W(0, 0))
    assert pipeir.verify(s).peak_activations == (1,)


def test_comments_and_free_layout() -> None:
    s = pipeir.parse("# c\npipeline{ranks=1 microbatches=1}# c\nschedule s{rank r{F(0,0)B(0,0)}}")
    assert len(s) == 2


@pytest.mark.parametrize("text", [
    "pipeline { ranks = 0  microbatches = 1 }\nschedule = 1f1b",
    "pipeline { ranks = 2  microbatches = 1  placement = [0, 0] }\nschedule s { rank r { } }",
    "pipeline { ranks = 2  microbatches = 1  placement = diagonal }\nschedule = 1f1b",
    "pipeline { ranks = 2  microbatches = true }\nschedule = 1f1b",
    "pipeline { ranks = 2  microbatches = 2  memory_limit = true }\nschedule = 1f1b",
])
def test_bad_pipeline_values(text: str) -> None:
    with pytest.raises(pipeir.UsageError) as e:
        pipeir.parse(text)
    assert e.value.diagnostics[0].span is not None


@pytest.mark.parametrize(("setting", "kwargs"), [
    ("placement = [0, 0]", {"placement": [0, 0]}),
    ("stages = 3  placement = [0, 1]", {"stages": 3, "placement": [0, 1]}),
    ("placement = [0, 5]", {"placement": [0, 5]}),
    ("placement = 3", {"placement": 3}),
    ("memory_limit = true", {"memory_limit": True}),
    ("accumulate = 0", {"accumulate": 0}),
    ("stages = 0", {"stages": 0}),
    ("stages = 1", {"stages": 1}),
    ("stages = 5000000", {"stages": 5000000}),
])
def test_pipeline_settings_are_checked_by_pipeline_config(setting: str,
                                                          kwargs: dict[str, object]) -> None:
    """One set of rules: a file's pipeline block fails with PipelineConfig's own message,
    pointed at the setting it names (or noting that the setting took its default)."""
    with pytest.raises(pipeir.config.ConfigError) as want:
        pipeir.PipelineConfig.make(2, 4, **kwargs)  # type: ignore[arg-type]
    text = f"pipeline {{ ranks = 2  microbatches = 4  {setting} }}\nschedule s {{ rank r {{ }} }}"
    with pytest.raises(pipeir.UsageError) as got:
        pipeir.parse(text)
    d = got.value.diagnostics[0]
    assert d.message == str(want.value)
    key = want.value.key
    if key in setting:
        assert d.span is not None and d.span.col == text.index(f" {key} =") + 2
    else:
        assert d.span is None
        assert d.notes[0].message == f"'{key}' was not set, so it took its default"


@pytest.mark.parametrize(("stmt", "fragment"), [
    ("F(r, 1.5)", "the micro-batch must be an integer"),
    ("F(r, 1 + true)", "'+' needs numbers"),
    ("let x = min", "is a function"),
    ("let x = F(0, 0)", "is an op, not a value"),
    ("min(1, 2)", "computes a value"),
    ("rank 0 { }", "cannot be nested"),
    ("for i in 0 .. 100000000 { for j in 0 .. 100000000 { } }", "iterations"),
    ("F(r, 1 // 0)", "division by zero"),
])
def test_semantic_errors(stmt: str, fragment: str) -> None:
    with pytest.raises(pipeir.UsageError, match=re.escape(fragment)):
        pipeir.parse("pipeline { ranks = 1  microbatches = 1 }\n"
                     f"schedule s {{ rank r {{ {stmt} }} }}")


def test_schedule_equality_ignores_spans_and_names() -> None:
    a = pipeir.parse(HEAD + "schedule a { rank r { for i in 0 .. 3 { F(r, i) } "
                     "for i in 0 .. 3 { B(r, i) } } }")
    assert a == pipeir.library.get("gpipe", 2, 3)
    assert a.span_of(F(0, 0)) is not None
    assert pipeir.library.get("gpipe", 2, 3).name == "gpipe"


def test_builder_api() -> None:
    cfg = pipeir.PipelineConfig.make(ranks=2, microbatches=1)
    s = pipeir.Schedule.from_programs(cfg, [[F(0, 0), I(0, 0), W(0, 0)],
                                            [F(1, 0), B(1, 0)]])
    assert pipeir.verify(s).peak_activations == (1, 1)
    assert s.rank_of(B(1, 0)) == 1
    kinds = {(str(u), str(v)): k for u, v, k in s.graph.edges(data="kind")}
    assert kinds["F(0,0)", "F(1,0)"] == pipeir.EdgeKind.DATA
    assert kinds["F(1,0)", "B(1,0)"] == pipeir.EdgeKind.DATA | pipeir.EdgeKind.ORDER
    assert kinds["B(1,0)", "I(0,0)"] == pipeir.EdgeKind.DATA
    assert kinds["I(0,0)", "W(0,0)"] == pipeir.EdgeKind.DATA | pipeir.EdgeKind.ORDER
    with pytest.raises(pipeir.VerifyError) as e:
        pipeir.Schedule.from_programs(cfg, [[F(0, 0), F(0, 0)], []])
    assert e.value.check == "duplicate"


def test_huge_pipelines_are_refused_up_front() -> None:
    with pytest.raises(pipeir.UsageError, match="too large") as e:
        pipeir.parse("pipeline { ranks = 100000000  microbatches = 100 }\nschedule = 1f1b")
    assert e.value.diagnostics[0].span is not None


def test_user_definitions_are_checked_when_using_the_library() -> None:
    with pytest.raises(pipeir.UsageError, match="unknown name 'y'"):
        pipeir.parse("pipeline { ranks = 2  microbatches = 2 }\nlet x = y\nschedule = 1f1b")
    elab = pipeir.load("pipeline { ranks = 2  microbatches = 2 }\nlet x = 3 * ranks\n"
                       "costs { F = x }\nschedule = 1f1b")
    assert elab.costs["F"][0] == 6


def test_overlap_pairs_round_trip_and_survive_passes() -> None:
    s = pipeir.parse("pipeline { ranks = 1  microbatches = 2 }\n"
                     "schedule s { rank r { F(0,0) overlap { F(0,1) B(0,0) } B(0,1) } }")
    assert s.pairs == ((F(0, 1), B(0, 0)),)
    assert s.pair_of(B(0, 0)) == F(0, 1) and s.pair_of(F(0, 0)) is None
    text = pipeir.print_schedule(s)
    assert "overlap { F(0,1) B(0,0) }" in text
    assert pipeir.parse(text) == s
    unpaired = pipeir.parse("pipeline { ranks = 1  microbatches = 2 }\n"
                            "schedule s { rank r { F(0,0) F(0,1) B(0,0) B(0,1) } }")
    assert unpaired.programs == s.programs and unpaired != s
    assert s.with_programs(s.programs).pairs == s.pairs
    assert s.with_programs([[F(0, 1), F(0, 0), B(0, 0), B(0, 1)]]).pairs == ()


def test_overlap_pair_must_be_independent_ops() -> None:
    s = pipeir.parse("pipeline { ranks = 1  microbatches = 1 }\n"
                     "schedule s { rank r { overlap { F(0,0) B(0,0) } } }")
    with pytest.raises(pipeir.VerifyError) as e:
        pipeir.verify(s)
    assert e.value.check == "overlap"
    with pytest.raises(pipeir.UsageError, match="pairs two ops"):
        pipeir.parse("pipeline { ranks = 1  microbatches = 1 }\n"
                     "schedule s { def g(a, b) { } rank r { overlap { F(0,0) g(0, 0) } } }")


def test_overlap_pair_starts_when_both_inputs_are_there() -> None:
    s = pipeir.parse("pipeline { ranks = 2  microbatches = 2 }\nschedule s {\n"
                     "rank 0 { F(0,0) F(0,1) overlap { B(0,0) B(0,1) } }\n"
                     "rank 1 { F(1,0) F(1,1) B(1,0) B(1,1) } }")
    pipeir.verify(s)
    for comm in ("overlapped", "blocking"):
        r = pipeir.simulate(s, pipeir.CostModel(latency=0.5), comm=comm)
        # B(0,0) alone could start when B(1,0)'s gradient arrives; paired, it also waits for
        # B(1,1)'s, and B(0,1) follows it back to back
        assert r.start[B(0, 0)] >= r.end[B(1, 1)] + 0.5
        assert r.start[B(0, 1)] == r.end[B(0, 0)]
        assert len(r.transfers) == 4  # the pair adds no message


def test_schedule_parameters_cannot_shadow_pipeline_settings() -> None:
    with pytest.raises(pipeir.UsageError, match="cannot be called 'ranks'"):
        pipeir.parse(HEAD + "schedule s(ranks = 3) { rank r { } }")


def test_byte_order_mark_is_ignored(tmp_path: Path) -> None:
    f = tmp_path / "bom.sched"
    f.write_bytes(b"\xef\xbb\xbf" + (HEAD + "schedule = gpipe").encode())
    assert pipeir.parse(f) == pipeir.library.get("gpipe", 2, 3)


def test_runaway_function_recursion_points_at_the_call() -> None:
    with pytest.raises(pipeir.UsageError, match="functions nest deeper") as e:
        pipeir.parse(HEAD + "schedule s {\n def f(x) = f(x)\n rank r { let y = f(1) } }")
    assert e.value.diagnostics[0].span is not None


def test_kept_function_values_are_the_ones_a_call_would_compute() -> None:
    # a function defined in a loop is made anew each time round: it sees this k, not the
    # first k's value kept
    s = pipeir.parse(HEAD + "schedule s {\n rank r { for k in 0 .. 3 {\n def g(x) = x + k\n"
                     " F(r, g(0)) } for k in 0 .. 3 { B(r, k) } } }")
    assert [op.mb for op in s.programs[0][:3]] == [0, 1, 2]
    # a value kept for 1 is not the answer for true (equal keys in a dict)
    with pytest.raises(pipeir.UsageError, match=r"the micro-batch must be an integer, got "
                       r"a boolean \(true\)") as e:
        pipeir.parse(HEAD + "schedule s {\n def f(x) = x\n rank r { F(r, f(1))\n"
                     " F(r, f(true)) } }")
    span = e.value.diagnostics[0].span
    assert span is not None and (span.line, span.col) == (5, 7)


_FUNCTIONS = HEAD + """schedule s {
    def sq(x) = x * x
    def lt(a, b) = min(1, max(0, b - a))
    def pick(a, b) = lt(a, b) * a + (1 - lt(a, b)) * b
    def perm(k, r) = (2 * k + r + sq(k) - k * k) % microbatches
    rank r {
        def at(k) = pick(perm(k, r), perm(k, r))
        def emit(k) { let m = at(k)  def same(x) = 2 * x + m - m  F(r, same(m) // 2) }
        for k in 0 .. microbatches { emit(k) }
        for k in 0 .. microbatches { B(r, at(microbatches - 1 - k)) }
    }
}
"""


def test_kept_function_values_give_the_schedule_running_every_call_gives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the oracle: the same elaboration with every closure's kept values dropped before each
    # call (each call runs, as before values were kept)
    from pipeir.frontend import expressions, scope, statements

    kept = pipeir.parse(_FUNCTIONS)
    # (worked by hand: rank r's k-th forward is micro-batch (2k + r) % 3, its backwards the
    # same in reverse)
    assert [list(p) for p in kept.programs] == [
        [F(0, 0), F(0, 2), F(0, 1), B(0, 1), B(0, 2), B(0, 0)],
        [F(1, 1), F(1, 0), F(1, 2), B(1, 2), B(1, 0), B(1, 1)]]
    sizes = [(p, m, v) for p in (1, 2, 3, 4) for v in (1, 2, 3) for m in (p, 2 * p, 3 * p + 1)
             if m % max(1, m // p) == 0]
    kept_lib = [pipeir.library.get("interleaved-1f1b", p, m, v=v) for p, m, v in sizes]

    def forgetful(fn: scope.Closure, *args: object) -> object:
        fn.memo.clear()
        return scope.invoke(fn, *args)  # type: ignore[arg-type]
    monkeypatch.setattr(expressions, "invoke", forgetful)
    monkeypatch.setattr(statements, "invoke", forgetful)
    assert pipeir.parse(_FUNCTIONS) == kept
    assert [pipeir.library.get("interleaved-1f1b", p, m, v=v) for p, m, v in sizes] == kept_lib


def test_printer_names_are_identifiers() -> None:
    s = pipeir.library.get("gpipe", 2, 2)
    odd = pipeir.Schedule.from_programs(s.config, s.programs, name="1-my sched")
    assert pipeir.parse(pipeir.print_schedule(odd)) == s
    assert "schedule s_1_my_sched {" in pipeir.print_schedule(odd)


def test_empty_programs_are_reported_at_the_schedule() -> None:
    with pytest.raises(pipeir.VerifyError) as e:
        pipeir.verify(pipeir.parse(HEAD + "schedule empty { rank r { } }"))
    span = e.value.diagnostics[0].span
    assert span is not None and (span.line, span.col) == (2, 10)


def test_verify_rejects_a_nonsense_memory_limit() -> None:
    with pytest.raises(pipeir.UsageError,
                       match="memory_limit must be a positive number of activations, got 0"):
        pipeir.verify(pipeir.library.get("1f1b", 2, 2), memory_limit=0)


@pytest.mark.parametrize(("text", "overrides", "where"), [
    ("pipeline {\n  ranks = 100000000\n  microbatches = 100\n}\n", {}, (2, 3)),
    ("pipeline {\n  ranks = 4\n  stages = ranks\n  microbatches = 100000000\n}\n", {}, (4, 3)),
    ("pipeline {\n  ranks = 4\n  stages = ranks\n  microbatches = 8\n}\n",
     {"microbatches": 100000000}, None),
    ("pipeline {\n  ranks = 4\n  microbatches = 100000000\n}\n", {"ranks": 2}, (3, 3)),
])
def test_a_size_error_points_at_the_largest_setting_or_at_set(
        text: str, overrides: dict[str, int], where: tuple[int, int] | None) -> None:
    """The size is a product; the caret goes to the factor that made it large, and to no line
    of the file when that factor came from --set."""
    with pytest.raises(pipeir.UsageError, match="too large") as e:
        pipeir.parse(text + "schedule = 1f1b", overrides=overrides)
    span = e.value.diagnostics[0].span
    assert (None if span is None else (span.line, span.col)) == where


@pytest.mark.parametrize("param", ["true", "max", "F"])
def test_a_schedule_parameter_cannot_take_a_built_in_name(param: str) -> None:
    text = (f"pipeline {{ ranks = 1  microbatches = 1 }}\nschedule s({param} = 0) "
            "{ rank r { F(0, 0)  B(0, 0) } }")
    with pytest.raises(pipeir.UsageError) as e:
        pipeir.parse(text)
    d = e.value.diagnostics[0]
    assert d.message == f"'{param}' is a built-in name; pick another name"
    assert d.span is not None and (d.span.line, d.span.col) == (2, 12)


_OPERATORS = ("+", "-", "*", "//", "%", "/", "<", "<=", ">", ">=")
_PY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
       "//": lambda a, b: a // b, "%": lambda a, b: a % b, "/": lambda a, b: a / b,
       "<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
       ">=": lambda a, b: a >= b}


def _spelt(v: int | bool, shape: str, name: str) -> tuple[str, str]:
    """A `let` for operand `v` and how the expression reads it: a number, a variable, an
    expression (a closure: the path a generated operator takes for anything else)."""
    lit = ("true" if v else "false") if isinstance(v, bool) else (f"({v})" if v < 0 else str(v))
    if shape == "number" and not isinstance(v, bool):
        return "", lit
    if shape == "expression":
        return f"let {name} = {lit} ", f"max({name}, {name})" if not isinstance(v, bool) \
            else f"({name} and true)"
    return f"let {name} = {lit} ", name


@settings(max_examples=300, deadline=None)
@given(op=st.sampled_from(_OPERATORS),
       a=st.one_of(st.integers(-9, 9), st.sampled_from([2**62, -2**62, 2**63 - 1, True])),
       b=st.one_of(st.integers(-9, 9), st.sampled_from([2**62, 3, -(2**63 - 1), False])),
       left=st.sampled_from(["number", "variable", "expression"]),
       right=st.sampled_from(["number", "variable", "expression"]))
def test_arithmetic_is_pythons_within_64_bits(op: str, a: int | bool, b: int | bool, left: str,
                                              right: str) -> None:
    """Every operator on every operand shape (the generated operators read numbers and
    variables inline) gives Python's result, refuses booleans, division by zero and results
    past 64 bits, and names the operand or expression at fault."""
    let_a, ea = _spelt(a, left, "a")
    let_b, eb = _spelt(b, right, "b")
    expr = f"{ea} {op} {eb}"
    text = ("pipeline { ranks = 1  microbatches = 1 }\n"
            f"schedule s {{ rank r {{ {let_a}{let_b}let got = {expr} "
            "require got == want, \"differs\"  F(0, 0) B(0, 0) }}")
    if isinstance(a, bool) or isinstance(b, bool):
        want_error = f"'{op}' needs numbers, got a boolean"
    elif b == 0 and op in ("//", "%", "/"):
        want_error = "division by zero"
    else:
        want = _PY[op](a, b)
        if isinstance(want, bool):
            spelt = "true" if want else "false"
        elif isinstance(want, float):  # ('/': compared where Python spells it plainly)
            spelt = repr(want) if want >= 0 else f"({want!r})"
            assume("e" not in spelt)
        elif not -(2**63 - 1) <= want <= 2**63 - 1:
            with pytest.raises(pipeir.UsageError, match=f"integer overflow: {a} "
                                                        f"{re.escape(op)} {b} is outside"):
                pipeir.parse(text.replace("want", "0"))
            return
        else:
            spelt = f"({want})" if want < 0 else str(want)
        pipeir.parse(text.replace("want", spelt))  # `require` holds: got == Python's result
        with pytest.raises(pipeir.UsageError, match="differs"):
            pipeir.parse(text.replace("want", spelt).replace("got == ", "got != "))
        return
    with pytest.raises(pipeir.UsageError) as e:
        pipeir.parse(text.replace("want", "0"))
    d = e.value.diagnostics[0]
    assert want_error in d.message
    line = text.split("\n")[1]
    col = line.index(" = " + expr) + 4  # (1-based) the left operand, then the right one
    at, spelt = (col, ea) if isinstance(a, bool) else (col + len(ea) + len(op) + 2, eb)
    at += spelt.startswith("(")  # (a parenthesised operand's span is inside its parentheses)
    assert d.span is not None and (d.span.line, d.span.col) == (2, at)
