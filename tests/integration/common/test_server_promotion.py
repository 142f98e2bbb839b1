"""Two of three servers lost at once, as docs/roles/server.md says it: the one left has no
majority of Sentinels, so nothing fails over on its own; `SENTINEL FAILOVER capyctl` on its
Sentinel makes its Redis the primary by hand; and the two lost servers, started again as
the launcher starts them, come back as its replicas, holding what was written on it."""

from __future__ import annotations

from functools import partial

import redis

from capycommon.replsettings import SERVICE
from replicatedservers import KEY, Server, follows, holds, send, settled, three_servers
from support import holds_for, wait_for


def _failover(server: Server) -> bytes | None:
    """SENTINEL FAILOVER on `server`'s Sentinel; None while it answers NOGOODSLAVE (it has
    not yet seen its replica lose the primary)."""
    try:
        with server.sentinel() as client:
            answer: bytes = send(client, "SENTINEL", "FAILOVER", SERVICE)
    except redis.exceptions.ResponseError as exc:
        if "NOGOODSLAVE" in str(exc):
            return None
        raise
    return answer


def test_the_server_left_is_promoted_by_hand_and_the_others_follow_it() -> None:
    with three_servers() as servers:
        first, second, third = servers
        settled(servers)
        first.kill()
        third.kill()
        holds_for(lambda: second.primary() == first.host, 3, "no failover without a majority")

        wait_for(partial(_failover, second), 15, "the Sentinel left to promote its Redis", 1)
        wait_for(lambda: second.primary() == second.host, 10, "the promotion")
        wait_for(partial(_writable, second), 10, "the promoted Redis to take writes")
        with second.control() as client:
            client.set(KEY, "two")

        for server in (first, third):
            server.start()  # as the launcher starts it: it asks the Sentinels first
            conf = server.paths.redis_conf.read_text()
            assert f"replicaof {second.host} {second.redis_port}" in conf
        for server in (first, third):  # a full resynchronisation waits 5 s for others
            wait_for(partial(follows, server, second.host), 20, f"{server.host} to follow")
            wait_for(partial(holds, server, b"two"), 10, f"{server.host} to hold the write")


def _writable(server: Server) -> bool:
    try:
        with server.control() as client:
            return bool(send(client, "ROLE")[0] == b"master")
    except (redis.RedisError, OSError):
        return False
