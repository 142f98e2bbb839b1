"""Binding a deployment to one host: its engine, its model folder and weights, its park tier.

The host's facts come in as values: `HostFacts`, and the models its hostd described
(`capycommon.domain.models.HostModels`). Nothing here reads a disk. Each refusal names the field
to change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath

from capycommon.deployments.checkpoint import Quantization, quantization
from capycommon.deployments.parallel import check_parallel
from capycommon.domain.deployment import Deployment, ModelSource
from capycommon.domain.engines import PARKING, Residency
from capycommon.domain.models import HostModels, ModelFacts, under_root
from capycommon.engines import decisions, lmcache
from capycommon.engines.adapters import adapter_for
from capycommon.engines.families import ENGINE_FAMILIES, EXPLICIT_RESOURCES, Family
from capycommon.engines.launch import Capabilities, check_extra_args, host_tiers
from capycommon.engines.registry import EngineProfile
from capycommon.errors import (
    CapabilityMissing,
    CapyError,
    HostBackedUnavailable,
    InvalidConfig,
    LMCacheUnavailable,
    ModelSourcePending,
    NotADecisionModel,
    NotFound,
    ProfileNotPublished,
)
from capycommon.hub.source import HubSource
from capycommon.units import format_size

# Downloads from the Hub, under the models root (`capycommon.hub.StorePaths`).
HUB_STORE = "sources/huggingface"
# A host_backed copy is charged 1.5 x the weights in the parked room, beside the engine's
# 4 GiB host overhead (reference §1 "Residency defaults", §6 "Memory accounting").
HOST_COPY_FACTOR = 1.5
ENGINE_HOST_OVERHEAD = 4 << 30


class ModelNotDescribed(Exception):
    """The host has not described the deployment's model path yet: the binding waits for
    its hostd (which describes what it is asked, `commands.Describe`), refusing nothing."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


@dataclass(frozen=True)
class HostFacts:
    """What resolution needs to know of the host, gathered by the caller."""

    unified: bool
    # Bytes the system domain may hold parked (the smaller of its parked and managed
    # limits); None while unknown.
    parked_room: int | None
    # The GPUs present: gpu0, gpu1, ...
    gpus: tuple[str, ...]
    # False where the host keeps its engines from their development controls
    # (host.deep_park: off): nothing parks deep there, and what would stops instead.
    deep_park: bool = True
    # False where LMCache is off on the host; True where its retention is zero (the default
    # of deployments that say none).
    lmcache: bool = True
    retention_zero: bool = False


@dataclass(frozen=True)
class Resolved:
    """A deployment as it would run on one host."""

    deployment: Deployment
    profile: EngineProfile
    # Where the model is on the host.
    model_path: PurePosixPath
    # Bytes of weights on disk; None when the folder holds none CapyCTL can measure.
    weights_bytes: int | None
    residency: Residency
    # Why this tier: "declared", or the rule that chose it.
    residency_reason: str
    # The pinned GPUs; empty lets placement pick.
    devices: tuple[str, ...]
    extra_args: tuple[str, ...]
    # The LMCache installation it runs with, or None; and what status says of it ("on", or
    # "off: <why>").
    cache: EngineProfile | None = None
    cache_note: str = "off"

    @property
    def cache_pool(self) -> int:
        """Host RAM its LMCache pins (0 without one)."""
        if self.cache is None:
            return 0
        return self.deployment.lmcache_pool or lmcache.DEFAULT_POOL


def resolve(
    deployment: Deployment,
    *,
    profiles: Mapping[str, EngineProfile],
    models: HostModels,
    host: HostFacts,
) -> Resolved:
    """Bind `deployment` to a host, or refuse naming the deployment, the field and the fix;
    `ModelNotDescribed` while the host has not described the model's path."""
    try:
        return _resolve(deployment, profiles, models, host)
    except CapyError as exc:
        message = f"deployment {deployment.name!r}: {exc.message}"
        raise exc.retold(message) from None


def _resolve(
    deployment: Deployment,
    profiles: Mapping[str, EngineProfile],
    models: HostModels,
    host: HostFacts,
) -> Resolved:
    profile = resolve_engine(deployment.engine, profiles)
    adapter = adapter_for(profile.family)
    config = deployment.engine_config
    reserved = adapter.reserved_for(profile)
    extra_args = check_extra_args(profile.family.value, config.extra_args, reserved)
    if profile.family in NEEDS_CONTEXT_LENGTH and config.context_length is None:
        raise InvalidConfig(
            f"engine_config.context_length is required for {NEEDS_CONTEXT_LENGTH[profile.family]};"
            " set it, e.g. 8192"
        )
    check_resources(deployment, profile)
    model = model_facts(deployment.model, models)
    check_parallel(deployment, profile, model, host)
    capabilities = adapter.capabilities(profile.version)
    if deployment.decides:
        check_decisions(profile, capabilities, model, extra_args)
    residency, reason = choose_residency(
        deployment.residency,
        profile,
        capabilities,
        host,
        model.weights_bytes,
        quantization(model),
    )
    cache, note = _cache(deployment, profile, residency, extra_args, model, profiles, host)
    return Resolved(
        deployment=deployment,
        profile=profile,
        model_path=PurePosixPath(model.path),
        weights_bytes=model.weights_bytes,
        residency=residency,
        residency_reason=reason,
        devices=deployment.pinned,
        extra_args=extra_args,
        cache=cache,
        cache_note=note,
    )


# The families that size their KV cache by the context length they are given, by name.
NEEDS_CONTEXT_LENGTH = {Family.LLAMACPP: "llama.cpp", Family.TENSORFOLD: "TensorFold"}


def check_resources(deployment: Deployment, profile: EngineProfile) -> None:
    """`resources` where CapyCTL cannot derive the engine's memory, and only there."""
    explicit = profile.family in EXPLICIT_RESOURCES
    if explicit and deployment.resources is None:
        raise InvalidConfig(
            f"resources is required for {profile.family} engines: CapyCTL cannot derive what "
            "they take; state it, e.g. resources: {gpu: 20GiB, ram: 4GiB}"
        )
    if not explicit and deployment.resources is not None:
        raise InvalidConfig(
            f"resources is for tensorfold and custom engines; CapyCTL sizes {profile.family} "
            "itself (engine_config.memory tunes it): drop resources"
        )


# What CapyCTL sets to connect an engine to its LMCache.
CACHE_FLAGS = ("--kv-transfer-config", "--enable-lmcache", "--lmcache-config-file")


def _cache(
    deployment: Deployment,
    profile: EngineProfile,
    residency: Residency,
    extra_args: tuple[str, ...],
    model: ModelFacts,
    profiles: Mapping[str, EngineProfile],
    host: HostFacts,
) -> tuple[EngineProfile | None, str]:
    """The LMCache the deployment runs with on this host (None: without), and what status
    says of it; `lmcache: required` where a condition fails is refused, naming it."""
    setting = deployment.lmcache or "auto"
    if setting == "off":
        return None, "off (lmcache: off)"
    if deployment.gpu_count > 1:
        why = "a model across several GPUs runs without LMCache in this release"
        if setting == "required":
            raise LMCacheUnavailable(f"lmcache: required, but {why}", gate="tensor_parallel")
        return None, f"off: {why} [tensor_parallel]"
    retention = deployment.retention or ("zero" if host.retention_zero else "default")
    found = lmcache.gate(
        lmcache.GateFacts(
            engine=profile,
            residency=residency,
            extra_args=extra_args,
            architectures=model.architectures,
            installs=lmcache.installs_of(profiles),
            retention_zero=retention == "zero",
            host_off=not host.lmcache,
            decisions=deployment.decides,
        )
    )
    if isinstance(found, lmcache.Closed):
        if setting == "required":
            raise LMCacheUnavailable(f"lmcache: required, but {found.why}", gate=found.gate)
        return None, f"off: {found.why} [{found.gate}]"
    clash = next((flag for flag in CACHE_FLAGS if lmcache.sets(extra_args, flag)), None)
    if clash is not None:
        raise InvalidConfig(
            f"engine_config.extra_args: {clash} is reserved while the model runs with LMCache: "
            "CapyCTL connects the engine to its own; drop it, or set lmcache: off"
        )
    pool = format_size(deployment.lmcache_pool or lmcache.DEFAULT_POOL)
    return found, f"on: LMCache {found.version} ({found.name}), pool {pool}"


# The decision heads each family reads (`capycommon.domain.models.DecisionHead`).
DECISION_HEADS = {
    Family.SGLANG: ("decision_config", "joint_head"),
    Family.LLAMACPP: ("gguf",),
}
DECISION_FILES = ("decision_config.json", "joint_head_config.json with joint_head.safetensors")


def check_decisions(
    profile: EngineProfile,
    capabilities: Capabilities,
    model: ModelFacts,
    extra_args: tuple[str, ...],
) -> None:
    """Refuse a decision model (api: decisions) its engine cannot answer from its head, a
    model that is no decision model, or an extra argument its launch bars. A Hub store not
    downloaded yet is checked by hostd once it is."""
    if not capabilities.decisions:
        raise CapabilityMissing(
            f"api: decisions: {profile.family} {profile.version} would answer a decision model "
            "from its text output, not its decision head (uncalibrated probabilities); serve "
            "it on SGLang 0.5.22 or later, or llama.cpp",
            capability="decisions",
        )
    decisions.check_args(profile.family, extra_args)
    if model.kind != "missing":
        check_head(profile, model)


def check_head(profile: EngineProfile, model: ModelFacts) -> None:
    """NotADecisionModel unless the model's files declare a decision head its engine reads."""
    heads = DECISION_HEADS.get(profile.family, ())
    head = model.decision
    if head is not None and head.kind in heads:
        return
    if head is not None:
        wants = "a GGUF with decision metadata" if "gguf" in heads else "a decision checkpoint"
        raise NotADecisionModel(
            f"model: {model.path} is a decision model for another engine ({head.evidence}); "
            f"{profile.family} reads {wants}: serve it on "
            f"{'llama.cpp' if head.kind == 'gguf' else 'SGLang'}, or name its other form"
        )
    raise NotADecisionModel(
        f"model: {model.path} is no decision model: "
        + (
            "its GGUF metadata has no <architecture>.decision.type"
            if profile.family == Family.LLAMACPP
            else f"it has no {', nor '.join(DECISION_FILES)}"
        )
        + "; name a decision model, or drop api: decisions to serve it for chat"
    )


def resolve_engine(engine: str, profiles: Mapping[str, EngineProfile]) -> EngineProfile:
    """A registered profile by name; a family name means the host's one profile of it."""
    found = profiles.get(engine)
    if found is not None and found.family not in ENGINE_FAMILIES:
        raise InvalidConfig(
            f"engine: {engine} is {found.family} {found.version}, a KV cache, not an engine; "
            "name a vLLM, SGLang, llama.cpp, TensorFold or custom engine (LMCache runs beside "
            "it: lmcache: auto)"
        )
    if found is not None:
        return found
    registered = ", ".join(sorted(profiles)) or "none"
    if engine in {family.value for family in ENGINE_FAMILIES}:
        matches = sorted(name for name, profile in profiles.items() if profile.family == engine)
        if len(matches) == 1:
            return profiles[matches[0]]
        if matches:
            raise ProfileNotPublished(
                f"engine: {engine} names a family with several registered engines "
                f"({', '.join(matches)}); name one of them"
            )
        raise ProfileNotPublished(
            f"engine: no {engine} engine is registered on this host (registered: {registered}); "
            "register one with capyctl engine add"
        )
    raise ProfileNotPublished(
        f"engine: {engine!r} is not a registered engine (registered: {registered}); name one "
        "of them or a family (vllm, sglang, llamacpp, tensorfold, custom), or register it with "
        "capyctl engine add"
    )


def model_facts(source: ModelSource, models: HostModels) -> ModelFacts:
    """The host's facts of the model's folder (or file): a name under the models root,
    `~/...`, or absolute."""
    if source.path is None:
        return _hub_facts(source, models)
    found = models.find(source.path)
    if found is None:
        raise ModelNotDescribed(source.path)
    if found.kind == "no_home":
        raise InvalidConfig(
            f"model: {source.path!r} names a home folder that does not exist; write the path"
        )
    if found.kind == "missing":
        hint = ""
        if under_root(source.path) and source.path.count("/") == 1:
            hint = f" (a Hugging Face repository is written {{hf: {source.path}}})"
        raise NotFound(
            f"model: {found.path} does not exist; put the model there or fix model{hint}"
        )
    return found


def hub_store(source: ModelSource) -> str:
    """Where a pinned Hugging Face source lives under a models root."""
    commit = source.hf_commit
    if source.hf_repo is None or commit is None:
        raise ModelSourcePending(
            f"model: {{hf: {source.hf}}} is not pinned to a commit; deploy it with capyctl "
            "deploy model, which resolves its revision to a commit and pins it, or write "
            "hf: org/name@<40-hex commit>"
        )
    return f"{HUB_STORE}/{HubSource(source.hf_repo, commit, source.files).store_name(commit)}"


def named_path(source: ModelSource) -> str | None:
    """The model path on a host that a source names: its folder, or a pinned Hugging Face
    source's store under the models root; None for an unpinned source."""
    if source.path is not None:
        return source.path
    return hub_store(source) if source.hf_commit is not None else None


def hub_origin(written: str) -> tuple[str | None, str | None]:
    """(repository, commit) of a store path `hub_store` wrote; (None, None) for any other."""
    prefix = f"{HUB_STORE}/"
    if not written.startswith(prefix) or "@" not in written:
        return None, None
    folder, _, pinned = written.removeprefix(prefix).partition("@")
    owner, _, name = folder.partition("--")
    return f"{owner}/{name}", pinned[:40]


def _hub_facts(source: ModelSource, models: HostModels) -> ModelFacts:
    """A Hugging Face source's store on the host: its facts once downloaded; before that, a
    missing folder that hostd downloads when it launches the model."""
    written = hub_store(source)
    found = models.find(written)
    if found is None:
        raise ModelNotDescribed(written)
    if found.kind in ("folder", "missing"):
        return found
    raise InvalidConfig(
        f"model: {found.path} is in the way of the download of {source.hf} (it is "
        f"{found.kind}, not a folder); remove it"
    )


def choose_residency(
    declared: Residency | None,
    profile: EngineProfile,
    capabilities: Capabilities,
    host: HostFacts,
    weights: int | None,
    checkpoint: Quantization | None = None,
) -> tuple[Residency, str]:
    """The park tier and why: the declared one if the engine and host can do it, else the
    reference's default (restart_only if the engine cannot park, or cannot park this
    checkpoint; deep on unified memory; on a discrete card host_backed when the host copy
    fits the parked room, else deep). On a host with deep parking off, a tier it bars (deep,
    or one that needs the engine's development controls) becomes restart_only, with a note:
    the model stops where it would have parked."""
    if checkpoint is not None and checkpoint.kind in capabilities.unparkable_checkpoints:
        return _unparkable_checkpoint(declared, profile, checkpoint)
    if declared is not None:
        if declared == Residency.HOST_BACKED and host.unified:
            raise HostBackedUnavailable(
                "residency: host_backed keeps the weights in host RAM, which on unified memory "
                "is the GPU's own memory; use deep, or drop residency"
            )
        if declared not in capabilities.residencies:
            raise CapabilityMissing(
                f"residency: {profile.family} {profile.version} cannot park ({declared}); "
                "use restart_only, or drop residency",
                capability="deep_park",
            )
        if declared not in host_tiers(capabilities, host.deep_park):
            note = _barred(declared, profile, capabilities)
            return Residency.RESTART_ONLY, f"declared {declared}, but {note}; it stops instead"
        return declared, "declared"
    if not any(tier in capabilities.residencies for tier in PARKING):
        return Residency.RESTART_ONLY, f"{profile.family} cannot park"
    tier, reason = _default_tier(host, weights)
    if tier not in capabilities.residencies:
        tier = next(t for t in (*PARKING, Residency.RESTART_ONLY) if t in capabilities.residencies)
        reason = f"{reason}, but {profile.family} parks only {tier}"
    if tier not in host_tiers(capabilities, host.deep_park):
        note = _barred(tier, profile, capabilities)
        return Residency.RESTART_ONLY, f"{reason}; {note}, so it stops instead of parking"
    return tier, reason


def _barred(tier: Residency, profile: EngineProfile, capabilities: Capabilities) -> str:
    """Why a host with deep parking off does not let an engine park at `tier`."""
    off = "deep parking is off on this host (host.deep_park: off)"
    if tier in capabilities.dev_control_tiers and tier != Residency.DEEP:
        return f"{off}, and {profile.family} parks {tier} only through its development controls"
    return off


def _unparkable_checkpoint(
    declared: Residency | None, profile: EngineProfile, checkpoint: Quantization
) -> tuple[Residency, str]:
    why = (
        f"{profile.family} cannot park a ModelOpt FP4 (NVFP4) checkpoint, and the model is "
        f"one ({checkpoint.evidence})"
    )
    if declared in PARKING:
        raise CapabilityMissing(
            f"residency: {declared}: {why}; set residency: restart_only (or drop residency)",
            capability="deep_park",
        )
    return Residency.RESTART_ONLY, "declared" if declared is not None else why


def _default_tier(host: HostFacts, weights: int | None) -> tuple[Residency, str]:
    if host.unified:
        return Residency.DEEP, "unified memory: a host copy would take the GPU's own memory"
    if weights is None:
        return Residency.DEEP, "the size of the weights is unknown"
    if host.parked_room is None:
        return Residency.DEEP, "the host's parked room is unknown"
    need = int(HOST_COPY_FACTOR * weights) + ENGINE_HOST_OVERHEAD
    sums = f"1.5 x {format_size(weights)} of weights + 4 GiB = {format_size(need)}"
    if need <= host.parked_room:
        return Residency.HOST_BACKED, f"{sums} fits the {format_size(host.parked_room)} parked room"
    return Residency.DEEP, f"{sums} exceeds the {format_size(host.parked_room)} parked room"
