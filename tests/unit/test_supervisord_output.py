"""supervisord's own output goes through the launcher, which loses the lines it cannot write
(its output on a full disk) instead of stopping supervisord with them."""

from __future__ import annotations

import io
import os

from capyctl_cli.launcher import _relay


class _FullDisk(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")


def _source(data: bytes) -> io.BufferedReader:
    read, write = os.pipe()
    os.write(write, data)
    os.close(write)
    return open(read, "rb")


def test_lines_are_relayed() -> None:
    out = io.StringIO()
    with _source(b"one\ntwo\n") as source:
        _relay(source, out)
    assert out.getvalue() == "one\ntwo\n"


def test_an_output_that_cannot_be_written_loses_the_lines_and_keeps_reading() -> None:
    with _source(b"Traceback\n" * 5_000) as source:
        _relay(source, _FullDisk())
        assert source.read() == b"", "every line was read"
