"""The typed settings tree of each role, and where each value came from.

Precedence is fixed here, in `load_settings`: flag > CAPYCTL_* environment > YAML role
document > default. Every layer records who stated each value, so a malformed value is
refused naming its origin, and `capyctl config show` can say where each value came from.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from capycommon.errors import InvalidConfig
from capycommon.simgpu import parse_devices
from capycommon.units import parse_duration, parse_size

Role = Literal["standalone", "server", "host"]
ROLES: tuple[Role, ...] = ("standalone", "server", "host")

LOOPBACK_NAMES = frozenset({"localhost"})


def split_address(value: str) -> tuple[str, int]:
    """`0.0.0.0:8443` -> ("0.0.0.0", 8443); `[::1]:7443` -> ("::1", 7443)."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"{value!r} is not ADDR:PORT (for example 0.0.0.0:8443)")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} of {value!r} is outside 1-65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host not in LOOPBACK_NAMES:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(
                f"{host!r} in {value!r} is not an IP address (use 0.0.0.0, 127.0.0.1 or [::1])"
            ) from None
    return host, port


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_NAMES or ipaddress.ip_address(host).is_loopback


def _check_address(value: str) -> str:
    split_address(value)
    return value


def _check_loopback_address(value: str) -> str:
    host, _ = split_address(value)
    if not is_loopback(host):
        raise ValueError(
            f"{value!r} is not a loopback address; the management API listens on loopback "
            "only (for example 127.0.0.1:7443); reach it remotely over ssh"
        )
    return value


def parse_port_range(value: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)-(\d+)", value)
    if not match:
        raise ValueError(f"{value!r} is not START-END (for example 8100-8199)")
    start, end = int(match[1]), int(match[2])
    if not 1024 <= start <= end <= 65535:
        raise ValueError(f"{value!r} must satisfy 1024 <= START <= END <= 65535")
    return start, end


def _check_idle_timeout(value: str) -> str:
    """A duration (`5m`), or `never` to turn the idle step off."""
    if value != "never":
        seconds = parse_duration(value)
        if seconds <= 0:
            raise ValueError(f"{value!r} is no time; give a duration above zero, or never")
    return value


def idle_seconds(value: str) -> float | None:
    """Seconds of an idle timeout, None for `never`."""
    return None if value == "never" else parse_duration(value)


def _check_port_range(value: str) -> str:
    parse_port_range(value)
    return value


def _check_redis_url(value: str | None) -> str | None:
    if value is not None and not value.startswith(("unix://", "redis://", "rediss://")):
        raise ValueError(f"{value!r} is not a redis URL (unix://PATH, redis:// or rediss://)")
    return value


ListenAddress = Annotated[str, AfterValidator(_check_address)]
LoopbackAddress = Annotated[str, AfterValidator(_check_loopback_address)]
PortRange = Annotated[str, AfterValidator(_check_port_range)]
IdleTimeout = Annotated[str, AfterValidator(_check_idle_timeout)]
RedisUrl = Annotated[str | None, AfterValidator(_check_redis_url)]
HostName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")]


class Strict(BaseModel):
    """Internal models and documents forbid unknown fields: a typo fails, naming the key."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class InferenceListener(Strict):
    bind: ListenAddress = "0.0.0.0:8443"


class ManagementListener(Strict):
    bind: LoopbackAddress = "127.0.0.1:7443"


class Listeners(Strict):
    inference: InferenceListener = InferenceListener()
    management: ManagementListener = ManagementListener()


def _check_limit(value: str | None) -> str | None:
    """A limit is a size (24GiB) or a whole percentage of the domain (40%)."""
    if value is None:
        return None
    if value.endswith("%"):
        share = value[:-1]
        if not share.isdigit() or not 0 <= int(share) <= 100:
            raise ValueError(f"{value!r} is not a whole percentage from 0% to 100%")
        return value
    parse_size(value)
    return value


Limit = Annotated[str | None, AfterValidator(_check_limit)]


class DomainLimits(Strict):
    """Overrides of the standalone-derived limits of one kind of memory domain."""

    managed_limit: Limit = None
    free_reserve: Limit = None
    parked_limit: Limit = None


class MemoryPolicy(Strict):
    # Host RAM (`system`), or the one pool of a unified-memory machine.
    system: DomainLimits = DomainLimits()
    # Every discrete GPU.
    gpu: DomainLimits = DomainLimits()


class SchedulingSection(Strict):
    memory: MemoryPolicy = MemoryPolicy()
    # The most models a host keeps parked; the least recently used beyond it stop.
    max_parked: int = Field(default=8, ge=0, le=256)
    # Seconds a model being switched out may finish its requests before it parks or stops.
    drain_timeout: float = Field(default=30.0, ge=1, le=600)
    # Seconds memwatch has to show a park's memory released; otherwise the engine stops.
    park_verify_timeout: float = Field(default=15.0, ge=1, le=600)
    # Seconds a request (and the start or wake it waits for) may wait for first output.
    request_deadline: float = Field(default=1800.0, gt=0, le=3600)
    # Idle models give their memory back: a ready model nobody asked for in this long parks
    # (or stops, if it cannot park), and a parked one stops after parked_idle_timeout. A
    # deployment's lifecycle overrides either; `never` turns the step off.
    ready_idle_timeout: IdleTimeout = "5m"
    parked_idle_timeout: IdleTimeout = "30m"


class RoutingSection(Strict):
    # Requests waiting for one deployment (0: none wait; they get queue_full at once, and
    # the start or wake is still asked for), and for all of them together.
    max_pending_per_deployment: int = Field(default=64, ge=0, le=4096)
    max_pending_total: int = Field(default=256, ge=0, le=65536)
    # Seconds of silence a stream may have after its first output.
    stream_idle_timeout: float = Field(default=120.0, ge=1, le=3600)


class ServerSection(Strict):
    listeners: Listeners = Listeners()
    scheduling: SchedulingSection = SchedulingSection()
    routing: RoutingSection = RoutingSection()


def _check_simulated_gpus(value: str | None) -> str | None:
    if value is not None:
        try:
            parse_devices(value)
        except InvalidConfig as exc:
            raise ValueError(exc.message.removeprefix("CAPYCTL_SIMULATED_GPUS: ")) from None
    return value


def _check_size(value: str | None) -> str | None:
    if value is not None:
        parse_size(value)
    return value


class HostSection(Strict):
    name: HostName = "local"
    models_root: Annotated[Path, AfterValidator(lambda p: p.expanduser())] = Field(
        default_factory=lambda: Path.home() / "models"
    )
    engine_ports: PortRange = "8100-8199"
    # Simulated GPUs instead of NVML: `gpu0:24GiB,gpu1:24GiB` or `unified:128GiB`.
    simulated_gpus: Annotated[str | None, AfterValidator(_check_simulated_gpus)] = None
    # Simulated host RAM, e.g. `64GiB` (with simulated GPUs only).
    simulated_host_ram: Annotated[str | None, AfterValidator(_check_size)] = None
    # Where simulated GPUs keep devices.json and the claims; None: <state>/simgpu.
    simgpu_dir: Path | None = None


class LogSection(Strict):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "text", "json"] = "auto"


class RedisSection(Strict):
    # None: the role's own redis-server on a unix socket in the state dir.
    url: RedisUrl = None
    # Seconds a service keeps trying to reach Redis before it exits non-zero.
    unreachable_after: float = Field(default=10.0, gt=0, le=300)


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
    host: HostSection = HostSection()


class ServerSettings(RoleSettings):
    kind: Literal["server"] = "server"
    server: ServerSection = ServerSection()


class HostSettings(RoleSettings):
    kind: Literal["host"] = "host"
    host: HostSection = HostSection()


AnySettings = StandaloneSettings | ServerSettings | HostSettings

MODELS: dict[Role, type[AnySettings]] = {
    "standalone": StandaloneSettings,
    "server": ServerSettings,
    "host": HostSettings,
}

# Named environment variables, each for one setting.
ENV_VARS: dict[str, str] = {
    "CAPYCTL_INFERENCE_ADDR": "server.listeners.inference.bind",
    "CAPYCTL_MANAGEMENT_ADDR": "server.listeners.management.bind",
    "CAPYCTL_HOST_NAME": "host.name",
    "CAPYCTL_MODELS_ROOT": "host.models_root",
    "CAPYCTL_ENGINE_PORTS": "host.engine_ports",
    "CAPYCTL_SIMULATED_GPUS": "host.simulated_gpus",
    "CAPYCTL_SIMULATED_HOST_RAM": "host.simulated_host_ram",
    "CAPYCTL_SIMGPU_DIR": "host.simgpu_dir",
    "CAPYCTL_LOG_LEVEL": "log.level",
    "CAPYCTL_LOG_FORMAT": "log.format",
    "CAPYCTL_REDIS_URL": "redis.url",
}

# Named role flags, each for one setting; the CLI offers these on `start` and `config show`.
FLAGS: dict[str, str] = {
    "--listen": "server.listeners.inference.bind",
    "--management-listen": "server.listeners.management.bind",
    "--host-name": "host.name",
    "--models-root": "host.models_root",
    "--engine-ports": "host.engine_ports",
    "--log-level": "log.level",
}


@dataclass
class Layer:
    """One source of values: nested data plus, per dotted path, who stated it."""

    source: Literal["flag", "env", "yaml"]
    data: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)

    def put(self, path: str, value: Any, origin: str) -> None:
        node = self.data
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
        self.origins[path] = origin

    def origin_of(self, path: str) -> str | None:
        """Who stated `path`, a path enclosing it, or a path inside it."""
        parts = path.split(".")
        for end in range(len(parts), 0, -1):
            origin = self.origins.get(".".join(parts[:end]))
            if origin is not None:
                return origin
        inside = f"{path}."
        return next((o for p, o in self.origins.items() if p.startswith(inside)), None)


@dataclass(frozen=True)
class SettingRow:
    path: str
    value: Any
    source: str


@dataclass(frozen=True)
class LoadedSettings:
    role: Role
    settings: AnySettings
    document: Path | None
    rows: tuple[SettingRow, ...]


def role_paths(role: Role) -> frozenset[str]:
    defaults = MODELS[role]().model_dump(mode="json", exclude={"kind"})
    return frozenset(path for path, _ in _leaves(defaults))


def flag_layer(role: Role, flags: Mapping[str, str | None]) -> Layer:
    """Flags given on the command line (name -> value; None means not given)."""
    layer = Layer("flag")
    known = role_paths(role)
    for name, value in flags.items():
        if value is None:
            continue
        path = FLAGS[name]
        if path not in known:
            raise InvalidConfig(f"{name} does not apply to the {role} role; drop it")
        layer.put(path, value, name)
    return layer


def env_layer(role: Role, env: Mapping[str, str]) -> Layer:
    """The named CAPYCTL_* variables that apply to `role`; an empty variable is unset."""
    layer = Layer("env")
    known = role_paths(role)
    for name, path in ENV_VARS.items():
        value = env.get(name, "")
        if value and path in known:
            layer.put(path, value, name)
    return layer


class _StrictLoader(yaml.SafeLoader):
    """A YAML loader that refuses duplicate keys instead of keeping the last one."""


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            line = key_node.start_mark.line + 1
            raise InvalidConfig(f"duplicate key {key!r} at line {line}; keep one of them")
        seen.add(key)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _mapping_without_duplicates,
)


def load_yaml_document(path: Path) -> Any:
    """Parse a YAML document strictly; errors name the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidConfig(f"cannot read {path}: {exc.strerror}; check the path") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except InvalidConfig as exc:
        raise InvalidConfig(f"{path}: {exc.message}") from None
    except yaml.YAMLError as exc:
        raise InvalidConfig(f"{path} is not valid YAML: {exc}; fix the document") from None


def yaml_layer(role: Role, path: Path | None) -> Layer:
    """The role document's values; `kind`, when present, must name the role."""
    layer = Layer("yaml")
    if path is None:
        return layer
    document = load_yaml_document(path)
    if document is None:
        return layer
    if not isinstance(document, dict):
        raise InvalidConfig(f"{path} must be a mapping of settings, not {type(document).__name__}")
    kind = document.pop("kind", role)
    if kind != role:
        raise InvalidConfig(f"{path} is a {kind!r} document; the {role} role needs kind: {role}")
    for dotted, value in _leaves(document):
        layer.put(dotted, value, str(path))
    return layer


def _leaves(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, f"{dotted}.")
        else:
            yield dotted, value


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_settings(
    role: Role,
    *,
    document: Path | None,
    env: Mapping[str, str],
    flags: Mapping[str, str | None] | None = None,
) -> LoadedSettings:
    """Build a role's settings: flag > CAPYCTL_* environment > YAML document > default."""
    layers = [flag_layer(role, flags or {}), env_layer(role, env), yaml_layer(role, document)]
    merged: dict[str, Any] = {}
    for layer in reversed(layers):  # lowest precedence first, so later ones win
        merged = _merge(merged, layer.data)
    try:
        settings = MODELS[role](**merged)
    except ValidationError as exc:
        raise InvalidConfig(_explain(exc, layers)) from None
    rows = []
    for path, value in _leaves(settings.model_dump(mode="json", exclude={"kind"})):
        source = next((layer.source for layer in layers if path in layer.origins), "default")
        rows.append(SettingRow(path, value, source))
    return LoadedSettings(role, settings, document, tuple(rows))


def _explain(exc: ValidationError, layers: list[Layer]) -> str:
    problems = []
    for error in exc.errors():
        path = ".".join(str(part) for part in error["loc"])
        layer, origin = next(
            ((layer, found) for layer in layers if (found := layer.origin_of(path)) is not None),
            (None, "a default"),
        )
        reason = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            problems.append(f"{origin}: unknown key {path!r}; remove it or correct its spelling")
        elif layer is not None and layer.source == "yaml":
            problems.append(f"{origin}: {path} = {error['input']!r}: {reason}")
        else:
            problems.append(f"{origin} sets {path} to {error['input']!r}: {reason}")
    return "; ".join(problems)


def locate_document(explicit: str | None, env: Mapping[str, str], implicit: Path) -> Path | None:
    """The role document: --config, else CAPYCTL_CONFIG, else the implicit one if present.

    An explicit document that is missing is an error; it is never generated or replaced.
    """
    named = explicit or env.get("CAPYCTL_CONFIG") or None
    if named is None:
        return implicit if implicit.exists() else None
    path = Path(named).expanduser().absolute()
    if not path.is_file():
        who = "--config" if explicit else "CAPYCTL_CONFIG"
        raise InvalidConfig(f"{who} names {path}, which is not a file; fix the path")
    return path


def redis_url(settings: AnySettings, default: str) -> str:
    return settings.redis.url or default


def host_name(settings: AnySettings) -> str | None:
    return settings.host.name if isinstance(settings, StandaloneSettings | HostSettings) else None


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
