"""Request places: at most 32 requests run on a deployment's instance at once, and the
requests waiting for one.

Routers take a place through one Lua script that also checks the instance is ready at the
generation they picked, so no request goes to an engine that is draining, parking or gone.
The places of one generation live in one hash; a new generation starts from zero, which is
how a request cut before the engine answered it settles at the instance's next stop.

Each router worker owns the places it takes, under its own owner id: the hash holds
`run:<owner>` (requests on their way), `idle:<owner>` (cut requests the engine had started
answering: they settle when the engine reads idle) and `stop:<owner>` (cut before any answer:
they may not have reached the engine's queue, so nothing but a stop proves them gone). The
requests a worker holds waiting for a place are counted the same way, in one hash for every
deployment (`<deployment> <owner>`), so the queue bounds hold for all workers together.

A worker keeps the place of a request that ended as a spare (`spare:<owner>`, counted per
deployment) while the instance stays ready and the worker holds no more than its share of
the places (the limit over the router's workers, or over the live owners where more live:
each take and keep counts them), and lets its next requests for that deployment through on
its spares without asking Redis: a steady stream of requests costs Redis next to nothing,
however busy the instance. A worker with a free spare takes no place (it uses a spare
first), so free spares only ever sit within their owner's share: a worker that holds less
than its share never waits behind another's idle spares.

A spare counts against the limit but not as a running request (it is idle, or carries a
request Redis was not told of), so nothing waits for spares but a drain: the worker gives its
spares back as soon as it hears the instance is no longer ready, those in use when their
requests end, and each spare left unused for SPARE_IDLE_S (a request uses the newest, so
spares beyond what the requests need grow old), so that other workers may take their places.

An owner lives while its entry in the owners' sorted set has not expired: it refreshes it
every few seconds, and whoever sees it exit (its parent) removes it. Every count is summed
over live owners only, so a worker that was killed, or a Redis that lost some writes, leaves
nothing behind: a dead owner's places and waiting requests count for nothing (its cut-at-stop
places still count until the stop), and every live owner writes its own counts again, from
its memory, every few seconds (`PlaceBook.keep`).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from typing import cast

import redis.asyncio as aioredis

from capycommon.domain.notifications import Notification
from capycommon.domain.places import Places
from capycommon.state import keys, placescripts
from capycommon.state.pipe import Pipe

LIMIT = 32
# An owner that has not refreshed its entry for this long is gone: its counts count no more.
OWNER_TTL_S = 10.0
# How long `PlaceBook.keep` waits for the changes in flight to end.
QUIET_S = 1.0
# The place fields of an owner, by the settlement they wait for ("" for a running request).
FIELDS = {"": "run", "settle_when_idle": "idle", "settle_at_stop": "stop"}
# How long a worker's spare place may stay unused before it is given back.
SPARE_IDLE_S = 1.0


class PlaceBook:
    """One owner's places and waiting requests, in Redis and in its own count.

    Every change is counted here as it is made in Redis; `keep` writes these counts back as
    they are, while no change is in flight, so a change whose answer was lost (Redis went
    away) or that Redis lost (a restart that dropped its last writes) is put right there. A
    change cut short once it may have reached Redis (its caller cancelled: a client hung up)
    leaves the owner `unsure`, and tells `on_unsure`, so that its keep comes at once.
    """

    def __init__(self, client: aioredis.Redis, owner: str, workers: int = 1) -> None:
        self.client = client
        self.owner = owner
        # The owners the places are shared by: this router's workers, or the live owners
        # its last take or keep counted, where more live (another router's).
        self.workers = workers
        self._owners = workers
        # (deployment, generation) -> this owner's places by field: run, idle, stop, spare.
        self.held: dict[tuple[str, int], Counter[str]] = {}
        # deployment -> the generation of its free spare places here, and when each was kept
        # (monotonic, oldest first): a request uses the newest, so spares beyond what the
        # requests need grow old and are given back.
        self.free: dict[str, tuple[int, list[float]]] = {}
        # deployment -> the limit of its places at this owner's last take.
        self._limit: dict[str, int] = {}
        # deployment -> this owner's requests waiting for a place.
        self.waiting: Counter[str] = Counter()
        # A request without a spare runs two scripts (take, give): they go through the pipe
        # of the client, which costs a fraction of redis-py's pool (`capycommon.state.pipe`).
        self.pipe = Pipe.of(client)
        self._open = asyncio.Event()
        self._open.set()
        self._quiet = asyncio.Event()
        self._quiet.set()
        self._in_flight = 0
        # A change was cut short (its caller cancelled, Redis failed) after it may have
        # reached Redis: Redis may count what this owner does not, until the next keep.
        # `on_unsure` hears of a cancelled one at once, so the owner keeps without waiting
        # its turn.
        self.unsure = False
        self.on_unsure: Callable[[], None] | None = None

    @contextlib.asynccontextmanager
    async def _change(self) -> AsyncIterator[None]:
        """One change in flight; `keep` waits for none."""
        await self._open.wait()
        self._in_flight += 1
        self._quiet.clear()
        try:
            yield
        except BaseException as exc:
            self.unsure = True
            # A Redis failure is retried at the owner's own pace; a cancelled caller's change
            # is put right at once.
            if isinstance(exc, asyncio.CancelledError) and self.on_unsure is not None:
                self.on_unsure()
            raise
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._quiet.set()

    async def take(self, host: str, deployment: str, generation: int, limit: int = LIMIT) -> int:
        """1 taken, 0 all taken, -1 the instance is not ready at `generation`. The limit and
        the live owners counted now set this owner's share, up to which it keeps spares
        (`end`)."""
        async with self._change():
            found = int(
                await self.pipe.run(
                    placescripts.TAKE_SCRIPT,
                    [
                        keys.instance(host, deployment, 0),
                        keys.places(deployment),
                        keys.place_owners(),
                    ],
                    [str(generation), str(limit), self.owner, str(OWNER_TTL_S)],
                )
            )
            if found > 0:
                self.held.setdefault((deployment, generation), Counter())["run"] += 1
                self._limit[deployment] = limit
                self._owners = found
        return min(found, 1)

    def use_spare(self, deployment: str, generation: int) -> bool:
        """Let a request through on a free spare place of the deployment's instance at
        `generation`, if this owner has one: nothing is sent to Redis. The caller saw the
        instance ready at that generation."""
        found = self.free.get(deployment)
        if found is None or found[0] != generation:
            return False
        kept = found[1]
        kept.pop()
        if not kept:
            del self.free[deployment]
        return True

    def share(self, deployment: str) -> int:
        """The most places of the deployment this owner may hold and keep spares."""
        return self._limit.get(deployment, 0) // max(self.workers, self._owners)

    def free_generation(self, deployment: str) -> int | None:
        """The generation of the deployment's free spare places here, if it has any."""
        found = self.free.get(deployment)
        return None if found is None else found[0]

    async def end(self, deployment: str, generation: int, spare: bool, keep: bool) -> None:
        """A running request ended (`spare`: it came through on a spare place). Its place
        is kept as a free spare when `keep` (the instance is still ready at `generation`) and
        this owner holds no more than its share; else it is given back."""
        held = self.held.get((deployment, generation), Counter()).total()
        found = self.free.get(deployment, (generation, []))
        if keep and held <= self.share(deployment) and found[0] == generation:
            # Free here first, so that a drop of the spares meanwhile gives it back too.
            self.free[deployment] = found
            found[1].append(time.monotonic())
            if not spare:
                await self._moved(deployment, generation, 1, "run", "spare")
            return
        await self._moved(deployment, generation, 1, "spare" if spare else "run", "")

    async def drop_spares(self, deployment: str, announce: bool = False) -> None:
        """Give back the deployment's free spare places (its instance is no longer ready at
        their generation). `announce`: say so on the control plane's channel, where the
        scheduler hears it (a drain waits for them)."""
        found = self.free.pop(deployment, None)
        if found is not None:
            generation, kept = found
            await self._moved(deployment, generation, len(kept), "spare", "")
            if announce:
                note = Notification(kind="places", id=deployment, version=generation)
                await self.client.publish(keys.notifications(), note.model_dump_json())

    def spares_due(self) -> float | None:
        """When the oldest free spare will have stayed unused SPARE_IDLE_S (monotonic)."""
        if not self.free:
            return None
        return min(kept[0] for _, kept in self.free.values()) + SPARE_IDLE_S

    async def drop_idle_spares(self) -> None:
        """Give back the free spare places that stayed unused SPARE_IDLE_S."""
        stale = time.monotonic() - SPARE_IDLE_S
        for deployment in list(self.free):
            found = self.free.get(deployment)  # as it is now: a give back may have awaited
            if found is None:
                continue
            generation, kept = found
            count = bisect.bisect_right(kept, stale)
            if count == 0:
                continue
            del kept[:count]
            if not kept:
                del self.free[deployment]
            await self._moved(deployment, generation, count, "spare", "")

    async def give(self, deployment: str, generation: int, count: int = 1, cut: str = "") -> None:
        """Give back `count` places: of running requests, or of cut requests that settled
        (`cut` is the field they count in: settle_when_idle or settle_at_stop)."""
        await self._moved(deployment, generation, count, FIELDS[cut], "")

    async def cut(self, deployment: str, generation: int, settle: str, spare: bool = False) -> None:
        """Mark one taken place (a spare one, `spare`) as a cut request that settles
        `settle_when_idle` or `settle_at_stop`."""
        await self._moved(deployment, generation, 1, "spare" if spare else "run", FIELDS[settle])

    async def _moved(
        self, deployment: str, generation: int, count: int, source: str, target: str
    ) -> None:
        """Move up to `count` places from one of this owner's fields to another (none for
        `target`: given back), here first: a move Redis did not confirm is put right by the
        next `keep`."""
        async with self._change():
            held = self.held.get((deployment, generation), Counter())
            moved = min(count, held[source])
            if moved == 0:
                return
            held[source] -= moved
            if target:
                held[target] += moved
            if held.total() == 0:
                del self.held[(deployment, generation)]
            await self.pipe.run(
                placescripts.MOVE_SCRIPT,
                [keys.places(deployment)],
                [str(generation), self.owner, str(moved), source, target],
            )

    async def join(self, deployment: str, per_deployment: int, total: int) -> bool:
        """Count one more request waiting for `deployment`, unless `per_deployment` wait for
        it or `total` for any, counting every live owner's."""
        async with self._change():
            joined = await self.pipe.run(
                placescripts.JOIN_SCRIPT,
                [keys.waiting(), keys.place_owners()],
                [deployment, self.owner, str(per_deployment), str(total), str(OWNER_TTL_S)],
            )
            if int(joined) == 1:
                self.waiting[deployment] += 1
        return int(joined) == 1

    async def leave(self, deployment: str) -> None:
        """One request stops waiting for `deployment` (here first, as `_moved`)."""
        async with self._change():
            if self.waiting[deployment] == 0:
                return
            self.waiting -= Counter([deployment])
            await self.pipe.run(
                placescripts.LEAVE_SCRIPT, [keys.waiting()], [f"{deployment} {self.owner}"]
            )

    async def keep(self, deployments: Iterable[str]) -> bool:
        """Refresh this owner and write its counts of `deployments` (and of every deployment
        it holds places of or has requests waiting for) as it knows them, once no change is
        in flight. False if changes stayed in flight past QUIET_S: nothing was written."""
        self._open.clear()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._quiet.wait(), QUIET_S)
            if not self._quiet.is_set():
                return False
            newest = self._newest()
            names = sorted(set(deployments) | set(newest) | set(self.waiting))
            args = [self.owner, str(OWNER_TTL_S)]
            for name in names:
                generation, held = newest.get(name, (0, Counter()))
                counts = [
                    generation,
                    *(held[kind] for kind in ("run", "idle", "stop", "spare")),
                    self.waiting[name],
                ]
                args += [name, *(str(n) for n in counts)]
            names_keys = [keys.places(name) for name in names]
            self._owners = int(
                await self.pipe.run(
                    placescripts.KEEP_SCRIPT,
                    [keys.place_owners(), keys.waiting(), *names_keys],
                    args,
                )
            )
            # Every change cut short before is written over (no change starts meanwhile, and
            # Redis runs the commands of the one connection in order: a late one ran first).
            self.unsure = False
            return True
        finally:
            self._open.set()

    def _newest(self) -> dict[str, tuple[int, Counter[str]]]:
        """Each deployment's newest generation held here, and its counts. Older ones were
        settled by their instance's stop: only their running requests stay, until they end."""
        newest: dict[str, tuple[int, Counter[str]]] = {}
        for (name, generation), held in sorted(self.held.items()):
            newest[name] = (generation, held)
        for (name, generation), held in list(self.held.items()):
            if generation < newest[name][0] and held["run"] == 0:
                del self.held[(name, generation)]
        for name, (generation, _) in list(self.free.items()):
            if generation < newest.get(name, (generation, None))[0]:  # a stop settled them
                del self.free[name]
        return newest


class PlaceStore:
    """The places of every deployment, over every live router worker, as one reads them."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def get(self, deployment: str) -> Places:
        keys_ = (keys.places(deployment), keys.place_owners())
        found = await self.client.eval(placescripts.READ, 2, *keys_)
        return _places(cast(list[int], found))

    async def waiting(self) -> dict[str, int]:
        """Each deployment's requests waiting for a place, over every live router worker."""
        found = cast(
            list[bytes | int],
            await self.client.eval(placescripts.WAITING, 2, keys.waiting(), keys.place_owners()),
        )
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in found[::2]]
        return {name: int(n) for name, n in zip(names, found[1::2], strict=True) if int(n) > 0}

    async def drop_owner(self, owner: str) -> None:
        """Remove `owner`, which has exited or is stopping, from the live owners: its places
        (but those cut before any answer) and its waiting requests count no more."""
        await self.client.zrem(keys.place_owners(), owner)


def _places(found: list[int]) -> Places:
    generation, running, idle, stop, spare = (int(n) for n in found)
    return Places(
        generation=generation,
        running=running,
        settle_when_idle=idle,
        settle_at_stop=stop,
        spare=spare,
    )
