"""Answers in typed events: OpenAI's Responses (`/v1/responses`) and Anthropic's Messages
(`/v1/messages`).

Each event's data names its own `type`, which is also its SSE event name: the router writes
`event: <type>` before each `data:` line, as both APIs do (the anthropic SDK reads the name,
the openai SDK the type). Neither stream ends with `data: [DONE]`.

As for chat, the router always streams from the engine and, for a client that asked for one
JSON body, assembles it: a response is the `response` of its last event
(`response.completed`, `.incomplete` or `.failed`), a message is built from its blocks as
Anthropic's SDK builds it. A response keeps the engine's ids, since a later request names
one as `previous_response_id`; a message takes the router's request id, as a chat answer does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from capycommon.errors import EngineError
from capyctl_router.errors import error_body

JsonDict = dict[str, Any]
# A response's events that end it, each carrying the whole response.
RESPONSE_ENDS = ("response.completed", "response.incomplete", "response.failed")
# What every message is, which vLLM's message_start leaves out (its defaults, unset).
MESSAGE = {"type": "message", "role": "assistant"}


def for_client(kind: str, route: str, request_id: str, event: JsonDict) -> JsonDict:
    """An engine's event as the client sees it: under the model it asked for (and a
    message under the router's id)."""
    if kind == "responses":
        response = event.get("response")
        if isinstance(response, dict):
            return {**event, "response": {**response, "model": route}}
        return event
    message = event.get("message")
    if event.get("type") == "message_start" and isinstance(message, dict):
        shown = {**MESSAGE, **message, "id": request_id, "model": route}
        return {**event, "message": shown}
    return event


def usage_of(event: JsonDict) -> JsonDict | None:
    """The usage an event carries: a response's at its end, a message's at its start and
    (its output tokens) at its last delta."""
    for holder in (event.get("response"), event.get("message"), event):
        if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
            found: JsonDict = holder["usage"]
            return found
    return None


def sse(event: JsonDict, dumps: Callable[[Any], bytes]) -> bytes:
    kind = event.get("type")
    name = kind if isinstance(kind, str) and kind.isprintable() else "message"
    return b"event: " + name.encode() + b"\ndata: " + dumps(event) + b"\n\n"


def error_event(
    kind: str, status: int, code: str, message: str, param: str | None = None
) -> JsonDict:
    """A failure after the stream began, as the API's own error event."""
    if kind == "responses":
        return {"type": "error", "code": code, "message": message, "param": param}
    return error_body(status, code, message, param, "anthropic")


@dataclass
class ResponseAssembly:
    """A non-streamed response: the one its last event carries."""

    route: str
    response: JsonDict | None = None

    def add(self, event: JsonDict) -> None:
        if event.get("type") in RESPONSE_ENDS and isinstance(event.get("response"), dict):
            self.response = event["response"]

    def body(self) -> JsonDict:
        if self.response is None:
            raise EngineError("the engine's response stream ended before the response did")
        return {**self.response, "model": self.route}


@dataclass
class MessageAssembly:
    """A non-streamed message, built from its stream: its start, each content block from
    its start and deltas, and the stop reason and usage of its last delta."""

    route: str
    request_id: str
    message: JsonDict | None = None
    blocks: dict[int, JsonDict] = field(default_factory=dict)
    partial_json: dict[int, list[str]] = field(default_factory=dict)

    def add(self, event: JsonDict) -> None:
        kind = event.get("type")
        if kind == "message_start" and isinstance(event.get("message"), dict):
            self.message = dict(event["message"])
        elif kind == "content_block_start" and isinstance(event.get("content_block"), dict):
            self.blocks[_index(event)] = dict(event["content_block"])
        elif kind == "content_block_delta" and isinstance(event.get("delta"), dict):
            self._delta(_index(event), event["delta"])
        elif kind == "message_delta" and self.message is not None:
            delta = event.get("delta")
            if isinstance(delta, dict):
                self.message.update(delta)
            usage = event.get("usage")
            if isinstance(usage, dict):
                self.message["usage"] = {**(self.message.get("usage") or {}), **usage}

    def _delta(self, index: int, delta: JsonDict) -> None:
        block = self.blocks.setdefault(index, {"type": "text", "text": ""})
        kind = delta.get("type")
        if kind == "input_json_delta":
            self.partial_json.setdefault(index, []).append(str(delta.get("partial_json") or ""))
            return
        for key in ("text", "thinking", "signature"):
            if key in delta:
                block[key] = str(block.get(key) or "") + str(delta[key] or "")

    def body(self) -> JsonDict:
        if self.message is None:
            raise EngineError("the engine's message stream ended before the message began")
        for index, parts in self.partial_json.items():
            text = "".join(parts)
            try:
                self.blocks[index]["input"] = json.loads(text) if text else {}
            except json.JSONDecodeError:
                raise EngineError(f"the engine's tool input is not JSON: {text[:200]!r}") from None
        content = [self.blocks[i] for i in sorted(self.blocks)]
        message = {**MESSAGE, **self.message}
        return {**message, "id": self.request_id, "model": self.route, "content": content}


def _index(event: JsonDict) -> int:
    index = event.get("index", 0)
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < 4096:
        raise EngineError(f"the engine sent a content block index that is not one: {index!r}")
    return index
