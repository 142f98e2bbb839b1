"""The processes of a role as supervisord runs them, each with its configuration written:
a role's Redis, a replicated server's Sentinel, and the services."""

from __future__ import annotations

import shutil

from capycommon.errors import ToolchainMissing
from capycommon.paths import write_atomic
from capycommon.service import HOST_FINAL_EXITS
from capycommon.settings import Role, ServerSettings
from capycommon.settingvalues import split_address
from capyctl_cli import aofrepair, primary, redisconf, sentinelconf, supervisor
from capyctl_cli.roles import SENTINEL, Prepared, service_command

# Redis that exits at once this many times in a row cannot start (its data, most often):
# supervisord's count, a backstop to the launcher's own (REDIS_FAILED_STARTS).
REDIS_START_RETRIES = 3


def programs(role: Role, prepared: Prepared) -> list[supervisor.Program]:
    """Each process of the role, its configuration written: Redis's (and a replicated
    server's Sentinel's, on its first start), once the Sentinels said which Redis is the
    primary."""
    server = None
    if "redis" in prepared.processes:
        server = shutil.which("redis-server")
        if server is None:
            raise ToolchainMissing(
                "redis-server is not installed; run `sudo apt-get install -y redis-server` "
                "(or scripts/setup as root)"
            )
    followed = _primary(prepared)
    result = []
    for name in prepared.processes:
        if name == "redis":
            assert server is not None
            result.append(_redis_program(server, prepared, followed))
        elif name == SENTINEL:
            assert server is not None
            assert followed is not None
            result.append(_sentinel_program(server, prepared, followed))
        else:
            final = HOST_FINAL_EXITS if role == "host" else ()
            argv = service_command(name, role, prepared)
            result.append(supervisor.Program(name, argv, 20, 8, final_exits=final))
    return result


def _primary(prepared: Prepared) -> str | None:
    """The primary a replicated server's Redis follows (or is); None for any other role."""
    settings = prepared.loaded.settings
    if prepared.shared is None or not isinstance(settings, ServerSettings):
        return None
    return primary.choose(prepared.paths, settings.replication, prepared.shared)


def _redis_program(server: str, prepared: Prepared, followed: str | None) -> supervisor.Program:
    refusal = aofrepair.unlisted_data(prepared.paths)
    if refusal is not None:
        raise refusal
    replica = None
    settings = prepared.loaded.settings
    if followed is not None and isinstance(settings, ServerSettings):
        advertise = settings.replication.advertise
        assert advertise is not None
        assert prepared.shared is not None
        replica = redisconf.Replica(
            advertise=advertise,
            port=split_address(settings.enrollment.control_bind)[1],
            password=prepared.shared.replica,
            primary=None if followed == advertise else followed,
        )
    conf = redisconf.render(prepared.paths, prepared.control, replica)
    write_atomic(prepared.paths.redis_conf, conf)
    argv = [server, str(prepared.paths.redis_conf)]
    return supervisor.Program("redis", argv, 10, 10, REDIS_START_RETRIES)


def _sentinel_program(server: str, prepared: Prepared, followed: str) -> supervisor.Program:
    """A replicated server's Sentinel; its configuration is written at its first start only
    (`sentinelconf`)."""
    settings = prepared.loaded.settings
    assert isinstance(settings, ServerSettings)
    assert prepared.shared is not None
    sentinelconf.ensure(prepared.paths, settings, prepared.shared, followed)
    argv = [server, str(prepared.paths.sentinel_conf), "--sentinel"]
    return supervisor.Program(SENTINEL, argv, 15, 10)
