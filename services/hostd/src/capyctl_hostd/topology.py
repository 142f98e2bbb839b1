"""A joined host follows the servers' topology: the Sentinels that name the primary Redis.

Each server's scheduler publishes the topology in Redis (`capycommon.state.topology`). hostd
reads it once it reached Redis and every CHECK_EVERY_S after, and when it differs from the
one in the host's joined file (`capycommon.joined`), writes the file again with it, saying
so once. hostd and memwatch read the file when they start, so from their next start they
find the primary through the Sentinels, wherever a failover put it. A host that joined
before its servers replicated learns the topology this way, and one whose servers changed
(one added or replaced) learns the new one.

A topology that is not published (servers that do not replicate, or a scheduler that has not
published it yet) changes nothing: the file keeps what it has. A server of an earlier
release gives the host no right to read it; hostd then stops asking.
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import NoPermissionError

from capycommon import joined
from capycommon.domain.replication import Topology
from capycommon.errors import CapyError
from capycommon.paths import StatePaths
from capycommon.service import REDIS_ERRORS, wait_event
from capycommon.state.stores import State

log = logging.getLogger(__name__)

# How often hostd reads the published topology; sooner again after Redis failed to answer.
CHECK_EVERY_S = 60.0
RETRY_S = 5.0


async def follow(state: State, paths: StatePaths, stop: asyncio.Event) -> None:
    """Keep the joined file's topology the published one until `stop` is set."""
    while not stop.is_set():
        try:
            await refresh(state, paths)
        except NoPermissionError:
            log.info(
                "this host may not read the servers' topology (a server of an earlier "
                "release, which does not replicate); the joined file keeps its own"
            )
            return
        except REDIS_ERRORS as exc:
            log.debug("could not read the servers' topology; trying again: %s", exc)
            await wait_event(stop, RETRY_S)
            continue
        await wait_event(stop, CHECK_EVERY_S)


async def refresh(state: State, paths: StatePaths) -> Topology | None:
    """Write the published topology into the joined file where it differs from the file's;
    the topology written, or None when nothing changed."""
    published = await state.topology.read()
    if published is None:
        return None
    try:
        found = joined.read(paths)
    except CapyError as exc:  # damaged since hostd started: the next start says so
        log.warning("cannot keep the servers' topology in the joined file: %s", exc.message)
        return None
    if found is None or found.topology == published:
        return None
    await asyncio.to_thread(joined.write, paths, found.model_copy(update={"topology": published}))
    log.info(
        "the servers' topology changed: hostd and memwatch find the primary Redis through "
        "these Sentinels from their next start",
        extra={"sentinels": list(published.sentinels), "file": str(paths.joined)},
    )
    return published
