"""hostd reads an engine log's last lines from its end, however long the log is."""

from __future__ import annotations

from pathlib import Path

from capyctl_hostd.engines import TAIL_BYTES, tail


def test_the_last_lines_of_a_long_log(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    lines = [f"line {i} " + "x" * 80 for i in range(5 * TAIL_BYTES // 80)]
    log.write_text("\n".join(lines) + "\n")
    assert log.stat().st_size > 4 * TAIL_BYTES
    assert tail(log, 50) == lines[-50:]


def test_a_last_line_without_its_newline_counts(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text("one\ntwo\nthree")
    assert tail(log, 2) == ["two", "three"]
    assert tail(log, 10) == ["one", "two", "three"], "a short log whole"


def test_a_line_cut_by_the_window_is_left_out(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text("y" * (2 * TAIL_BYTES) + "\nlast\n")
    assert tail(log, 5) == ["last"], "never a fragment of a longer line"


def test_no_log_no_lines(tmp_path: Path) -> None:
    assert tail(tmp_path / "missing.log") == []
    (tmp_path / "empty.log").write_text("")
    assert tail(tmp_path / "empty.log") == []
