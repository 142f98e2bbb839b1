"""The engine simulator's SGLang load figures: `/metrics` in SGLang's Prometheus exposition
and `/v1/loads`, for the engine's state."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from enginesim.engine import Engine
from enginesim.metrics import Exposition

if TYPE_CHECKING:
    from enginesim.sglang import SglangArgs


def exposition(engine: Engine, args: SglangArgs, aborts: int) -> str:
    """SGLang's /metrics as its Prometheus exposition names them, for the engine's state."""
    labels = {"model_name": args.served_model_name}
    stats = engine.stats
    out = Exposition()
    gauges = {
        "num_running_reqs": len(engine.running),
        "num_queue_reqs": len(engine.waiting),
        "num_used_tokens": sum(
            w.prompt_tokens + w.completion_tokens for w in engine.running.values()
        ),
        "token_usage": 0.0,
        "gen_throughput": 0.0,
        "cache_hit_rate": 0.0,
    }
    for name, value in gauges.items():
        out.gauge(f"sglang:{name}", name.replace("_", " ") + ".", [(labels, value)])
    counters = {
        "prompt_tokens": stats.prompt_tokens,
        "generation_tokens": stats.generation_tokens,
        "num_requests": stats.requests,
        "num_aborted_requests": aborts,
    }
    for name, value in counters.items():
        out.counter(f"sglang:{name}", name.replace("_", " ") + ".", [(labels, value)])
    out.histogram("sglang:time_to_first_token_seconds", "Time to first token.", labels, stats.ttft)
    out.histogram("sglang:e2e_request_latency_seconds", "End-to-end latency.", labels, stats.e2e)
    return out.text()


def loads(engine: Engine, args: SglangArgs, version: str) -> dict[str, Any]:
    """SGLang's /v1/loads (0.5.20 and later): one data-parallel rank's load."""
    used = sum(w.prompt_tokens + w.completion_tokens for w in engine.running.values())
    load = {
        "dp_rank": 0,
        "num_running_reqs": len(engine.running),
        "num_waiting_reqs": len(engine.waiting),
        "num_waiting_uncached_tokens": 0,
        "num_used_tokens": used,
        "num_total_tokens": used,
        "max_total_num_tokens": 0,
        "max_running_requests": args.max_running_requests,
        "token_usage": 0.0,
        "gen_throughput": 0.0,
        "cache_hit_rate": 0.0,
        "utilization": 0.0,
    }
    return {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": version,
        "accelerator": None,
        "num_accelerators": 1,
        "loads": [load],
    }
