"""How an engine's answer reaches the client, by the shape of its API (`shape_of`).

Chat and completions answer in chunks of `choices` (`ChatShape`): each streamed as a `data:`
line, the stream ended by `data: [DONE]`, a failure after the first chunk an error chunk in
OpenAI's envelope; a client that asked for one JSON body gets it assembled from the chunks
(`Assembly`). A streamed transcription is relayed the same way. Responses and Messages answer
in typed events (`TypedShape`, `typed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from capyctl_router import typed
from capyctl_router.errors import error_body
from capyctl_router.relay import Call, JsonDict, dumps


class Assembler(Protocol):
    def add(self, event: JsonDict) -> None: ...

    def body(self) -> JsonDict: ...


class Shape(Protocol):
    def shown(self, event: JsonDict) -> JsonDict | None:
        """An engine event as the client sees it; None for one it does not see."""
        ...

    def sse(self, event: JsonDict) -> bytes: ...

    def end(self) -> bytes:
        """What ends the client's stream."""
        ...

    def error(self, status: int, code: str, message: str, param: str | None) -> bytes:
        """A failure after the stream began, as its error event."""
        ...

    def assembly(self) -> Assembler: ...


def shape_of(call: Call) -> Shape:
    return TypedShape(call) if call.answer == "events" else ChatShape(call)


@dataclass
class ChatShape:
    call: Call

    def shown(self, event: JsonDict) -> JsonDict | None:
        return for_client(self.call, event)

    def sse(self, event: JsonDict) -> bytes:
        return b"data: " + dumps(event) + b"\n\n"

    def end(self) -> bytes:
        return DONE

    def error(self, status: int, code: str, message: str, param: str | None) -> bytes:
        return self.sse(error_body(status, code, message, param)) + DONE

    def assembly(self) -> Assembler:
        return Assembly(self.call)


@dataclass
class TypedShape:
    call: Call

    def shown(self, event: JsonDict) -> JsonDict | None:
        call = self.call
        usage = typed.usage_of(event)
        if usage is not None:
            call.usage = usage
        return typed.for_client(call.kind, call.route, call.request_id, event)

    def sse(self, event: JsonDict) -> bytes:
        return typed.sse(event, dumps)

    def end(self) -> bytes:
        return b""

    def error(self, status: int, code: str, message: str, param: str | None) -> bytes:
        return self.sse(typed.error_event(self.call.kind, status, code, message, param))

    def assembly(self) -> Assembler:
        call = self.call
        if call.kind == "responses":
            return typed.ResponseAssembly(call.route)
        return typed.MessageAssembly(call.route, call.request_id)


DONE = b"data: [DONE]\n\n"


def for_client(call: Call, event: JsonDict) -> JsonDict | None:
    """An engine event (not an error: those end the answer) as the client sees it: our id
    and its model id; the usage-only chunk and the usage fields only if it asked for them."""
    if call.kind == "audio.transcriptions":  # its events are the engine's: only renamed
        return {**event, "model": call.route} if "model" in event else event
    event = {**event, "id": call.request_id, "model": call.route}
    if "usage" in event and event["usage"] is not None:
        call.usage = event["usage"]
    if not call.client_usage:
        if not event.get("choices") and event.get("usage") is not None:
            return None
        event.pop("usage", None)
    return event


@dataclass
class Assembly:
    """A non-streamed answer built from the engine's stream, as the engine would answer."""

    call: Call
    created: int | None = None
    extras: JsonDict = field(default_factory=dict)
    content: list[str] = field(default_factory=list)
    reasoning: dict[str, list[str]] = field(default_factory=dict)
    tools: dict[int, JsonDict] = field(default_factory=dict)
    logprobs: list[Any] = field(default_factory=list)
    finish: str | None = None
    choice_extras: JsonDict = field(default_factory=dict)

    def add(self, event: JsonDict) -> None:
        """One event of the engine's answer (not an error: those end the answer)."""
        self.created = self.created or event.get("created")
        if event.get("usage") is not None:
            self.call.usage = event["usage"]
        if "system_fingerprint" in event:
            self.extras["system_fingerprint"] = event["system_fingerprint"]
        for choice in event.get("choices") or []:
            self._choice(choice)

    def _choice(self, choice: JsonDict) -> None:
        delta = choice.get("delta")
        if delta is None:  # completions: text chunks
            self.content.append(choice.get("text") or "")
        else:
            self.content.append(delta.get("content") or "")
            for key in ("reasoning_content", "reasoning"):
                if key in delta:
                    self.reasoning.setdefault(key, []).append(delta[key] or "")
            for call in delta.get("tool_calls") or []:
                self._tool(call)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            self.logprobs += logprobs.get("content") or []
        if choice.get("finish_reason") is not None:
            self.finish = choice["finish_reason"]
            self.choice_extras = {
                k: v
                for k, v in choice.items()
                if k not in ("index", "delta", "text", "logprobs", "finish_reason")
            }

    def _tool(self, call: JsonDict) -> None:
        found = self.tools.setdefault(
            int(call.get("index", 0)),
            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
        )
        if call.get("id"):
            found["id"] = call["id"]
        if call.get("type"):
            found["type"] = call["type"]
        function = call.get("function") or {}
        found["function"]["name"] += function.get("name") or ""
        found["function"]["arguments"] += function.get("arguments") or ""

    def body(self) -> JsonDict:
        text = "".join(self.content)
        logprobs = {"content": self.logprobs} if self.logprobs else None
        if self.call.kind == "completions":
            choice: JsonDict = {
                "index": 0,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": self.finish,
                **self.choice_extras,
            }
            kind = "text_completion"
        else:
            calls = [self.tools[i] for i in sorted(self.tools)]
            message: JsonDict = {"role": "assistant", "content": text or (None if calls else "")}
            for key, parts in self.reasoning.items():
                message[key] = "".join(parts) or None
            if calls:
                message["tool_calls"] = calls
            choice = {
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": self.finish,
                **self.choice_extras,
            }
            kind = "chat.completion"
        body: JsonDict = {
            "id": self.call.request_id,
            "object": kind,
            "created": self.created,
            "model": self.call.route,
            "choices": [choice],
            **self.extras,
        }
        if self.call.usage is not None:
            body["usage"] = self.call.usage
        return body
