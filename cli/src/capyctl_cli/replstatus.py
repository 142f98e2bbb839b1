"""What `capyctl status` shows of replicated servers: which Redis is the primary, what this
server's own Redis is, how far each replica lags, and whether the Sentinels have a quorum."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import redis
from pydantic import BaseModel

from capycommon.paths import StatePaths
from capycommon.redistarget import CONTROL_USER, read_secret
from capycommon.replication import PEER_USER, read_secrets
from capycommon.replsettings import SERVICE

if TYPE_CHECKING:
    from capycommon.state.replicas import ReplicationInfo
    from capycommon.state.stores import Blocking

# A Sentinel that does not answer in this long is shown as not answering.
SENTINEL_TIMEOUT_S = 1.0


class ReplicaStatus(BaseModel):
    address: str
    state: str
    behind_bytes: int
    lag_s: int


class SentinelStatus(BaseModel):
    address: str
    # The primary it names (HOST:PORT), or None when it did not answer.
    primary: str | None
    # Its CKQUORUM answer, or why it could not be asked.
    said: str
    quorum: bool


class ReplicationStatus(BaseModel):
    # The primary a majority of the Sentinels name, or None without a majority.
    primary: str | None
    # This server's own Redis: "master" or "slave", as Redis says.
    role: str
    # A replica's link to its primary: "up" or "down".
    link: str | None
    replicas: list[ReplicaStatus]
    sentinels: list[SentinelStatus]
    # Whether a majority of the Sentinels can elect a new primary (CKQUORUM OK).
    quorum: bool


def collect(paths: StatePaths, state: Blocking) -> ReplicationStatus | None:
    """The replication of the server on `paths`, its primary read through `state`; None
    for a server that does not replicate."""
    if not paths.replication_secrets.exists():
        return None
    topology = state(lambda s: s.topology.read())
    found: ReplicationInfo = state(lambda s: s.replicas.info())
    local = _local_info(paths)
    sentinels = [_sentinel(paths, address) for address in topology.sentinels] if topology else []
    named = Counter(s.primary for s in sentinels if s.primary is not None)
    primary, votes = named.most_common(1)[0] if named else (None, 0)
    majority = len(sentinels) // 2 + 1
    return ReplicationStatus(
        primary=primary if votes >= majority else None,
        role=str(local.get("role", "unknown")),
        link=local.get("master_link_status"),
        replicas=[ReplicaStatus(**vars(replica)) for replica in found.replicas],
        sentinels=sentinels,
        quorum=sum(s.quorum for s in sentinels) >= majority,
    )


def _local_info(paths: StatePaths) -> dict[str, Any]:
    """What this server's own Redis says of its replication (its unix socket)."""
    password = read_secret(paths.redis_password)
    try:
        with redis.Redis(
            unix_socket_path=str(paths.redis_socket),
            username=CONTROL_USER,
            password=password,
            socket_timeout=SENTINEL_TIMEOUT_S,
        ) as client:
            info: dict[str, Any] = client.info("replication")
            return info
    except (redis.RedisError, OSError):
        return {}


def _sentinel(paths: StatePaths, address: str) -> SentinelStatus:
    host, _, port = address.rpartition(":")
    secrets = read_secrets(paths.replication_secrets)
    try:
        with redis.Redis(
            host=host.strip("[]"),
            port=int(port),
            username=PEER_USER,
            password=secrets.peer,
            ssl=True,
            ssl_certfile=str(paths.server_certificate),
            ssl_keyfile=str(paths.server_key),
            ssl_ca_certs=str(paths.authority_certificate),
            socket_timeout=SENTINEL_TIMEOUT_S,
            socket_connect_timeout=SENTINEL_TIMEOUT_S,
        ) as client:
            named = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
            said = _text(client.execute_command("SENTINEL", "CKQUORUM", SERVICE))
    except redis.ResponseError as exc:
        return SentinelStatus(address=address, primary=None, said=str(exc), quorum=False)
    except (redis.RedisError, OSError) as exc:
        return SentinelStatus(
            address=address, primary=None, said=f"unreachable: {exc}", quorum=False
        )
    primary = f"{_text(named[0])}:{_text(named[1])}" if named else None
    return SentinelStatus(address=address, primary=primary, said=said, quorum=said.startswith("OK"))


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def render(found: ReplicationStatus) -> list[tuple[str, str]]:
    """The lines `capyctl status` adds for replication."""
    mine = "the primary" if found.role == "master" else f"a replica (link {found.link or '?'})"
    replicas = "; ".join(
        f"{r.address} {r.state}, {r.behind_bytes} B behind, acknowledged {r.lag_s} s ago"
        for r in found.replicas
    )
    answering = sum(s.primary is not None for s in found.sentinels)
    quorum = "quorum OK" if found.quorum else "NO QUORUM: a lost primary is not replaced"
    return [
        ("primary", found.primary or "none agreed by a majority of the Sentinels"),
        ("this server's redis", mine),
        ("replicas", replicas or "none connected"),
        ("sentinels", f"{answering} of {len(found.sentinels)} answer; {quorum}"),
    ]
