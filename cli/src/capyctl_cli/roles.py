"""What each role runs, and preparing a state dir for it."""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from capycommon import credentials, joined
from capycommon.credentials import Credentials
from capycommon.errors import HostNameChanged, InvalidConfig, ToolchainMissing
from capycommon.paths import StatePaths, check_socket_path, ensure_private_dir, write_atomic
from capycommon.peerfile import PeerFile
from capycommon.redistarget import joined_target
from capycommon.replication import Secrets, ensure_secrets
from capycommon.settings import HostSettings, Role, ServerSettings, own_host, template
from capycommon.settingsources import LoadedSettings, load_settings, locate_document
from capyctl_cli import peers, serveridentity
from capyctl_cli.redisconf import ControlPort

log = logging.getLogger("capyctl.launcher")

SERVICES = ("router", "scheduler", "hostd", "memwatch")

# The processes of each role, in start order. redis is the role's private redis-server.
PROCESSES: dict[Role, tuple[str, ...]] = {
    "standalone": ("redis", "router", "scheduler", "hostd", "memwatch"),
    "server": ("redis", "router", "scheduler"),
    "host": ("hostd", "memwatch"),
}
# What a server with an embedded host (host.embedded: on) runs besides.
EMBEDDED_HOST = ("hostd", "memwatch")
# A replicated server's Sentinel, which starts after its Redis (it watches it).
SENTINEL = "sentinel"


@dataclass(frozen=True)
class Prepared:
    paths: StatePaths
    loaded: LoadedSettings
    credentials: Credentials | None
    # A server's TLS port for joined hosts.
    control: ControlPort | None = None
    # A replicated server's shared passwords (`replication.*` set).
    shared: Secrets | None = None

    @property
    def processes(self) -> tuple[str, ...]:
        """The processes this start runs, in start order."""
        settings = self.loaded.settings
        if not isinstance(settings, ServerSettings):
            return PROCESSES[settings.kind]
        found = PROCESSES["server"]
        if settings.replication.enabled:
            found = (found[0], SENTINEL, *found[1:])
        if own_host(settings) is not None:
            found += EMBEDDED_HOST
        return found


def prepare(
    role: Role,
    state_dir: Path,
    config: str | None,
    env: Mapping[str, str],
    flags: Mapping[str, str | None],
    peer: PeerFile | None = None,
) -> Prepared:
    """Make the state dir ready for `role`: private folders, the role document, credentials,
    and the host's name (kept on the first start, checked on every later one). `peer`: a
    server's peer file, installed on its first start (`peers.install`)."""
    paths = StatePaths(state_dir)
    for folder in (paths.root, paths.run_dir, paths.logs_dir, paths.config_dir, paths.redis_dir):
        ensure_private_dir(folder)
    implicit = paths.role_document(role)
    if not (config or env.get("CAPYCTL_CONFIG")) and not implicit.exists():
        write_atomic(implicit, template(role))
    document = locate_document(config, env, implicit)
    loaded = load_settings(role, document=document, env=env, flags=flags)
    if isinstance(loaded.settings, HostSettings):
        if loaded.settings.redis.url is None:
            # A joined host is the host it joined as, unless a name was given on purpose.
            found = joined.read(paths)
            named = next(row for row in loaded.rows if row.path == "host.name")
            if found is not None and named.source == "default":
                flags = {**flags, "--host-name": found.host_name}
                loaded = load_settings(role, document=document, env=env, flags=flags)
        keep_host_name(paths, loaded)
        if isinstance(loaded.settings, HostSettings) and loaded.settings.redis.url is None:
            check_joined(paths, loaded.settings)
        return Prepared(paths, loaded, None)
    check_socket_path(paths.redis_socket)
    check_socket_path(paths.supervisor_socket)
    control, shared = None, None
    if isinstance(loaded.settings, ServerSettings):
        control, shared = _prepare_server(paths, loaded.settings, peer)
    if own_host(loaded.settings) is not None:
        keep_host_name(paths, loaded)
    return Prepared(paths, loaded, credentials.ensure(paths.credentials), control, shared)


def _prepare_server(
    paths: StatePaths, settings: ServerSettings, peer: PeerFile | None
) -> tuple[ControlPort, Secrets | None]:
    """A server's identity, and a replicated server's shared passwords: from its peer file
    on its first start, made by the first server."""
    if peer is not None and peers.install(paths, settings, peer):
        log.info(
            "installed the peer file: the servers' authority (SHA-256 %s), passwords and keys; "
            "following %s first. Delete the peer file now.",
            peer.fingerprint,
            peer.primary,
        )
    shared = None
    if settings.replication.enabled:
        shared = ensure_secrets(paths.replication_secrets)
    return serveridentity.prepare(paths, settings, shared), shared


def check_joined(paths: StatePaths, settings: HostSettings) -> None:
    """A host without `redis.url` must have joined a server, under the name it starts with."""
    target = joined_target(paths)  # refuses a host that never joined, naming the fix
    found = joined.read(paths)
    assert found is not None
    assert target.tls is not None
    if found.host_name != settings.host.name:
        raise HostNameChanged(
            f"this state dir joined the server as host {found.host_name!r} "
            f"({paths.joined}), but this start is host {settings.host.name!r}; start it "
            f"as {found.host_name} (--host-name {found.host_name})"
        )


def keep_host_name(paths: StatePaths, loaded: LoadedSettings) -> None:
    """Keep the host's name in the state dir on its first start; refuse a later start under
    another name (its instances, engines and readings are all kept under the name)."""
    host = own_host(loaded.settings)
    assert host is not None
    name = host.name
    file = paths.host_name
    ensure_private_dir(file.parent)
    try:
        kept = file.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        write_atomic(file, f"{name}\n")
        return
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
        raise InvalidConfig(f"cannot read {file}: {reason}; restore it or fix its mode") from None
    if kept != name:
        row = next(row for row in loaded.rows if row.path == "host.name")
        said = row.origin or "the machine's hostname"
        raise HostNameChanged(
            f"this state dir belongs to host {kept!r} (kept in {file} since its first start), "
            f"but this start is host {name!r} (from {said}); start it as {kept}: keep the "
            f"hostname (a container: docker run --hostname {kept}) or set host.name: {kept} "
            f"(--host-name {kept} or CAPYCTL_HOST_NAME={kept}); a new host needs another "
            "--state-dir"
        )


def service_command(service: str, role: Role, prepared: Prepared) -> list[str]:
    """The argv of one service process; it finds its settings exactly as the role did."""
    module = f"capyctl_{service}"
    if importlib.util.find_spec(module) is None:
        raise ToolchainMissing(
            f"the {service} service is not installed in {sys.prefix}; run scripts/setup"
        )
    argv = [sys.executable, "-m", module, "--role", role, "--state-dir", str(prepared.paths.root)]
    if prepared.loaded.document is not None:
        argv += ["--config", str(prepared.loaded.document)]
    return argv
