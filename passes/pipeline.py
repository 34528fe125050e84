"""Pipeline strings: `interleave{v=2},split-backward{mode=h2},verify`.

One grammar for every pass: `name{key=value,...}` items separated by commas. Option types come
from the pass's dataclass field annotations, so a pass never parses its own options and every
bad name, option or value is a diagnostic that points into the pipeline string. Passes made in
Python are held to the same types when they join a pipeline (`expect_pass`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

from pipeir import limits
from pipeir.diagnostics import Note, PipeirError, Source, Span, UsageError, did_you_mean
from pipeir.passes import registry
from pipeir.passes.base import LoweredPass, PassBase, check_options
from pipeir.passes.context import CommModel

SOURCE_NAME = "<passes>"


@dataclass(frozen=True)
class Pipeline:
    """Parsed passes in order, each with where it was written (None when built in Python)."""

    passes: tuple[PassBase, ...]
    spans: tuple[Span | None, ...]

    def __post_init__(self) -> None:
        # (passes built in Python never met the pipeline syntax's checks: the same here)
        for p in self.passes:
            expect_pass(p)

    @classmethod
    def of(cls, passes: Sequence[PassBase]) -> Pipeline:
        if isinstance(passes, PassBase | str):
            raise TypeError(f"expected a list of passes, got {type(passes).__name__} "
                            f"{passes!r}: " + ("put it in a list" if isinstance(passes, PassBase)
                                                else "a pipeline string goes to "
                                                     "parse_pipeline(...)"))
        if not isinstance(passes, Iterable):
            raise TypeError(f"expected a list of passes, got {type(passes).__name__}")
        got = tuple(passes)  # (a generator too)
        return cls(got, (None,) * len(got))

    @property
    def comm(self) -> CommModel:
        """The communication model the lowered programs run under: the last lowered pass
        that decides it (`overlap`: overlapped), else blocking sends."""
        for p in reversed(self.passes):
            if isinstance(p, LoweredPass) and p.comm is not None:
                return p.comm
        return "blocking"

    def then(self, p: PassBase) -> Pipeline:
        """This pipeline with `p` appended (flags such as `--overlap` spell a pass)."""
        return Pipeline((*self.passes, p), (*self.spans, None))

    def __str__(self) -> str:
        return ",".join(p.spec() for p in self.passes)


@dataclass(frozen=True)
class OptionInfo:
    """One option of a pass, as `pipeirc passes` lists it."""

    name: str
    type_text: str
    default: Any
    choices: tuple[str, ...] | None


def options_of(cls: type[PassBase]) -> list[OptionInfo]:
    """The options a pass takes, from its dataclass fields."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
        choices = _choices(hint)
        out.append(OptionInfo(f.name, _type_text(hint), default, choices))
    return out


def parse_pipeline(spec: str, extra: Mapping[str, type[PassBase]] | None = None) -> Pipeline:
    """Parse a pipeline string; `extra` adds passes (e.g. from `--pass-plugin`) by name."""
    if not isinstance(spec, str):
        raise TypeError(f"parse_pipeline: expected a pipeline string such as "
                        f"'split-backward,overlap', got {type(spec).__name__}")
    for name, cls in (extra or {}).items():
        if not (isinstance(cls, type) and issubclass(cls, PassBase)):
            raise TypeError(f"parse_pipeline(extra=...): '{name}' must name a pass class "
                            f"(a subclass of Pass or LoweredPass), got {cls!r}")
    src = Source(SOURCE_NAME, spec)
    if "\n" in spec:
        raise UsageError("a pipeline string is one line", _span(src, spec.index("\n"), 1))
    return _Parser(src, extra or {}).parse()


class _Parser:
    def __init__(self, src: Source, extra: Mapping[str, type[PassBase]]):
        self.src = src
        self.text = src.text
        self.i = 0
        self.extra = extra

    def parse(self) -> Pipeline:
        passes, spans = [], []
        self._ws()
        if self.i == len(self.text):
            raise UsageError("empty pipeline: name at least one pass, e.g. "
                             "'interleave{v=2},verify'", _span(self.src, 0, 1))
        while True:
            p, span = self._item()
            passes.append(p)
            spans.append(span)
            self._ws()
            if self.i == len(self.text):
                return Pipeline(tuple(passes), tuple(spans))
            if self.text[self.i] != ",":
                raise self._error(f"expected ',' between passes, found "
                                  f"'{self.text[self.i]}'", self.i)
            self.i += 1
            self._ws()
            if self.i == len(self.text):
                raise self._error("expected a pass name after ','", self.i - 1)

    def _item(self) -> tuple[PassBase, Span]:
        start = self.i
        name = self._word()
        if not name:
            found = self.text[self.i]
            raise self._error(f"expected a pass name, found '{found}'", self.i)
        name_span = _span(self.src, start, len(name))
        cls = self._lookup(name, name_span)
        raw: dict[str, tuple[str, Span]] = {}
        self._ws()
        self._no_parentheses(name)
        if self.i < len(self.text) and self.text[self.i] == "{":
            open_at = self.i
            self.i += 1
            while True:
                self._ws()
                if self.i == len(self.text):
                    raise self._error("unclosed '{': expected '}'", open_at)
                if self.text[self.i] == "}":
                    self.i += 1
                    break
                key, value, kspan, vspan = self._option()
                if key in raw:
                    raise UsageError(f"option '{key}' of pass '{name}' is given twice", kspan)
                raw[key] = (value, vspan)
                self._ws()
                if self.i < len(self.text) and self.text[self.i] == ",":
                    self.i += 1
                    self._ws()
                    if self.i < len(self.text) and self.text[self.i] == "}":
                        raise self._error("expected an option after ','", self.i)
                    continue
                if self.i < len(self.text) and self.text[self.i] == "}":
                    continue
                if self.i == len(self.text):
                    raise self._error("unclosed '{': expected '}'", open_at)
                raise self._error(f"expected ',' or '}}' after an option, found "
                                  f"'{self.text[self.i]}'", self.i)
        span = _span(self.src, start, self.i - start)
        return build_pass(cls, raw, span, name_span), span

    def _no_parentheses(self, name: str) -> None:
        """`interleave(v=2)`, as a Python call is written: say that options go in braces and
        show the pass spelt that way, rather than "expected ','" at the parenthesis."""
        if self.i == len(self.text) or self.text[self.i] not in "([":
            return
        close = self.text.find(")" if self.text[self.i] == "(" else "]", self.i)
        inner = self.text[self.i + 1:close] if close >= 0 else "..."
        raise UsageError(f"options of pass '{name}' go in braces, not "
                         f"'{self.text[self.i]}'", _span(self.src, self.i, 1),
                         (Note(f"did you mean '{name}{{{inner}}}'?" if inner.strip() else
                               f"did you mean '{name}'?"),))

    def _option(self) -> tuple[str, str, Span, Span]:
        kstart = self.i
        key = self._word()
        if not key:
            raise self._error(f"expected an option name, found '{self.text[self.i]}'", self.i)
        kspan = _span(self.src, kstart, len(key))
        self._ws()
        if self.i == len(self.text) or self.text[self.i] != "=":
            raise UsageError(f"expected '=' and a value after option '{key}'", kspan)
        self.i += 1
        self._ws()
        vstart = self.i
        while self.i < len(self.text) and self.text[self.i] not in ",}{ \t":
            self.i += 1
        value = self.text[vstart:self.i]
        if not value:
            raise self._error(f"expected a value for option '{key}'",
                              min(vstart, len(self.text) - 1))
        return key, value, kspan, _span(self.src, vstart, len(value))

    def _lookup(self, name: str, span: Span) -> type[PassBase]:
        if name in self.extra:
            return self.extra[name]
        if name not in registry.targets():
            known = (*self.extra, *registry.names())
            raise UsageError(f"unknown pass '{name}'", span,
                             (*did_you_mean(name, known),
                              Note("`pipeirc passes` lists the available passes")))
        try:
            return registry.get(name)
        except PipeirError as e:
            raise UsageError(e.message, span) from None

    def _word(self) -> str:
        start = self.i
        while self.i < len(self.text) and (self.text[self.i].isalnum()
                                           or self.text[self.i] in "-_."):
            self.i += 1
        return self.text[start:self.i]

    def _ws(self) -> None:
        while self.i < len(self.text) and self.text[self.i] in " \t":
            self.i += 1

    def _error(self, message: str, at: int) -> UsageError:
        return UsageError(message, _span(self.src, at, 1))


def build_pass(cls: type[PassBase], raw: Mapping[str, tuple[str, Span | None]],
               span: Span | None = None, name_span: Span | None = None) -> PassBase:
    """An instance of `cls` from option texts, converted by the field annotations."""
    opts = {o.name: o for o in options_of(cls)}
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for key, (text, vspan) in raw.items():
        if key not in opts:
            listed = ", ".join(opts) if opts else "none"
            raise UsageError(f"pass '{cls.name}' has no option '{key}' (options: {listed})",
                             vspan if vspan is None else _key_span(vspan, key),
                             did_you_mean(key, opts))
        values[key] = convert(text, hints[key], f"option '{key}' of pass '{cls.name}'", vspan)
    missing = [o.name for o in opts.values()
               if o.default is dataclasses.MISSING and o.name not in values]
    if missing:
        raise UsageError(f"pass '{cls.name}' needs option{'s' if len(missing) > 1 else ''} "
                         f"{', '.join(missing)}, e.g. {cls.name}{{{missing[0]}=...}}",
                         name_span or span)
    try:
        return cls(**values)
    except UsageError as e:  # the pass's own validation (see base.OptionError)
        option = getattr(e, "option", None)
        where = raw[option][1] if isinstance(option, str) and option in raw else span
        raise UsageError(e.message, where, e.diagnostics[0].notes) from None


def _key_span(vspan: Span, key: str) -> Span:
    """The span of `key` in `key=value`, given the span of the value (no spaces assumed)."""
    line = vspan.source.line(vspan.line)
    col = line.rfind(key, 0, vspan.col - 1)
    if col < 0:
        return vspan
    return Span(vspan.source, vspan.line, col + 1, vspan.line, col + 1 + len(key))


def convert(text: str, hint: Any, what: str, span: Span | None) -> Any:
    """Convert an option's text to the annotated type, or explain what was expected."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        args = get_args(hint)
        if type(None) in args and text.lower() == "none":
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return convert(text, rest[0], what, span)
    if origin is Literal:
        choices = [str(a) for a in get_args(hint)]
        if text in choices:
            return get_args(hint)[choices.index(text)]
        raise UsageError(f"{what} must be one of {', '.join(choices)}, got '{text}'", span,
                         did_you_mean(text, choices))
    if hint is bool:
        if text.lower() in ("true", "1", "yes", "on"):
            return True
        if text.lower() in ("false", "0", "no", "off"):
            return False
        raise UsageError(f"{what} must be true or false, got '{text}'", span)
    # NOTE: integers are 64-bit and numbers finite, as in `.sched` files (`pipeir.limits`):
    # recompute{budget=1e400} was inf and reorder{budget_ms=10**23} a Python big integer,
    # both accepted and both meaningless
    # (a whole number written for a float stays an int, as Python's `budget=2` would: the
    # pass reads it as a number, and messages and `spec` show what was written, not 2.0)
    whole = re.fullmatch(r"[+-]?[0-9]+", text.strip())  # (ASCII: int() reads other digits)
    if hint is int or (hint is float and whole):
        if not whole:
            raise UsageError(f"{what} must be an integer, got '{text}'", span)
        value = int(text, 10)
        if hint is float and limits.int_overflow(value):
            return float(value)  # (a number option: 10**20 as 1e20 is)
        if limits.int_overflow(value):
            raise UsageError(f"{what} is out of range: integers are 64-bit, at most "
                             f"{limits.MAX_INT:,}", span)
        return value
    if hint is float:
        try:
            if not text.isascii():  # (float() reads other digits; the language does not)
                raise ValueError(text)
            number = float(text)
        except ValueError:
            raise UsageError(f"{what} must be a number, got '{text}'", span) from None
        if not math.isfinite(number):
            raise UsageError(f"{what} must be a finite number, got '{text}'", span)
        return number
    if hint is str:
        return text
    raise UsageError(f"{what} has a type the pipeline syntax cannot spell ({hint!r})", span)


def expect_pass(p: object) -> PassBase:
    """`p` if it is a pass whose options have their annotated types (what `convert` makes
    of a pipeline string: `recompute{all=false}` is False, while `Recompute(all="false")`
    in Python was a true string and recomputed every forward); else a TypeError, or the
    UsageError `convert` gives for the same value written in a pipeline."""
    if not isinstance(p, PassBase):
        hint = ""
        if isinstance(p, type) and issubclass(p, PassBase):
            hint = f": give an instance, {p.__name__}()"
        elif isinstance(p, str):
            hint = (": a pipeline is one string of passes ('split-backward,overlap'), read by "
                    "parse_pipeline, not a list of names")
        raise TypeError(f"expected a pass, got {type(p).__name__} {p!r}{hint}")
    if not isinstance(getattr(type(p), "name", None), str):
        raise TypeError(f"pass class {type(p).__name__} has no name: give it one, e.g. "
                        f"name: ClassVar[str] = \"my-pass\"")
    check_options(p)  # (made passes were checked; one whose class skipped it is caught here)
    return p


def _choices(hint: Any) -> tuple[str, ...] | None:
    if get_origin(hint) is Literal:
        return tuple(str(a) for a in get_args(hint))
    return None


def _type_text(hint: Any) -> str:
    origin = get_origin(hint)
    if origin is Literal:
        return "|".join(str(a) for a in get_args(hint))
    if origin in (Union, types.UnionType):
        return " | ".join("none" if a is type(None) else _type_text(a) for a in get_args(hint))
    return {int: "int", float: "float", bool: "bool", str: "str"}.get(hint, repr(hint))


def _span(src: Source, offset: int, length: int) -> Span:
    """A span on the (single) line of a pipeline string; offsets are 0-based."""
    return Span(src, 1, offset + 1, 1, offset + 1 + max(1, length))
