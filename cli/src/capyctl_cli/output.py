"""The one place the CLI prints: tables and summaries as text, or JSON on request."""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from capycommon.errors import CapyError


def emit_json(data: Any) -> None:
    indent = 2 if sys.stdout.isatty() else None
    print(json.dumps(data, indent=indent, default=str))


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
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    if as_json:
        print(json.dumps({"code": exc.code, "message": exc.message}), file=sys.stderr)
    else:
        print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
