"""CapyCTL's Redis functions: the one library of Lua that hosts may run.

A joined host's Redis user may not run scripts of its own (EVAL, EVALSHA, SCRIPT LOAD): a
script holds the whole server until it ends, so one host's busy loop would stall every
other client. What hosts need of Lua, the instance compare-and-set, is a function of this
library instead, which only the control plane loads (FUNCTION LOAD REPLACE, at the
scheduler's start and again whenever its guard finds the library missing or of another
version) and hosts only call (FCALL). Redis checks a function's keys against its caller's
ACL as it does a script's: the keys it declares, and every key it touches inside.

A host's service that finds the library missing (a server just started, or whose Redis lost
its data) waits for the control plane to load it, and past MISSING_WAIT_S treats it as an
outage of Redis (`FunctionsMissing`): its loop retries as it would after a lost connection.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

log = logging.getLogger(__name__)

LIBRARY = "capyctl"
TRANSITION = "capyctl_transition"
VERSION_FUNCTION = "capyctl_version"
# How long a caller waits for the control plane to load a missing library, and how often it
# asks again meanwhile.
MISSING_WAIT_S = 30.0
MISSING_RETRY_S = 0.25

# KEYS: instance, instances set, events stream, notify channel.
# ARGV: allowed states (comma list, may include "absent"), expected generation ("" = any),
#       new record, event, member, notification.
_TRANSITION = """
local function transition(keys, args)
  local current = redis.call('GET', keys[1])
  local state = 'absent'
  if current then
    local ok, record = pcall(cjson.decode, current)
    if not ok or type(record) ~= 'table' then return {0, current} end
    state = record['state']
    if args[2] ~= '' and tostring(record['generation']) ~= args[2] then
      return {0, current}
    end
  end
  local allowed = false
  for name in string.gmatch(args[1], '[^,]+') do
    if name == state then allowed = true end
  end
  if not allowed then return {0, current or ''} end
  redis.call('SET', keys[1], args[3])
  redis.call('SADD', keys[2], args[5])
  redis.call('XADD', keys[3], 'MAXLEN', '~', '10000', '*', 'event', args[4])
  redis.call('PUBLISH', keys[4], args[6])
  return {1, args[3]}
end
"""

# The library's version: its code's own digest, so a changed library is loaded again.
VERSION = hashlib.sha256(_TRANSITION.encode()).hexdigest()[:16]

SOURCE = f"""#!lua name={LIBRARY}
{_TRANSITION}
redis.register_function('{TRANSITION}', transition)
redis.register_function{{
  function_name = '{VERSION_FUNCTION}',
  callback = function() return '{VERSION}' end,
  flags = {{'no-writes'}},
}}
"""


class FunctionsMissing(ResponseError):
    """Redis has no CapyCTL library (or another version of it) after MISSING_WAIT_S: the
    control plane did not load it. Callers treat it as an outage of Redis."""


def missing(exc: ResponseError) -> bool:
    """Whether `exc` is Redis's answer to a call of a function it does not have."""
    return str(exc).startswith("Function not found")


async def load(client: aioredis.Redis) -> None:
    """Load the library, replacing any version of it (the control plane's user only)."""
    await command(client)("FUNCTION", "LOAD", "REPLACE", SOURCE)


async def loaded_version(client: aioredis.Redis) -> str | None:
    """The version of the library Redis has; None when it has none."""
    try:
        found = await command(client)("FCALL_RO", VERSION_FUNCTION, 0)
    except ResponseError as exc:
        if missing(exc):
            return None
        raise
    return found.decode() if isinstance(found, bytes) else str(found)


async def call(
    client: aioredis.Redis, function: str, keys: Sequence[str], args: Sequence[str]
) -> Any:
    """FCALL `function` of the library, waiting up to MISSING_WAIT_S for the control plane to
    load it when Redis does not have it."""
    waited = False
    try:
        async with asyncio.timeout(MISSING_WAIT_S):
            while True:
                try:
                    return await command(client)("FCALL", function, len(keys), *keys, *args)
                except ResponseError as exc:
                    if not missing(exc):
                        raise
                if not waited:
                    log.warning(
                        "Redis has no CapyCTL functions yet; waiting for the control plane "
                        "to load them",
                        extra={"function": function},
                    )
                    waited = True
                await asyncio.sleep(MISSING_RETRY_S)
    except TimeoutError:
        raise FunctionsMissing(
            f"Redis has no function {function} after {MISSING_WAIT_S:g} s: the control "
            "plane (the scheduler) loads CapyCTL's functions; is it running?"
        ) from None


def command(client: aioredis.Redis) -> Callable[..., Awaitable[Any]]:
    """`client`'s way to send any command as written."""
    # redis-py leaves execute_command untyped; these commands go to Redis as written.
    command: Callable[..., Awaitable[Any]] = client.execute_command
    return command
