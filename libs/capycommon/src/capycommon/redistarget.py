"""Which Redis a process of a role talks to, and as whom.

- `redis.url`, when set, decides alone.
- A standalone role's services use its private Redis on a unix socket as its default user.
- A server's router and scheduler use its Redis on the unix socket too, but as the `capyctl`
  user: its default user is off, since the TLS port that joined hosts use would otherwise let
  any holder of a host certificate in as a user with every right.
- A joined host's hostd and memwatch reach the server's Redis over mutual TLS, as the host's
  own ACL user, with the certificate and password `capyctl join host` left in its state dir.
- Servers that replicate one state (`replication.*`) have one primary Redis, which may move:
  a server's own processes and every joined host find it through the servers' Sentinels
  (`Topology`) and talk to it over mutual TLS, a server's as the `capyctl` user with the
  server certificate, a host's as its own user with its host certificate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from capycommon import joined as joined_file
from capycommon import replication
from capycommon.domain.replication import Topology
from capycommon.errors import CredentialsUnusable, InvalidConfig
from capycommon.paths import StatePaths, read_private

if TYPE_CHECKING:
    from capycommon.replsettings import ReplicationSection
    from capycommon.settings import AnySettings

# The server's own Redis user: the router, the scheduler and the CLI on the server.
CONTROL_USER = "capyctl"
# The URL of a target whose primary the Sentinels name: its scheme alone, as the address
# is found at each connect.
PRIMARY_URL = "rediss://"


@dataclass(frozen=True)
class TlsFiles:
    """A client certificate (with its key in the same file, or in `key`), and the only
    authority the server may present."""

    certificate: Path
    authority: Path
    # A server's certificate keeps its key apart (`StatePaths.server_key`); a host's holds
    # both.
    key: Path | None = None


@dataclass(frozen=True)
class RedisTarget:
    url: str
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: TlsFiles | None = None
    # Replicated servers: the primary is found through these Sentinels (asked over the same
    # TLS), and `url` names only the scheme (rediss://).
    topology: Topology | None = None

    @property
    def described(self) -> str:
        """The URL fit for a log line: user kept, password out."""
        if self.topology is not None:
            sentinels = ",".join(self.topology.sentinels)
            return f"the primary of Sentinels {sentinels} (user {self.username})"
        parts = urlsplit(self.url)
        if parts.password is None:
            return self.url if self.username is None else f"{self.url} (user {self.username})"
        host = parts.netloc.rsplit("@", 1)[1]
        return parts._replace(netloc=f"{parts.username or ''}:***@{host}").geturl()

    def client_options(self) -> dict[str, Any]:
        """What a redis-py client (or pool) needs besides the URL. Certificate files are read
        at each new connection, so a renewed certificate is used without a restart."""
        options: dict[str, Any] = {}
        if self.username is not None:
            options["username"] = self.username
        if self.password is not None:
            options["password"] = self.password
        if self.tls is not None:
            options.update(
                ssl_certfile=str(self.tls.certificate),
                ssl_ca_certs=str(self.tls.authority),
                ssl_cert_reqs="required",
                ssl_check_hostname=True,
            )
            if self.tls.key is not None:
                options["ssl_keyfile"] = str(self.tls.key)
        return options


def target_for(settings: AnySettings, paths: StatePaths) -> RedisTarget:
    # The settings' classes, here only: a command that reads a role's record needs no settings.
    from capycommon.settings import HostSettings, ServerSettings  # noqa: PLC0415

    if settings.redis.url is not None:
        return RedisTarget(settings.redis.url)
    if isinstance(settings, ServerSettings):
        if settings.replication.enabled:
            return replicated_target(paths, settings.replication)
        return control_target(paths)
    if isinstance(settings, HostSettings):
        return joined_target(paths)
    return RedisTarget(paths.redis_url)


def control_target(paths: StatePaths) -> RedisTarget:
    """The server's Redis, on its unix socket, as the control plane's user."""
    return RedisTarget(paths.redis_url, CONTROL_USER, read_secret(paths.redis_password))


def replicated_target(paths: StatePaths, section: ReplicationSection) -> RedisTarget:
    """The primary of replicated servers, found through every server's Sentinel."""
    found = replication.read_secrets(paths.replication_secrets)
    return primary_target(
        paths, replication.topology(section.servers, section.sentinel_port, found)
    )


def primary_target(paths: StatePaths, topology: Topology) -> RedisTarget:
    """The primary that `topology`'s Sentinels name, as a server's own processes reach it:
    as the control plane's user, presenting the server certificate (which carries clientAuth
    on a replicated server), trusting the server authority alone."""
    files = TlsFiles(paths.server_certificate, paths.authority_certificate, key=paths.server_key)
    password = read_secret(paths.redis_password)
    return RedisTarget(PRIMARY_URL, CONTROL_USER, password, files, topology)


def joined_target(paths: StatePaths) -> RedisTarget:
    """The Redis of the server this host joined, over mutual TLS as the host's user."""
    found = joined_file.read(paths)
    if found is None:
        raise InvalidConfig(
            f"this host has not joined a server ({paths.joined} does not exist): on the server "
            "run `capyctl invite host NAME --output NAME.join`, then here `capyctl join host "
            "--join-file NAME.join`; or set redis.url to a Redis this host may use"
        )
    missing = joined_file.missing_files(paths)
    if missing:
        names = ", ".join(str(path) for path in missing)
        raise CredentialsUnusable(
            f"this host joined a server but {names} is missing; join again: "
            "`capyctl invite host NAME --recover` on the server, then "
            "`capyctl join host --join-file FILE --recover` here"
        )
    files = TlsFiles(paths.host_certificate, paths.joined_authority)
    # With a topology the address is the server the host joined through, kept for the
    # role's record: the Sentinels name the primary at each connect.
    return RedisTarget(
        f"rediss://{found.redis_address}",
        found.redis_user,
        found.redis_password,
        files,
        found.topology,
    )


def read_secret(path: Path) -> str:
    """A one-line secret kept owner-only in the state dir."""
    value = read_private(
        path,
        missing="start the server role once to create it",
        fix=f"delete {path} and start the server role again",
    ).strip()
    if not value:
        raise CredentialsUnusable(f"{path} is empty; delete it and start the server again")
    return value
