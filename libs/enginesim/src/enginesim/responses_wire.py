"""The OpenAI Responses API on the wire: the request, and the Response object or its SSE
events as each family writes them.

A `Reply` is one response: the request it answers (repeated in the Response as the family
repeats it), its ids, and the engine's work. Its output items come from the tokens the work
produced: the reasoning (a `reasoning` item), the answer (a `message` item with one
`output_text` part) and a tool call (a `function_call` item). Streamed, the events go
`response.created`, `response.in_progress`, each item's `output_item.added` (with
`content_part.added`), one delta per token, the item's `.done` events, and
`response.completed` carrying the whole Response. Every event is `event: <type>` and
`data: <json>` with a `sequence_number`; no `data: [DONE]` ends the stream.
"""

from __future__ import annotations

import functools
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from enginesim.engine import Token, TokenKind, Work
from enginesim.openai_chat import JsonDict, random_id

# The output item each kind of token belongs to.
ITEM_OF: dict[TokenKind, str] = {
    "reasoning": "reasoning",
    "content": "message",
    "tool_name": "function_call",
    "tool_args": "function_call",
}


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`, as the engines read it (fields they ignore are kept)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[JsonDict]
    instructions: str | None = None
    stream: bool | None = False
    store: bool | None = True
    background: bool | None = False
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    tools: list[JsonDict] = Field(default_factory=list)
    tool_choice: str | JsonDict = "auto"
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool | None = True
    metadata: JsonDict | None = None
    user: str | None = None
    request_id: str | None = None  # vLLM and SGLang: the response's id

    def chat_tools(self) -> list[JsonDict] | None:
        """The function tools in chat's form; other kinds (web search, MCP) are dropped."""
        tools = [
            {
                "type": "function",
                "function": {
                    key: tool[key] for key in ("name", "description", "parameters") if key in tool
                },
            }
            for tool in self.tools
            if tool.get("type") == "function" and tool.get("name")
        ]
        return tools or None

    def chat_tool_choice(self) -> str | JsonDict:
        choice = self.tool_choice
        if not isinstance(choice, dict):
            return choice
        function = choice.get("function")
        name = choice.get("name") or (function.get("name") if isinstance(function, dict) else None)
        return {"type": "function", "function": {"name": name}} if name else "auto"


def sse(kind: str, data: JsonDict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


def produced(work: Work, *kinds: TokenKind) -> str:
    return "".join(token.text for token in work.produced if token.kind in kinds)


class Reply:
    """One response as vLLM writes it; the other families override the hooks."""

    deltas = True  # whether a stream carries its items' events (SGLang's does not)

    def __init__(
        self,
        body: ResponsesRequest,
        work: Work,
        response_id: str,
        model: str | None,
        call_id: str,
        finished: Callable[[JsonDict], None] | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.body = body
        self.work = work
        self.response_id = response_id
        self.model = model
        self.call_id = call_id
        # Called with the whole Response of work that ran to its end (the store).
        self.finished = finished
        self.limit = max_tokens  # the engine's token budget, where the family reports it
        self.created_at = int(time.time())

    # Family hooks -----------------------------------------------------------------------

    def new_id(self, prefix: str) -> str:
        return f"{prefix}_{uuid.uuid4().hex}"

    def stream_ids(self, kind: str) -> tuple[str, str]:
        """(item id, call id) of an item as the stream names it: vLLM names streamed items
        afresh (a bare hex id, `call_<hex>`), unlike the whole Response's."""
        return uuid.uuid4().hex, f"call_{uuid.uuid4().hex}"

    def status(self) -> str:
        return "incomplete" if self.work.finish == "length" else "completed"

    def fields(self) -> JsonDict:
        """The Response's fields besides its id, object, times, model, output and usage."""
        body, status = self.body, self.status()
        extra = body.model_extra or {}
        return {
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": body.instructions,
            "metadata": body.metadata,
            "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "tool_choice": body.tool_choice,
            "tools": body.tools,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "background": bool(body.background),
            "max_output_tokens": self.max_tokens(),
            "max_tool_calls": extra.get("max_tool_calls"),
            "previous_response_id": body.previous_response_id,
            "prompt": None,
            "reasoning": extra.get("reasoning"),
            "service_tier": extra.get("service_tier", "auto"),
            "text": extra.get("text"),
            "top_logprobs": None,
            "truncation": extra.get("truncation", "disabled"),
            "user": body.user,
            "input_messages": None,
            "output_messages": None,
        }

    def max_tokens(self) -> int | None:
        return self.body.max_output_tokens if self.limit is None else self.limit

    def usage(self) -> JsonDict | None:
        work = self.work
        return {
            "input_tokens": work.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": work.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens()},
            "total_tokens": work.prompt_tokens + work.completion_tokens,
        }

    def streamed_usage(self) -> JsonDict | None:
        return self.usage()

    def reasoning_item(self, item_id: str, text: str | None, status: str | None) -> JsonDict:
        item: JsonDict = {"id": item_id, "summary": [], "type": "reasoning", "status": status}
        if text is not None:
            item["content"] = [{"text": text, "type": "reasoning_text"}]
        return item

    def text_part(self, text: str, streamed: bool = False) -> JsonDict:
        logprobs: list[Any] | None = [] if streamed else None
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def message_item(self, item_id: str, text: str | None, status: str) -> JsonDict:
        content = [] if text is None else [self.text_part(text)]
        return {
            "id": item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def call_item(
        self, item_id: str, call_id: str, name: str, arguments: str, status: str
    ) -> JsonDict:
        return {
            "id": item_id,
            "call_id": call_id,
            "type": "function_call",
            "status": status,
            "name": name,
            "arguments": arguments,
        }

    # The whole Response -----------------------------------------------------------------

    def reasoning_tokens(self) -> int:
        return sum(1 for token in self.work.produced if token.kind == "reasoning")

    @functools.cached_property
    def output(self) -> list[JsonDict]:
        """Made once, so the Response answered, stored and completed keeps its ids."""
        work, items = self.work, []
        reasoning = produced(work, "reasoning")
        if reasoning:
            items.append(self.reasoning_item(self.new_id("rs"), reasoning, None))
        content = produced(work, "content")
        if content:
            items.append(self.message_item(self.new_id("msg"), content, "completed"))
        name = produced(work, "tool_name")
        if name:
            arguments = produced(work, "tool_args")
            items.append(
                self.call_item(self.new_id("fc"), self.call_id, name, arguments, "completed")
            )
        return items

    def whole(self, usage: JsonDict | None = None) -> JsonDict:
        answer: JsonDict = {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "output": self.output,
            "status": self.status(),
            "usage": self.usage() if usage is None else usage,
            **self.fields(),
        }
        if self.finished is not None and self.work.finish not in ("abort", "error"):
            self.finished(answer)
        return answer

    def pending(self) -> JsonDict:
        """The Response as `response.created` and `response.in_progress` show it."""
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "output": [],
            "status": "in_progress",
            "usage": None,
            **self.fields(),
            "incomplete_details": None,
        }

    # The stream -------------------------------------------------------------------------

    async def events(self) -> AsyncIterator[str]:
        """Created and in progress at once, then the items as the tokens come."""
        counter = itertools.count()

        def event(kind: str, **data: Any) -> str:
            return sse(kind, {"type": kind, "sequence_number": next(counter), **data})

        opening = self.pending()
        yield event("response.created", response=opening) + event(
            "response.in_progress", response=opening
        )
        items = _Items(self, event)
        async for batch in self.work.batches():
            if self.deltas:
                yield "".join(part for token in batch for part in items.feed(token))
        end = items.close()
        if self.work.finish == "error":
            end.append(event("error", code="internal_error", message=self.work.error, param=None))
        else:
            end.append(event("response.completed", response=self.whole(self.streamed_usage())))
        yield "".join(end)


class _Items:
    """The stream's open output item: each token's delta, opened and closed as it changes."""

    def __init__(self, reply: Reply, event: Callable[..., str]) -> None:
        self.reply = reply
        self.event = event
        self.kind: str | None = None
        self.index = -1
        self.item_id = ""
        self.call_id = ""
        self.name = ""
        self.text: list[str] = []

    def feed(self, token: Token) -> list[str]:
        kind = ITEM_OF[token.kind]
        events: list[str] = []
        if kind != self.kind or token.kind == "tool_name":
            events += self.close()
            events += self._open(kind, token)
            if token.kind == "tool_name":
                return events
        self.text.append(token.text)
        where = {"item_id": self.item_id, "output_index": self.index}
        if kind == "reasoning":
            events.append(
                self.event(
                    "response.reasoning_text.delta", **where, content_index=0, delta=token.text
                )
            )
        elif kind == "message":
            events.append(
                self.event(
                    "response.output_text.delta",
                    **where,
                    content_index=0,
                    delta=token.text,
                    logprobs=[],
                )
            )
        else:
            events.append(
                self.event("response.function_call_arguments.delta", **where, delta=token.text)
            )
        return events

    def _open(self, kind: str, token: Token) -> list[str]:
        reply, event = self.reply, self.event
        self.kind, self.index, self.text = kind, self.index + 1, []
        self.item_id, self.call_id = reply.stream_ids(kind)
        added = {"output_index": self.index}
        part = {"item_id": self.item_id, "output_index": self.index, "content_index": 0}
        if kind == "function_call":
            self.name = token.text
            item = reply.call_item(self.item_id, self.call_id, self.name, "", "in_progress")
            return [event("response.output_item.added", **added, item=item)]
        if kind == "reasoning":
            item = reply.reasoning_item(self.item_id, None, "in_progress")
            first = {"type": "reasoning_text", "text": ""}
        else:
            item = reply.message_item(self.item_id, None, "in_progress")
            first = reply.text_part("", streamed=True)
        return [
            event("response.output_item.added", **added, item=item),
            event("response.content_part.added", **part, part=first),
        ]

    def close(self) -> list[str]:
        kind, text, reply, event = self.kind, "".join(self.text), self.reply, self.event
        self.kind = None
        where = {"item_id": self.item_id, "output_index": self.index}
        if kind == "function_call":
            item = reply.call_item(self.item_id, self.call_id, self.name, text, "completed")
            return [
                event(
                    "response.function_call_arguments.done", **where, arguments=text, name=self.name
                ),
                event("response.output_item.done", output_index=self.index, item=item),
            ]
        if kind == "reasoning":
            part: JsonDict = {"type": "reasoning_text", "text": text}
            done = event("response.reasoning_text.done", **where, content_index=0, text=text)
            item = reply.reasoning_item(self.item_id, text, "completed")
        elif kind == "message":
            part = reply.text_part(text)
            done = event(
                "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
            )
            item = reply.message_item(self.item_id, text, "completed")
        else:
            return []
        return [
            done,
            event("response.content_part.done", **where, content_index=0, part=part),
            event("response.output_item.done", output_index=self.index, item=item),
        ]


class SglangReply(Reply):
    """SGLang's: its stream sends no items' events for a model without the harmony format
    (only created, in progress and completed). Before its Responses fixes (`fixed` False)
    the usage it reports is all zeros, and the whole Response writes it in chat's shape."""

    deltas = False

    def __init__(self, *args: Any, fixed: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fixed = fixed

    def stream_ids(self, kind: str) -> tuple[str, str]:
        return self.new_id("item"), self.call_id

    def status(self) -> str:
        return "completed"

    def fields(self) -> JsonDict:
        body = self.body
        return {
            "parallel_tool_calls": body.parallel_tool_calls,
            "tool_choice": body.tool_choice,
            "tools": body.tools,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "reasoning": None,
            "store": body.store,
            "temperature": 0.7 if body.temperature is None else body.temperature,
            "text": None,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": (body.model_extra or {}).get("truncation", "disabled"),
            "user": body.user,
            "metadata": body.metadata,
        }

    def usage(self) -> JsonDict | None:
        if not self.fixed:
            zero = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
            return {**zero, "prompt_tokens_details": None, "reasoning_tokens": 0}
        answer = super().usage()
        assert answer is not None
        answer["input_tokens_details"]["cache_write_tokens"] = 0
        return answer

    def streamed_usage(self) -> JsonDict | None:
        if self.fixed:
            return self.usage()
        return {
            "input_tokens": 0,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 0,
        }


class LlamaReply(Reply):
    """llama-server's: ids of 32 random characters, a few fields, `completed_at`, and a
    function call named by `call_id` alone (`fc_` and the tool call's id)."""

    def new_id(self, prefix: str) -> str:
        return f"{prefix}_{random_id(32)}"

    def stream_ids(self, kind: str) -> tuple[str, str]:
        return self.new_id("rs" if kind == "reasoning" else "msg"), self.call_id

    def status(self) -> str:
        return "completed"

    def fields(self) -> JsonDict:
        return {"completed_at": int(time.time())}

    def usage(self) -> JsonDict | None:
        work = self.work
        return {
            "input_tokens": work.prompt_tokens,
            "output_tokens": work.completion_tokens,
            "total_tokens": work.prompt_tokens + work.completion_tokens,
            "input_tokens_details": {"cached_tokens": 0},
        }

    def reasoning_item(self, item_id: str, text: str | None, status: str | None) -> JsonDict:
        item = super().reasoning_item(item_id, text, status or "completed")
        item["encrypted_content"] = ""
        return item

    def text_part(self, text: str, streamed: bool = False) -> JsonDict:
        return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}

    def call_item(
        self, item_id: str, call_id: str, name: str, arguments: str, status: str
    ) -> JsonDict:
        return {
            "type": "function_call",
            "status": status,
            "arguments": arguments,
            "call_id": f"fc_{call_id}",
            "name": name,
        }
