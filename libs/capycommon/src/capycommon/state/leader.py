"""The scheduler lease in Redis, and its fencing epoch.

A claim is one script: the lease is taken when nobody holds it (or it expired), renewed by
its holder, and taken over by a new process of the holder's own server (a restarted
scheduler); each new holder increments the epoch. The lease expires on Redis's clock, so a
holder that stops renewing (stopped, paused, cut off) loses it after its time to live
whatever the clocks of the servers say.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import redis.asyncio as aioredis

from capycommon.domain.leader import Lease, PlanTimes
from capycommon.state import keys, quarantine

# KEYS: lease, epoch. ARGV: server, token, time to live (ms), now (Unix seconds).
# Returns {1, lease} when the caller holds the lease now, {0, lease} when another does.
_CLAIM = """
local held = redis.call('GET', KEYS[1])
if held then
  local ok, lease = pcall(cjson.decode, held)
  if ok and type(lease) == 'table' then
    if lease['server'] ~= ARGV[1] then return {0, held} end
    if lease['token'] == ARGV[2] then
      redis.call('PEXPIRE', KEYS[1], ARGV[3])
      return {1, held}
    end
  end
end
local epoch = redis.call('INCR', KEYS[2])
local lease = cjson.encode({server = ARGV[1], token = ARGV[2], epoch = epoch,
                            since = tonumber(ARGV[4])})
redis.call('SET', KEYS[1], lease, 'PX', ARGV[3])
return {1, lease}
"""

# KEYS: lease. ARGV: token. Gives the lease up if the caller still holds it.
_RELEASE = """
local held = redis.call('GET', KEYS[1])
if not held then return 0 end
local ok, lease = pcall(cjson.decode, held)
if ok and type(lease) == 'table' and lease['token'] == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def server_name(state_dir: Path | str) -> str:
    """A server as the lease names it: its machine and its role's state dir, which a restart
    keeps and no other server shares."""
    return f"{socket.gethostname()}:{state_dir}"


class LeaderStore:
    """The lease the schedulers contend for, and the epoch hosts fence commands with."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def claim(self, server: str, token: str, ttl_s: float) -> tuple[bool, Lease | None]:
        """Take or renew the lease for `ttl_s`: (whether the caller holds it, the lease as it
        stands). A lease Redis holds that is not one (refused) reads None."""
        key = keys.scheduler_lease()
        found = await self.client.eval(
            _CLAIM,
            2,
            key,
            keys.scheduler_epoch(),
            server,
            token,
            str(max(1, round(ttl_s * 1000))),
            repr(time.time()),
        )
        held, raw = found
        return bool(int(held)), quarantine.parse(Lease, raw, key)

    async def release(self, token: str) -> bool:
        """Give the lease up (a clean stop), if `token` still holds it."""
        gone = await self.client.eval(_RELEASE, 1, keys.scheduler_lease(), token)
        return bool(int(gone))

    async def current(self) -> Lease | None:
        """The lease as it stands, or None when nobody holds it."""
        key = keys.scheduler_lease()
        raw = await self.client.get(key)
        return None if raw is None else quarantine.parse(Lease, raw, key)

    async def epoch(self) -> int | None:
        """The latest lease's epoch, None before any lease (or when it is not a number,
        refused)."""
        key = keys.scheduler_epoch()
        raw = await self.client.get(key)
        if raw is None:
            return None
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        if not text.isdigit() or len(text) > 18:
            quarantine.REFUSALS.refuse(key, raw, "not an epoch (a whole number)")
            return None
        return int(text)

    async def publish_plan_times(self, times: PlanTimes) -> None:
        await self.client.set(keys.scheduler_plan_times(), times.model_dump_json())

    async def plan_times(self) -> PlanTimes | None:
        """What the leader's planning costs, as it last wrote; None before it did."""
        key = keys.scheduler_plan_times()
        return quarantine.parse(PlanTimes, await self.client.get(key), key)
