"""Which instance records the control plane believes: a host's record counts as its
deployment's instance only by the scheduler's own choices (the generation it drew and the
host it placed it on); a refused record's live engine is an orphan, stopped on its own host."""

from __future__ import annotations

import logging
import time

import pytest

from capycommon.deployments.load import parse_deployment
from capycommon.domain.desired import DeploymentRecord
from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.state.ownership import owners
from capycommon.state.quarantine import REFUSALS
from support import instance_record


def deployment(generation: int, host: str | None) -> DeploymentRecord:
    now = time.time()
    document = parse_deployment({"name": "s1", "engine": "vllm", "model": "m"}, "test")
    return DeploymentRecord(
        name="s1",
        revision=1,
        digest="d",
        document=document,
        created_at=now,
        updated_at=now,
        generation=generation,
        host=host,
    )


def record(
    host: str, generation: int, state: InstanceState = InstanceState.READY
) -> InstanceRecord:
    return instance_record("s1", host, generation=generation, state=state, port=8100)


def test_the_placed_hosts_record_is_the_instance_and_a_forged_higher_one_an_orphan(
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = REFUSALS.counts[("ha", "instance")]
    real, forged = record("hb", 5), record("ha", 50)
    with caplog.at_level(logging.WARNING):
        instances, orphans = owners([forged, real], {"s1": deployment(5, "hb")})
    assert instances == {"s1": real}
    assert orphans == [forged]  # stopped on ha, its own host, and nowhere else
    assert REFUSALS.counts[("ha", "instance")] == before + 1
    assert "claims generation 50; the scheduler drew 5" in caplog.text
    owners([forged, real], {"s1": deployment(5, "hb")})
    assert REFUSALS.counts[("ha", "instance")] == before + 1, "the same value counts once"


def test_the_current_generation_on_another_host_is_refused() -> None:
    real, forged = record("hb", 5), record("ha", 5)
    instances, orphans = owners([forged, real], {"s1": deployment(5, "hb")})
    assert instances == {"s1": real}
    assert orphans == [forged]


def test_while_the_placed_host_has_not_written_no_other_host_stands_in() -> None:
    """Between the scheduler drawing generation 6 on hc and hc's first write, neither a
    forged record of an older generation nor the old host's is taken for the instance."""
    old, forged = record("hb", 5, InstanceState.STOPPED), record("ha", 4)
    instances, orphans = owners([old, forged], {"s1": deployment(6, "hc")})
    assert instances == {}
    assert orphans == [forged]


def test_an_older_generation_on_the_placed_host_is_still_the_instance() -> None:
    """A start draws the next generation before hostd writes it: until then the record of
    the one before, on the same host, stays the instance (as it always did)."""
    older = record("hb", 5, InstanceState.STOPPED)
    instances, _ = owners([older], {"s1": deployment(6, "hb")})
    assert instances == {"s1": older}


def test_a_record_of_before_placements_were_kept_is_weighed_by_its_generation_alone() -> None:
    real, forged = record("hb", 5), record("ha", 9)
    instances, orphans = owners([real, forged], {"s1": deployment(5, None)})
    assert instances == {"s1": real}
    assert orphans == [forged]
