"""The server's settings for running on two or three machines (`replication.*`): its own
address, its peers', and how Redis Sentinel watches their Redis.

Each server runs a Redis and a Sentinel. One Redis is the primary; the others replicate it
over mutual TLS on the servers' TLS port (`enrollment.control_bind`'s port, the same on every
server), and the Sentinels (on `sentinel_port`, the same on every server) elect a new primary
when it is lost. Every process of the control plane and of the hosts finds the primary
through the Sentinels.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, model_validator

from capycommon.domain.strict import Strict
from capycommon.settingnames import Setting, setting
from capycommon.settingvalues import Seconds, check_dial_host

# The name the Sentinels know the servers' Redis by.
SERVICE = "capyctl"


def _check_host(value: str | None) -> str | None:
    if value is not None:
        check_dial_host(value)
    return value


def _check_hosts(value: str | None) -> str | None:
    if value is not None:
        for host in split_hosts(value):
            check_dial_host(host)
    return value


def split_hosts(value: str) -> tuple[str, ...]:
    """`a.lan, 10.0.0.2` -> ("a.lan", "10.0.0.2")."""
    found = tuple(part.strip() for part in value.split(",") if part.strip())
    if not found:
        raise ValueError(f"{value!r} names no address; give HOST[,HOST]")
    return found


class ReplicationSection(Strict):
    """A server among two or three that share one replicated state."""

    advertise: Annotated[str | None, AfterValidator(_check_host), Setting(metavar="HOST")] = (
        setting(
            None,
            (
                "This server's address, as its peers and the hosts dial it (an IP address or a "
                "DNS name its certificate names); set it with peers to run replicated."
            ),
            "10.0.0.11",
        )
    )
    peers: Annotated[str | None, AfterValidator(_check_hosts), Setting(metavar="HOST[,HOST]")] = (
        setting(
            None,
            "The other servers' addresses, comma-separated (one or two).",
            "10.0.0.12,10.0.0.13",
        )
    )
    sentinel_port: int = setting(
        26379, "The TCP port of each server's Sentinel (mutual TLS).", "26380", ge=1, le=65535
    )
    down_after: Seconds = setting(
        2.0,
        "Seconds a primary may be unreachable before the Sentinels elect another.",
        "5",
        ge=0.5,
        le=60,
    )
    ack_timeout: Seconds = setting(
        2.0,
        (
            "Seconds a declaration (deploy, delete, drain, revoke, invite) waits for a "
            "replica to hold it before it is refused as not replicated."
        ),
        "5",
        ge=0.1,
        le=60,
    )

    @model_validator(mode="after")
    def _both_or_neither(self) -> ReplicationSection:
        if (self.advertise is None) != (self.peers is None):
            raise ValueError(
                "replication needs both replication.advertise (this server's address) and "
                "replication.peers (the others'); set both, or neither to run alone"
            )
        if self.advertise is not None and self.advertise in self.peer_hosts:
            raise ValueError(
                f"replication.peers names this server's own address {self.advertise!r}; "
                "list only the other servers"
            )
        if len(self.peer_hosts) > 2:
            raise ValueError(
                "replication.peers names more than two servers; CapyCTL runs on two or "
                "three servers"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.advertise is not None

    @property
    def peer_hosts(self) -> tuple[str, ...]:
        return () if self.peers is None else split_hosts(self.peers)

    @property
    def servers(self) -> tuple[str, ...]:
        """Every server's address, this one's first."""
        return () if self.advertise is None else (self.advertise, *self.peer_hosts)

    @property
    def quorum(self) -> int:
        """How many Sentinels must agree that the primary is lost: a majority of the
        servers' (two of three; both of two, so two servers alone never fail over)."""
        return len(self.servers) // 2 + 1
