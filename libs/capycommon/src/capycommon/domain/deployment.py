"""The deployment document: what a person writes to serve one model.

Strict everywhere: an unknown key, a bare number where a size or duration belongs, or a value
out of range fails, naming the field. Sizes and durations are held as bytes and seconds and
written back in their exact unit (`14GiB`, `5m`), so a dumped document reads back the same.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    PlainSerializer,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from capycommon.domain.engines import Api, Residency
from capycommon.domain.strict import Strict
from capycommon.units import format_duration, format_size_exact, parse_duration, parse_size

NAME_PATTERN = r"[a-z0-9][a-z0-9._-]{0,62}"
HF_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[0-9a-f]{40})?"
MAX_REQUEST_DEADLINE_S = 3600.0

# Engine variables CapyCTL owns (ADR 0014, the 0.1.7 telemetry notes): set by it, or able to
# redirect what the engine loads, where it listens, or which GPU it sees.
RESERVED_ENV_PREFIXES = ("NCCL_", "GLOO_", "MASTER_", "CAPYCTL_", "LD_", "PYTHON", "LMCACHE_")
RESERVED_ENV_NAMES = frozenset(
    {
        "VLLM_HOST_IP", "SGLANG_HOST_IP", "HOST_IP", "PATH", "PYTHONPATH", "CUDA_HOME",
        "CUDA_VISIBLE_DEVICES", "HOME", "CUDA_DEVICE_ORDER", "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE", "VLLM_PLUGINS", "VLLM_SERVER_DEV_MODE", "VLLM_API_KEY",
        "TORCH_EXTENSIONS_DIR", "VLLM_PORT", "VLLM_ALLOW_INSECURE_SERIALIZATION",
        "LLAMA_API_KEY", "DO_NOT_TRACK", "VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK",
        "PROMETHEUS_MULTIPROC_DIR", "TENSORFOLD_API_KEY", "TENSORFOLD_CUDA_MEMORY_LIMIT_GB",
        "TENSORFOLD_NO_UPDATE_CHECK",
    }
)  # fmt: skip
FREE_ENV_NAMES = frozenset({"PYTHONUNBUFFERED"})


def env_reserved(name: str) -> bool:
    if name in FREE_ENV_NAMES:
        return False
    return name in RESERVED_ENV_NAMES or name.startswith(RESERVED_ENV_PREFIXES)


def _size(value: object) -> int:
    if not isinstance(value, str):
        raise ValueError(
            f"{value!r} is not a size; write it like 512MiB or 24GiB (B, KiB, MiB, GiB, TiB)"
        )
    size = parse_size(value)
    if size <= 0:
        raise ValueError(f"{value!r} is empty; give a size above zero, or drop the field")
    return size


def _duration(value: object) -> float:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a duration; write it like 500ms, 30s, 5m or 1h")
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError(f"{value!r} is no time; give a duration above zero, or drop the field")
    return seconds


def _idle_timeout(value: object) -> object:
    """A duration, or `never`: the idle step is off for this deployment."""
    if value == "never":
        return value
    try:
        return _duration(value)
    except ValueError as exc:
        raise ValueError(f"{exc}, or never to turn it off") from None


def _format_idle_timeout(value: float | str) -> str:
    return value if isinstance(value, str) else format_duration(value)


def _pool(size: int) -> int:
    if size < 1 << 30:
        raise ValueError(
            f"{format_size_exact(size)} is below 1GiB, the smallest LMCache pool; give 1GiB "
            "or more (the pool is pinned host RAM: 4GiB holds tens of thousands of tokens)"
        )
    return size


def _request_deadline(seconds: float) -> float:
    if seconds > MAX_REQUEST_DEADLINE_S:
        raise ValueError(f"{format_duration(seconds)} is above the most a request may wait, 1h")
    return seconds


def _env_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"{name!r} is not a variable name (letters, digits and _)")
    if env_reserved(name):
        raise PydanticCustomError(
            "engine_env_reserved",
            "{name} is reserved: CapyCTL sets it or it changes what the engine loads, "
            "where it listens or which GPU it sees; remove it",
            {"name": name, "code": f"engine_env_reserved:{name}"},
        )
    return name


def _text(value: object) -> str:
    """YAML reads 8192 or true as a number or a bool; an argument or variable is text."""
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a string; quote it, e.g. '{value}'")
    return value


def _model(value: object) -> object:
    """`model: Qwen3-4B` is short for `model: {path: Qwen3-4B}`."""
    if isinstance(value, str):
        return {"path": value}
    if not isinstance(value, dict):
        raise ValueError(
            f"{value!r} is not a model; name a folder under the models root, an absolute "
            "path, or a Hugging Face repository as {hf: org/name}"
        )
    return value


def _matching(pattern: str, what: str) -> AfterValidator:
    """A pattern check whose refusal says what was expected, not the regular expression."""
    compiled = re.compile(pattern)

    def check(value: str) -> str:
        if compiled.fullmatch(value) is None:
            raise ValueError(f"{value!r} is not {what}")
        return value

    return AfterValidator(check)


# A size in bytes, written as 14GiB; a bare number is refused (its unit would be a guess).
Size = Annotated[int, BeforeValidator(_size), PlainSerializer(format_size_exact, return_type=str)]
# A duration in seconds, written as 500ms, 30s, 5m or 1h.
Duration = Annotated[
    float, BeforeValidator(_duration), PlainSerializer(format_duration, return_type=str)
]
# An idle timeout: a duration, or `never`.
IdleTimeout = Annotated[
    float | Literal["never"],
    BeforeValidator(_idle_timeout),
    PlainSerializer(_format_idle_timeout, return_type=str),
]
Name = Annotated[
    str,
    _matching(
        NAME_PATTERN,
        "a deployment name: lowercase letters, digits, '.', '_' and '-', starting with a "
        "letter or digit, at most 63 characters (e.g. qwen3-4b)",
    ),
]
EngineName = Annotated[
    str,
    _matching(
        NAME_PATTERN,
        "an engine name: a registered engine (capyctl engine list) or a family "
        "(vllm, sglang, llamacpp)",
    ),
]
# Public model ids clients send: OpenAI-style ids such as `qwen3-4b` or `Qwen/Qwen3-4B`.
Route = Annotated[
    str,
    _matching(
        r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}",
        "a route: letters, digits and . _ : / @ + -, starting with a letter or digit, at most "
        "128 characters (e.g. qwen3-4b)",
    ),
]
HfRef = Annotated[
    str, _matching(HF_PATTERN, "a Hugging Face repository: org/name or org/name@<40-hex commit>")
]
ParserName = Annotated[
    str,
    _matching(
        r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}",
        "a parser name: auto, none or the engine's parser name (e.g. hermes, qwen3)",
    ),
]
GpuId = Annotated[str, _matching(r"gpu[0-9]{1,3}", "a GPU id; write gpuN, e.g. gpu0")]
HostName = Annotated[
    str,
    _matching(
        r"[a-z0-9][a-z0-9-]{0,62}",
        "a host name: lowercase letters, digits and '-', starting with a letter or digit, at "
        "most 63 characters (capyctl list hosts shows them)",
    ),
]
EnvName = Annotated[str, AfterValidator(_env_name)]
Text = Annotated[str, BeforeValidator(_text)]


class ModelSource(Strict):
    """Exactly one of a local folder (`path`) or a Hugging Face repository (`hf`).

    `hf: org/name@<40-hex commit>` is pinned. `hf: org/name` with an optional `revision` (a
    branch or tag; main when absent) is pinned by `capyctl deploy model`, which writes the
    commit into `hf` and keeps `revision` to say what it was resolved from. `files` narrows
    the download to the files its patterns match."""

    path: str | None = None
    hf: HfRef | None = None
    revision: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    files: tuple[Annotated[str, Field(min_length=1)], ...] = ()

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if (self.path is None) == (self.hf is None):
            raise ValueError("give exactly one of path or hf")
        if self.path is not None:
            if not self.path.strip():
                raise ValueError("path is empty; name a folder")
            if ".." in self.path.split("/"):
                raise ValueError(f"{self.path!r} climbs out with ..; write the folder plainly")
            if self.revision is not None or self.files:
                raise ValueError("revision and files are for hf sources; drop them for a path")
        if self.revision is not None and not self.revision.isprintable():
            raise ValueError(f"revision {self.revision!r} is not a branch, tag or commit name")
        return self

    @property
    def hf_repo(self) -> str | None:
        return self.hf.partition("@")[0] if self.hf else None

    @property
    def hf_commit(self) -> str | None:
        if self.hf is None:
            return None
        return self.hf.partition("@")[2] or None

    def pinned(self, commit: str) -> ModelSource:
        """This source at `commit`, remembering the branch or tag it was resolved from."""
        assert self.hf_repo is not None
        revision = self.revision or ("main" if self.hf_commit is None else None)
        return self.model_copy(update={"hf": f"{self.hf_repo}@{commit}", "revision": revision})


class Device(Strict):
    id: GpuId


class Placement(Strict):
    """Where the deployment may run. `hosts` empty: on any host."""

    hosts: tuple[HostName, ...] = ()

    @field_validator("hosts")
    @classmethod
    def _unique_hosts(cls, hosts: tuple[str, ...]) -> tuple[str, ...]:
        repeated = sorted({host for host in hosts if hosts.count(host) > 1})
        if repeated:
            raise ValueError(f"{', '.join(repeated)} listed twice; keep one")
        return hosts


class Memory(Strict):
    request: Size | None = None
    kv_cache: Size | None = None
    startup: Size | None = None

    @model_validator(mode="after")
    def _ordered(self) -> Memory:
        request = self.request
        if request is not None and self.startup is not None and self.startup < request:
            raise ValueError(
                f"startup ({format_size_exact(self.startup)}) is below request "
                f"({format_size_exact(request)}); the startup peak is at least the steady "
                "reservation: raise startup or drop it"
            )
        if request is not None and self.kv_cache is not None and self.kv_cache > request:
            raise ValueError(
                f"kv_cache ({format_size_exact(self.kv_cache)}) is above request "
                f"({format_size_exact(request)}), which holds it: raise request or lower kv_cache"
            )
        return self


class Resources(Strict):
    """What the engine takes while it starts, serves and stops, stated: on its GPU, and in
    host RAM (on unified memory, their sum on the one pool). Required where CapyCTL cannot
    derive it (TensorFold, a custom engine); nothing is charged while it is stopped."""

    gpu: Size
    ram: Size


class EngineConfig(Strict):
    context_length: Annotated[StrictInt, Field(ge=1, le=16_777_216)] | None = None
    max_concurrent_requests: Annotated[StrictInt, Field(ge=1, le=4096)] | None = None
    memory: Memory = Memory()
    tool_call_parser: ParserName | None = None
    reasoning_parser: ParserName | None = None
    extra_args: tuple[Text, ...] = ()
    env: Mapping[EnvName, Text] = Field(default_factory=dict)
    # How many GPUs of one host the model spans (tensor parallelism); None: one, or as many as
    # `devices` names.
    tensor_parallel: Annotated[StrictInt, Field(ge=1, le=64)] | None = None


class Lifecycle(Strict):
    # An idle ready model parks after ready_idle_timeout (or stops if it cannot park); a
    # parked one stops after parked_idle_timeout. Absent: the role's defaults
    # (server.scheduling.*_idle_timeout); `never` turns the step off for this deployment.
    ready_idle_timeout: IdleTimeout | None = None
    parked_idle_timeout: IdleTimeout | None = None
    # Idle or capacity reclaim never stops a warm deployment; requests still start or wake it.
    warm: StrictBool = False
    # explicit: the deployment moves only on operator commands.
    activation: Literal["on_demand", "explicit"] = "on_demand"


class Deployment(Strict):
    """One deployment document. `routes` defaults to `[name]`."""

    schema_version: Literal[1] = 1
    kind: Literal["deployment"] = "deployment"
    name: Name
    engine: EngineName
    model: Annotated[ModelSource, BeforeValidator(_model)]
    routes: tuple[Route, ...] = ()
    residency: Residency | None = None
    devices: tuple[Device, ...] = ()
    placement: Placement = Placement()
    engine_config: EngineConfig = EngineConfig()
    resources: Resources | None = None
    lifecycle: Lifecycle = Lifecycle()
    request_deadline: Annotated[Duration, AfterValidator(_request_deadline)] | None = None
    # zero: its engines keep no log and write no core dump (docs/retention.md); none: the
    # host's `retention`.
    retention: Literal["default", "zero"] | None = None
    # A private LMCache beside each instance (docs/lmcache.md): auto (none: where every
    # condition holds), off, or required (the deployment fails where one does not).
    lmcache: Literal["auto", "off", "required"] | None = None
    # Host RAM the instance's LMCache pins for its cache; none: 4GiB.
    lmcache_pool: Annotated[Size, AfterValidator(_pool)] | None = None
    # What the model serves (docs/decisions.md): chat (and completions, embeddings) or
    # decisions, a decision model's probabilities for typed questions (SGLang, llama.cpp).
    api: Api = "chat"

    @model_validator(mode="before")
    @classmethod
    def _default_routes(cls, data: Any) -> Any:
        name = data.get("name") if isinstance(data, dict) else None
        if isinstance(name, str) and "routes" not in data and re.fullmatch(NAME_PATTERN, name):
            return {**data, "routes": [name]}
        return data

    @model_validator(mode="before")
    @classmethod
    def _host_shorthand(cls, data: Any) -> Any:
        """`host: b` is `placement: {hosts: [b]}`; the two together are refused."""
        if not isinstance(data, dict) or "host" not in data:
            return data
        if "placement" in data:
            raise ValueError("give host or placement.hosts, not both")
        rest = {key: value for key, value in data.items() if key != "host"}
        return {**rest, "placement": {"hosts": [data["host"]]}}

    @field_validator("routes")
    @classmethod
    def _unique_routes(cls, routes: tuple[str, ...]) -> tuple[str, ...]:
        if not routes:
            raise ValueError("names no route; list at least one, or drop routes to use the name")
        repeated = sorted({route for route in routes if routes.count(route) > 1})
        if repeated:
            raise ValueError(f"{', '.join(repeated)} listed twice; keep one")
        return routes

    @field_validator("devices")
    @classmethod
    def _unique_devices(cls, devices: tuple[Device, ...]) -> tuple[Device, ...]:
        ids = [device.id for device in devices]
        repeated = sorted({gpu for gpu in ids if ids.count(gpu) > 1})
        if repeated:
            raise ValueError(f"{', '.join(repeated)} listed twice; keep one")
        return devices

    @model_validator(mode="after")
    def _devices_match(self) -> Deployment:
        size = self.engine_config.tensor_parallel
        if size is not None and self.devices and size != len(self.devices):
            raise PydanticCustomError(
                "tensor_parallel_invalid",
                "engine_config.tensor_parallel is {size} but devices names {count} GPUs; name "
                "{size} devices, or drop one of the two",
                {"size": size, "count": len(self.devices), "code": "tensor_parallel_invalid"},
            )
        return self

    def allows(self, host: str) -> bool:
        """Whether it may run on `host` (placement.hosts, when it names any)."""
        return not self.placement.hosts or host in self.placement.hosts

    @property
    def decides(self) -> bool:
        """Whether it serves decisions, not chat."""
        return self.api == "decisions"

    @property
    def pinned(self) -> tuple[str, ...]:
        """The GPUs it is pinned to (gpu0, ...), in the order named; empty: placement picks."""
        return tuple(device.id for device in self.devices)

    @property
    def gpu_count(self) -> int:
        """How many GPUs of one host it spans: its tensor-parallel size."""
        return self.engine_config.tensor_parallel or len(self.devices) or 1
