"""The typed settings tree of each role.

Every leaf of a tree is a setting, with a description and an example value; its flag and
variable are derived from its path (`capycommon.settingnames`), so nothing lists them by hand.
Its values are checked by their types (`capycommon.settingvalues`) and arrive only through
`capycommon.settingsources.load_settings`, which fixes their precedence and remembers who
stated each.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import Field
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from capycommon.domain.strict import Strict
from capycommon.enrollsettings import EnrollmentSection
from capycommon.hostsettings import EmbeddedHostSection, HostSection, JoinedHostSection
from capycommon.replsettings import ReplicationSection
from capycommon.settingnames import Setting, SettingSpec, setting, specs_of
from capycommon.settingvalues import (
    IdleTimeout,
    Limit,
    ListenAddress,
    LoopbackAddress,
    RedisUrl,
    Seconds,
    Workers,
)

Role = Literal["standalone", "server", "host"]
ROLES: tuple[Role, ...] = ("standalone", "server", "host")


class ConnectionLimits(Strict):
    """What one client's connections may hold of a listener, beyond what HTTP itself bounds:
    a connection that sends no request head in time (or sends it too slowly), or a request
    body too slowly, one left idle between requests, and one client's pile of connections are
    closed or refused, so they cannot hold the listener's file descriptors."""

    header_timeout: Seconds = setting(
        10.0,
        (
            "Seconds a client has to send a request's head, from connecting or from "
            "the first byte of its next request; a slower connection is closed."
        ),
        "30",
        gt=0,
        le=300,
    )
    body_timeout: Seconds = setting(
        60.0,
        (
            "Seconds a client has to send a request's whole body, from the end of its "
            "head; a slower one is answered 408 request_timeout and its connection closed."
        ),
        "30",
        gt=0,
        le=3600,
    )
    keep_alive_timeout: Annotated[int, Setting(metavar="SECONDS")] = setting(
        5,
        "Seconds a connection may stay idle between requests before it is closed.",
        "75",
        ge=1,
        le=3600,
    )
    connections_per_client: int = setting(
        256,
        (
            "Connections one client address may hold open; one more is answered "
            "503 unavailable and closed."
        ),
        "64",
        ge=1,
        le=65536,
    )


class InferenceListener(ConnectionLimits):
    bind: Annotated[
        ListenAddress,
        Setting(flags=("--listen",), variables=("CAPYCTL_INFERENCE_ADDR",), metavar="ADDR:PORT"),
    ] = setting(
        "0.0.0.0:8443", "The inference API's address (all interfaces by default).", "127.0.0.1:8444"
    )


class ManagementListener(Strict):
    bind: Annotated[
        LoopbackAddress,
        Setting(
            flags=("--management-listen",),
            variables=("CAPYCTL_MANAGEMENT_ADDR",),
            metavar="ADDR:PORT",
        ),
    ] = setting(
        "127.0.0.1:7443", "The management API's address, on loopback only.", "127.0.0.1:7444"
    )


class Listeners(Strict):
    inference: InferenceListener = InferenceListener()
    management: ManagementListener = ManagementListener()


class DomainLimits(Strict):
    """Overrides of the standalone-derived limits of one kind of memory domain."""

    managed_limit: Limit = setting(None, "The most CapyCTL charges on the domain.", "40%")
    free_reserve: Limit = setting(None, "What stays free on the domain after any admission.", "10%")
    parked_limit: Limit = setting(None, "The most parked models may hold on the domain.", "16GiB")


class MemoryPolicy(Strict):
    # Host RAM (`system`), or the one pool of a unified-memory machine.
    system: DomainLimits = DomainLimits()
    # Every discrete GPU.
    gpu: DomainLimits = DomainLimits()


class SchedulingSection(Strict):
    memory: MemoryPolicy = MemoryPolicy()
    max_parked: int = setting(
        8,
        "The most models a host keeps parked; the least recently used beyond it stop.",
        "3",
        ge=0,
        le=256,
    )
    drain_timeout: Seconds = setting(
        30.0,
        "Seconds a model being switched out may finish its requests before it parks or stops.",
        "10",
        ge=1,
        le=600,
    )
    park_verify_timeout: Seconds = setting(
        15.0,
        "Seconds memwatch has to show a park's memory released; otherwise the engine stops.",
        "5",
        ge=1,
        le=600,
    )
    host_lost_after: Seconds = setting(
        30.0,
        (
            "Seconds a joined host may stay unreachable (no heartbeat) before its "
            "models that may run elsewhere start on another host."
        ),
        "60",
        ge=1,
        le=3600,
    )
    request_deadline: Seconds = setting(
        1800.0,
        "Seconds a request (and the start or wake it waits for) may wait for first output.",
        "600",
        gt=0,
        le=3600,
    )
    # Idle models give their memory back: a ready model nobody asked for in this long parks
    # (or stops, if it cannot park), and a parked one stops after parked_idle_timeout. A
    # deployment's lifecycle overrides either; `never` turns the step off.
    ready_idle_timeout: Annotated[IdleTimeout, Setting(metavar="DURATION|never")] = setting(
        "5m", "A ready model nobody asked for in this long parks (or stops); never: off.", "10m"
    )
    parked_idle_timeout: Annotated[IdleTimeout, Setting(metavar="DURATION|never")] = setting(
        "30m", "A parked model nobody asked for in this long stops; never: off.", "2h"
    )


class RoutingSection(Strict):
    max_pending_per_deployment: int = setting(
        64,
        (
            "Requests waiting for one deployment (0: none wait; they get queue_full "
            "at once, and the start or wake is still asked for)."
        ),
        "16",
        ge=0,
        le=4096,
    )
    max_pending_total: int = setting(
        256, "Requests waiting for any deployment.", "128", ge=0, le=65536
    )
    stream_idle_timeout: Seconds = setting(
        120.0, "Seconds of silence a stream may have after its first output.", "60", ge=1, le=3600
    )


# `auto` router workers: one per this many CPUs this process may run on, within the bounds.
CPUS_PER_WORKER = 4
AUTO_WORKERS_MAX = 8


def auto_workers(cpus: int | None = None) -> int:
    """The router workers `auto` means on a machine with `cpus` CPUs (this process's own by
    default): one per CPUS_PER_WORKER, at least one, at most AUTO_WORKERS_MAX. The router
    shares its CPUs with the engines' own front ends and the other services: on two CPUs, one
    worker served a third more short chats a second than two did."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0))
    return max(1, min(AUTO_WORKERS_MAX, cpus // CPUS_PER_WORKER))


class RouterSection(Strict):
    workers: Workers = setting(
        "auto",
        (
            "Router worker processes sharing the inference listener; a killed one "
            "loses only its own requests while the others serve. auto: one per 4 CPUs, 1 to 8."
        ),
        "4",
    )

    @property
    def worker_count(self) -> int:
        return auto_workers() if self.workers == "auto" else self.workers


class ServerSection(Strict):
    listeners: Listeners = Listeners()
    scheduling: SchedulingSection = SchedulingSection()
    routing: RoutingSection = RoutingSection()
    router: RouterSection = RouterSection()


class LogSection(Strict):
    level: Literal["debug", "info", "warning", "error"] = setting(
        "info", "The least severe log line written.", "debug"
    )
    format: Literal["auto", "text", "json"] = setting(
        "auto", "auto: text on a terminal, JSON lines otherwise.", "json"
    )


class RedisSection(Strict):
    url: Annotated[RedisUrl, Setting(metavar="URL", secret=True)] = setting(
        None,
        (
            "The Redis to use (none: the role's own redis-server on a unix socket in "
            "the state dir); it may carry a password, so it never comes from a flag."
        ),
        "redis://127.0.0.1:6390/0",
    )
    unreachable_after: Seconds = setting(
        10.0,
        "Seconds a service keeps trying to reach Redis before it exits non-zero.",
        "30",
        gt=0,
        le=300,
    )


class RoleSettings(BaseSettings):
    """Common to every role. Values arrive only through `load_settings`."""

    model_config = SettingsConfigDict(extra="forbid", frozen=True)

    log: LogSection = LogSection()
    redis: RedisSection = RedisSection()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The environment and the document are read by `load_settings`, which fixes their
        # precedence and remembers who said what; the model only validates the result.
        return (init_settings,)


class StandaloneSettings(RoleSettings):
    kind: Literal["standalone"] = "standalone"
    server: ServerSection = ServerSection()
    host: HostSection = Field(default_factory=HostSection)


class ServerSettings(RoleSettings):
    kind: Literal["server"] = "server"
    server: ServerSection = ServerSection()
    enrollment: EnrollmentSection = EnrollmentSection()
    replication: ReplicationSection = ReplicationSection()
    host: EmbeddedHostSection = Field(default_factory=EmbeddedHostSection)


class HostSettings(RoleSettings):
    kind: Literal["host"] = "host"
    host: JoinedHostSection = Field(default_factory=JoinedHostSection)


AnySettings = StandaloneSettings | ServerSettings | HostSettings

MODELS: dict[Role, type[AnySettings]] = {
    "standalone": StandaloneSettings,
    "server": ServerSettings,
    "host": HostSettings,
}


@functools.cache
def setting_specs(role: Role) -> dict[str, SettingSpec]:
    """Every setting of a role by its dotted path, with its flags and variables."""
    return {spec.path: spec for spec in specs_of(MODELS[role])}


def all_setting_specs() -> dict[str, SettingSpec]:
    """Every setting of any role (the standalone role has all but the server's enrollment)."""
    found: dict[str, SettingSpec] = {}
    for role in ROLES:
        found.update(setting_specs(role))
    return found


def redacted(path: str, value: Any) -> Any:
    """A value fit to print: a secret setting's URL without its password."""
    spec = all_setting_specs().get(path)
    if spec is None or not spec.secret or not isinstance(value, str):
        return value
    parts = urlsplit(value)
    if parts.password is None:
        return value
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


def redis_url(settings: AnySettings, default: str) -> str:
    return settings.redis.url or default


def own_host(settings: AnySettings) -> HostSection | None:
    """The host this role runs engines on: a standalone role's, a host's, and a server's
    embedded one; None for a server without one."""
    if isinstance(settings, ServerSettings) and settings.host.embedded == "off":
        return None
    return settings.host


def host_name(settings: AnySettings) -> str | None:
    found = own_host(settings)
    return None if found is None else found.name


def server_tag(settings: AnySettings) -> str:
    """What tells a replicated server's control processes from another server's (their
    heartbeats, their place owners): its `replication.advertise`; empty where it runs
    alone."""
    if isinstance(settings, ServerSettings) and settings.replication.advertise is not None:
        return settings.replication.advertise
    return ""


def template(role: Role) -> str:
    """The implicit role document written on first start: every default, commented out."""
    lines = [
        f"# CapyCTL {role} role document. Uncomment a line to change its setting.",
        "# Precedence: flag > CAPYCTL_* environment > this file > default.",
        f"kind: {role}",
    ]
    defaults = MODELS[role]().model_dump(mode="json", exclude={"kind"})
    lines.extend(_commented(defaults, 0))
    return "\n".join(lines) + "\n"


def _commented(data: Mapping[str, Any], depth: int) -> Iterator[str]:
    indent = "  " * depth
    for key, value in data.items():
        if isinstance(value, Mapping):
            yield f"# {indent}{key}:"
            yield from _commented(value, depth + 1)
        else:
            rendered = yaml.safe_dump(value, default_flow_style=True).strip()
            rendered = rendered.removesuffix("\n...").removesuffix("...").strip()
            yield f"# {indent}{key}: {rendered}"
