"""TensorFold: always restart-only, sized by the deployment's `resources`.

TensorFold's command line is not public. Everything CapyCTL assumes of it stands here, and
nowhere else (docs/engines.md says the same, plainly):
- the install is one executable, `tensorfold`; `tensorfold --version` prints
  `tensorfold <version>`;
- `tensorfold serve --model PATH --host H --port P --served-model-name NAME
  --context-length N --parallel N` serves the OpenAI chat and completions routes;
  `--parallel` is its concurrency (8 unless the deployment says otherwise);
- it reads its API key from `TENSORFOLD_API_KEY`, keeps within
  `TENSORFOLD_CUDA_MEMORY_LIMIT_GB` (GiB) on its GPU, and checks for updates unless
  `TENSORFOLD_NO_UPDATE_CHECK=1`;
- `GET /health` answers 200 once the model is loaded; it has no metrics CapyCTL reads.
A real TensorFold that differs can still run as a custom engine (`engines.custom`), whose
registration gives its command.
"""

from __future__ import annotations

import re

from capycommon.engines.launch import (
    ENGINE_HOST,
    LaunchPlan,
    LaunchSpec,
    check_extra_args,
    check_restart_only,
    options,
    required_context_length,
    unmetered_capabilities,
)
from capycommon.errors import InvalidConfig

EXECUTABLE = "tensorfold"
VERSION_LINE = re.compile(r"^tensorfold\s+(\d+\.\d+(?:\.\d+)?\S*)\s*$", re.MULTILINE)
DEFAULT_PARALLEL = 8
KEY_VARIABLE = "TENSORFOLD_API_KEY"
MEMORY_LIMIT_VARIABLE = "TENSORFOLD_CUDA_MEMORY_LIMIT_GB"
NO_UPDATE_CHECK_VARIABLE = "TENSORFOLD_NO_UPDATE_CHECK"
RESERVED_ENV = frozenset({KEY_VARIABLE, MEMORY_LIMIT_VARIABLE, NO_UPDATE_CHECK_VARIABLE})
RESERVED = frozenset(
    {
        "--model",
        "--host",
        "--port",
        "--served-model-name",
        "--context-length",
        "--parallel",
        "--api-key",
    }
)
GiB = 1 << 30

capabilities = unmetered_capabilities


def memory_limit(gpu_bytes: int) -> str:
    """TENSORFOLD_CUDA_MEMORY_LIMIT_GB for a budget: GiB, rounded down to a hundredth, so an
    engine that reads the figure as decimal GB takes less, never more."""
    return f"{gpu_bytes * 100 // GiB / 100:.2f}"


def plan(spec: LaunchSpec) -> LaunchPlan:
    check_restart_only(spec, "TensorFold")
    tuning = spec.tuning
    context_length = required_context_length(spec, "TensorFold")
    if tuning.gpu_memory_bytes is None:
        raise InvalidConfig("resources.gpu is required for TensorFold; set resources")
    argv = [str(spec.profile.executable), "serve"]
    argv += options(
        ("--model", str(spec.model_path)),
        ("--host", ENGINE_HOST),
        ("--port", spec.port),
        ("--served-model-name", spec.served_name),
        ("--context-length", context_length),
        ("--parallel", tuning.max_concurrent_requests or DEFAULT_PARALLEL),
    )
    argv += check_extra_args("tensorfold", tuning.extra_args, RESERVED)
    env = {
        KEY_VARIABLE: spec.api_key,
        MEMORY_LIMIT_VARIABLE: memory_limit(tuning.gpu_memory_bytes),
        NO_UPDATE_CHECK_VARIABLE: "1",
    }
    return LaunchPlan(argv, env)
