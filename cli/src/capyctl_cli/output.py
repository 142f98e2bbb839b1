"""The one place the CLI prints: text, tables and summaries, JSON on request, and errors.

Commands hand it a model (an answer of the management API, a report) and the text that
shows it; `--json` prints the model's JSON instead. The role launcher's echo of its
processes' logs is the one other writer: a stream of lines, not output of a command.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from capycommon.errors import CapyError

# What --json prints: a model or a list of them (or, for commands without one, plain data).
Printable = BaseModel | Sequence[BaseModel] | Mapping[str, Any] | Sequence[Mapping[str, Any]]


def echo(text: str = "", *, err: bool = False) -> None:
    """Print a line (to stderr with `err`), flushed so that a pipe sees it at once."""
    print(text, file=sys.stderr if err else sys.stdout, flush=True)


def emit_json(data: Printable) -> None:
    indent = 2 if sys.stdout.isatty() else None
    echo(json.dumps(_plain(data), indent=indent, default=str))


def show(data: Printable, text: str | Callable[[], str], *, as_json: bool) -> None:
    """`data` as JSON with --json, else the text that shows it."""
    if as_json:
        emit_json(data)
    else:
        echo(text if isinstance(text, str) else text())


def _plain(data: Printable) -> object:
    if isinstance(data, BaseModel):
        return data.model_dump(mode="json")
    if isinstance(data, Mapping):
        return data
    return [_plain(item) for item in data]


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers], *([_cell(v) for v in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def pairs(items: Sequence[tuple[str, Any]]) -> str:
    width = max((len(k) for k, _ in items), default=0)
    return "\n".join(f"{k.ljust(width)}  {_cell(v)}" for k, v in items)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def error(exc: CapyError, *, as_json: bool = False, debug: bool = False) -> None:
    """An expected error as one line (or one JSON object) on stderr; its traceback first
    with `capyctl --debug`."""
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    if as_json:
        echo(json.dumps({"code": exc.code, "message": exc.message}), err=True)
    else:
        echo(f"error [{exc.code}]: {exc.message}", err=True)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
