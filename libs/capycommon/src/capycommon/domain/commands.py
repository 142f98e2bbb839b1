"""Commands from the scheduler to a host's hostd, as they travel on the host's stream.

Each instance command names the deployment, the instance and the generation it is for; hostd
refuses (and records) a command for a stale generation. `Describe` asks for the facts of
model paths instead (`capycommon.domain.models`); `Pull` and `Remove` act on the host's model
store. Launch, park, wake and stop carry the scheduler's reason, which hostd writes into the
events of the transitions it makes, so a host's history says why each happened.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, TypeAdapter

from capycommon.domain.strict import Strict

if TYPE_CHECKING:  # the deployments' schema reads the host's facts, which name HubPull
    from capycommon.domain.deployment import ModelSource


class _Command(Strict):
    deployment: str
    instance: int = 0
    generation: int


class HubPull(Strict):
    """A pinned Hugging Face source hostd downloads into its model store before the engine
    starts (nothing to do when the store has it)."""

    repo: str
    commit: str
    files: tuple[str, ...] = ()

    @classmethod
    def of(cls, model: ModelSource) -> HubPull | None:
        """What hostd downloads for a deployment's model: its pinned Hugging Face source, if
        it has one."""
        if model.hf_repo is None or model.hf_commit is None:
            return None
        return cls(repo=model.hf_repo, commit=model.hf_commit, files=model.files)


class CacheLaunch(Strict):
    """The LMCache server to run beside the engine, and what the scheduler charges for it."""

    profile: str
    pool_bytes: int = Field(gt=0)
    host_bytes: int = Field(ge=0)
    device_bytes: int = Field(ge=0)


class EngineTuning(Strict):
    """What a deployment sets of its engine's tuning: the scheduler sends it in a launch, and
    hostd hands it to the engine's adapter as it came (`capycommon.engines.launch`)."""

    # The share of the device's total memory the engine may take (vLLM, SGLang).
    memory_fraction: float | None = None
    kv_cache_bytes: int | None = None
    # The device bytes the engine may take, where the deployment states them (`resources`:
    # TensorFold is told so).
    gpu_memory_bytes: int | None = Field(default=None, ge=0)
    context_length: int | None = None
    max_concurrent_requests: int | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    extra_args: tuple[str, ...] = ()
    # How many GPUs the engine spans (its tensor-parallel size); None: one.
    tensor_parallel: int | None = Field(default=None, ge=2, le=64)


class _LaunchHead(_Command):
    """The fields of a launch that stand before its tuning in the command's JSON."""

    kind: Literal["launch"] = "launch"
    reason: str = "requested"
    revision: int
    profile: str
    model_path: str
    served_name: str
    residency: Literal["host_backed", "deep", "restart_only"]
    gpu_uuid: str
    # Every GPU of the set in rank order, for an engine across several (gpu_uuid is the
    # first); empty for one GPU.
    gpu_uuids: tuple[str, ...] = Field(default=(), max_length=64)


class Launch(EngineTuning, _LaunchHead):
    """Start an engine. Its fields lie flat in the JSON: the head's, the tuning's, then these
    (pydantic orders inherited fields from the last base to the first)."""

    env: dict[str, str] = Field(default_factory=dict)
    start_deadline_s: float = 1800.0
    # The source to download first, for a model from the Hub; the deadline starts after it.
    hub: HubPull | None = None
    # The deployment's `retention` (None: the host's).
    retention: Literal["default", "zero"] | None = None
    # Its LMCache server; None: the engine runs without one.
    cache: CacheLaunch | None = None
    # What the model serves: chat, or decisions (a decision model).
    api: Literal["chat", "decisions"] = "chat"

    @property
    def devices(self) -> tuple[str, ...]:
        """The UUIDs of every GPU it starts the engine on, in rank order."""
        return self.gpu_uuids or (self.gpu_uuid,)

    def tuning(self) -> EngineTuning:
        """The engine's tuning alone, without the rest of the command, for its adapter."""
        return EngineTuning.model_validate(self.model_dump(include=set(EngineTuning.model_fields)))


class Park(_Command):
    """Park a serving engine.

    With `release_bound_bytes` (the scheduler's parked charge: the most device bytes the
    parked engine may still hold), the park counts only once memwatch shows the engine's
    processes within it; if that is not seen within `verify_s`, hostd stops the instance, so
    the charge never understates what the device holds.
    """

    kind: Literal["park"] = "park"
    reason: str = "requested"
    release_bound_bytes: int | None = Field(default=None, ge=0)
    verify_s: float = Field(default=15.0, gt=0)


class Wake(_Command):
    kind: Literal["wake"] = "wake"
    reason: str = "requested"
    wake_deadline_s: float = 900.0


class Stop(_Command):
    """Stop the instance's engine. `keep_cache`: a restart_only park, which keeps its LMCache
    server (and the pool's contents) for the next launch. A stop of an instance already
    stopped whose server was kept stops that server."""

    kind: Literal["stop"] = "stop"
    reason: str = "requested"
    keep_cache: bool = False


class Abort(_Command):
    kind: Literal["abort"] = "abort"
    request_id: str


class Describe(Strict):
    """Describe these model paths (`capycommon.state.hostfacts`) besides the models root, each as
    deployments write it (a name under the models root, `~/...`, or absolute): the whole
    list the control plane needs, replacing the one before. hostd keeps describing them
    (re-reading when they change) until a later list leaves them out."""

    kind: Literal["describe"] = "describe"
    paths: tuple[str, ...]
    # For a path that is a Hub source's store: the source, whose file listing gives the
    # weights' size before the download.
    sources: dict[str, HubPull] = Field(default_factory=dict)


class Pull(Strict):
    """Download a Hub source into the host's model store ahead of any deployment (`capyctl
    model pull`). hostd reports under the operation's id (`capycommon.state.downloads`)."""

    kind: Literal["pull"] = "pull"
    operation: str
    source: HubPull


class Remove(Strict):
    """Remove a download from the host's model store (`capyctl model remove`): `name` is the
    store's path under the models root. hostd refuses while an instance of the host runs
    from it or it is being downloaded."""

    kind: Literal["remove"] = "remove"
    operation: str
    name: str


class TailLog(Strict):
    """Send the last `lines` lines of an instance's engine log on the reply channel
    `keys.engine_log_reply(host, reply)` (`capycommon.state.enginelogs`): pub/sub, which Redis
    never writes to disk, so the lines of an engine that keeps its log in memory only
    (retention: zero) reach no disk on the way."""

    kind: Literal["tail_log"] = "tail_log"
    deployment: str
    instance: int = 0
    reply: str
    lines: int = Field(default=100, ge=1, le=10_000)


InstanceCommand = Launch | Park | Wake | Stop | Abort


StoreCommand = Pull | Remove


HostCommand = InstanceCommand | Describe | StoreCommand | TailLog


COMMAND: TypeAdapter[HostCommand] = TypeAdapter(Annotated[HostCommand, Field(discriminator="kind")])
