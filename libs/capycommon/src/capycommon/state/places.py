"""Request places: at most 32 requests run on a deployment's instance at once.

Routers take a place through one Lua script that also checks the instance is ready at the
generation they picked, so no request goes to an engine that is draining, parking or gone.
The places of one generation live in one hash; a new generation starts from zero, which is
how a request cut before the engine answered it settles at the instance's next stop.

Fields: `generation`, `running` (places taken), `settle_when_idle` (cut requests the engine
had started answering: they settle when the engine reads idle) and `settle_at_stop` (cut
before any answer: they may not have reached the engine's queue yet, so nothing but a stop
proves them gone).
"""

from __future__ import annotations

from typing import cast

import redis
import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict

from capycommon.state import keys

LIMIT = 32

# KEYS: the instance record, the places hash. ARGV: generation, limit.
# Returns 1 (taken), 0 (all places taken) or -1 (not ready at that generation).
_TAKE = """
local raw = redis.call('GET', KEYS[1])
if not raw then return -1 end
local record = cjson.decode(raw)
if record['state'] ~= 'ready' or tostring(record['generation']) ~= ARGV[1] then return -1 end
if redis.call('HGET', KEYS[2], 'generation') ~= ARGV[1] then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], 'generation', ARGV[1], 'running', 0,
             'settle_when_idle', 0, 'settle_at_stop', 0)
end
if tonumber(redis.call('HGET', KEYS[2], 'running')) >= tonumber(ARGV[2]) then return 0 end
redis.call('HINCRBY', KEYS[2], 'running', 1)
return 1
"""

# KEYS: the places hash. ARGV: generation, places to give back, and the cut field to lower
# with them ("" for none). Nothing changes for another generation (a stop settled them).
_GIVE = """
if redis.call('HGET', KEYS[1], 'generation') ~= ARGV[1] then return 0 end
local n = tonumber(ARGV[2])
local running = tonumber(redis.call('HGET', KEYS[1], 'running'))
redis.call('HSET', KEYS[1], 'running', math.max(0, running - n))
if ARGV[3] ~= '' then
  local cut = tonumber(redis.call('HGET', KEYS[1], ARGV[3]))
  redis.call('HSET', KEYS[1], ARGV[3], math.max(0, cut - n))
end
return 1
"""

# KEYS: the places hash. ARGV: generation, the cut field to raise.
_CUT = """
if redis.call('HGET', KEYS[1], 'generation') ~= ARGV[1] then return 0 end
redis.call('HINCRBY', KEYS[1], ARGV[2], 1)
return 1
"""


# KEYS: the places hash. A restarted router forgets the requests it held: their places are
# freed, except those cut before any answer (only a stop settles them).
_RESET = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'running', redis.call('HGET', KEYS[1], 'settle_at_stop'),
           'settle_when_idle', 0)
return 1
"""


class Places(BaseModel):
    """The places of one deployment's current generation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    generation: int = 0
    running: int = 0
    settle_when_idle: int = 0
    settle_at_stop: int = 0

    @property
    def serving(self) -> int:
        """Requests the engine is, or may be, working on, excluding those cut before any
        answer (stopping and switching do not wait for those)."""
        return self.running - self.settle_at_stop


class PlaceBook:
    """A router's takes and returns of places."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self._take = client.register_script(_TAKE)
        self._give = client.register_script(_GIVE)
        self._cut = client.register_script(_CUT)
        self._reset = client.register_script(_RESET)

    async def take(self, host: str, deployment: str, generation: int, limit: int = LIMIT) -> int:
        """1 taken, 0 all taken, -1 the instance is not ready at `generation`."""
        found = await self._take(
            keys=[keys.instance(host, deployment, 0), keys.places(deployment)],
            args=[str(generation), str(limit)],
        )
        return int(found)

    async def give(self, deployment: str, generation: int, count: int = 1, cut: str = "") -> None:
        await self._give(keys=[keys.places(deployment)], args=[str(generation), str(count), cut])

    async def cut(self, deployment: str, generation: int, settle: str) -> None:
        """Mark one taken place as a cut request that settles `settle_when_idle` or
        `settle_at_stop`."""
        await self._cut(keys=[keys.places(deployment)], args=[str(generation), settle])

    async def reset(self, deployment: str) -> None:
        """At a router's start: it holds no request, so only cut-at-stop places remain."""
        await self._reset(keys=[keys.places(deployment)], args=[])


def _places(raw: dict[bytes, bytes]) -> Places:
    return Places.model_validate({k.decode(): int(v) for k, v in raw.items()}) if raw else Places()


def read(client: redis.Redis, deployment: str) -> Places:
    return _places(cast(dict[bytes, bytes], client.hgetall(keys.places(deployment))))


async def aread(client: aioredis.Redis, deployment: str) -> Places:
    return _places(cast(dict[bytes, bytes], await client.hgetall(keys.places(deployment))))
