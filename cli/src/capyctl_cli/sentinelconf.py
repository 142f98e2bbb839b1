"""The configuration of a replicated server's Sentinel, written at its first start only.

Sentinel keeps its own configuration from then on: it records there which Redis is the
primary (its `sentinel monitor` line follows every failover), the replicas and the other
Sentinels it found, and its epoch. Writing the file again would make it forget all that, so
a setting that only this file holds (the Sentinel port, `replication.down_after`, the bind
address) applies to a server whose `sentinel/sentinel.conf` is removed before its start
(docs/roles/server.md, Three servers).
"""

from __future__ import annotations

from capycommon.authority import CERT_FILE
from capycommon.paths import StatePaths, ensure_private_dir, write_atomic
from capycommon.replication import PEER_USER, SENTINEL_USER, Secrets, sentinel_user_lines
from capycommon.replsettings import SERVICE
from capycommon.settings import ServerSettings
from capycommon.settingvalues import split_address

# How long the Sentinels take over a failover that stalls before another may try (Sentinel's
# own default is three minutes).
FAILOVER_TIMEOUT_MS = 10_000


def render(paths: StatePaths, settings: ServerSettings, shared: Secrets, primary: str) -> str:
    """A Sentinel on the servers' TLS bind address, at `replication.sentinel_port`, mutual TLS
    with the server's certificate both ways (to clients, to the Redis it watches, to the
    other Sentinels), watching the Redis at `primary` under the name `capyctl`.

    It logs in to each Redis as the Sentinel user, and to each other Sentinel as the peer
    user; it serves no client that does not log in (its default user is off), the discover
    user only the questions that find the primary. It names itself and the Redis by the
    servers' addresses as given (`announce-hostnames`), so a client checks each certificate
    against the name it was issued for."""
    replication = settings.replication
    assert replication.advertise is not None, "only a replicated server runs a Sentinel"
    bind, redis_port = split_address(settings.enrollment.control_bind)
    port = replication.sentinel_port
    lines = [
        "# Written by capyctl at the first start; Sentinel keeps it from then on.",
        "port 0",
        f"bind {bind}",
        f"tls-port {port}",
        f"tls-cert-file {paths.server_certificate}",
        f"tls-key-file {paths.server_key}",
        f"tls-ca-cert-file {paths.authority_dir / CERT_FILE}",
        "tls-auth-clients yes",
        "tls-replication yes",
        'tls-protocols "TLSv1.2 TLSv1.3"',
        "daemonize no",
        'logfile ""',
        f"dir {paths.sentinel_dir}",
        "sentinel resolve-hostnames yes",
        "sentinel announce-hostnames yes",
        f"sentinel announce-ip {replication.advertise}",
        f"sentinel announce-port {port}",
        f"sentinel monitor {SERVICE} {primary} {redis_port} {replication.quorum}",
        f"sentinel auth-user {SERVICE} {SENTINEL_USER}",
        f"sentinel auth-pass {SERVICE} {shared.sentinel}",
        f"sentinel down-after-milliseconds {SERVICE} {round(replication.down_after * 1000)}",
        f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}",
        f"sentinel sentinel-user {PEER_USER}",
        f"sentinel sentinel-pass {shared.peer}",
        *sentinel_user_lines(shared),
    ]
    return "\n".join(lines) + "\n"


def ensure(paths: StatePaths, settings: ServerSettings, shared: Secrets, primary: str) -> bool:
    """Write the Sentinel's configuration unless it has one; whether it was written."""
    ensure_private_dir(paths.sentinel_dir)
    if paths.sentinel_conf.exists():
        return False
    write_atomic(paths.sentinel_conf, render(paths, settings, shared, primary), mode=0o600)
    return True


def recorded_primary(paths: StatePaths) -> str | None:
    """The primary this server's Sentinel last recorded (its `sentinel monitor` line, which
    it rewrites at each failover it sees); None before its first start."""
    try:
        text = paths.sentinel_conf.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    for line in text.splitlines():
        words = line.split()
        if words[:3] == ["sentinel", "monitor", SERVICE] and len(words) == 6:
            return words[3]
    return None
