"""Places: the engines a deployment's requests may go to, as the router's table holds them."""

from __future__ import annotations

from capycommon.domain.strict import Strict


class Places(Strict):
    """The places of one deployment's current generation."""

    generation: int = 0
    running: int = 0
    settle_when_idle: int = 0
    settle_at_stop: int = 0
    # Places router workers keep for their next requests: idle, or carrying a request let
    # through since Redis last heard (a drain waits for them to be given back).
    spare: int = 0

    @property
    def serving(self) -> int:
        """Requests the engine is, or may be, working on, excluding those cut before any
        answer (stopping and switching do not wait for those)."""
        return self.running - self.settle_at_stop


def owner_id(name: str, pid: int, server: str = "") -> str:
    """A process's owner id: its name and pid, so a restarted worker never takes up the
    places of the one before it, and on replicated servers its server's address, as two
    servers' processes may have one pid."""
    return f"{name}@{server}:{pid}" if server else f"{name}:{pid}"
