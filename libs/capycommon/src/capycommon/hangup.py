"""A client's hang-up, met wherever the request's task waits.

An ASGI server tells the app that its client left only through `receive` (an
`http.disconnect` message), which a request does not call while it waits on an upstream or
streams its answer. `Watch` waits for it in a task of its own, for the whole request, and
cancels the request's task wherever that waits (on an upstream, or on the client's socket),
so that the upstream's connection is closed at once. The request's task tells that
cancellation from any other (a server stopping) by `Watch.gone`, and takes it back with
`uncancel` to end as a cut request. The router serves each request so, and the host's
ingress each request of the router.
"""

from __future__ import annotations

import asyncio

from starlette.types import Receive


class Watch:
    """The client's hang-up, waited for by one task for the whole request: it cancels the
    request's own task (the one that makes the `Watch`), wherever that waits. `gone`: whether
    it did. `stop` ends the watching task, once the request is done."""

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self._ending = False
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self._ending:
            self.gone = True
            self._task.cancel()

    def ending(self) -> None:
        """The answer's last part goes out: the connection's end after it is no hang-up."""
        self._ending = True

    def stop(self) -> None:
        self._watcher.cancel()


def uncancel() -> None:
    """Take back the cancellation a hang-up made (`Watch`): the task goes on, to end the
    request as a cut one."""
    task = asyncio.current_task()
    assert task is not None
    task.uncancel()
