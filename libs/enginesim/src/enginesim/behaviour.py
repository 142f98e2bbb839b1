"""How one simulated engine behaves: timings, the answer it gives, and the faults it shows.

The behaviour is a JSON document inside the installation (engines start with a closed
environment, so it cannot come from a variable): `<site-packages>/vllm/_capyctl_sim.json`,
`<site-packages>/sglang/_capyctl_sim.json`, or `llama-server.sim.json` next to a simulated
`llama-server`. A simulated LMCache server's (`LMCacheBehaviour`) is
`<site-packages>/lmcache/_capyctl_sim.json`. A missing file means every default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MIB = 1 << 20


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ToolCall(_Strict):
    """The call the simulated model makes when a request offers tools."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class CrashAtStart(_Strict):
    """Print `message` on stderr at the end of loading and exit with `exit_code`."""

    exit_code: int = 1
    message: str = "RuntimeError: simulated crash at start-up"


class SchedulerDies(_Strict):
    """SGLang: the scheduler child dies `after_seconds` into loading the weights, printing
    `message` and exiting with `exit_code`, while the HTTP server waits on and never listens.
    The scheduler and detokenizer run as children then; see `sglang_children`."""

    after_seconds: float = Field(default=1.5, ge=0)
    exit_code: int = 1
    message: str = "RuntimeError: simulated scheduler failure while loading the weights"


class RankDies(_Strict):
    """vLLM and SGLang: the process of tensor-parallel rank `rank` prints `message` on stderr,
    releases its memory and exits with `exit_code`, `after_seconds` after the engine is ready
    (serving). The engine then goes down as the real one does:

    - vLLM: the rank is a `VLLM::Worker_TP<rank>` (with one rank, the `VLLM::EngineCore`
      itself). The EngineCore's executor notices the dead worker (`Worker proc
      VllmWorker-<rank> died unexpectedly, shutting down executor.`), stops the other workers
      and exits; the API server then answers /health with 503 for a moment and exits non-zero.
    - SGLang: the rank is a `sglang::scheduler_TP<rank>` (with one rank, the server process
      itself). The server notices the child's death (`Received sigquit from a child
      process.`), stops every other child and exits non-zero.

    Either way no process of the engine stays and no claim is left to a live process. A rank
    the engine does not run (`rank` >= its tensor-parallel size) never dies; llama.cpp, which
    has no ranks, ignores the fault."""

    rank: int = Field(default=0, ge=0)
    after_seconds: float = Field(default=2.0, ge=0)
    exit_code: int = 1
    message: str = "RuntimeError: simulated death of a tensor-parallel rank"


class DisconnectLag(_Strict):
    """SGLang notices a hang-up late: a non-streamed request every ~4 s, a stream ~2 s after."""

    non_stream: float = Field(default=4.0, ge=0)
    stream: float = Field(default=2.0, ge=0)


class Faults(_Strict):
    crash_at_start: CrashAtStart | None = None
    # Requests are accepted and counted as running, but no token ever comes; health stays 200.
    hang: bool = False
    # After this many generated tokens (over the process's life) the engine dies.
    die_mid_stream: int | None = Field(default=None, ge=1)
    # This long after it is ready the engine dies: /health 503 (vLLM), then a non-zero exit.
    die_after_seconds: float | None = Field(default=None, ge=0)
    # Sleep, release and idle sleep report success but the bytes stay on the device.
    sleep_keeps_memory: bool = False
    # Every answer after a wake is garbage (what CapyCTL's wake canary must catch).
    garbage_after_wake: bool = False
    # vLLM: SIGKILL of the API server leaves its EngineCore child alive, holding the memory.
    leave_child_on_sigkill: bool = True
    # A client hang-up does not stop the work: the request runs on to its end (a leak).
    keep_generating_on_disconnect: bool = False
    # SGLang: /release_memory_occupation while requests run kills the scheduler ("crash",
    # the process exits non-zero) or answers 400 ("error").
    release_while_busy: Literal["crash", "error"] = "crash"
    # vLLM: a request while asleep is held without tokens until /wake_up ("hold") or kills the
    # engine ("crash"); None follows the version (hold from 0.17 on).
    request_while_asleep: Literal["hold", "crash"] | None = None
    # SGLang: a request while the weights are released waits ("hang") or fails with 500 ("error").
    generate_while_released: Literal["hang", "error"] = "hang"
    disconnect_abort_lag: DisconnectLag = DisconnectLag()
    # SGLang: the scheduler child dies while loading (the /dev/shm segments it made stay, the
    # HTTP server lives on, Python 3.12's ResourceTracker noise follows its exit).
    scheduler_dies: SchedulerDies | None = None
    # vLLM and SGLang: one tensor-parallel rank's process dies once the engine is ready, and
    # the whole engine goes down with it (see `RankDies`).
    rank_dies: RankDies | None = None


class Behaviour(_Strict):
    load_seconds: float = Field(default=1.0, ge=0)
    warmup_seconds: float = Field(default=0.5, ge=0)  # SGLang: /health 503 while warming up
    sleep_seconds: float = Field(default=0.1, ge=0)
    wake_seconds: float = Field(default=0.2, ge=0)
    tokens_per_second: float = Field(default=50.0, gt=0)
    # Benchmarks of what sits in front of the engine: the whole answer is ready once the
    # request is admitted (tokens_per_second is ignored), the generation routes skip
    # FastAPI's routing layers, and each turn of the event loop sends its writes together,
    # so a short answer costs the engine well under a millisecond. The wire format, the API
    # key check and every other route stay as they are.
    instant: bool = False
    # Before a request's first token (the prompt's prefill): nothing is sent meanwhile.
    prefill_seconds: float = Field(default=0.0, ge=0)
    # One decision request (/v1/systemone): its prefill, while it counts as running.
    decision_seconds: float = Field(default=0.05, ge=0)
    answer: str = "Hello from the engine simulator."
    # Emitted before the answer when the engine parses reasoning; "" turns it off.
    reasoning: str = "The user wants a short greeting."
    tool_call: ToolCall | None = None
    # What a sleeping engine keeps on the device (CUDA context, allocator pools).
    residue_bytes: int = Field(default=512 * MIB, ge=0)
    # vLLM: more than the ready footprint while it loads (profiling, compile workspaces), as
    # real engines take: the whole load holds the budget plus this much, then lets it go.
    startup_extra_bytes: int = Field(default=0, ge=0)
    memory_lag_seconds: float = Field(default=0.2, ge=0)
    # With an LMCache connector: how long the engine waits for its server to answer at
    # start-up (and for each answer later), as the connector's mq_timeout (300 s in vLLM).
    kv_connect_seconds: float = Field(default=5.0, gt=0)
    faults: Faults = Faults()


class LMCacheBehaviour(_Strict):
    """How a simulated LMCache server (`enginesim.lmcache`) behaves."""

    # /api/healthcheck answers 503 this long after the HTTP API is up, then 200.
    startup_seconds: float = Field(default=0.3, ge=0)
    # Print `fail_message` on stderr and exit 1 before binding any port.
    fail_at_start: bool = False
    fail_message: str = "RuntimeError: simulated LMCache failure at start-up"
    # The engine is never initialised: 503 for ever, and engines get no answer.
    never_healthy: bool = False
    # Resident memory the server holds besides Python's own (never the pool's size).
    resident_mib: int = Field(default=8, ge=0)
    # This long after it became healthy the server dies (exit 1).
    crash_after_seconds: float | None = Field(default=None, ge=0)
    # The most chunks kept; the least recently used goes first.
    max_chunks: int = Field(default=65536, ge=1)
    # The /api/ routes (/api/healthcheck, /api/status, /api/clear-cache) of LMCache's newer
    # HTTP API; off: only /healthcheck and /status, as LMCache 0.5.6 serves them.
    api_routes: bool = True
    # Each store is answered this long after it came (a slow pool).
    store_seconds: float = Field(default=0.0, ge=0)


GARBAGE_ANSWER = "!!!!!!!! !!!!!!!! !!!!!!!! !!!!!!!!"


def load_behaviour(path: Path | None) -> Behaviour:
    """The behaviour in `path`; every default when there is no such file."""
    if path is None or not path.is_file():
        return Behaviour()
    return Behaviour.model_validate_json(path.read_bytes())


def load_lmcache_behaviour(path: Path | None) -> LMCacheBehaviour:
    """The LMCache behaviour in `path`; every default when there is no such file."""
    if path is None or not path.is_file():
        return LMCacheBehaviour()
    return LMCacheBehaviour.model_validate_json(path.read_bytes())


def save_behaviour(path: Path, behaviour: Behaviour | LMCacheBehaviour) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(behaviour.model_dump_json(indent=2) + "\n")
    tmp.replace(path)


def version_tuple(version: str) -> tuple[int, ...]:
    """`0.11.1rc2` -> (0, 11, 1); `6500` -> (6500,). Only the leading numbers count."""
    numbers: list[int] = []
    for part in version.split("."):
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        numbers.append(int(digits))
        if len(digits) != len(part):
            break
    return tuple(numbers)
