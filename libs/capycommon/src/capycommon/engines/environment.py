"""The closed environment an engine starts with: nothing of the caller's leaks in."""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

from capycommon.engines.families import PYTHON_FAMILIES, Family
from capycommon.engines.launch import LaunchPlan, LaunchSpec

SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
# The engines' own usage reports, off unless the host sets `engine_telemetry: allow`.
TELEMETRY_OFF = {
    "DO_NOT_TRACK": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
}
# Engines are given local paths and never download (hostd fetched the model already), nor
# talk to the Hub at all.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
# CapyCTL's helper modules (`engines/runtime/`), written into each launch's runtime folder.
VLLM_GUARD = "capyctl_vllm_guard"
SGLANG_LAUNCHER = "capyctl_sglang_launch"
# The launch's own folder for Prometheus' multiprocess files (SGLang), in its runtime folder.
PROMETHEUS_DIR = "prometheus"


def engine_environment(
    spec: LaunchSpec,
    plan: LaunchPlan,
    *,
    gpu_uuid: str,
    home: Path,
    simgpu_dir: Path | None = None,
    telemetry: bool = False,
) -> dict[str, str]:
    """The engine's environment: its own bin first, its usage reports off (unless the host
    allows `telemetry`), the Hub offline, its GPUs by UUID (`gpu_uuid`: one, or several
    comma-separated in rank order, as CUDA_VISIBLE_DEVICES lists them)."""
    profile = spec.profile
    own_bin = profile.install_path / "bin" if profile.family in PYTHON_FAMILIES else None
    if profile.family in (Family.TENSORFOLD, Family.CUSTOM):
        own_bin = profile.executable.parent  # the programs it starts may stand beside it
    path = f"{own_bin}:{SYSTEM_PATH}" if own_bin else SYSTEM_PATH
    env = {
        "PATH": path,
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "CUDA_VISIBLE_DEVICES": gpu_uuid,
        **({} if telemetry else TELEMETRY_OFF),
        **OFFLINE,
    }
    if simgpu_dir is not None:
        env["CAPYCTL_SIMGPU_DIR"] = str(simgpu_dir)
    env.update(plan.env)
    return env


def install_runtime(runtime_dir: Path) -> None:
    """Write CapyCTL's helper modules (the vLLM key guard, the SGLang launcher) owner-only into
    `runtime_dir`, with an empty folder for the engine's Prometheus files."""
    runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    (runtime_dir / PROMETHEUS_DIR).mkdir(mode=0o700, exist_ok=True)
    for module in (VLLM_GUARD, SGLANG_LAUNCHER):
        source = resources.files("capycommon.engines.runtime").joinpath(f"{module}.py")
        target = runtime_dir / f"{module}.py"
        with source.open("rb") as reader, target.open("wb") as writer:
            shutil.copyfileobj(reader, writer)
        target.chmod(0o600)
