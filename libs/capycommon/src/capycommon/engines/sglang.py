"""SGLang: `python -m sglang.launch_server` (through CapyCTL's launcher, which adds the key),
parked by releasing its memory occupation."""

from __future__ import annotations

from packaging.version import Version

from capycommon.domain.engines import PARKING, Residency
from capycommon.engines import decisions
from capycommon.engines.control import EngineControl, parse_metric
from capycommon.engines.environment import PROMETHEUS_DIR, SGLANG_LAUNCHER
from capycommon.engines.families import Family, parse_version
from capycommon.engines.launch import (
    MODELOPT_FP4,
    Capabilities,
    LaunchPlan,
    LaunchSpec,
    check_extra_args,
    helper_env,
    options,
    python_server_argv,
)

RESERVED = frozenset(
    {
        "--model-path",
        "--model",
        "--host",
        "--port",
        "--api-key",
        "--admin-api-key",
        "--served-model-name",
        "--mem-fraction-static",
        "--context-length",
        "--max-running-requests",
        "--enable-memory-saver",
        "--enable-weights-cpu-backup",
        "--enable-metrics",
        "--tp",
        "--tp-size",
        "--dp",
        "--dp-size",
        "--config",
        "--tool-call-parser",
        "--reasoning-parser",
        "--log-requests",
        "--ssl-keyfile",
        "--ssl-certfile",
        "--tokenizer-worker-num",
    }
)


# Counted by SGLang's tokenizer manager for each abort of a request it holds.
ABORTED = "sglang:num_aborted_requests_total"
# The first release whose aborts CapyCTL follows to each request's end (the 0.1.7 notes).
REPORTS_ENDS = Version("0.5.22")
# The first release that answers decision checkpoints from their head (`/v1/systemone`).
DECISIONS_FROM = Version("0.5.22")


def capabilities(version: str) -> Capabilities:
    parsed = parse_version(Family.SGLANG, version)
    return Capabilities(
        residencies=(*PARKING, Residency.RESTART_ONLY),
        abort_by_id=True,
        request_id="body",
        reasoning_field="reasoning_content",
        park_needs_idle=True,  # the scheduler asserts idle; a busy release can kill it
        requests_while_parked="fail",
        disconnect_abort_lag_s=4.0,  # non-streamed requests notice a hang-up every ~4 s
        metrics_running="sglang:num_running_reqs",
        metrics_waiting="sglang:num_queue_reqs",
        abort_reports_end=parsed >= REPORTS_ENDS,
        children_live_with_engine=True,
        # SGLang cannot release a ModelOpt FP4 (NVFP4) model's memory and resume it yet.
        unparkable_checkpoints=frozenset({MODELOPT_FP4}),
        decisions=parsed >= DECISIONS_FROM,
    )


def plan(spec: LaunchSpec) -> LaunchPlan:
    """SGLang reads its key from --api-key only. The launcher (`engines/runtime/`) takes it
    from the environment and adds it to the server's arguments inside the process, so the
    process's command line, open to every local user, never holds it."""
    tuning = spec.tuning
    argv = [*python_server_argv(spec, SGLANG_LAUNCHER, "--model-path"), "--enable-metrics"]
    argv += options(
        ("--mem-fraction-static", tuning.memory_fraction),
        ("--context-length", tuning.context_length),
        ("--max-running-requests", tuning.max_concurrent_requests),
        ("--enable-memory-saver", spec.residency in PARKING),
        ("--enable-weights-cpu-backup", spec.residency == Residency.HOST_BACKED),
        ("--tool-call-parser", tuning.tool_call_parser),
        ("--reasoning-parser", tuning.reasoning_parser),
        # One scheduler per GPU of CUDA_VISIBLE_DEVICES; --mem-fraction-static applies to each.
        ("--tp-size", tuning.tensor_parallel),
    )
    if spec.api == "decisions":
        decisions.check_args(Family.SGLANG, tuning.extra_args)
        argv += decisions.launch_args(Family.SGLANG, tuning.context_length)
    argv += check_extra_args("sglang", tuning.extra_args, RESERVED)
    # SGLang's HTTP server makes a TemporaryDirectory for Prometheus' multiprocess files and
    # points its children there, unless this variable names a folder; the server's exit then
    # removes that folder under children still writing to it, and each of their metric
    # updates prints a FileNotFoundError. A folder of the launch's own, which hostd removes
    # once every process is gone, keeps each launch's metrics apart and ends that noise.
    prometheus = str(spec.runtime_dir / PROMETHEUS_DIR)
    return LaunchPlan(argv, {"PROMETHEUS_MULTIPROC_DIR": prometheus, **helper_env(spec)})


class SglangControl(EngineControl):
    async def park(self, residency: Residency) -> None:
        self.check_parks(residency)
        await self._call("POST", "/release_memory_occupation", self.timeouts.park, json={})

    async def wake(self, residency: Residency) -> None:
        self.check_parks(residency)
        wake = self.timeouts.wake
        if residency == Residency.HOST_BACKED:
            await self._call("POST", "/resume_memory_occupation", wake, json={})
        else:
            await self._call("POST", "/resume_memory_occupation", wake, json={"tags": ["weights"]})
            reload = {"model_path": str(self.spec.model_path)}
            await self._call("POST", "/update_weights_from_disk", wake, json=reload)
            rest = {"tags": ["kv_cache", "cuda_graph"]}
            await self._call("POST", "/resume_memory_occupation", wake, json=rest)
        await self._call("POST", "/flush_cache", wake)

    async def abort(self, request_id: str) -> None:
        await self._call("POST", "/abort_request", self.timeouts.abort, json={"rid": request_id})

    async def aborts_counted(self) -> int:
        """How many aborts of requests it held the engine has counted since it started."""
        text = (await self._call("GET", "/metrics", self.timeouts.metrics)).text
        return int(parse_metric(text, ABORTED))

    async def abort_counted(self, request_id: str) -> int:
        """Abort a request by id; returns how far the engine's abort count moved meanwhile.

        SGLang's /abort_request answers 200 with an empty body for any rid. With one
        tokenizer worker (CapyCTL never starts more), its tokenizer manager drops an abort for
        a rid it does not hold in its per-request state (`rid_to_state`) and counts every
        other in `sglang:num_aborted_requests_total` before answering; a rid leaves that
        state once the scheduler's output says the request finished, the abort's included.
        So a count that moves by one says the engine held this request, and one that does not
        move says it holds it no more. The caller runs one such call at a time per engine.
        """
        before = await self.aborts_counted()
        await self.abort(request_id)
        return await self.aborts_counted() - before
