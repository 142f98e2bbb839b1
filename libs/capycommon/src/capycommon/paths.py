"""Where a role keeps its state, and the file-system helpers that keep it private."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from capycommon.errors import CredentialsUnusable, InvalidConfig

# A unix socket path longer than this does not fit in sockaddr_un on Linux.
MAX_SOCKET_PATH = 107


def default_state_dir(env: Mapping[str, str]) -> Path:
    """`$XDG_STATE_HOME/capyctl`, else `~/.local/state/capyctl`."""
    xdg = env.get("XDG_STATE_HOME", "")
    if xdg:
        return Path(xdg) / "capyctl"
    return Path.home() / ".local" / "state" / "capyctl"


def resolve_state_dir(flag: str | None, env: Mapping[str, str]) -> tuple[Path, str]:
    """The state dir and who chose it: `flag`, `env` or `default`."""
    if flag:
        return Path(flag).expanduser().absolute(), "flag"
    if env.get("CAPYCTL_STATE_DIR"):
        return Path(env["CAPYCTL_STATE_DIR"]).expanduser().absolute(), "env"
    return default_state_dir(env), "default"


@dataclass(frozen=True)
class StatePaths:
    """Every path under a role's state dir. Nothing else spells these names."""

    root: Path

    @property
    def release(self) -> Path:
        """The newest CapyCTL release that started a role on this state dir."""
        return self.root / "release"

    @property
    def config_dir(self) -> Path:
        return self.root / "config"

    def role_document(self, role: str) -> Path:
        return self.config_dir / f"{role}.yaml"

    @property
    def identity_dir(self) -> Path:
        return self.root / "identity"

    @property
    def credentials(self) -> Path:
        return self.identity_dir / "credentials"

    @property
    def host_name(self) -> Path:
        """The host's name, kept from the state dir's first start."""
        return self.identity_dir / "host-name"

    # The server's certificate authority and its own certificate (the Redis TLS port and the
    # bootstrap listener present it), and the password of the control plane's Redis user.

    @property
    def authority_dir(self) -> Path:
        return self.identity_dir / "ca"

    @property
    def authority_certificate(self) -> Path:
        """The server authority's certificate (`capycommon.authority.CERT_FILE`), which the
        server's own processes trust as TLS clients of the other servers."""
        return self.authority_dir / "ca.pem"

    @property
    def server_certificate(self) -> Path:
        return self.identity_dir / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.identity_dir / "server.key"

    @property
    def router_certificate(self) -> Path:
        """The router's client certificate and its private key, in one file, issued by the
        server's authority at each start: what it presents to a host's ingress."""
        return self.identity_dir / "router.pem"

    @property
    def router_id(self) -> Path:
        """The identity the router's certificate names (`urn:capyctl:router:<id>`), kept
        from the server's first start."""
        return self.identity_dir / "router-id"

    @property
    def replication_secrets(self) -> Path:
        """The passwords servers share to replicate and to watch each other's Redis
        (`capycommon.replication.Secrets`), made by the first server and carried to the
        others in its peer file."""
        return self.identity_dir / "replication.json"

    @property
    def redis_password(self) -> Path:
        """The password of the server's `capyctl` Redis user (the router and the scheduler)."""
        return self.identity_dir / "redis-password"

    @property
    def redis_users(self) -> Path:
        """The server Redis's ACL file: its users, one per joined host besides its own."""
        return self.redis_dir / "users.acl"

    # What a host keeps once it joined a server.

    @property
    def host_certificate(self) -> Path:
        """The host's certificate and its private key, in one file: a renewal replaces both
        with one rename."""
        return self.identity_dir / "host.pem"

    @property
    def joined_authority(self) -> Path:
        """The CA of the server this host joined (from its join file)."""
        return self.identity_dir / "server-ca.pem"

    @property
    def joined(self) -> Path:
        """The host's enrollment: its id, the server's addresses and its Redis credentials."""
        return self.identity_dir / "joined.json"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def role_lock(self) -> Path:
        return self.run_dir / "role.lock"

    @property
    def host_stopped(self) -> Path:
        """Left by a host service that cannot go on (revoked, its certificate refused, a
        server of another release line): the error's code and message, for the launcher to
        stop the role with its exit code (supervisord does not restart such a service)."""
        return self.run_dir / "host-stopped"

    @property
    def role_record(self) -> Path:
        return self.run_dir / "role.json"

    @property
    def engines_record(self) -> Path:
        """hostd's own record of the engines it launched: kept apart from Redis, so an engine
        whose instance record was lost with Redis's data is still found (and stopped)."""
        return self.run_dir / "engines.json"

    @property
    def supervisord_conf(self) -> Path:
        return self.run_dir / "supervisord.conf"

    @property
    def supervisor_socket(self) -> Path:
        return self.run_dir / "supervisor.sock"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def redis_dir(self) -> Path:
        return self.root / "redis"

    @property
    def sentinel_dir(self) -> Path:
        return self.root / "sentinel"

    @property
    def initial_primary(self) -> Path:
        """The address of the Redis a replicated server followed (or was) at its first start:
        itself for the first server, the server that invited it for the others. What a later
        start follows when no Sentinel answers and this server's own Sentinel recorded none."""
        return self.sentinel_dir / "initial-primary"

    @property
    def sentinel_conf(self) -> Path:
        """Written at the first start; Sentinel keeps it from then on (it records there
        which Redis is the primary, and its peers)."""
        return self.sentinel_dir / "sentinel.conf"

    @property
    def redis_conf(self) -> Path:
        return self.redis_dir / "redis.conf"

    @property
    def redis_socket(self) -> Path:
        return self.redis_dir / "redis.sock"

    @property
    def redis_url(self) -> str:
        return f"unix://{self.redis_socket}"


def ensure_private_dir(path: Path) -> None:
    """Create `path` (and parents) owner-only; refuse one that others may write to."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777
    if mode & 0o022:
        raise InvalidConfig(
            f"{path} is writable by group or others (mode {mode:04o}); "
            f"run `chmod 700 {path}` and start again"
        )


def write_atomic(path: Path, data: str, mode: int = 0o600) -> None:
    """Write `data` to `path` through a temporary file and a rename, with `mode`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_private(path: Path, *, missing: str, fix: str) -> str:
    """The text of an owner-only file that holds a secret. Refused, naming the file: missing
    (`missing` says how to make it), unreadable or not UTF-8 (`fix` says how to mend it),
    another user's, or open to group or others."""
    try:
        info = path.stat()
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CredentialsUnusable(f"{path} does not exist; {missing}") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
        raise CredentialsUnusable(f"cannot read {path}: {reason}; {fix}") from None
    if info.st_uid != os.getuid():
        raise CredentialsUnusable(
            f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}); "
            f"run `chown {os.getuid()} {path}`"
        )
    mode = info.st_mode & 0o777
    if mode & 0o077:
        raise CredentialsUnusable(
            f"{path} holds a secret but is readable or writable by group or others (mode "
            f"{mode:04o}); run `chmod 600 {path}`"
        )
    return text


def check_socket_path(path: Path) -> None:
    """Refuse a unix socket path the kernel cannot bind."""
    if len(str(path)) > MAX_SOCKET_PATH:
        raise InvalidConfig(
            f"the socket path {path} is {len(str(path))} characters, over the limit of "
            f"{MAX_SOCKET_PATH}; choose a shorter state dir (--state-dir)"
        )
