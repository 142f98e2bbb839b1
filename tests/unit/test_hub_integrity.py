"""File identities as the Hub lists them: git blob sha1 and sha256, computed while streaming
and across a resume; Content-Range and ETag parsing."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from capycommon.hub.integrity import (
    Expected,
    StreamHash,
    content_range_start,
    etag_value,
    git_blob_sha1,
)

CONTENT = b'{"hidden_size": 64}\n' * 1000


def test_the_git_blob_sha1_is_what_git_computes(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(CONTENT)
    git = subprocess.run(
        ["git", "hash-object", str(tmp_path / "f")], capture_output=True, check=True, text=True
    )
    assert git_blob_sha1(CONTENT) == git.stdout.strip()
    assert git_blob_sha1(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"


@pytest.mark.parametrize("lfs", [False, True])
def test_a_streamed_file_matches_its_listing_in_any_chunking(lfs: bool) -> None:
    oid = hashlib.sha256(CONTENT).hexdigest() if lfs else git_blob_sha1(CONTENT)
    digest = StreamHash(Expected("f", len(CONTENT), oid, lfs=lfs))
    for start in range(0, len(CONTENT), 777):
        digest.update(CONTENT[start : start + 777])
    assert digest.mismatch() is None
    assert digest.sha256 == hashlib.sha256(CONTENT).hexdigest()


def test_a_resumed_hash_first_reads_the_partial_bytes(tmp_path: Path) -> None:
    partial = tmp_path / "f.partial"
    partial.write_bytes(CONTENT[:5000])
    digest = StreamHash(Expected("f", len(CONTENT), git_blob_sha1(CONTENT), lfs=False))
    digest.feed_file(partial)
    assert digest.count == 5000
    digest.update(CONTENT[5000:])
    assert digest.mismatch() is None


def test_a_wrong_size_or_byte_is_named() -> None:
    expected = Expected("model.bin", len(CONTENT), hashlib.sha256(CONTENT).hexdigest(), lfs=True)
    short = StreamHash(expected)
    short.update(CONTENT[:-1])
    assert (
        short.mismatch() == f"model.bin has {len(CONTENT) - 1} bytes, the Hub lists {len(CONTENT)}"
    )
    wrong = StreamHash(expected)
    wrong.update(b"X" + CONTENT[1:])
    assert "model.bin has sha256" in (wrong.mismatch() or "")
    blob = StreamHash(Expected("config.json", len(CONTENT), git_blob_sha1(CONTENT), lfs=False))
    blob.update(b"X" + CONTENT[1:])
    assert "git blob sha1" in (blob.mismatch() or "")


@pytest.mark.parametrize(
    ("header", "start"),
    [
        ("bytes 100-199/200", 100),
        ("bytes 0-0/1", 0),
        ("bytes 5-9/*", 5),
        (" bytes 7-9/10 ", 7),
        ("bytes 9-5/10", None),
        ("bytes */10", None),
        ("items 0-1/2", None),
        ("", None),
        (None, None),
    ],
)
def test_content_range_gives_the_first_byte(header: str | None, start: int | None) -> None:
    assert content_range_start(header) == start


def test_an_etag_loses_its_weak_prefix_and_quotes() -> None:
    assert etag_value('W/"abc"') == "abc"
    assert etag_value('"abc"') == "abc"
    assert etag_value("abc") == "abc"
    assert etag_value('""') is None
    assert etag_value(None) is None


def test_a_reset_hash_starts_from_no_bytes() -> None:
    digest = StreamHash(Expected("f", len(CONTENT), git_blob_sha1(CONTENT), lfs=False))
    digest.update(b"bytes of another file")
    digest.reset()
    digest.update(CONTENT)
    assert digest.mismatch() is None
