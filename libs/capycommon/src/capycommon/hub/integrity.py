"""The Hub's file identities, computed while bytes stream in.

An LFS file is known by the sha256 of its content (the tree's `lfs.oid`); any other file by its
git blob sha1: sha1 over `blob <size>\\0` followed by the content (the tree's `oid`). Every
file also gets a sha256, which the store's manifest records.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 1 << 20
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


def git_blob_sha1(content: bytes) -> str:
    """The git blob id of `content`."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content, usedforsecurity=False).hexdigest()


@dataclass(frozen=True)
class Expected:
    """A file as the Hub lists it: its path, size and identity (sha256 when `lfs`, else the
    git blob sha1)."""

    path: str
    size: int
    oid: str
    lfs: bool


class StreamHash:
    """The sha256 of a file's bytes and, for a non-LFS file, its git blob sha1, fed in order.

    The git header needs the size up front: it is the size the Hub listed, so a file of
    another length cannot match."""

    def __init__(self, expected: Expected) -> None:
        self.expected = expected
        self.reset()

    def reset(self) -> None:
        """Back to no bytes: the file restarts from zero."""
        self.count = 0
        self._sha256 = hashlib.sha256()
        self._sha1 = None
        if not self.expected.lfs:
            size = self.expected.size
            self._sha1 = hashlib.sha1(b"blob %d\0" % size, usedforsecurity=False)

    def update(self, chunk: bytes) -> None:
        self.count += len(chunk)
        self._sha256.update(chunk)
        if self._sha1 is not None:
            self._sha1.update(chunk)

    def feed_file(self, path: Path) -> None:
        """Hashes the bytes already in `path` (a partial file being resumed)."""
        with path.open("rb") as file:
            while chunk := file.read(_CHUNK):
                self.update(chunk)

    @property
    def sha256(self) -> str:
        return self._sha256.hexdigest()

    @property
    def oid(self) -> str:
        """The identity the Hub lists for this file, of the bytes fed so far."""
        if self._sha1 is not None:
            return self._sha1.hexdigest()
        return self.sha256

    def mismatch(self) -> str | None:
        """What differs from the listing (size first, then identity), or None when it matches."""
        want = self.expected
        if self.count != want.size:
            return f"{want.path} has {self.count} bytes, the Hub lists {want.size}"
        kind = "sha256" if want.lfs else "git blob sha1"
        if self.oid != want.oid:
            return f"{want.path} has {kind} {self.oid}, the Hub lists {want.oid}"
        return None


def content_range_start(header: str | None) -> int | None:
    """The first byte of a `Content-Range: bytes N-M/TOTAL` answer, or None when the header is
    missing or not of that form (`*` stands for an unknown total)."""
    if header is None:
        return None
    match = _CONTENT_RANGE.match(header.strip())
    if match is None or int(match[2]) < int(match[1]):
        return None
    return int(match[1])


def etag_value(header: str | None) -> str | None:
    """An ETag without its `W/` prefix and quotes."""
    if header is None:
        return None
    value = header.strip()
    value = value.removeprefix("W/")
    return value.strip('"') or None
