"""Which Redis a replicated server's Redis follows when the server starts.

The Sentinels decide which Redis is the primary; a starting server asks them (every server's,
its own included, should it still run) before it writes its Redis's configuration, so that
a server coming back after a failover starts as a replica of the new primary instead of as a
second primary. When none answers (the first start of the cluster, or every server down at
once), it follows what this server's Sentinel last recorded, and before that the initial
primary kept from its first start: itself for the first server, the server that invited it
for the others.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from capycommon.authority import CERT_FILE
from capycommon.paths import StatePaths
from capycommon.replication import (
    PEER_USER,
    Secrets,
    keep_initial_primary,
    read_initial_primary,
)
from capycommon.replsettings import SERVICE, ReplicationSection
from capyctl_cli import sentinelconf

log = logging.getLogger("capyctl.launcher")

# How long a Sentinel may take to connect and answer: a server that does not answer within it
# is down, or not started yet.
ASK_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Answer:
    """What one Sentinel names the primary, and the version of its configuration (its
    config epoch: each failover makes a higher one)."""

    primary: str
    epoch: int


def choose(
    paths: StatePaths,
    replication: ReplicationSection,
    shared: Secrets,
    timeout: float = ASK_TIMEOUT_S,
) -> str:
    """The address of the primary this server's Redis should follow (its own: it is the
    primary). The Sentinel that heard of the latest failover decides (one just restarted
    still names the primary it knew, under an older epoch, until its peers tell it), and
    among equals, the most of them. The first start keeps what it chose as the initial
    primary."""
    advertise = replication.advertise
    assert advertise is not None, "only a replicated server has a primary to follow"
    initial = read_initial_primary(paths.initial_primary)
    answers = [
        found
        for host in replication.servers
        if (found := ask_sentinel(paths, host, replication.sentinel_port, shared, timeout))
    ]
    recorded = sentinelconf.recorded_primary(paths)
    if answers:
        latest = max(answer.epoch for answer in answers)
        named = Counter(answer.primary for answer in answers if answer.epoch == latest)
        primary = named.most_common(1)[0][0]
        log.info("the Sentinels name %s the primary (config epoch %d)", primary, latest)
    elif recorded is not None:
        primary = recorded
        log.info("no Sentinel answered; following %s, as this server's Sentinel recorded", primary)
    else:
        primary = initial or advertise
        log.info("no Sentinel answered; following %s, the initial primary", primary)
    if initial is None:
        keep_initial_primary(paths.initial_primary, primary)
    return primary


def ask_sentinel(
    paths: StatePaths, host: str, port: int, shared: Secrets, timeout: float
) -> Answer | None:
    """The primary as the Sentinel at `host` names it, asked over mutual TLS with this
    server's certificate, as the Sentinels' own user; None if it does not answer in time or
    watches none. The address is GET-MASTER-ADDR-BY-NAME's (during a failover, the replica
    being promoted, where SENTINEL MASTER still names the lost primary), the epoch SENTINEL
    MASTER's."""
    client = redis.Redis(
        host=host,
        port=port,
        username=PEER_USER,
        password=shared.peer,
        ssl=True,
        ssl_certfile=str(paths.server_certificate),
        ssl_keyfile=str(paths.server_key),
        ssl_ca_certs=str(paths.authority_dir / CERT_FILE),
        ssl_cert_reqs="required",
        ssl_check_hostname=True,
        socket_connect_timeout=timeout,
        socket_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        protocol=2,
    )
    # redis-py leaves execute_command untyped; the commands go to Sentinel as written, and
    # SENTINEL MASTER's answer comes back as Sentinel sends it: field, value, field, ...
    command: Callable[..., Any] = client.execute_command
    try:
        address = command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        master = command("SENTINEL", "MASTER", SERVICE)
    except (redis.RedisError, OSError):
        return None
    finally:
        client.close()
    try:
        fields = dict(zip(master[::2], master[1::2], strict=True))
        return Answer(address[0].decode(), int(fields[b"config-epoch"]))
    except (TypeError, IndexError, KeyError, ValueError):  # not what Sentinel 7 answers
        return None
