"""What every adapter shares: the launch request, the plan it becomes, the capabilities."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from capycommon.domain.commands import EngineTuning
from capycommon.domain.engines import Api, Residency
from capycommon.engines.registry import EngineProfile
from capycommon.errors import CapabilityMissing, InvalidConfig

ENGINE_HOST = "127.0.0.1"
# Where CapyCTL's helper modules (`engines/runtime/`) read the launch's key.
KEY_VARIABLE = "CAPYCTL_ENGINE_API_KEY"


# A checkpoint kind (`capycommon.deployments.checkpoint`): ModelOpt FP4 (NVFP4) weights.
MODELOPT_FP4 = "modelopt_fp4"


@dataclass(frozen=True)
class LaunchSpec:
    """Everything an adapter needs to start one engine."""

    profile: EngineProfile
    model_path: Path
    served_name: str
    port: int
    api_key: str = field(repr=False)
    residency: Residency
    # Where CapyCTL's helper modules (the vLLM key guard, the SGLang launcher) are written for
    # this launch.
    runtime_dir: Path
    # The deployment's tuning, as the launch command carried it.
    tuning: EngineTuning = field(default_factory=EngineTuning)
    api: Api = "chat"


@dataclass(frozen=True)
class LaunchPlan:
    """A fixed argv (no shell) and the engine-specific variables of its environment."""

    argv: list[str]
    env: dict[str, str] = field(repr=False)


@dataclass(frozen=True)
class Capabilities:
    """What a family (at a version) can do, and how CapyCTL must treat it."""

    residencies: tuple[Residency, ...]
    abort_by_id: bool
    request_id: Literal["header", "body", "none"]
    reasoning_field: str
    # Parking while requests run is unsafe: drain first (SGLang asserts idle and can crash).
    park_needs_idle: bool
    # What happens to a request that reaches a parked engine.
    requests_while_parked: Literal["held", "crash", "fail", "not_applicable"]
    # How long the engine takes to notice a client hang-up by itself.
    disconnect_abort_lag_s: float
    metrics_running: str
    metrics_waiting: str
    # The engine shows when an aborted request has ended (SGLang 0.5.22 and later): hostd
    # reports it, and the router gives back that request's place at once.
    abort_reports_end: bool = False
    # The leader's children live as long as the engine (SGLang's scheduler and detokenizer):
    # one that dies while the engine starts fails the launch (the leader would wait on).
    children_live_with_engine: bool = False
    # Park tiers that work only through the engine's development controls (vLLM's /sleep
    # needs VLLM_SERVER_DEV_MODE); a host with deep parking off uses none of them.
    dev_control_tiers: tuple[Residency, ...] = ()
    # Checkpoint kinds (`capycommon.deployments.checkpoint`) the engine cannot park.
    unparkable_checkpoints: frozenset[str] = frozenset()
    # It answers a decision model (`api: decisions`) from its decision head, over System One.
    decisions: bool = False


def restart_only(metrics_running: str = "", metrics_waiting: str = "") -> Capabilities:
    """An engine CapyCTL can only start and stop (llama.cpp, TensorFold, a custom engine): a
    hang-up is the closed connection alone; without metric names its load is not read."""
    return Capabilities(
        residencies=(Residency.RESTART_ONLY,),
        abort_by_id=False,
        request_id="none",
        reasoning_field="reasoning_content",
        park_needs_idle=False,
        requests_while_parked="not_applicable",
        disconnect_abort_lag_s=0.0,
        metrics_running=metrics_running,
        metrics_waiting=metrics_waiting,
    )


def unmetered_capabilities(version: str = "") -> Capabilities:
    """TensorFold's and a custom engine's, at any version: no metrics CapyCTL reads."""
    return restart_only()


def required_context_length(spec: LaunchSpec, engine: str) -> int:
    """The context length an engine that sizes its KV cache by it must be given."""
    if spec.tuning.context_length is None:
        raise InvalidConfig(
            f"engine_config.context_length is required for {engine}; set it, e.g. 8192"
        )
    return spec.tuning.context_length


def check_restart_only(spec: LaunchSpec, engine: str) -> None:
    """Refuse a launch that would park an engine that cannot."""
    if spec.residency != Residency.RESTART_ONLY:
        raise CapabilityMissing(
            f"residency: {engine} cannot park {spec.residency}; use restart_only",
            capability="deep_park",
        )


def host_tiers(capabilities: Capabilities, deep_park: bool) -> tuple[Residency, ...]:
    """The tiers an engine may use on a host: with deep parking off (host.deep_park: off),
    neither `deep` nor a tier that needs the engine's development controls."""
    if deep_park:
        return capabilities.residencies
    barred = {Residency.DEEP, *capabilities.dev_control_tiers}
    return tuple(tier for tier in capabilities.residencies if tier not in barred)


def python_server_argv(spec: LaunchSpec, module: str, model_flag: str) -> list[str]:
    """The start both Python engines share: their server module on the model, bound to
    loopback at the launch's port, answering to the deployment's name."""
    return [
        str(spec.profile.executable),
        "-m",
        module,
        model_flag,
        str(spec.model_path),
        "--host",
        ENGINE_HOST,
        "--port",
        str(spec.port),
        "--served-model-name",
        spec.served_name,
    ]


def helper_env(spec: LaunchSpec) -> dict[str, str]:
    """What a Python engine needs to run CapyCTL's helper modules: the launch's key, which
    stays off the command line (open to every local user, where the environment is open to
    its owner only), and the launch's runtime folder, which holds the modules, on its path."""
    return {KEY_VARIABLE: spec.api_key, "PYTHONPATH": str(spec.runtime_dir)}


def options(*pairs: tuple[str, object | None]) -> list[str]:
    """`--flag value` for each pair whose value is set; a True value is a bare `--flag`."""
    argv: list[str] = []
    for flag, value in pairs:
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, f"{value:.4f}" if isinstance(value, float) else str(value)]
    return argv


def check_extra_args(family: str, args: Iterable[str], reserved: frozenset[str]) -> tuple[str, ...]:
    """Pass the user's extra arguments only when none touches what CapyCTL controls.

    Refused: short options, reserved flags, and any prefix of one (argparse accepts
    abbreviations, so `--serv` would set `--served-model-name`).
    """
    checked = tuple(args)
    for arg in checked:
        if not arg.startswith("-"):
            continue  # the value of the option before it
        if not arg.startswith("--") or arg == "--":
            raise InvalidConfig(
                f"engine_config.extra_args: {arg!r} is a short option; {family} extra "
                "arguments must be long options (--name or --name=value)"
            )
        name = arg.split("=", 1)[0]
        clash = next((flag for flag in sorted(reserved) if flag.startswith(name)), None)
        if clash is not None:
            why = "is reserved" if clash == name else f"abbreviates the reserved {clash}"
            raise InvalidConfig(
                f"engine_config.extra_args: {name} {why}: CapyCTL sets it for {family}; "
                "use the deployment's typed fields instead"
            )
    return checked
