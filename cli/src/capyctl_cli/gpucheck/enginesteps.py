"""Steps 4 to 6, on the shared role (`bench`): an engine whose memory is real device memory,
several models that do not all fit asked in turn, and a clean drain.

Every figure of memory is what memwatch's readings credit to the processes the check started
(`DeviceWatch.ours`), CUDA contexts included, which is what nvidia-smi shows for them; times
are from asking to the state being seen (polled every 50 ms) or to the answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from capycommon.units import format_size
from capyctl_cli.gpucheck.bench import BEHAVIOUR, Bench
from capyctl_cli.gpucheck.report import Fail, spread

GiB = 1 << 30
MiB = 1 << 20
PROBE = "probe"
PROBE_BYTES = 6 * GiB
MODELS = ("model-a", "model-b", "model-c")
ORDER = ("model-a", "model-b", "model-c", "model-a")
# Each of MODELS takes this share of the room on the GPU: with the ledger's CUDA context
# charge on top, two fit and three do not on any GPU of 12 GiB or more.
SHARE = 0.38
START_TIMEOUT_S = 240.0
PARK_TIMEOUT_S = 120.0
SHOW_TIMEOUT_S = 15.0
SLACK = 256 * MiB  # a reading may differ from the bytes asked for by the allocator's rounding


def _mib(size: float) -> int:
    return int(size) // MiB * MiB


def _held(bench: Bench, since: float, shows: Callable[[int], bool], what: str) -> int:
    """Ours in the first reading begun since `since` whose figure of ours `shows` it."""
    reading = bench.watch.wait(lambda r: shows(bench.ours(r)), SHOW_TIMEOUT_S, what, since)
    return bench.ours(reading)


def _cycle(bench: Bench, claim: int) -> dict[str, float]:
    """Start, park and wake the probe: each time, and what the GPU held after each."""
    asked = bench.act(PROBE, "start")
    ready_at = bench.reach(PROBE, "ready", START_TIMEOUT_S)

    def loaded(held: int) -> bool:
        return held >= claim - SLACK

    ready = _held(bench, ready_at, loaded, f"the probe's {format_size(claim)} ready")
    starting = [r for r in bench.watch.since(asked) if r.at <= ready_at]
    peak = max((bench.ours(r) for r in starting), default=0)
    park_asked = bench.act(PROBE, "park")
    parked_at = bench.reach(PROBE, "parked", PARK_TIMEOUT_S)
    parked = _held(bench, parked_at, lambda held: held < claim // 2, "the probe's park released")
    wake_asked = bench.act(PROBE, "start")
    woken_at = bench.reach(PROBE, "ready", START_TIMEOUT_S)
    woken = _held(bench, woken_at, loaded, f"the probe's {format_size(claim)} woken")
    return {
        "cold": ready_at - asked,
        "park": parked_at - park_asked,
        "wake": woken_at - wake_asked,
        "ready": ready,
        "parked": parked,
        "woken": woken,
        "peak": peak,
    }


def engine_on_cuda(bench: Bench) -> str:
    """Step 4: the simulator as vLLM on real memory, started cold, parked and woken."""
    claim = _mib(min(PROBE_BYTES, bench.room() // 4))
    bench.deploy(PROBE, claim, _mib(claim // 6))
    seen = _cycle(bench, claim)
    bench.ask(PROBE)
    measured = bench.startup_peak(PROBE)
    bench.delete(PROBE)
    bench.watch.wait(lambda r: bench.ours(r) == 0, 30, "nothing held once the probe is deleted")
    size = {key: format_size(int(seen[key])) for key in ("ready", "parked", "woken", "peak")}
    peak, extra = int(seen["peak"]), format_size(BEHAVIOUR.startup_extra_bytes)
    if abs(measured - peak) > max(SLACK, peak // 20):
        raise Fail(
            f"memwatch measured a startup peak of {format_size(measured)}, NVML read {size['peak']}"
        )
    return (
        f"cold start {seen['cold']:.1f} s, park {seen['park']:.1f} s, wake {seen['wake']:.1f} s; "
        f"a {format_size(claim)} model held {size['ready']} ready, {size['parked']} parked, "
        f"{size['woken']} woken; startup peak (with {extra} of start-up extra) measured by "
        f"memwatch {format_size(measured)}, read by NVML {size['peak']}"
    )


def models_in_turn(bench: Bench) -> str:
    """Step 5: three models, two of which fit, asked a, b, c, a; all must answer, and the
    GPU never hold more of ours than the ledger manages."""
    claim = _mib(bench.room() * SHARE)
    for name in MODELS:
        bench.deploy(name, claim, _mib(claim // 8))
    since = time.monotonic()
    times, together = [], []
    for name in ORDER:
        times.append(bench.ask(name))
        together.append("+".join(bench.ready_ones()) or "none")
    readings = bench.watch.since(since)
    ours = max(bench.ours(r) for r in readings)
    used = max(r.used for r in readings)
    managed = bench.domain.managed_limit
    if ours > managed + SLACK:
        raise Fail(
            f"the GPU held {format_size(ours)} of ours, above the managed {format_size(managed)}"
        )
    return (
        f"{len(MODELS)} models of {format_size(claim)} on {bench.gpu.describe()} (managed "
        f"limit {format_size(managed)}) asked {', '.join(ORDER)}: all answered, in "
        f"{spread(times)}; the GPU held at most {format_size(used)} ({format_size(ours)} "
        f"ours); ready after each: {' | '.join(together)}"
    )


def clean_drain(bench: Bench) -> str:
    """Step 6: the host drained, no byte left on the GPU by the check's processes, the
    role stopped."""
    asked = time.monotonic()
    bench.drain()
    drained = time.monotonic() - asked
    left = bench.watch.wait(lambda r: bench.ours(r) == 0, 30, "0 bytes of ours", time.monotonic())
    stopped = bench.role.stop()
    after = bench.watch.wait(lambda r: bench.ours(r) == 0, 30, "0 bytes of ours", time.monotonic())
    first = bench.watch.first
    return (
        f"drained in {drained:.1f} s, then NVML credited 0 B to the check's processes "
        f"({format_size(left.used)} used, {format_size(first.used)} before the check); the "
        f"role stopped in {stopped:.1f} s, 0 B of ours after ({format_size(after.used)} used)"
    )
