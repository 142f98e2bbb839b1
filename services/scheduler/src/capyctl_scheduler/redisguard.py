"""The control plane's guard over Redis's scripts: CapyCTL's functions are loaded, and a
script that runs away is stopped.

Redis runs one script (or function) at a time and serves nobody meanwhile. Past its
`busy-reply-threshold` (`capyctl_cli.redisconf`) it answers every other command BUSY, and
takes only SCRIPT KILL, FUNCTION KILL and SHUTDOWN NOSAVE. The guard asks Redis the version
of CapyCTL's library every GUARD_EVERY_S: a BUSY answer makes it send both kills (one of
them is the right one), logged once for each time Redis is stuck; a missing library, or
another version of it, makes it load the library (`capycommon.state.functions`).

A script that already wrote cannot be killed (Redis answers UNKILLABLE: only SHUTDOWN
NOSAVE ends it, losing what was not saved); the guard says so and leaves the choice to the
operator.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress

from redis.exceptions import ResponseError

from capycommon.service import REDIS_ERRORS, wait_event
from capycommon.state import functions
from capycommon.state.pipe import RedisBusy
from capycommon.state.stores import State

log = logging.getLogger(__name__)

# Below the server's busy-reply-threshold (1 s): a probe waiting on a running script is
# answered BUSY as soon as the threshold passes, so the kill follows it at once.
GUARD_EVERY_S = 0.5


class RedisGuard:
    def __init__(self, state: State) -> None:
        self.state = state
        self.stuck = False  # Redis answered BUSY, and no probe has passed since

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with suppress(*REDIS_ERRORS):  # an outage, which the service logs as such
                await self.check()
            await wait_event(stop, GUARD_EVERY_S)

    async def check(self) -> None:
        """Probe once: kill a runaway script, load a missing library."""
        try:
            version = await functions.loaded_version(self.state.client)
        except RedisBusy as exc:
            await self.kill(str(exc))
            return
        if self.stuck:
            self.stuck = False
            log.info("Redis serves again after a script was stopped")
        if version != functions.VERSION:
            await functions.load(self.state.client)
            log.info(
                "loaded CapyCTL's Redis functions",
                extra={"version": functions.VERSION, "found": version},
            )

    async def kill(self, busy: str) -> None:
        """Stop the script Redis is running: SCRIPT KILL for a script, FUNCTION KILL for a
        function (each refuses the other's)."""
        answers = []
        for words in (("SCRIPT", "KILL"), ("FUNCTION", "KILL")):
            try:
                await functions.command(self.state.client)(*words)
                answers.append(f"{' '.join(words)}: OK")
            except ResponseError as exc:
                answers.append(f"{' '.join(words)}: {exc}")
        if self.stuck:
            return
        self.stuck = True
        unkillable = any("UNKILLABLE" in answer for answer in answers)
        log.error(
            "Redis ran a script past its time limit and served nobody; "
            + (
                "it cannot be killed, as it wrote: only `SHUTDOWN NOSAVE` on the server's "
                "Redis ends it"
                if unkillable
                else "stopped it"
            ),
            extra={"busy": busy, "answers": answers},
        )
