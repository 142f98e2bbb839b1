"""llama.cpp: the user's `llama-server`. It cannot park: it is always restart-only."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from capycommon.engines import decisions
from capycommon.engines.control import EngineControl
from capycommon.engines.families import Family
from capycommon.engines.launch import (
    ENGINE_HOST,
    Capabilities,
    LaunchPlan,
    LaunchSpec,
    check_extra_args,
    check_restart_only,
    required_context_length,
    restart_only,
)
from capycommon.errors import EngineError, InvalidConfig

DEFAULT_SLOTS = 4

RESERVED = frozenset(
    {
        "--model",
        "--host",
        "--port",
        "--api-key",
        "--api-key-file",
        "--alias",
        "--ctx-size",
        "--parallel",
        "--metrics",
        "--no-webui",
        "--webui",
        "--n-gpu-layers",
        "--sleep-idle-seconds",
        "--slots",
        "--no-slots",
        "--ssl-key-file",
        "--ssl-cert-file",
        "--props",
        "--models-dir",
        "--models-preset",
        "--path",
        "--log-file",
        "--jinja",
        "--no-jinja",
        "--reasoning-format",
        "--hf-repo",
        "--model-url",
        "--split-mode",
        "--tensor-split",
        "--main-gpu",
    }
)


def capabilities(version: str) -> Capabilities:
    found = restart_only("llamacpp:requests_processing", "llamacpp:requests_deferred")
    return replace(found, decisions=True)  # a build without decision serving says so at readiness


def model_file(path: Path) -> Path:
    """The GGUF to load: the file itself, or the first (part of the) one in a folder."""
    if path.is_file():
        return path
    files = sorted(path.glob("*.gguf"))
    first_parts = [f for f in files if "-00001-of-" in f.name]
    chosen = first_parts or files
    if not chosen:
        raise InvalidConfig(f"model: {path} holds no .gguf file for llama.cpp")
    return chosen[0]


def plan(spec: LaunchSpec) -> LaunchPlan:
    check_restart_only(spec, "llama.cpp")
    tuning = spec.tuning
    context_length = required_context_length(spec, "llama.cpp")
    argv = [
        str(spec.profile.executable),
        "-m",
        str(model_file(spec.model_path)),
        "--host",
        ENGINE_HOST,
        "--port",
        str(spec.port),
        "--alias",
        spec.served_name,
        "-c",
        str(context_length),
        "-np",
        str(tuning.max_concurrent_requests or DEFAULT_SLOTS),
        "-ngl",
        "999",
        "--metrics",
        "--no-webui",
        "--jinja",
    ]
    if tuning.reasoning_parser:
        argv += ["--reasoning-format", "deepseek"]
    if tuning.tensor_parallel:
        # The layers split evenly over every GPU of CUDA_VISIBLE_DEVICES, in one process.
        argv += ["--split-mode", "layer", "--tensor-split", ",".join("1" * tuning.tensor_parallel)]
    if spec.api == "decisions":
        decisions.check_args(Family.LLAMACPP, tuning.extra_args)
        slots = tuning.max_concurrent_requests or DEFAULT_SLOTS
        argv += decisions.launch_args(Family.LLAMACPP, context_length, slots)
    argv += check_extra_args("llamacpp", tuning.extra_args, RESERVED)
    # llama-server reads its key from LLAMA_API_KEY: it stays out of the process list.
    return LaunchPlan(argv, {"LLAMA_API_KEY": spec.api_key})


class LlamacppControl(EngineControl):
    """Park, wake and abort by id are not available: the base refuses them."""

    async def confirm_api(self) -> None:
        """A decision model is ready only once llama.cpp's /v1/models says it outputs
        decisions (it reads that from the GGUF's metadata)."""
        if self.spec.api != "decisions":
            return
        found = await self._call("GET", "/v1/models", self.timeouts.health)
        said = decisions.modalities(found.json(), self.spec.served_name)
        if said is None or decisions.DECISIONS_MODALITY not in said:
            shown = "no output modalities" if said is None else f"output modalities {said}"
            raise EngineError(
                f"llama.cpp's /v1/models gives {self.spec.served_name!r} {shown}, not "
                f"{decisions.DECISIONS_MODALITY}: {self.spec.model_path} is no decision model "
                "to this build, or the build cannot serve one (api: decisions)"
            )
