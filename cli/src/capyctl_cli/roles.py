"""What each role runs, and preparing a state dir for it."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from capycommon import credentials
from capycommon.credentials import Credentials
from capycommon.errors import InvalidConfig, ToolchainMissing
from capycommon.paths import StatePaths, check_socket_path, ensure_private_dir, write_atomic
from capycommon.settings import (
    HostSettings,
    LoadedSettings,
    Role,
    load_settings,
    locate_document,
    template,
)

SERVICES = ("router", "scheduler", "hostd", "memwatch")

# The processes of each role, in start order. redis is the role's private redis-server.
PROCESSES: dict[Role, tuple[str, ...]] = {
    "standalone": ("redis", "router", "scheduler", "hostd", "memwatch"),
    "server": ("redis", "router", "scheduler"),
    "host": ("hostd", "memwatch"),
}


@dataclass(frozen=True)
class Prepared:
    paths: StatePaths
    loaded: LoadedSettings
    credentials: Credentials | None


def prepare(
    role: Role,
    state_dir: Path,
    config: str | None,
    env: Mapping[str, str],
    flags: Mapping[str, str | None],
) -> Prepared:
    """Make the state dir ready for `role`: private folders, the role document, credentials."""
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
            raise InvalidConfig(
                "the host role needs the server's Redis: set redis.url in the host document "
                "or CAPYCTL_REDIS_URL"
            )
        return Prepared(paths, loaded, None)
    check_socket_path(paths.redis_socket)
    check_socket_path(paths.supervisor_socket)
    return Prepared(paths, loaded, credentials.ensure(paths.credentials))


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
