"""`.sched` text -> syntax tree. Lark parses (LALR, contextual lexer); a separate transformer
reads positions (`propagate_positions`) into spans; syntax errors become diagnostics."""

from __future__ import annotations

import math
from functools import cache
from typing import Any

from lark import Lark, Token, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken, VisitError
from lark.visitors import Transformer_NonRecursive

from pipeir import limits
from pipeir._nesting import nesting_guard
from pipeir.diagnostics import Note, Source, Span, UsageError
from pipeir.frontend import ast
from pipeir.grammar import grammar_text


@cache
def _lark() -> Lark:
    return Lark(grammar_text(), parser="lalr", lexer="contextual", propagate_positions=True,
                maybe_placeholders=True)


def parse_source(source: Source) -> ast.Module:
    """Parse a whole `.sched` file into a syntax tree, or raise a UsageError at the bad token."""
    with nesting_guard(source.name):
        try:
            tree = _lark().parse(source.text)
        except UnexpectedInput as e:
            raise _syntax_error(source, e) from None
        try:
            module = _ToAst(source).transform(tree)
        except VisitError as e:  # a literal the transformer refuses (an integer too large)
            if isinstance(e.orig_exc, UsageError):
                raise e.orig_exc from None
            raise
    assert isinstance(module, ast.Module)
    return module


# ---- syntax errors ---------------------------------------------------------------------------

# Known mistakes, matched on the parser state they leave (Lark's `match_examples`); each comes
# in two positions because the state differs at the start of a block and after a statement.
_EXAMPLES: dict[str, list[str]] = {
    "a range is written 'a .. b'": [
        "schedule s { rank r { for i in 0 to 3 { } } }",
        "schedule s { rank r { F(0,0) for i in 0 to 3 { } } }",
        "schedule s { rank r { for i in 0, 3 { } } }",
        "schedule s { rank r { F(0,0) for i in 0, 3 { } } }",
    ],
    "arguments are separated by ','": [
        "schedule s { rank r { F(0 1) } }",
        "schedule s { rank r { F(0,0) F(0 1) } }",
    ],
    "'rank' takes a variable or a rank number: 'rank r { ... }' or 'rank 0 { ... }'": [
        "schedule s { rank { } }",
        "schedule s { rank r { } rank { } }",
    ],
    "a schedule needs a name and a body: 'schedule NAME { ... }'": [
        "schedule { }",
        "pipeline { } schedule { }",
    ],
    "statements do not end with ';'": [
        "schedule s { rank r { F(0,0); } }",
        "schedule s { rank r { F(0,0) F(0,1); } }",
        "let x = 1;",
    ],
}


def _describe(token_type: str) -> str:
    if token_type == "$END":
        return "end of file"
    try:
        pattern = _lark().get_terminal(token_type).pattern
    except KeyError:
        return token_type.lower()
    if pattern.type == "str":
        return f"'{pattern.value}'"
    return {"NAME": "a name", "INT": "an integer", "FLOAT": "a number", "STRING": "a string",
            "SCHEDNAME": "a schedule name", "COMP_OP": "an operator",
            "ADD_OP": "an operator", "MUL_OP": "an operator"}.get(
        token_type, token_type.lower())


def _syntax_error(source: Source, e: UnexpectedInput) -> UsageError:
    try:
        label = e.match_examples(_lark().parse, _EXAMPLES, use_accepts=True)
    except Exception:  # lark 1.3.1 matcher can raise TypeError on some parser states
        label = None
    notes = (Note(label),) if isinstance(label, str) else ()
    if isinstance(e, UnexpectedCharacters):
        pos = e.pos_in_stream or 0
        char = source.text[pos] if pos < len(source.text) else "?"
        span = Span(source, e.line, e.column, e.line, e.column + 1)
        return UsageError(f"unexpected character {char!r}", span, notes)
    raw: set[str] = set(getattr(e, "accepts", None) or getattr(e, "expected", None) or ())
    expected = sorted({_describe(t) for t in raw})
    shown = ", ".join(expected[:8]) + (", ..." if len(expected) > 8 else "")
    if isinstance(e, UnexpectedToken) and e.token.type != "$END":
        tok = e.token
        span = Span(source, tok.line, tok.column, tok.end_line or tok.line,
                    tok.end_column or tok.column + len(tok))
        what = f"'{tok}'" if tok.type not in ("INT", "FLOAT", "STRING") else \
            f"{_describe(tok.type)} {tok}"
        opener = _unclosed_brace(source, (tok.line, tok.column)) if "'}'" in expected else None
        if opener is not None and opener[0].line < tok.line:  # (a '{' on the line is plain)
            notes = (*notes, Note(f"this '{{' is still open: its '}}' belongs before '{tok}'",
                                      opener[0]))
        return UsageError(f"unexpected {what}; expected {shown}", span, notes)
    text = source.text[:-1] if source.text.endswith("\n") else source.text
    lines = text.split("\n")  # as Lark counts lines: "\r" or "\x0c" do not end one
    line = len(lines)
    col = len(lines[-1].rstrip("\r")) + 1
    eof = Span(source, line, max(1, col - 1) if col > 1 else 1, line, col)
    opener = _unclosed_brace(source)
    if "'}'" in expected and opener is not None:
        return UsageError("unexpected end of file: a '{' is never closed", eof,
                          (Note(opener[1], opener[0]), *notes))
    return UsageError(f"unexpected end of file; expected {shown}", eof, notes)


def _unclosed_brace(source: Source, before: tuple[int, int] | None = None
                    ) -> tuple[Span, str] | None:
    """The '{' left open at the end of the text (or before `before`, a (line, col)), comments
    and strings skipped, with a note's text; None when every '{' is closed.

    NOTE: counting alone blames the outermost block: in `schedule s { rank r { for ... { F(r,
    i)` followed by two '}'s, those close the `for` and the `rank`, and the `schedule`'s '{'
    is the one left. Indentation tells which '{' the writer forgot to close: a '}' that begins
    its line less indented than the line of the '{' it would match was written for an outer
    block, so that '{' (the first such, in reading order) is the unclosed one.
    """
    stack: list[tuple[int, int, int]] = []  # (line, col, indentation of the '{'s line)
    misaligned: tuple[int, int, int, int] | None = None  # the '{' and the line of its '}'
    for lineno, text in enumerate(source.text.split("\n"), 1):
        indent = len(text) - len(text.lstrip(" \t"))
        in_str = False
        for col, ch in enumerate(text, 1):
            if before is not None and (lineno, col) >= before:
                break
            if ch == '"':
                in_str = not in_str
            elif in_str:
                continue
            elif ch == "#":
                break
            elif ch == "{":
                stack.append((lineno, col, indent))
            elif ch == "}" and stack:
                line, col0, opened = stack.pop()
                if misaligned is None and col == indent + 1 and indent < opened:
                    misaligned = (line, col0, opened, lineno)
    if not stack:
        return None
    if misaligned is not None:
        line, col, _, closer = misaligned
        return (Span(source, line, col, line, col + 1),
                f"this '{{' has no matching '}}' (the '}}' on line {closer} is indented for an "
                "outer block)")
    line, col, _ = stack[-1]
    return Span(source, line, col, line, col + 1), "this '{' has no matching '}'"


# ---- tree -> AST ------------------------------------------------------------------------------
def _flat(items: Any) -> tuple[Any, ...]:
    return tuple(x for x in items if x is not None)


@v_args(meta=True)
class _ToAst(Transformer_NonRecursive):  # type: ignore[type-arg]
    def __init__(self, source: Source):
        super().__init__()
        self.source = source

    def _span(self, meta: Any) -> Span:
        if getattr(meta, "empty", False):
            return Span(self.source, 1, 1, 1, 1)
        return Span(self.source, meta.line, meta.column, meta.end_line, meta.end_column)

    def _tspan(self, tok: Token) -> Span:
        return Span(self.source, tok.line or 1, tok.column or 1, tok.end_line or tok.line or 1,
                    tok.end_column or (tok.column or 1) + len(tok))

    # top level
    def start(self, meta: Any, items: list[Any]) -> ast.Module:
        return ast.Module(self._span(meta), _flat(items))

    def pipeline_block(self, meta: Any, c: list[Any]) -> ast.PipelineBlock:
        return ast.PipelineBlock(self._span(meta), _flat(c))

    def costs_block(self, meta: Any, c: list[Any]) -> ast.CostsBlock:
        return ast.CostsBlock(self._span(meta), _flat(c))

    def setting(self, meta: Any, c: list[Any]) -> ast.Setting:
        (name, name_span), value = c
        return ast.Setting(self._span(meta), name, name_span, value)

    def dotted_name(self, meta: Any, c: list[Token]) -> tuple[str, Span]:
        return ".".join(str(t) for t in c), self._span(meta)

    def schedule_def(self, meta: Any, c: list[Any]) -> ast.ScheduleDef:
        name, params, body = c
        return ast.ScheduleDef(self._span(meta), str(name), self._tspan(name),
                               params or (), body)

    def params(self, meta: Any, c: list[Any]) -> tuple[ast.Param, ...]:
        return _flat(c)

    def param(self, meta: Any, c: list[Any]) -> ast.Param:
        return ast.Param(self._span(meta), str(c[0]), c[1])

    def schedule_use(self, meta: Any, c: list[Any]) -> ast.ScheduleUse:
        name, args = c
        return ast.ScheduleUse(self._span(meta), str(name), self._tspan(name), args or ())

    def args_kw(self, meta: Any, c: list[Any]) -> tuple[ast.KwArg, ...]:
        return _flat(c)

    def kwarg(self, meta: Any, c: list[Any]) -> ast.KwArg:
        return ast.KwArg(self._span(meta), str(c[0]), c[1])

    # statements
    def block(self, meta: Any, c: list[Any]) -> tuple[ast.Stmt, ...]:
        return _flat(c)

    def let_stmt(self, meta: Any, c: list[Any]) -> ast.Let:
        return ast.Let(self._span(meta), str(c[0]), self._tspan(c[0]), c[1])

    def for_stmt(self, meta: Any, c: list[Any]) -> ast.For:
        var, start, rng, stop, body = c
        range_span = Span(self.source, start.span.line, start.span.col,
                          stop.span.end_line, stop.span.end_col)
        del rng
        return ast.For(self._span(meta), str(var), self._tspan(var), start, stop, range_span, body)

    def if_stmt(self, meta: Any, c: list[Any]) -> ast.If:
        cond, then = c[0], c[1]
        rest = [x for x in c[2:] if x is not None]
        orelse: tuple[ast.Stmt, ...] = ()
        if rest:
            orelse = rest[0] if isinstance(rest[0], tuple) else (rest[0],)
        return ast.If(self._span(meta), cond, then, orelse)

    def rank_each(self, meta: Any, c: list[Any]) -> ast.RankEach:
        return ast.RankEach(self._span(meta), str(c[0]), self._tspan(c[0]), c[1])

    def rank_one(self, meta: Any, c: list[Any]) -> ast.RankOne:
        rank = c[0]
        if isinstance(rank, Token):
            rank = ast.Num(self._tspan(rank), self._int(rank, self._tspan(rank)))
        return ast.RankOne(self._span(meta), rank, c[1])

    def call_stmt(self, meta: Any, c: list[Any]) -> ast.CallStmt:
        return ast.CallStmt(self._span(meta), str(c[0]), self._tspan(c[0]), _flat(c[1:]))

    def overlap_stmt(self, meta: Any, c: list[Any]) -> ast.Overlap:
        return ast.Overlap(self._span(meta), c[0], c[1])

    def _func(self, meta: Any, c: list[Any], expr: Any, body: Any) -> ast.FuncDef:
        params = tuple(str(t) for t in c[1:-1] if t is not None)
        return ast.FuncDef(self._span(meta), str(c[0]), self._tspan(c[0]), params, expr, body)

    def func_expr(self, meta: Any, c: list[Any]) -> ast.FuncDef:
        return self._func(meta, c, c[-1], None)

    def func_block(self, meta: Any, c: list[Any]) -> ast.FuncDef:
        return self._func(meta, c, None, c[-1])

    def require_stmt(self, meta: Any, c: list[Any]) -> ast.Require:
        msg = str(c[1])[1:-1] if c[1] is not None else None
        return ast.Require(self._span(meta), c[0], msg)

    # expressions
    def binop(self, meta: Any, c: list[Any]) -> ast.BinOp:
        left, op, right = c
        return ast.BinOp(self._span(meta), str(op), self._tspan(op), left, right)

    boolop = binop

    def unary(self, meta: Any, c: list[Any]) -> ast.Unary:
        return ast.Unary(self._span(meta), str(c[0]), c[1])

    def int_lit(self, meta: Any, c: list[Token]) -> ast.Num:
        return ast.Num(self._span(meta), self._int(c[0], self._span(meta)))

    def _int(self, token: Token, span: Span) -> int:
        try:
            return limits.to_int(str(token))
        except ValueError as e:
            raise UsageError(str(e), span) from None

    def float_lit(self, meta: Any, c: list[Token]) -> ast.Num:
        value = float(c[0])
        if not math.isfinite(value):  # (1e400 is inf: every later sum of it a NaN)
            raise UsageError(f"number {c[0]} is beyond a 64-bit float (about 1.8e308 in "
                             f"magnitude)", self._span(meta))
        return ast.Num(self._span(meta), value)

    def str_lit(self, meta: Any, c: list[Token]) -> ast.Str:
        return ast.Str(self._span(meta), str(c[0])[1:-1])

    def var(self, meta: Any, c: list[Token]) -> ast.Var:
        return ast.Var(self._span(meta), str(c[0]))

    def call(self, meta: Any, c: list[Any]) -> ast.Call:
        return ast.Call(self._span(meta), str(c[0]), self._tspan(c[0]), _flat(c[1:]))

    def list_lit(self, meta: Any, c: list[Any]) -> ast.ListLit:
        return ast.ListLit(self._span(meta), _flat(c))
