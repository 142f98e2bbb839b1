"""Sizes as people write them: 512MiB, 24GiB, 1.5TiB, 100B."""

from __future__ import annotations

import re

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB)\s*$")


def parse_size(text: str) -> int:
    """Bytes in `text`; raises ValueError naming the accepted units."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(
            f"{text!r} is not a size; write it like 512MiB or 24GiB (B, KiB, MiB, GiB, TiB)"
        )
    return int(float(match[1]) * _UNITS[match[2]])


def format_size(size: int) -> str:
    """The largest unit that keeps the number at or above 1, with one decimal."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if size >= _UNITS[unit]:
            return f"{size / _UNITS[unit]:.1f} {unit}"
    return f"{size} B"
