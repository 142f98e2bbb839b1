"""A process's loss of Redis is one warning, however many failures it meets, and its end one
line; failures just after the end belong to the same outage."""

from __future__ import annotations

import logging

import pytest

from capycommon.service import OUTAGE_QUIET_S, Outage, RedisCannotWrite


def _said(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.INFO]


def test_one_warning_per_outage(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="capycommon.service")
    now = [100.0]
    outage = Outage(clock=lambda: now[0])
    outage.ok()
    for _ in range(50):
        outage.failed(ConnectionError("refused"))
    now[0] += 1.5
    outage.ok()
    outage.ok()
    now[0] += 0.1
    outage.failed(ConnectionError("loading"))  # an answer that was on its way
    outage.ok()
    assert _said(caplog) == [
        ("WARNING", "lost Redis; reconnecting"),
        ("INFO", "reconnected to Redis"),
        ("INFO", "reconnected to Redis"),
    ]
    caplog.clear()
    now[0] += OUTAGE_QUIET_S
    outage.failed(ConnectionError("refused"))
    assert _said(caplog) == [("WARNING", "lost Redis; reconnecting")], "a new outage"


def test_refused_writes_are_one_error_until_a_write_succeeds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="capycommon.service")
    outage = Outage()
    for _ in range(20):
        outage.failed(RedisCannotWrite("Errors writing to the AOF file: No space left on device"))
        outage.ok()  # reads still work meanwhile
    outage.wrote()
    outage.wrote()
    said = _said(caplog)
    assert [level for level, _ in said] == ["ERROR", "INFO"]
    assert said[0][1].startswith("Redis refuses writes: it cannot save the role's state")
    assert said[1][1] == "Redis takes writes again"
