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
import re
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from capycommon.enrollsettings import EnrollmentSection
from capycommon.settingnames import Setting, SettingSpec, specs_of
from capycommon.settingvalues import (
    DialAddress,
    HostName,
    IdleTimeout,
    Limit,
    ListenAddress,
    LoopbackAddress,
    OnOff,
    PortRange,
    RedisUrl,
    Seconds,
    SimulatedGpus,
    Size,
    Workers,
)

Role = Literal["standalone", "server", "host"]
ROLES: tuple[Role, ...] = ("standalone", "server", "host")


class Strict(BaseModel):
    """Internal models and documents forbid unknown fields: a typo fails, naming the key."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ConnectionLimits(Strict):
    """What one client's connections may hold of a listener, beyond what HTTP itself bounds:
    a connection that sends no request head in time (or sends it too slowly), or a request
    body too slowly, one left idle between requests, and one client's pile of connections are
    closed or refused, so they cannot hold the listener's file descriptors."""

    header_timeout: Seconds = Field(
        default=10.0,
        gt=0,
        le=300,
        description="Seconds a client has to send a request's head, from connecting or from "
        "the first byte of its next request; a slower connection is closed.",
        examples=["30"],
    )
    body_timeout: Seconds = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="Seconds a client has to send a request's whole body, from the end of its "
        "head; a slower one is answered 408 request_timeout and its connection closed.",
        examples=["30"],
    )
    keep_alive_timeout: Annotated[int, Setting(metavar="SECONDS")] = Field(
        default=5,
        ge=1,
        le=3600,
        description="Seconds a connection may stay idle between requests before it is closed.",
        examples=["75"],
    )
    connections_per_client: int = Field(
        default=256,
        ge=1,
        le=65536,
        description="Connections one client address may hold open; one more is answered "
        "503 unavailable and closed.",
        examples=["64"],
    )


class InferenceListener(ConnectionLimits):
    bind: Annotated[
        ListenAddress,
        Setting(flags=("--listen",), variables=("CAPYCTL_INFERENCE_ADDR",), metavar="ADDR:PORT"),
    ] = Field(
        "0.0.0.0:8443",
        description="The inference API's address (all interfaces by default).",
        examples=["127.0.0.1:8444"],
    )


class ManagementListener(Strict):
    bind: Annotated[
        LoopbackAddress,
        Setting(
            flags=("--management-listen",),
            variables=("CAPYCTL_MANAGEMENT_ADDR",),
            metavar="ADDR:PORT",
        ),
    ] = Field(
        "127.0.0.1:7443",
        description="The management API's address, on loopback only.",
        examples=["127.0.0.1:7444"],
    )


class Listeners(Strict):
    inference: InferenceListener = InferenceListener()
    management: ManagementListener = ManagementListener()


class DomainLimits(Strict):
    """Overrides of the standalone-derived limits of one kind of memory domain."""

    managed_limit: Limit = Field(
        None, description="The most CapyCTL charges on the domain.", examples=["40%"]
    )
    free_reserve: Limit = Field(
        None, description="What stays free on the domain after any admission.", examples=["10%"]
    )
    parked_limit: Limit = Field(
        None, description="The most parked models may hold on the domain.", examples=["16GiB"]
    )


class MemoryPolicy(Strict):
    # Host RAM (`system`), or the one pool of a unified-memory machine.
    system: DomainLimits = DomainLimits()
    # Every discrete GPU.
    gpu: DomainLimits = DomainLimits()


class SchedulingSection(Strict):
    memory: MemoryPolicy = MemoryPolicy()
    max_parked: int = Field(
        default=8,
        ge=0,
        le=256,
        description="The most models a host keeps parked; the least recently used beyond it stop.",
        examples=["3"],
    )
    drain_timeout: Seconds = Field(
        default=30.0,
        ge=1,
        le=600,
        description="Seconds a model being switched out may finish its requests before it "
        "parks or stops.",
        examples=["10"],
    )
    park_verify_timeout: Seconds = Field(
        default=15.0,
        ge=1,
        le=600,
        description="Seconds memwatch has to show a park's memory released; otherwise the "
        "engine stops.",
        examples=["5"],
    )
    host_lost_after: Seconds = Field(
        default=30.0,
        ge=1,
        le=3600,
        description="Seconds a joined host may stay unreachable (no heartbeat) before its "
        "models that may run elsewhere start on another host.",
        examples=["60"],
    )
    request_deadline: Seconds = Field(
        default=1800.0,
        gt=0,
        le=3600,
        description="Seconds a request (and the start or wake it waits for) may wait for first "
        "output.",
        examples=["600"],
    )
    # Idle models give their memory back: a ready model nobody asked for in this long parks
    # (or stops, if it cannot park), and a parked one stops after parked_idle_timeout. A
    # deployment's lifecycle overrides either; `never` turns the step off.
    ready_idle_timeout: Annotated[IdleTimeout, Setting(metavar="DURATION|never")] = Field(
        "5m",
        description="A ready model nobody asked for in this long parks (or stops); never: off.",
        examples=["10m"],
    )
    parked_idle_timeout: Annotated[IdleTimeout, Setting(metavar="DURATION|never")] = Field(
        "30m",
        description="A parked model nobody asked for in this long stops; never: off.",
        examples=["2h"],
    )


class RoutingSection(Strict):
    max_pending_per_deployment: int = Field(
        default=64,
        ge=0,
        le=4096,
        description="Requests waiting for one deployment (0: none wait; they get queue_full "
        "at once, and the start or wake is still asked for).",
        examples=["16"],
    )
    max_pending_total: int = Field(
        default=256,
        ge=0,
        le=65536,
        description="Requests waiting for any deployment.",
        examples=["128"],
    )
    stream_idle_timeout: Seconds = Field(
        default=120.0,
        ge=1,
        le=3600,
        description="Seconds of silence a stream may have after its first output.",
        examples=["60"],
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
    workers: Workers = Field(
        default="auto",
        description="Router worker processes sharing the inference listener; a killed one "
        "loses only its own requests while the others serve. auto: one per 4 CPUs, 1 to 8.",
        examples=["4"],
    )

    @property
    def worker_count(self) -> int:
        return auto_workers() if self.workers == "auto" else self.workers


class ServerSection(Strict):
    listeners: Listeners = Listeners()
    scheduling: SchedulingSection = SchedulingSection()
    routing: RoutingSection = RoutingSection()
    router: RouterSection = RouterSection()


def machine_host_name(hostname: str | None = None) -> str:
    """This machine's hostname made a host name: its first label, lower-cased, each run of
    other characters a hyphen, at most 63 characters; `local` if nothing is left."""
    label = (socket.gethostname() if hostname is None else hostname).split(".")[0].lower()
    name = re.sub(r"[^a-z0-9-]+", "-", label).strip("-")[:63].rstrip("-")
    return name or "local"


class HostSection(Strict):
    name: HostName = Field(
        default_factory=machine_host_name,
        description="This host's name; the state dir keeps the name of its first start.",
        examples=["gpu-box"],
    )
    models_root: Annotated[
        Path,
        AfterValidator(lambda p: p.expanduser()),
        Setting(flags=("--models-root",), variables=("CAPYCTL_MODELS_ROOT",)),
    ] = Field(
        default_factory=lambda: Path.home() / "models",
        description="The folder that model names in deployments are relative to.",
        examples=["/srv/models"],
    )
    engine_ports: Annotated[
        PortRange,
        Setting(
            flags=("--engine-ports",),
            variables=("CAPYCTL_ENGINE_PORTS",),
            metavar="START-END",
            empty_refused=True,
        ),
    ] = Field(
        "8100-8199",
        description="The loopback ports engines listen on.",
        examples=["8200-8299"],
    )
    deep_park: Annotated[
        OnOff,
        Setting(flags=("--deep-park",), variables=("CAPYCTL_DEEP_PARK",), empty_refused=True),
    ] = Field(
        "on",
        description="off: no engine here parks deep or runs with its development controls "
        "(vLLM's dev mode); models that would park deep stop instead.",
        examples=["off"],
    )
    engine_telemetry: Annotated[
        Literal["off", "allow"],
        Setting(
            flags=("--engine-telemetry",),
            variables=("CAPYCTL_ENGINE_TELEMETRY",),
            empty_refused=True,
        ),
    ] = Field(
        "off",
        description="off: every engine here gets DO_NOT_TRACK=1 (vLLM also VLLM_DO_NOT_TRACK=1 "
        "and VLLM_NO_USAGE_STATS=1), so none reports usage off the host; allow: the engines' "
        "own defaults.",
        examples=["allow"],
    )
    retention: Annotated[
        Literal["default", "zero"],
        Setting(flags=("--retention",), variables=("CAPYCTL_RETENTION",), empty_refused=True),
    ] = Field(
        "default",
        description="zero: engines here keep no log and write no core dump, unless a "
        "deployment says retention: default.",
        examples=["zero"],
    )
    lmcache: Annotated[
        Literal["auto", "off"],
        Setting(flags=("--lmcache",), variables=("CAPYCTL_LMCACHE",), empty_refused=True),
    ] = Field(
        "auto",
        description="off: no model here runs with LMCache, whatever its deployment says (one "
        "that says lmcache: required fails here).",
        examples=["off"],
    )
    simulated_gpus: Annotated[
        SimulatedGpus,
        Setting(variables=("CAPYCTL_SIMULATED_GPUS",), metavar="NAME:SIZE,..."),
    ] = Field(
        None,
        description="Simulated GPUs instead of NVML: gpu0:24GiB,gpu1:24GiB or unified:128GiB.",
        examples=["gpu0:24GiB"],
    )
    simulated_host_ram: Annotated[
        Size,
        Setting(variables=("CAPYCTL_SIMULATED_HOST_RAM",), metavar="SIZE"),
    ] = Field(
        None,
        description="Simulated host RAM, e.g. 64GiB (with simulated GPUs only).",
        examples=["64GiB"],
    )
    simgpu_dir: Annotated[Path | None, Setting(variables=("CAPYCTL_SIMGPU_DIR",))] = Field(
        None,
        description="Where simulated GPUs keep devices.json and the claims; none: <state>/simgpu.",
        examples=["/srv/capyctl/simgpu"],
    )


class IngressSection(Strict):
    """A joined host's ingress: where the server's router reaches this host's engines, over
    mutual TLS (`capycommon.ingress`)."""

    bind: ListenAddress = Field(
        "0.0.0.0:8444",
        description="Where this joined host's ingress listens for the server's router (mutual "
        "TLS); only the server needs to reach it.",
        examples=["100.64.0.21:8444"],
    )
    address: DialAddress = Field(
        None,
        description="The HOST:PORT the server's router dials for the ingress (none: bind; on "
        "every interface, this machine's hostname).",
        examples=["gpu-box.lan:8444"],
    )


class JoinedHostSection(HostSection):
    """The host role's host settings: a standalone role's, and its ingress once joined."""

    ingress: IngressSection = IngressSection()


class LogSection(Strict):
    level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="The least severe log line written.", examples=["debug"]
    )
    format: Literal["auto", "text", "json"] = Field(
        "auto",
        description="auto: text on a terminal, JSON lines otherwise.",
        examples=["json"],
    )


class RedisSection(Strict):
    url: Annotated[RedisUrl, Setting(metavar="URL", secret=True)] = Field(
        None,
        description="The Redis to use (none: the role's own redis-server on a unix socket in "
        "the state dir); it may carry a password, so it never comes from a flag.",
        examples=["redis://127.0.0.1:6390/0"],
    )
    unreachable_after: Seconds = Field(
        default=10.0,
        gt=0,
        le=300,
        description="Seconds a service keeps trying to reach Redis before it exits non-zero.",
        examples=["30"],
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


class EmbeddedHostSection(HostSection):
    """A server's own host: with `embedded: on` the server also runs hostd and memwatch, and
    serves models on this machine's GPUs beside those of its joined hosts."""

    embedded: Annotated[
        OnOff,
        Setting(
            flags=("--embedded-host",), variables=("CAPYCTL_EMBEDDED_HOST",), empty_refused=True
        ),
    ] = Field(
        "off",
        description="on: this server is also a host, as a standalone role is (its models run "
        "here too, beside those of joined hosts); the other host settings apply only then.",
        examples=["on"],
    )


class ServerSettings(RoleSettings):
    kind: Literal["server"] = "server"
    server: ServerSection = ServerSection()
    enrollment: EnrollmentSection = EnrollmentSection()
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
