"""Engine load entries: their JSON round trip, reading the hash, and when an engine last
worked."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from capycommon.domain.hosts import EngineLoad
from capycommon.engines.control import Load
from capycommon.state.load import decode
from capyctl_hostd.loads import entry
from support import instance_record

BUSY = EngineLoad(generation=3, running=2, waiting=1, last_active_at=1005.0, read_at=1005.0)
READY = instance_record("chat", "h", generation=3, since=1000.0)


def test_an_entry_reads_back_the_same() -> None:
    assert EngineLoad.model_validate_json(BUSY.model_dump_json()) == BUSY
    raw = BUSY.model_dump_json()
    assert decode({b"chat:0": raw.encode(), "code:1": raw}, "k") == {"chat:0": BUSY, "code:1": BUSY}
    assert decode({}, "k") == {}


def test_an_entry_refuses_unknown_and_missing_fields() -> None:
    with pytest.raises(ValidationError, match="extra"):
        EngineLoad.model_validate_json(BUSY.model_dump_json()[:-1] + ', "queued": 4}')
    with pytest.raises(ValidationError, match="read_at"):
        EngineLoad.model_validate(
            {"generation": 3, "running": 0, "waiting": 0, "last_active_at": 1.0}
        )


def test_an_engine_with_work_is_active_when_read() -> None:
    for now in (Load(running=1, waiting=0), Load(running=0, waiting=2)):
        found = entry(READY, now, 1010.0, BUSY)
        assert (found.running, found.waiting) == (now.running, now.waiting)
        assert (found.last_active_at, found.read_at, found.generation) == (1010.0, 1010.0, 3)


def test_an_idle_engine_keeps_when_it_last_worked() -> None:
    assert entry(READY, Load(running=0, waiting=0), 1010.0, BUSY).last_active_at == 1005.0


def test_an_idle_engine_without_its_own_entry_is_idle_since_its_state() -> None:
    idle = Load(running=0, waiting=0)
    assert entry(READY, idle, 1010.0, None).last_active_at == 1000.0
    earlier_launch = BUSY.model_copy(update={"generation": 2})
    assert entry(READY, idle, 1010.0, earlier_launch).last_active_at == 1000.0
