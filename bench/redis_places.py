"""What a request's two place scripts cost: a place taken, then given back.

Each request through the router runs `PlaceBook.take` and `PlaceBook.give`, two Lua scripts.
This times the same two scripts, with the same keys and arguments, through redis-py's
asyncio client (register_script, on the services' blocking pool: the baseline) and through
`capycommon.state.pipe`, one after the other and 32 pairs at once, in interleaved rounds on
one redis-server. It prints the wall time and this process's CPU time per pair (Redis's own
work is in its own process, the same for both sides), with the ratio pipe / redis-py.

    .venv/bin/python bench/redis_places.py [--pairs N] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from capycommon.service import redis_client
from capycommon.state import keys, places, placescripts
from capycommon.state.pipe import Pipe

HOST, NAME, GENERATION, OWNER = "local", "bench", 1, "router-0:1"
LIMIT = 1000  # never reached: every pair gives its place back
TAKE_KEYS = [keys.instance(HOST, NAME, 0), keys.places(NAME), keys.place_owners()]
TAKE_ARGS = [str(GENERATION), str(LIMIT), OWNER, str(places.OWNER_TTL_S)]
GIVE_KEYS = [keys.places(NAME)]
GIVE_ARGS = [str(GENERATION), OWNER, "1", "run", ""]

Pair = Callable[[], Awaitable[None]]


def _start_redis(folder: Path) -> subprocess.Popen[bytes]:
    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit("redis-server is not installed; run scripts/setup")
    sock = folder / "redis.sock"
    proc = subprocess.Popen(
        [
            *(server, "--port", "0", "--unixsocket", str(sock), "--dir", str(folder)),
            *("--save", "", "--appendonly", "no"),
        ],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while not sock.exists():
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("redis-server did not start in 10 s")
        time.sleep(0.05)
    return proc


async def _timed(pair: Pair, pairs: int, concurrency: int) -> tuple[float, float]:
    """Wall and CPU seconds per pair, `pairs` pairs run by `concurrency` tasks."""

    async def worker(count: int) -> None:
        for _ in range(count):
            await pair()

    share = pairs // concurrency
    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker(share) for _ in range(concurrency)))
    done = share * concurrency
    return (time.perf_counter() - wall) / done, (time.process_time() - cpu) / done


async def main(pairs: int, rounds: int) -> None:
    folder = Path(tempfile.mkdtemp(prefix="capy-bench-"))
    proc = _start_redis(folder)
    client = redis_client(f"unix://{folder / 'redis.sock'}")
    try:
        record = {"state": "ready", "generation": GENERATION}
        await client.set(keys.instance(HOST, NAME, 0), json.dumps(record))
        take_script = client.register_script(placescripts.TAKE)
        give_script = client.register_script(placescripts.MOVE)
        pipe = Pipe.of(client)

        async def through_redis_py() -> None:
            assert await take_script(keys=TAKE_KEYS, args=TAKE_ARGS) >= 1  # the places held
            await give_script(keys=GIVE_KEYS, args=GIVE_ARGS)

        async def through_pipe() -> None:
            assert await pipe.run(placescripts.TAKE_SCRIPT, TAKE_KEYS, TAKE_ARGS) >= 1
            await pipe.run(placescripts.MOVE_SCRIPT, GIVE_KEYS, GIVE_ARGS)

        sides = {"redis-py": through_redis_py, "pipe": through_pipe}
        print(f"{pairs} take+give pairs a side a round, {rounds} rounds, medians")
        print(f"{'concurrency':<12} {'side':<9} {'us/pair':>8} {'cpu us/pair':>12}")
        for concurrency in (1, 32):
            found: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
            for pair in sides.values():  # warm up: connections opened, scripts loaded
                await _timed(pair, 200, concurrency)
            for _ in range(rounds):
                for side, pair in sides.items():
                    found[side].append(await _timed(pair, pairs, concurrency))
            medians = {
                side: (
                    statistics.median(wall for wall, _ in times),
                    statistics.median(cpu for _, cpu in times),
                )
                for side, times in found.items()
            }
            for side, (wall, cpu) in medians.items():
                note = "   (baseline)" if side == "redis-py" else ""
                print(f"{concurrency:<12} {side:<9} {wall * 1e6:>8.1f} {cpu * 1e6:>12.1f}{note}")
            (base_wall, base_cpu), (wall, cpu) = medians["redis-py"], medians["pipe"]
            print(
                f"{concurrency:<12} {'ratio':<9} {wall / base_wall:>8.2f} {cpu / base_cpu:>12.2f}"
                "   pipe / redis-py"
            )
    finally:
        await client.aclose()
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.pairs, args.rounds))
