"""The launcher's count of Redis's failed starts, read from its log (aofrepair.StartLog):
only what Redis wrote since the launch counts, a start that loaded clears the count, and a
log read in pieces or rotated counts the same."""

from __future__ import annotations

from pathlib import Path

from capyctl_cli.aofrepair import StartLog

STARTING = "1:C 05 Dec 2026 04:09:42.205 # oO0OoO0OoO0Oo Redis is starting oO0OoO0OoO0Oo\n"
LOADING = "1:M 05 Dec 2026 04:09:42.211 * Reading RDB base file on AOF loading...\n"
FAILED = "1:M 05 Dec 2026 04:09:42.211 # Bad file format reading the append only file\n"
READY = "1:M 05 Dec 2026 04:09:42.300 * Ready to accept connections\n"
# Redis 7.0 (Debian 12's) says it so.
READY_7_0 = "1:M 05 Dec 2026 04:09:42.300 * The server is now ready to accept connections at x\n"


def append(log: Path, text: str) -> None:
    with log.open("a") as file:
        file.write(text)


def test_only_the_starts_since_the_launch_count(tmp_path: Path) -> None:
    log = tmp_path / "redis.log"
    log.write_text(STARTING + FAILED + STARTING + FAILED)  # an earlier launch's
    starts = StartLog(log)
    assert starts.failed_in_a_row() == 0
    append(log, STARTING + LOADING + FAILED)
    assert starts.failed_in_a_row() == 1
    append(log, STARTING + LOADING)
    assert starts.failed_in_a_row() == 2


def test_a_start_that_loads_clears_the_count(tmp_path: Path) -> None:
    log = tmp_path / "redis.log"
    starts = StartLog(log)  # no log yet: none
    assert starts.failed_in_a_row() == 0
    log.write_text(STARTING + FAILED + STARTING)
    assert starts.failed_in_a_row() == 2
    append(log, "1:M 05 Dec 2026 04:09:42.300 * Ready to accept ")  # a line cut in two
    assert starts.failed_in_a_row() == 2
    append(log, "connections\n")
    assert starts.failed_in_a_row() == 0
    append(log, STARTING + FAILED)
    assert starts.failed_in_a_row() == 1


def test_redis_7_0s_ready_line_clears_the_count_too(tmp_path: Path) -> None:
    """Else every start of Debian 12's Redis counted as failed, and a role whose Redis was
    restarted once gave up at the next moment supervisord showed it exited."""
    log = tmp_path / "redis.log"
    starts = StartLog(log)
    log.write_text(STARTING + LOADING + READY_7_0)
    assert starts.failed_in_a_row() == 0
    append(log, STARTING + FAILED + STARTING + LOADING + READY_7_0)
    assert starts.failed_in_a_row() == 0


def test_a_rotated_log_is_read_from_its_start(tmp_path: Path) -> None:
    log = tmp_path / "redis.log"
    log.write_text(STARTING + READY + "x" * 4096)
    starts = StartLog(log)
    log.write_text(STARTING + FAILED)  # supervisord moved the full one aside
    assert starts.failed_in_a_row() == 1
