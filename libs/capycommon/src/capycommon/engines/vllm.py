"""vLLM: `python -m vllm.entrypoints.openai.api_server`, parked with its sleep mode."""

from __future__ import annotations

from packaging.version import Version

from capycommon.domain.engines import PARKING, Residency
from capycommon.engines.control import EngineControl
from capycommon.engines.environment import VLLM_GUARD
from capycommon.engines.families import Family, parse_version
from capycommon.engines.launch import (
    Capabilities,
    LaunchPlan,
    LaunchSpec,
    check_extra_args,
    helper_env,
    options,
    python_server_argv,
)

GUARD = f"{VLLM_GUARD}.KeyGuard"
RELOAD_WEIGHTS: dict[str, object] = {
    "method": "reload_weights",
    "args": [],
    "kwargs": {},
    "timeout": None,
}

RESERVED = frozenset(
    {
        "--model",
        "--host",
        "--port",
        "--uds",
        "--api-key",
        "--served-model-name",
        "--gpu-memory-utilization",
        "--max-model-len",
        "--max-num-seqs",
        "--kv-cache-memory-bytes",
        "--enable-sleep-mode",
        "--middleware",
        "--tensor-parallel-size",
        "--pipeline-parallel-size",
        "--data-parallel-size",
        "--config",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "--reasoning-parser",
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level",
        "--ssl-keyfile",
        "--ssl-certfile",
        "--ssl-ca-certs",
        "--root-path",
        "--allowed-origins",
        "--headless",
        "--api-server-count",
        "--enable-log-requests",
        "--disable-log-requests",
        "--enable-request-id-headers",
        "--shutdown-timeout",
    }
)


# The first release that answers decision models from their decision head; None: none yet.
# vLLM 0.32 serves /v1/systemone by reading the text output's label logprobs, which ignores
# the head a decision checkpoint was trained with (its probabilities are not the calibrated
# ones), so CapyCTL refuses it for api: decisions. Qualify each later release here.
DECISION_HEADS_FROM: Version | None = None


def capabilities(version: str) -> Capabilities:
    parsed = parse_version(Family.VLLM, version)
    # 0.11.1-0.15 send both names; 0.16 dropped reasoning_content.
    reasoning = "reasoning_content" if parsed <= Version("0.11.0") else "reasoning"
    return Capabilities(
        residencies=(*PARKING, Residency.RESTART_ONLY),
        abort_by_id=False,
        request_id="header",
        reasoning_field=reasoning,
        park_needs_idle=False,  # /sleep aborts what runs (mode=abort, 0.17+)
        requests_while_parked="held" if parsed >= Version("0.17") else "crash",
        disconnect_abort_lag_s=0.0,
        metrics_running="vllm:num_requests_running",
        metrics_waiting="vllm:num_requests_waiting",
        dev_control_tiers=PARKING,  # /sleep and /wake_up exist only in dev mode
        decisions=DECISION_HEADS_FROM is not None and parsed >= DECISION_HEADS_FROM,
    )


def plan(spec: LaunchSpec) -> LaunchPlan:
    tuning = spec.tuning
    argv = [
        *python_server_argv(spec, "vllm.entrypoints.openai.api_server", "--model"),
        "--middleware",
        GUARD,
        "--disable-uvicorn-access-log",
    ]
    argv += options(
        ("--gpu-memory-utilization", tuning.memory_fraction),
        ("--max-model-len", tuning.context_length),
        ("--max-num-seqs", tuning.max_concurrent_requests),
        ("--kv-cache-memory-bytes", tuning.kv_cache_bytes),
        ("--enable-sleep-mode", spec.residency in PARKING),
        ("--enable-auto-tool-choice", bool(tuning.tool_call_parser)),
        ("--tool-call-parser", tuning.tool_call_parser),
        ("--reasoning-parser", tuning.reasoning_parser),
        # One worker per GPU of CUDA_VISIBLE_DEVICES; memory figures apply to each.
        ("--tensor-parallel-size", tuning.tensor_parallel),
    )
    argv += check_extra_args("vllm", tuning.extra_args, RESERVED)
    # vLLM's own check on /v1, and the guard on every other path, dev controls included; both
    # read the key from the environment.
    env = {"VLLM_API_KEY": spec.api_key, **helper_env(spec)}
    if spec.residency in PARKING:
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /sleep, /wake_up, /collective_rpc
    return LaunchPlan(argv, env)


class VllmControl(EngineControl):
    async def park(self, residency: Residency) -> None:
        self.check_parks(residency)
        level = "1" if residency == Residency.HOST_BACKED else "2"
        await self._call("POST", "/sleep", self.timeouts.park, params={"level": level})

    async def wake(self, residency: Residency) -> None:
        self.check_parks(residency)
        wake = self.timeouts.wake
        await self._call("POST", "/wake_up", wake, params={"tags": "weights"})
        if residency == Residency.DEEP:
            await self._call("POST", "/collective_rpc", wake, json=RELOAD_WEIGHTS)
        await self._call("POST", "/wake_up", wake, params={"tags": "kv_cache"})
        await self._call("POST", "/reset_prefix_cache", wake)
