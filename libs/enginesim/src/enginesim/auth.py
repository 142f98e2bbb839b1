"""Bearer-key checks as each engine does them: which paths, which headers, what refusal."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send


class BearerAuth:
    """ASGI middleware: a guarded path needs `Authorization: Bearer <one of keys>`.

    `guarded(path)` picks the paths (OPTIONS always passes); `refusal()` is the engine's 401.
    `also_x_api_key` accepts the key in `x-api-key` too (newer llama-server builds).
    """

    def __init__(
        self,
        app: ASGIApp,
        keys: Sequence[str],
        guarded: Callable[[str], bool],
        refusal: Callable[[], Response],
        also_x_api_key: bool = False,
    ) -> None:
        self.app = app
        self.keys = [key.encode() for key in keys]
        self.guarded = guarded
        self.refusal = refusal
        self.also_x_api_key = also_x_api_key

    def _allowed(self, scope: Scope) -> bool:
        offered: list[bytes] = []
        for name, value in scope["headers"]:
            if name.lower() == b"authorization" and value[:7].lower() == b"bearer ":
                offered.append(value[7:].strip())
            elif self.also_x_api_key and name.lower() == b"x-api-key":
                offered.append(value.strip())
        return any(hmac.compare_digest(o, key) for o in offered for key in self.keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and self.keys
            and scope["method"] != "OPTIONS"
            and self.guarded(scope["path"])
            and not self._allowed(scope)
        ):
            await self.refusal()(scope, receive, send)
            return
        await self.app(scope, receive, send)
