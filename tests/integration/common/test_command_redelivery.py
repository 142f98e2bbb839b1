"""A command a host's hostd was handed but had not acknowledged when the primary was lost is
handed out again by the new primary: streams and their consumer groups replicate, and
hostd's reader reads its delivered history again after any read that failed."""

from __future__ import annotations

import pytest

from capycommon.domain.commands import Stop
from capycommon.service import REDIS_ERRORS, redis_client
from capycommon.state.stores import State
from capycommon.state.streams import Reader
from sentinels import replicated_servers
from support import wait_for, wait_for_async

HOST = "gpu1"


@pytest.mark.anyio
async def test_a_command_handed_out_before_the_failover_is_handed_out_again() -> None:
    with replicated_servers() as servers:
        client = redis_client(servers.control_target())
        try:
            state = State(client)
            reader = Reader(state.commands.group(HOST))
            await reader.group.ensure()
            stop = Stop(deployment="m1", generation=3, reason="test")
            await state.commands.send(HOST, stop, epoch=2)
            assert await reader.read(count=16) == []  # its delivered history: none yet
            handed = await reader.read(count=16, block_ms=1000)  # then the new ones
            assert len(handed) == 1
            # On a replica before the primary is lost, as every acknowledged write is there
            # within the replication's lag.
            assert await state.replicas.confirm(2, 5) == 2
            lost = servers.primary()
            assert lost is not None
            servers.kill(lost)
            wait_for(
                lambda: servers.primary() not in (None, lost), timeout=30, what="a new primary"
            )
            again: list[tuple[str, dict[bytes, bytes]]] = []

            async def handed_again() -> bool:
                try:
                    again.extend(await Reader(state.commands.group(HOST)).read(count=16))
                except REDIS_ERRORS:  # the lost primary's connections failing: read again
                    return False
                return bool(again)

            await wait_for_async(handed_again, timeout=30, what="the command handed out again")
            assert [entry_id for entry_id, _ in again] == [handed[0][0]]
            assert again[0][1] == handed[0][1], "the same command, its epoch beside it"
        finally:
            await client.aclose()
