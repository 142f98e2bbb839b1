"""hostd's half of the scheduler lease: a launch, park, wake or stop carries the epoch of the
scheduler that sent it, and is refused when that epoch is older than the lease's (Redis's
counter, or the newest a command has brought here). A scheduler that lost its lease without
knowing it (paused, cut off) can so neither start a second copy of a model nor stop one it no
longer owns. Aborts (from routers) and model-store commands carry none and need none.
"""

from __future__ import annotations

import logging

from redis.exceptions import NoPermissionError

from capycommon.domain import commands as hc
from capycommon.state.stores import State

log = logging.getLogger(__name__)

FENCED = (hc.Launch, hc.Park, hc.Wake, hc.Stop)


class Fence:
    def __init__(self, state: State, host: str) -> None:
        self.state = state
        self.host = host
        self.newest = 0  # the newest epoch a command brought
        self.unreadable = False  # this host's Redis user may not read the epoch

    async def _stored(self) -> int:
        """The lease's epoch in Redis (0 before any). A server of an earlier release gives a
        joined host no right to read it: the newest epoch a command brought fences alone."""
        try:
            return await self.state.leader.epoch() or 0
        except NoPermissionError:
            if not self.unreadable:
                self.unreadable = True
                log.warning(
                    "this host may not read the scheduler's epoch (a server of an earlier "
                    "release); commands are fenced by the newest epoch one brought"
                )
            return 0

    async def admit(self, command: hc.HostCommand, epoch: int | None) -> bool:
        """Whether `command` may run; a refused one is recorded as `fenced`."""
        if not isinstance(command, FENCED):
            return True
        lease = max(self.newest, await self._stored())
        if epoch is not None and epoch >= lease:
            self.newest = max(self.newest, epoch)
            return True
        if epoch is None and lease == 0:  # a server from before the lease
            return True
        said = "no epoch" if epoch is None else f"epoch {epoch}"
        why = (
            f"{command.kind} refused: sent with {said} by a scheduler that no longer holds "
            f"the lease (now at epoch {lease})"
        )
        log.warning("%s:%s %s", command.deployment, command.instance, why)
        await self.state.instances(self.host).fenced(
            command.deployment, command.instance, command.generation, why
        )
        return False
