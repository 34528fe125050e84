"""Cost files: a JSON object or TOML document of cost settings (the format `pipeirc profile`
writes), read into dotted settings, each with the span of its key so that an error points at
the line. Nested tables are joined with dots (`[stage.2]` / `F = 1.5` is `stage.2.F`).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeir import jsonread, limits
from pipeir.diagnostics import Source, Span, UsageError
from pipeir.sim.cost_settings import MAX_COST, show_value

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 reads JSON cost files only
    tomllib = None


def read_cost_file(path: str | os.PathLike[str]) -> dict[str, tuple[Any, Span | None]]:
    """A JSON or TOML cost file as dotted settings, each with the span of its key when it can
    be found in the text (so errors point at the line)."""
    src = limits.read_input(path, "cost file (JSON or TOML)")  # (it checks `path` is one)
    p = Path(path)
    is_json = p.suffix.lower() == ".json"
    data = jsonread.loads(src, "JSON cost file", "cost") if is_json else _parse_toml(src)
    if not isinstance(data, dict):
        raise UsageError("a cost file must be a JSON object or a TOML table, "
                         f"got {show_value(data)}", Span(src, 1, 1, 1, 2))
    flat: dict[str, tuple[Any, jsonread.Path]] = {}
    twice = _flatten(data, (), flat)
    if is_json:
        places = jsonread.positions(src)

        def key_span(name: str) -> Span | None:
            place = places.get(flat[name][1])
            return place.key if place is not None else None
    else:
        def key_span(name: str) -> Span | None:
            return _find_key(src, name)
    if twice is not None:
        raise UsageError(f"cost '{twice}' is given twice, once as a dotted key and once in a "
                         "table (the file would keep one without a word)",
                         key_span(twice) or Span(src, 1, 1, 1, 2))
    if flat.get("version", (1,))[0] == 1 and \
            all(k in ("version", "meta") or k.startswith("meta.") for k in flat):  # wrong file?
        raise UsageError("the cost file sets no costs; leave --costs out for the defaults "
                         "(F = 1, B = 2, free links)", Span(src, 1, 1, 1, 2))
    return {k: (v, key_span(k)) for k, (v, _) in flat.items()}


def _too_long(src: Source) -> UsageError:
    return UsageError(f"{src.name}: a number has too many digits to read; costs must be at "
                      f"most {MAX_COST:g}")


def _parse_toml(src: Source) -> Any:
    if tomllib is None:  # pragma: no cover - Python 3.10
        raise UsageError(f"{src.name}: TOML cost files need Python 3.11; use JSON "
                         "(a .json file) instead")
    try:
        return tomllib.loads(src.text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        m = re.search(r"\(at line (\d+), column (\d+)\)", msg)
        if m is None:
            raise UsageError(f"{src.name}: malformed TOML cost file: {msg}") from None
        line, col = int(m.group(1)), int(m.group(2))
        raise UsageError(f"malformed TOML cost file: {msg[:m.start()].strip()}",
                         Span(src, line, col, line, col + 1)) from None
    except ValueError:  # Python refuses to convert integers of over 4300 digits
        raise _too_long(src) from None


def flat_settings(data: Mapping[str, Any]) -> dict[str, Any]:
    """A cost file's contents as nested tables (what `pipeir.runtime.profile.cost_settings`
    returns) as dotted settings for `CostModel.from_settings`, less the `meta` table."""
    flat: dict[str, tuple[Any, jsonread.Path]] = {}
    _flatten({k: v for k, v in data.items() if k != "meta"}, (), flat)
    return {k: v for k, (v, _) in flat.items()}


def _flatten(data: Mapping[str, Any], path: jsonread.Path,
             out: dict[str, tuple[Any, jsonread.Path]]) -> str | None:
    """Nested tables into dotted names in `out` (name -> (value, its path in the file)); the
    first name given twice (`"stage.1.F"` beside `[stage.1] F`), if any."""
    for k, v in data.items():
        name = ".".join(map(str, (*path, k)))
        if isinstance(v, dict) and name != "meta":
            twice = _flatten(v, (*path, k), out)
            if twice is not None:
                return twice
        elif name in out:
            out[name] = (v, (*path, k))  # the error points at the second
            return name
        else:
            out[name] = (v, (*path, k))
    return None


def _find_key(src: Source, name: str) -> Span | None:
    """In a TOML file (which keeps no positions either), best effort: where a dotted name's
    last part is written, found by looking for each part after the previous one (`[stage.1]`
    then `F =`); None rather than a wrong line when the parts cannot be found in order."""
    parts = name.split(".")
    pos = 0
    for part in parts[:-1]:
        m = re.compile(r'(?<![\w-])"?' + re.escape(part) + r'"?(?![\w-])').search(src.text, pos)
        if m is None:
            return None
        pos = m.end()
    last = re.escape(parts[-1])
    m = re.compile(r'(?<![\w-])("' + last + r'"\s*:|' + last + r'\s*=|"' + last + r'"\s*=)'
                   ).search(src.text, pos)
    if m is None:
        return None
    return src.span(m.start(), m.start() + len(m.group(0).rstrip(":= \t")))
