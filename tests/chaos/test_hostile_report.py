"""The findings of the report on a joined host's trust, each replayed as it was done, with
nothing but host `ha`'s own files, against a server where `s1` runs on `hb`: the takeover
of `s1` and its prompts, the scheduler's crash loop on one malformed key, the router's full
read that stopped for good, and the script that stalled the cluster."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import httpx
import pytest
import redis

from capycommon.state import keys
from hostilehost import SMALL, Hostile, forged_record, refused_by_metrics
from serversetup import ask
from support import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _as_ha(hostile: Hostile) -> Iterator[Callable[..., Any]]:
    client = hostile.as_host("ha")
    try:
        yield client.execute_command
    finally:
        client.close()


@pytest.fixture
def ha(hostile: Hostile) -> Iterator[Callable[..., Any]]:
    """One command at a time, as ha's own user sends it."""
    yield from _as_ha(hostile)


def test_the_reported_takeover_moves_nothing_and_reaches_no_prompt(
    hostile: Hostile, ha: Callable[..., Any]
) -> None:
    """ha writes hb's record of s1 as its own, at generation 50, lists it, points its ingress
    at its own listener and announces both: the takeover of the report."""
    assert hostile.listener is not None
    before = hostile.s1()
    counted = refused_by_metrics(hostile)
    ha("SET", keys.instance("ha", "s1", 0), forged_record({"generation": 50}))
    ha("SADD", keys.instances("ha"), "s1:0")
    ha("SET", keys.host_info("ha"), json.dumps({"ingress": hostile.listener.address}))
    ha(
        "PUBLISH",
        keys.host_notifications("ha"),
        '{"kind": "instance", "id": "s1:0", "version": 50}',
    )
    ha("PUBLISH", keys.host_notifications("ha"), '{"kind": "host", "id": "ha", "version": 0}')
    wait_for(lambda: refused_by_metrics(hostile) > counted, 30, "the forged record refused")
    client = hostile.openai()
    for _ in range(3):
        assert ask(client, "s1")
    assert hostile.s1().generation == before.generation
    assert hostile.placed() == "hb"
    assert hostile.listener.accepted == 0
    listed = hostile.ok("list", "deployments")
    assert "s1" in listed
    assert "hb" in listed.split("s1", 1)[1].splitlines()[0]


@pytest.mark.parametrize(
    "kind", ["instance", "memory", "info", "engines", "models", "engine-load", "unknown-host"]
)
def test_one_malformed_key_stops_no_service(
    hostile: Hostile, ha: Callable[..., Any], kind: str
) -> None:
    """Bad JSON in each key the control plane reads, or a valid record naming a host nobody
    knows: the report's crash loop of the scheduler."""
    beats = hostile.beats()
    counted = refused_by_metrics(hostile)
    bad = f"{{not json {kind} {time.monotonic_ns()}"

    def write() -> None:
        """Written again until refused: ha's own agents rewrite some of these keys."""
        if kind == "instance":
            ha("SET", keys.instance("ha", "bogus", 0), bad)
            ha("SADD", keys.instances("ha"), "bogus:0")
        elif kind == "unknown-host":
            stranger = forged_record({"deployment": "bogus", "host": "zz", "port": len(bad)})
            ha("SET", keys.instance("ha", "bogus", 0), stranger)
            ha("SADD", keys.instances("ha"), "bogus:0")
        elif kind == "engine-load":
            ha("HSET", keys.engine_load("ha"), "s1:0", bad)
        else:
            ha("SET", f"{keys.host_prefix('ha')}:{kind}", bad)
        note = '{"kind": "instance", "id": "bogus:0", "version": 1}'
        ha("PUBLISH", keys.host_notifications("ha"), note)

    def refused() -> bool:
        write()
        return refused_by_metrics(hostile) > counted

    wait_for(refused, 30, f"the bad {kind} refused", interval=0.5)
    assert ask(hostile.openai(), "s1")
    assert hostile.ok("list", "deployments")
    assert hostile.beats() == beats


def test_the_router_reads_its_table_again_after_bad_data(hostile: Hostile) -> None:
    """A change no notification announced is still seen by the full read every 5 s, after
    all the bad data above (the report's router stopped re-reading for good)."""
    hostile.deploy("quiet", model="small", engine_config=SMALL, placement={"hosts": ["hb"]})
    key = hostile.server.credentials()["api_key"]
    url = f"http://{hostile.server.inference}/v1/models"

    def listed() -> set[str]:
        answer = httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=10)
        return {model["id"] for model in answer.json()["data"]}

    wait_for(lambda: "quiet" in listed(), 30, "quiet to be listed")
    raw = cast(bytes, hostile.redis.get(keys.deployment("quiet")))
    record = json.loads(raw) | {"stopped": True}
    hostile.redis.set(keys.deployment("quiet"), json.dumps(record))  # and no notification
    wait_for(lambda: "quiet" not in listed(), 30, "the router's full read to see quiet stopped")


def test_a_host_runs_no_script_of_its_own(hostile: Hostile, ha: Callable[..., Any]) -> None:
    """The report's 8 s busy loop: refused before it runs, and everything serves on."""
    with pytest.raises(redis.exceptions.NoPermissionError):
        ha("EVAL", "local i = 0 while true do i = i + 1 end", "0")
    assert ask(hostile.openai(), "s1")
