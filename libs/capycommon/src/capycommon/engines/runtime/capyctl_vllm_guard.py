"""ASGI middleware for vLLM (`--middleware capyctl_vllm_guard.KeyGuard`).

vLLM's own --api-key guards only /v1 and a few other prefixes; its dev controls (/sleep,
/wake_up, /collective_rpc) stay open. This guard puts the per-launch key in front of every
path. It runs inside the engine's environment, so it uses the standard library only.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

KEY_VARIABLE = "CAPYCTL_ENGINE_API_KEY"


class KeyGuard:
    def __init__(self, app: App) -> None:
        self.app = app
        self.expected = f"Bearer {os.environ[KEY_VARIABLE]}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = b""
            for name, value in scope["headers"]:
                if name.lower() == b"authorization":
                    given = value
            if not hmac.compare_digest(given, self.expected):
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [(b"content-type", b"application/json")],
                    }
                )
                await send({"type": "http.response.body", "body": b'{"error":"Unauthorized"}'})
                return
        await self.app(scope, receive, send)
