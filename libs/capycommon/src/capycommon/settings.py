"""The typed settings tree of each role, and where each value came from.

Precedence is fixed here, in `load_settings`: flag > CAPYCTL_* environment > YAML role
document > default. Every layer records who stated each value, so a malformed value is
refused naming its origin, and `capyctl config show` can say where each value came from.

Every leaf of a tree is a setting, with a description and an example value; its flag and
variable are derived from its path (`capycommon.settingnames`), so nothing lists them by hand.
"""

from __future__ import annotations

import difflib
import functools
import ipaddress
import re
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from capycommon.errors import InvalidConfig
from capycommon.settingnames import Setting, SettingSpec, derived_flag, specs_of
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
HostName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$"), Setting(metavar="NAME")]
Seconds = Annotated[float, Setting(metavar="SECONDS")]


class Strict(BaseModel):
    """Internal models and documents forbid unknown fields: a typo fails, naming the key."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class InferenceListener(Strict):
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


Limit = Annotated[str | None, AfterValidator(_check_limit), Setting(metavar="SIZE|N%")]


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


def _on_off(value: object) -> object:
    """YAML reads a bare on/off as a boolean; the setting keeps the word."""
    if value is True:
        return "on"
    if value is False:
        return "off"
    return value


OnOff = Annotated[Literal["on", "off"], BeforeValidator(_on_off)]


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
    simulated_gpus: Annotated[
        str | None,
        AfterValidator(_check_simulated_gpus),
        Setting(variables=("CAPYCTL_SIMULATED_GPUS",), metavar="NAME:SIZE,..."),
    ] = Field(
        None,
        description="Simulated GPUs instead of NVML: gpu0:24GiB,gpu1:24GiB or unified:128GiB.",
        examples=["gpu0:24GiB"],
    )
    simulated_host_ram: Annotated[
        str | None,
        AfterValidator(_check_size),
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


class ServerSettings(RoleSettings):
    kind: Literal["server"] = "server"
    server: ServerSection = ServerSection()


class HostSettings(RoleSettings):
    kind: Literal["host"] = "host"
    host: HostSection = Field(default_factory=HostSection)


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
    """Every setting of any role (the standalone role has them all)."""
    found: dict[str, SettingSpec] = {}
    for role in ROLES:
        found.update(setting_specs(role))
    return found


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
    # The flag, variable or document that stated it; None for a default.
    origin: str | None = None


@dataclass(frozen=True)
class LoadedSettings:
    role: Role
    settings: AnySettings
    document: Path | None
    rows: tuple[SettingRow, ...]


def flag_layer(role: Role, flags: Mapping[str, str | None]) -> Layer:
    """Flags given on the command line (name -> value; None means not given)."""
    specs = setting_specs(role)
    by_flag = {name: spec for spec in specs.values() for name in spec.flags}
    stated: dict[str, list[tuple[str, str]]] = {}
    for name, value in flags.items():
        if value is None:
            continue
        spec = by_flag.get(name)
        if spec is None:
            raise InvalidConfig(unknown_flag(role, name))
        stated.setdefault(spec.path, []).append((name, value))
    layer = Layer("flag")
    for path, given in stated.items():
        layer.put(path, *_agreed(path, given))
    return layer


def unknown_flag(role: Role, name: str) -> str:
    """Why `name` is no flag of `role`'s settings, and what to do instead."""
    for spec in all_setting_specs().values():
        if name in spec.flags:
            return f"{name} does not apply to the {role} role; drop it"
        if spec.secret and name == derived_flag(spec.path):
            return (
                f"{spec.path} never comes from a flag (it may hold a secret); set "
                f"{spec.variable} or {spec.path} in the role document"
            )
    known = [flag for spec in setting_specs(role).values() for flag in spec.flags]
    # `--max-parked` is most likely the end of a setting's path; else the closest spelling.
    ends = [flag for flag in known if flag.endswith(f"-{name.lstrip('-')}")]
    close = ends[:1] if len(ends) == 1 else difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"unknown flag {name} for the {role} role{hint} (--help lists every flag)"


def env_layer(role: Role, env: Mapping[str, str]) -> Layer:
    """The CAPYCTL_* variables of `role`'s settings; an empty one counts as unset, except
    where the setting refuses it."""
    layer = Layer("env")
    for spec in setting_specs(role).values():
        given = []
        for name in spec.variables:
            value = env.get(name)
            if value is None:
                continue
            if value == "":
                if spec.empty_refused:
                    raise InvalidConfig(
                        f"{name} is set but empty; give it a value (for example "
                        f"{name}={spec.example}) or unset it"
                    )
                continue
            given.append((name, value))
        if given:
            layer.put(spec.path, *_agreed(spec.path, given))
    return layer


def _agreed(path: str, given: list[tuple[str, str]]) -> tuple[str, str]:
    """The value of a setting stated under several names, which must agree."""
    first_name, first = given[0]
    for name, value in given[1:]:
        if value != first:
            raise InvalidConfig(
                f"{first_name} and {name} both set {path}, to {first!r} and {value!r}; "
                "give one of them"
            )
    return first, first_name


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
        stated = next((layer for layer in layers if path in layer.origins), None)
        if stated is None:
            rows.append(SettingRow(path, value, "default"))
        else:
            rows.append(SettingRow(path, value, stated.source, stated.origins[path]))
    return LoadedSettings(role, settings, document, tuple(rows))


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
