"""Sizes and durations as people write them: 512MiB, 24GiB, 1.5TiB, 100B; 500ms, 30s, 5m, 1h."""

from __future__ import annotations

import re

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
# No machine holds more than this: a larger size is a mistaken unit or a typo.
MAX_SIZE = 64 << 40
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB)\s*$")


def parse_size(text: str) -> int:
    """Bytes in `text`; raises ValueError naming the accepted units."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(
            f"{text!r} is not a size; write it like 512MiB or 24GiB (B, KiB, MiB, GiB, TiB)"
        )
    size = int(float(match[1]) * _UNITS[match[2]])
    if size > MAX_SIZE:
        raise ValueError(f"{text!r} is more than any machine holds (at most 64TiB); check the unit")
    return size


def format_size(size: int) -> str:
    """The largest unit that keeps the number at or above 1, with one decimal."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if size >= _UNITS[unit]:
            return f"{size / _UNITS[unit]:.1f} {unit}"
    return f"{size} B"


def format_size_exact(size: int) -> str:
    """The largest unit that holds `size` whole, so `parse_size` reads back the same bytes."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if size and size % _UNITS[unit] == 0:
            return f"{size // _UNITS[unit]}{unit}"
    return f"{size}B"


_DURATION_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*$")


def parse_duration(text: str) -> float:
    """Seconds in `text`, to the millisecond; raises ValueError naming the accepted units."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a duration; write it like 500ms, 30s, 5m or 1h")
    return round(float(match[1]) * _DURATION_MS[match[2]]) / 1000


def format_duration(seconds: float) -> str:
    """The largest unit that holds `seconds` whole (to the millisecond): 300.0 -> 5m."""
    ms = round(seconds * 1000)
    for unit in ("h", "m", "s"):
        if ms and ms % _DURATION_MS[unit] == 0:
            return f"{ms // _DURATION_MS[unit]}{unit}"
    return f"{ms}ms"
