"""The engine simulator's vLLM metrics: `/metrics` in vLLM's Prometheus exposition, by
version (the deprecated GPU cache gauge before 0.12, the sleep state gauge from 0.11.1)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from enginesim.engine import Engine
from enginesim.metrics import Exposition

if TYPE_CHECKING:
    from enginesim.vllm import VllmArgs


def exposition(engine: Engine, args: VllmArgs, v: tuple[int, ...], sleep_level: int | None) -> str:
    """vLLM's /metrics as its Prometheus exposition names them, for the engine's state."""
    labels = {"model_name": args.served_names[0], "engine": "0"}
    stats = engine.stats
    out = Exposition()
    out.gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        [(labels, len(engine.running))],
    )
    out.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        [(labels, len(engine.waiting))],
    )
    usage = min(1.0, len(engine.running) / max(1, args.max_num_seqs))
    out.gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        [(labels, usage)],
    )
    if v < (0, 12):
        out.gauge(
            "vllm:gpu_cache_usage_perc", "GPU KV-cache usage (deprecated).", [(labels, usage)]
        )
    if v >= (0, 11, 1):
        states = {
            "awake": sleep_level is None,
            "weights_offloaded": sleep_level == 1,
            "discard_all": sleep_level == 2,
        }
        samples = [({**labels, "sleep_state": k}, float(v)) for k, v in states.items()]
        out.gauge(
            "vllm:engine_sleep_state", "Engine sleep state; 1 marks the current one.", samples
        )
    _counters(out, labels, engine)
    out.histogram(
        "vllm:time_to_first_token_seconds",
        "Time to first token in seconds.",
        labels,
        stats.ttft,
    )
    out.histogram(
        "vllm:e2e_request_latency_seconds", "End to end request latency.", labels, stats.e2e
    )
    out.histogram(
        "vllm:request_queue_time_seconds",
        "Time spent in WAITING phase.",
        labels,
        stats.queue_time,
    )
    return out.text()


def _counters(out: Exposition, labels: dict[str, str], engine: Engine) -> None:
    stats = engine.stats
    out.counter(
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        [(labels, stats.prompt_tokens)],
    )
    out.counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        [(labels, stats.generation_tokens)],
    )
    finished = {
        "stop": stats.finished["stop"] + stats.finished["tool_calls"],
        "length": stats.finished["length"],
        "abort": stats.finished["abort"],
        "error": stats.finished["error"],
    }
    samples = [({**labels, "finished_reason": k}, float(v)) for k, v in finished.items()]
    out.counter("vllm:request_success", "Count of successfully processed requests.", samples)
    for name in ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits"):
        out.counter(f"vllm:{name}", name.replace("_", " ").capitalize() + ".", [(labels, 0)])
