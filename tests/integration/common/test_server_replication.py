"""Three servers replicating one state, as the server role configures them
(`replicatedservers`): a write on the primary reaches both replicas; the Sentinels reach a
quorum; the discover user finds the primary and changes nothing; and when the primary's
machine is lost (its Redis and Sentinel killed), another becomes the primary, and the lost
one, started again as the launcher starts it, comes back as its replica."""

from __future__ import annotations

from functools import partial

import pytest
import redis

from capycommon.replication import DISCOVER_USER
from capycommon.replsettings import SERVICE
from replicatedservers import follows, holds, quorum, send, settled, three_servers
from support import wait_for


def test_three_servers_replicate_and_fail_over() -> None:
    with three_servers() as servers:
        first, second, third = servers
        settled(servers)
        assert "replicaof" not in first.paths.redis_conf.read_text()
        for server in (second, third):
            conf = server.paths.redis_conf.read_text()
            assert f"replicaof {first.host} {first.redis_port}" in conf
        assert all(server.primary() == first.host for server in servers)
        wait_for(partial(quorum, second), 15, "the three Sentinels to reach a quorum")

        with second.sentinel(DISCOVER_USER) as discover:
            answer = send(discover, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
            assert answer == [first.host.encode(), str(first.redis_port).encode()]
            for refused in (
                ("SENTINEL", "FAILOVER", SERVICE),
                ("SENTINEL", "SET", SERVICE, "down-after-milliseconds", "60000"),
                ("SENTINEL", "REMOVE", SERVICE),
            ):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    send(discover, *refused)

        first.kill()  # its machine lost: its Redis and its Sentinel
        promoted = wait_for(
            lambda: (found := second.primary()) != first.host and found, 20, "a new primary"
        )
        new, other = (second, third) if promoted == second.host else (third, second)
        assert promoted == new.host
        with new.control() as client:
            client.set("capyctl:test:replicated", "two")
        wait_for(partial(holds, other, b"two"), 10, "the other server to follow the new primary")

        first.start()  # as the launcher starts it again: it asks the Sentinels first
        assert f"replicaof {new.host} {new.redis_port}" in first.paths.redis_conf.read_text()
        # A full resynchronisation first waits 5 s for other replicas to take it too. (A
        # loaded machine may see the new primary miss its pings and fail over once more:
        # the lost server then follows whichever the Sentinels name.)
        wait_for(lambda: follows(first, new.primary() or ""), 20, "the lost server to be a replica")
        wait_for(partial(holds, first, b"two"), 10, "the lost server to hold the new write")
        with first.sentinel(DISCOVER_USER) as discover:  # its users as Sentinel saved them
            answer = send(discover, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
            assert answer[0].decode() in (second.host, third.host)
            with pytest.raises(redis.exceptions.NoPermissionError):
                send(discover, "SENTINEL", "FAILOVER", SERVICE)
