"""The syntax tree of a `.sched` file: plain frozen dataclasses, each with its source span."""

from __future__ import annotations

from dataclasses import dataclass

from pipeir.diagnostics import Span


@dataclass(frozen=True)
class Node:
    span: Span


# ---- expressions ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Num(Node):
    value: int | float


@dataclass(frozen=True)
class Str(Node):
    value: str


@dataclass(frozen=True)
class Var(Node):
    name: str


@dataclass(frozen=True)
class Call(Node):
    name: str
    name_span: Span
    args: tuple[Expr, ...]


@dataclass(frozen=True)
class ListLit(Node):
    items: tuple[Expr, ...]


@dataclass(frozen=True)
class Unary(Node):
    op: str  # '-' or 'not'
    operand: Expr


@dataclass(frozen=True)
class BinOp(Node):
    op: str
    op_span: Span
    left: Expr
    right: Expr


Expr = Num | Str | Var | Call | ListLit | Unary | BinOp


# ---- statements ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting(Node):
    name: str  # dotted for cost settings: "F", "stage.2.F", ...
    name_span: Span
    value: Expr


@dataclass(frozen=True)
class PipelineBlock(Node):
    settings: tuple[Setting, ...]


@dataclass(frozen=True)
class CostsBlock(Node):
    settings: tuple[Setting, ...]


@dataclass(frozen=True)
class Let(Node):
    name: str
    name_span: Span
    value: Expr


@dataclass(frozen=True)
class For(Node):
    var: str
    var_span: Span
    start: Expr
    stop: Expr
    range_span: Span
    body: tuple[Stmt, ...]


@dataclass(frozen=True)
class If(Node):
    cond: Expr
    then: tuple[Stmt, ...]
    orelse: tuple[Stmt, ...]


@dataclass(frozen=True)
class RankEach(Node):
    var: str
    var_span: Span
    body: tuple[Stmt, ...]


@dataclass(frozen=True)
class RankOne(Node):
    rank: Expr
    body: tuple[Stmt, ...]


@dataclass(frozen=True)
class CallStmt(Node):
    name: str
    name_span: Span
    args: tuple[Expr, ...]


@dataclass(frozen=True)
class Overlap(Node):
    """Two ops a rank runs together (DualPipe's overlapped forward/backward pair)."""

    first: CallStmt
    second: CallStmt


@dataclass(frozen=True)
class FuncDef(Node):
    name: str
    name_span: Span
    params: tuple[str, ...]
    expr: Expr | None  # `def f(x) = expr`
    body: tuple[Stmt, ...] | None  # `def g(x) { ... }`


@dataclass(frozen=True)
class Require(Node):
    cond: Expr
    message: str | None


Stmt = (Let | For | If | RankEach | RankOne | CallStmt | Overlap | FuncDef | Require
        | PipelineBlock)


# ---- top level -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Param(Node):
    name: str
    default: Expr | None


@dataclass(frozen=True)
class ScheduleDef(Node):
    name: str
    name_span: Span
    params: tuple[Param, ...]
    body: tuple[Stmt, ...]


@dataclass(frozen=True)
class KwArg(Node):
    name: str
    value: Expr


@dataclass(frozen=True)
class ScheduleUse(Node):
    name: str
    name_span: Span
    args: tuple[KwArg, ...]


Item = PipelineBlock | CostsBlock | ScheduleDef | ScheduleUse | FuncDef | Let


@dataclass(frozen=True)
class Module(Node):
    items: tuple[Item, ...]
