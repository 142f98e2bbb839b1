"""OpenAI chat and text completions as the engines answer them: one JSON body or SSE chunks.

What differs by family (the reasoning field, tool-call ids, extra fields such as vLLM's
`stop_reason` or llama.cpp's `timings`) is a `Dialect`. Token counts are deterministic: the
prompt counts one token per 4 characters of its text (at least 1), and each generated piece
(a word with its leading space, a fragment of tool arguments) is one token.
"""

from __future__ import annotations

import functools
import json
import math
import re
import secrets
import string
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from enginesim.bodies import Tolerant
from enginesim.engine import Finish, Token, TokenKind, Work

JsonDict = dict[str, Any]
_PIECES = re.compile(r"\s*\S+")
# Stands for a piece's text while its event's template is made; no answer holds it.
_HOLE = "\x00piece\x00"
# A prompt's token i is its text's characters 4i to 4i + 3.
CHARS_PER_TOKEN = 4


class StreamOptions(Tolerant):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class ChatRequest(Tolerant):
    model: str | None = None
    messages: list[JsonDict] = Field(min_length=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    n: int | None = Field(default=1, ge=1, le=1)
    tools: list[JsonDict] | None = None
    tool_choice: str | JsonDict | None = None
    request_id: str | None = None  # vLLM
    rid: str | None = None  # SGLang
    # vLLM and SGLang: go on to max_tokens past the answer's end.
    ignore_eos: bool | None = False

    @property
    def limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

    def named_tool(self) -> str | None:
        if isinstance(self.tool_choice, dict):
            function = self.tool_choice.get("function") or {}
            name = function.get("name") if isinstance(function, dict) else None
            return str(name) if name else None
        return None

    def prompt_text(self) -> str:
        return "".join(text_of(message.get("content")) for message in self.messages)


class EmbeddingRequest(Tolerant):
    model: str | None = None
    input: str | list[str] = Field(min_length=1)


class CompletionRequest(Tolerant):
    model: str | None = None
    prompt: str | list[str] | list[int]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=16, ge=0)
    request_id: str | None = None
    rid: str | None = None
    ignore_eos: bool | None = False

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        return " ".join(str(part) for part in self.prompt)


# A chat or a text completion, as a family checks it and gives it its ids.
GenerationRequest = ChatRequest | CompletionRequest
# A request a family names its served model for (`Frontend.model_name`).
ModelRequest = ChatRequest | CompletionRequest | EmbeddingRequest


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def count_prompt_tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def pieces(text: str) -> list[str]:
    return _PIECES.findall(text)


@functools.lru_cache(maxsize=32)
def _tokens_of(kind: TokenKind, text: str) -> tuple[Token, ...]:
    """The tokens of one text, made once: the behaviour's answer may be thousands of words,
    and every request that gets it would otherwise split it anew."""
    return tuple(Token(kind, piece) for piece in pieces(text))


def plan(
    answer: str,
    reasoning: str,
    tool: tuple[str, str] | None,
    limit: int | None,
    ignore_eos: bool = False,
) -> tuple[list[Token], Finish]:
    """The tokens a request will get, and how it finishes if nothing stops it. With
    `ignore_eos` the answer goes on, again and again, until `limit`."""
    tokens = list(_tokens_of("reasoning", reasoning))
    if tool is None:
        content = _tokens_of("content", answer)
        tokens += content
        if ignore_eos and limit is not None and content:
            while len(tokens) < limit:
                tokens += content
            return tokens[:limit], "length"
        finish: Finish = "stop"
    else:
        name, arguments = tool
        tokens.append(Token("tool_name", name))
        tokens += _tokens_of("tool_args", arguments)
        finish = "tool_calls"
    if limit is not None and len(tokens) > limit:
        return tokens[:limit], "length"
    return tokens, finish


def random_id(length: int, alphabet: str = string.ascii_letters + string.digits) -> str:
    return "".join(secrets.choice(alphabet) for _ in range(length))


@dataclass(frozen=True)
class Dialect:
    """What one family puts in its chat answers."""

    reasoning_fields: tuple[str, ...]
    new_tool_call_id: Callable[[], str]
    choice_extras: JsonDict = field(default_factory=dict)  # vLLM: stop_reason
    usage_null_in_chunks: bool = True
    tool_calls_always_listed: bool = False  # vLLM: message.tool_calls is [] when there are none
    timings: bool = False  # llama.cpp: `timings` on every chunk
    system_fingerprint: str | None = None
    # With an LMCache connector: usage's `prompt_tokens_details` of a request's work.
    prompt_details: Callable[[Work], JsonDict] | None = None


@dataclass
class Answer:
    """One request's identity, as its responses name it."""

    work: Work
    response_id: str
    model: str
    dialect: Dialect
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    # The text of a piece's event before and after its JSON string, by event kind.
    _templates: dict[str, tuple[str, str]] = field(default_factory=dict, init=False, repr=False)

    @functools.cached_property
    def tool_call_id(self) -> str:
        """Made the first time a tool call is answered, the same for all its parts."""
        return self.dialect.new_tool_call_id()

    def usage(self) -> JsonDict:
        prompt, completion = self.work.prompt_tokens, self.work.completion_tokens
        usage: JsonDict = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if self.dialect.prompt_details is not None:
            usage["prompt_tokens_details"] = self.dialect.prompt_details(self.work)
        return usage

    def timings(self) -> JsonDict:
        work = self.work
        first = work.first_token_at or work.created
        last = work.finished_at or time.monotonic()
        predicted_ms = max(0.001, (last - first) * 1000)
        prompt_ms = max(0.001, (first - work.created) * 1000)
        return {
            "cache_n": 0,
            "prompt_n": work.prompt_tokens,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / work.prompt_tokens,
            "prompt_per_second": work.prompt_tokens * 1000 / prompt_ms,
            "predicted_n": work.completion_tokens,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / max(1, work.completion_tokens),
            "predicted_per_second": work.completion_tokens * 1000 / predicted_ms,
        }

    # One JSON body ----------------------------------------------------------------------

    def message(self) -> JsonDict:
        produced = self.work.produced
        content = "".join(t.text for t in produced if t.kind == "content")
        reasoning = "".join(t.text for t in produced if t.kind == "reasoning")
        name = "".join(t.text for t in produced if t.kind == "tool_name")
        arguments = "".join(t.text for t in produced if t.kind == "tool_args")
        message: JsonDict = {"role": "assistant", "content": content or (None if name else "")}
        for field_name in self.dialect.reasoning_fields:
            message[field_name] = reasoning or None
        calls = []
        if name:
            function = {"name": name, "arguments": arguments}
            calls.append({"id": self.tool_call_id, "type": "function", "function": function})
        if calls or self.dialect.tool_calls_always_listed:
            message["tool_calls"] = calls
        return message

    def chat_body(self) -> JsonDict:
        choice = {
            "index": 0,
            "message": self.message(),
            "logprobs": None,
            "finish_reason": self.work.finish,
            **self.dialect.choice_extras,
        }
        body = self._envelope("chat.completion", [choice])
        body["usage"] = self.usage()
        if self.dialect.timings:
            body["timings"] = self.timings()
        return body

    def text_body(self) -> JsonDict:
        text = "".join(t.text for t in self.work.produced)
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": self.work.finish,
            **self.dialect.choice_extras,
        }
        body = self._envelope("text_completion", [choice])
        body["usage"] = self.usage()
        return body

    def _envelope(self, kind: str, choices: list[JsonDict]) -> JsonDict:
        body: JsonDict = {
            "id": self.response_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.dialect.system_fingerprint is not None:
            body["system_fingerprint"] = self.dialect.system_fingerprint
        return body

    # SSE ----------------------------------------------------------------------------------

    def _event(self, kind: str, choices: list[JsonDict], usage: JsonDict | None = None) -> str:
        body = self._envelope(kind, choices)
        if usage is not None:
            body["usage"] = usage
        elif self.include_usage and self.dialect.usage_null_in_chunks:
            body["usage"] = None
        if self.dialect.timings:
            body["timings"] = self.timings()
        return f"data: {json.dumps(body)}\n\n"

    def _delta(self, token: Token) -> JsonDict:
        if token.kind == "reasoning":
            return dict.fromkeys(self.dialect.reasoning_fields, token.text)
        if token.kind == "content":
            return {"content": token.text}
        if token.kind == "tool_name":
            call = {
                "index": 0,
                "id": self.tool_call_id,
                "type": "function",
                "function": {"name": token.text},
            }
            return {"tool_calls": [call]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": token.text}}]}

    def _chat_choice(self, delta: JsonDict, finish: str | None = None) -> JsonDict:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice.update(self.dialect.choice_extras)
        return choice

    def _piece(self, kind: str, token: Token) -> str:
        """The event of one generated piece. A content or text piece fills a template made
        once per answer from `_event` itself (same bytes; only the text differs between
        them), so a long stream costs little more than its text. llama.cpp's `timings`
        change with every event, so its pieces are written whole."""
        text_kind = kind == "text_completion"
        if self.dialect.timings or not (text_kind or token.kind == "content"):
            return self._event(kind, [self._piece_choice(kind, token)])
        template = self._templates.get(kind)
        if template is None:
            hole = Token(token.kind, _HOLE)
            parts = self._event(kind, [self._piece_choice(kind, hole)]).split(json.dumps(_HOLE))
            if len(parts) != 2:
                return self._event(kind, [self._piece_choice(kind, token)])
            template = self._templates[kind] = (parts[0], parts[1])
        return template[0] + json.dumps(token.text) + template[1]

    def _piece_choice(self, kind: str, token: Token) -> JsonDict:
        if kind == "text_completion":
            return {"index": 0, "text": token.text, "logprobs": None, "finish_reason": None}
        return self._chat_choice(self._delta(token))

    async def chat_events(self) -> AsyncIterator[str]:
        """The role chunk comes with the first output, as the engines send it: nothing is
        sent while the request waits or its prompt is processed. Each batch of tokens the
        engine produced together is one string (one write), and so is the end."""
        kind = "chat.completion.chunk"
        role = self._event(kind, [self._chat_choice({"role": "assistant", "content": ""})])
        started = False
        async for batch in self.work.batches():
            events = [self._piece(kind, token) for token in batch]
            if not started:
                started = True
                events.insert(0, role)
            yield "".join(events)
        end = [] if started else [role]
        if self.work.finish == "error":
            end.append(self._error_event())
        else:
            end.append(self._event(kind, [self._chat_choice({}, self.work.finish or "abort")]))
        yield "".join(end + self._tail(kind))

    async def text_events(self) -> AsyncIterator[str]:
        kind = "text_completion"
        async for batch in self.work.batches():
            yield "".join(self._piece(kind, token) for token in batch)
        last = {
            "index": 0,
            "text": "",
            "logprobs": None,
            "finish_reason": self.work.finish or "abort",
            **self.dialect.choice_extras,
        }
        end = self._error_event() if self.work.finish == "error" else self._event(kind, [last])
        yield "".join([end, *self._tail(kind)])

    def _error_event(self) -> str:
        error = {
            "message": self.work.error or "internal error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
        return f"data: {json.dumps({'error': error})}\n\n"

    def _tail(self, kind: str) -> list[str]:
        usage = [self._event(kind, [], usage=self.usage())] if self.include_usage else []
        return [*usage, "data: [DONE]\n\n"]
