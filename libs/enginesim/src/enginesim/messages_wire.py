"""Anthropic's Messages API on the wire: the request, its chat conversion, and the message or
its SSE events as each family writes them.

A `MessageReply` is one answer: the reasoning becomes a `thinking` block, the answer a `text`
block, a tool call a `tool_use` block (its arguments parsed into `input`). Streamed:
`message_start` with the first output (nothing is sent while the request waits or its prompt
is processed), each block's `content_block_start`, one `content_block_delta` per token
(`thinking_delta`, `text_delta`, `input_json_delta`), `content_block_stop`, then
`message_delta` (the stop reason, the usage) and `message_stop`. Every event is
`event: <type>` and `data: <json>`. None of the engines sends `ping` events.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from enginesim.engine import Token, Work
from enginesim.openai_chat import JsonDict, text_of
from enginesim.responses_wire import produced, sse

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
BLOCK_OF = {"reasoning": "thinking", "content": "text", "tool_name": "tool_use"}


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens`: what a message would be, without its limits."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[JsonDict]
    system: str | list[JsonDict] | None = None
    tools: list[JsonDict] | None = None
    tool_choice: JsonDict | None = None

    def chat_messages(self) -> list[JsonDict]:
        """The conversation in chat's terms: the system prompt, then each message's text,
        its tool calls (assistant) and its tool results (as tool messages)."""
        system = self.system
        out: list[JsonDict] = []
        if system:
            out.append(
                {
                    "role": "system",
                    "content": system if isinstance(system, str) else text_of(system),
                }
            )
        for message in self.messages:
            out += _chat_of(message)
        return out

    def chat_tools(self) -> list[JsonDict] | None:
        if not self.tools:
            return None
        return [
            {
                "type": "function",
                "function": {
                    "name": tool.get("name", ""),
                    "description": tool.get("description"),
                    "parameters": tool.get("input_schema") or {"type": "object"},
                },
            }
            for tool in self.tools
        ]

    def chat_tool_choice(self) -> str | JsonDict | None:
        """Anthropic's choice in chat's terms: auto, any (required), a named tool, none."""
        choice = self.tool_choice or {"type": "auto"}
        kind = choice.get("type")
        if kind == "any":
            return "required"
        if kind == "tool":
            return {"type": "function", "function": {"name": choice.get("name")}}
        return "none" if kind == "none" else "auto"


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages` as vLLM and SGLang read it: the model and max_tokens required."""

    model: str | None = Field(min_length=1)
    max_tokens: int | None = Field(ge=1)
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    metadata: JsonDict | None = None


class LooseMessagesRequest(MessagesRequest):
    """llama-server's reading: model and max_tokens may be left out."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)


def _chat_of(message: JsonDict) -> list[JsonDict]:
    role, content = message.get("role", "user"), message.get("content")
    if not isinstance(content, list):
        return [{"role": role, "content": text_of(content)}]
    out: list[JsonDict] = []
    texts: list[str] = []
    calls: list[JsonDict] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            function = {
                "name": block.get("name", ""),
                "arguments": json.dumps(block.get("input") or {}),
            }
            calls.append({"id": block.get("id", ""), "type": "function", "function": function})
        elif kind == "tool_result":
            result = {"role": "tool", "tool_call_id": block.get("tool_use_id", "")}
            out.append({**result, "content": text_of(block.get("content"))})
    if texts or calls:
        turn: JsonDict = {"role": role, "content": "".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


class MessageReply:
    """One message as vLLM writes it (its stream ends with `data: [DONE]`); the other
    families override the hooks."""

    thinking_streamed = True  # SGLang's stream leaves the reasoning out

    def __init__(self, work: Work, message_id: str, model: str, call_id: str) -> None:
        self.work = work
        self.message_id = message_id
        self.model = model
        self.call_id = call_id

    # Family hooks -----------------------------------------------------------------------

    def signature(self) -> str:
        return uuid.uuid4().hex

    def usage(self) -> JsonDict:
        return {
            "input_tokens": self.work.prompt_tokens,
            "output_tokens": self.work.completion_tokens,
        }

    def whole(self) -> JsonDict:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "content": self.content(),
            "model": self.model,
            "stop_reason": self.stop_reason(),
            "usage": self.usage(),
        }

    def start(self) -> JsonDict:
        """`message_start`'s message (vLLM's leaves out the fields it did not set)."""
        return {
            "id": self.message_id,
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.work.prompt_tokens, "output_tokens": 0},
        }

    def delta(self) -> JsonDict:
        """`message_delta`'s body."""
        return {"delta": {"stop_reason": self.stop_reason()}, "usage": self.usage()}

    def tail(self) -> list[str]:
        return ["data: [DONE]\n\n"]

    # Both forms -------------------------------------------------------------------------

    def stop_reason(self) -> str:
        return STOP_REASONS.get(self.work.finish or "stop", "end_turn")

    def content(self) -> list[JsonDict]:
        work, blocks = self.work, []
        reasoning = produced(work, "reasoning")
        if reasoning:
            blocks.append(
                {"type": "thinking", "thinking": reasoning, "signature": self.signature()}
            )
        text = produced(work, "content")
        if text:
            blocks.append({"type": "text", "text": text})
        name = produced(work, "tool_name")
        if name:
            blocks.append(
                {"type": "tool_use", "id": self.call_id, "name": name, "input": self.arguments()}
            )
        return blocks

    def arguments(self) -> Any:
        try:
            return json.loads(produced(self.work, "tool_args") or "{}")
        except ValueError:
            return {}

    async def events(self) -> AsyncIterator[str]:
        blocks = _Blocks(self)
        opening = sse("message_start", {"type": "message_start", "message": self.start()})
        started = False
        async for batch in self.work.batches():
            events = [part for token in batch for part in blocks.feed(token)]
            yield "".join(events if started else [opening, *events])
            started = True
        end = [] if started else [opening]
        end += blocks.close()
        if self.work.finish == "error":
            error = {"type": "internal_error", "message": self.work.error or "internal error"}
            end.append(sse("error", {"type": "error", "error": error}))
        else:
            end.append(sse("message_delta", {"type": "message_delta", **self.delta()}))
            end.append(sse("message_stop", {"type": "message_stop"}))
        yield "".join(end + self.tail())


class _Blocks:
    """The stream's open content block: started, fed a delta per token, and stopped."""

    def __init__(self, reply: MessageReply) -> None:
        self.reply = reply
        self.kind: str | None = None
        self.index = -1

    def feed(self, token: Token) -> list[str]:
        if token.kind == "reasoning" and not self.reply.thinking_streamed:
            return []
        events: list[str] = []
        kind = BLOCK_OF.get(token.kind, "tool_use")
        if kind != self.kind or token.kind == "tool_name":
            events += self.close()
            events.append(self._start(kind, token))
            if token.kind == "tool_name":
                return events
        if kind == "thinking":
            delta = {"type": "thinking_delta", "thinking": token.text}
        elif kind == "text":
            delta = {"type": "text_delta", "text": token.text}
        else:
            delta = {"type": "input_json_delta", "partial_json": token.text}
        data = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return [*events, sse("content_block_delta", data)]

    def _start(self, kind: str, token: Token) -> str:
        self.kind, self.index = kind, self.index + 1
        if kind == "thinking":
            block: JsonDict = {"type": "thinking", "thinking": ""}
        elif kind == "text":
            block = {"type": "text", "text": ""}
        else:
            block = {"type": "tool_use", "id": self.reply.call_id, "name": token.text, "input": {}}
        data = {"type": "content_block_start", "index": self.index, "content_block": block}
        return sse("content_block_start", data)

    def close(self) -> list[str]:
        kind, self.kind = self.kind, None
        if kind is None:
            return []
        events = []
        if kind == "thinking":
            delta = {"type": "signature_delta", "signature": self.reply.signature()}
            data = {"type": "content_block_delta", "index": self.index, "delta": delta}
            events.append(sse("content_block_delta", data))
        stop = {"type": "content_block_stop", "index": self.index}
        return [*events, sse("content_block_stop", stop)]


class SglangMessageReply(MessageReply):
    """SGLang's: a `msg_` id, cache-read tokens in the usage, no reasoning in the stream,
    its `message_start` with no input tokens yet, and no `[DONE]`."""

    thinking_streamed = False

    def signature(self) -> str:
        return "dummy-signature"

    def usage(self) -> JsonDict:
        return {**super().usage(), "cache_read_input_tokens": 0}

    def start(self) -> JsonDict:
        usage = {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0}
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "usage": usage,
        }

    def tail(self) -> list[str]:
        return []


class LlamaMessageReply(MessageReply):
    """llama-server's: every field written, an empty signature, the stop sequence (null),
    only the output tokens in `message_delta`, and no `[DONE]`."""

    def signature(self) -> str:
        return ""

    def usage(self) -> JsonDict:
        work = self.work
        return {
            "cache_read_input_tokens": 0,
            "input_tokens": work.prompt_tokens,
            "output_tokens": work.completion_tokens,
        }

    def whole(self) -> JsonDict:
        return {**super().whole(), "stop_sequence": None}

    def start(self) -> JsonDict:
        usage = {**self.usage(), "output_tokens": 0}
        return {**super().start(), "type": "message", "role": "assistant", "usage": usage}

    def delta(self) -> JsonDict:
        delta = {"stop_reason": self.stop_reason(), "stop_sequence": None}
        return {"delta": delta, "usage": {"output_tokens": self.work.completion_tokens}}

    def tail(self) -> list[str]:
        return []
