"""What a GGUF file's metadata says, read from its header without loading any tensor.

A GGUF file begins with `GGUF`, its version (2 or 3: 64-bit lengths), the count of its tensors
and of its metadata pairs; each pair is a key (a length and UTF-8 bytes), a value type and
the value. Scalars and strings are kept; arrays (the tokenizer's vocabulary, tens of
thousands of strings) are skipped, never held. The reading is bounded: a header larger
than `MAX_HEADER` bytes, or one with more pairs than `MAX_PAIRS`, is read no further.

A decision model says so in its metadata: `<architecture>.decision.type` names the head
(`clef`, `laya`, `kev`, `lfm2-d1`, ...); llama.cpp reports `decisions` among its output
modalities for it, and answers `/v1/systemone` only then.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

MAGIC = b"GGUF"
MAX_HEADER = 64 << 20
MAX_PAIRS = 1 << 16
MAX_STRING = 1 << 20
DECISION_SUFFIX = ".decision.type"
# Value types: struct format of each scalar; 8 is a string, 9 an array.
SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
STRING, ARRAY = 8, 9

Value = int | float | bool | str


class NotGguf(ValueError):
    """The file is not a GGUF file this reader knows (or its header is cut short)."""


class _Header:
    """A bounded reader of the header's bytes."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.read_bytes = 0

    def take(self, size: int) -> bytes:
        self.read_bytes += size
        if self.read_bytes > MAX_HEADER:
            raise NotGguf(f"the metadata runs past {MAX_HEADER >> 20} MiB")
        found = self.file.read(size)
        if len(found) != size:
            raise NotGguf("the header is cut short")
        return found

    def scalar(self, form: str) -> Value:
        value: Value = struct.unpack(form, self.take(struct.calcsize(form)))[0]
        return value

    def string(self) -> str:
        size = int(self.scalar("<Q"))
        if size > MAX_STRING:
            raise NotGguf(f"a string of {size} bytes")
        return self.take(size).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Value | None:
        """The value of type `kind`; None for an array, skipped."""
        if kind in SCALARS:
            return self.scalar(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            raise NotGguf(f"value type {kind} is not one GGUF defines")
        inner, count = int(self.scalar("<I")), int(self.scalar("<Q"))
        if inner in SCALARS:
            self.take(struct.calcsize(SCALARS[inner]) * count)
        else:
            for _ in range(count):
                self.value(inner)
        return None


def pairs(path: Path) -> Iterator[tuple[str, Value]]:
    """The file's metadata pairs with scalar or string values, in order. NotGguf for a file
    that is not a GGUF file (or not a regular one); OSError where it cannot be read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise NotGguf("not a regular file")
        header = _Header(file)
        if header.take(4) != MAGIC:
            raise NotGguf("it does not begin with GGUF")
        version = int(header.scalar("<I"))
        if version not in (2, 3):
            raise NotGguf(f"GGUF version {version} (2 and 3 are read)")
        header.scalar("<Q")  # the tensors
        count = int(header.scalar("<Q"))
        if count > MAX_PAIRS:
            raise NotGguf(f"{count} metadata pairs")
        for _ in range(count):
            key = header.string()
            value = header.value(int(header.scalar("<I")))
            if value is not None:
                yield key, value


def decision_type(path: Path) -> str | None:
    """The decision head a GGUF file declares (`<architecture>.decision.type`); None for a
    file that declares none. NotGguf or OSError as `pairs`."""
    for key, value in pairs(path):
        if key.endswith(DECISION_SUFFIX) and isinstance(value, str) and value:
            return value
    return None
