"""`POST /v1/messages` and `POST /v1/messages/count_tokens` (Anthropic's Messages API) on the
simulated engines, keyed by family and version. Every engine serves it by converting the
request to chat (system prompt, messages, tools, tool choice, max_tokens), which decides the
tool call and counts the prompt; the request is then admitted, planned, queued, timed and
aborted on a client's hang-up exactly as chat is (`Frontend.answer`), and answered as a
message (`enginesim.messages_wire`). `count_tokens` answers `{"input_tokens": N}`, N being
the prompt tokens the same request would count, and runs nothing.

- vLLM from 0.11.1, count_tokens from 0.17.0: a body it cannot read is a 400 in its own
  envelope; every refusal of the chat it becomes (an unknown model, `"auto"` tools without
  --enable-auto-tool-choice and --tool-call-parser, a dead engine) is translated into
  Anthropic's `{"type": "error", "error": {"type", "message"}}`. The message's id is the
  chat completion's (`chatcmpl-<X-Request-Id or hex>`).
- SGLang from 0.5.9 (count_tokens with it): a body it cannot read is its flat 400; other
  refusals in Anthropic's envelope; ids `msg_<hex>`.
- llama.cpp from build LLAMACPP_MESSAGES_FROM (count_tokens with it): model and max_tokens
  may be left out; a request without messages is its 500 `'messages' is required`; errors
  in its own `{"error": {code, message, type}}`. Older builds answer 404 as for any unknown
  path.
Before those versions vLLM and SGLang have no such routes (FastAPI's 404).
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from enginesim.api_common import AddRoute, llama_not_found
from enginesim.behaviour import version_tuple
from enginesim.engine import Work
from enginesim.messages_wire import (
    CountTokensRequest,
    LlamaMessageReply,
    LooseMessagesRequest,
    MessageReply,
    MessagesRequest,
    SglangMessageReply,
)
from enginesim.openai_chat import ChatRequest, count_prompt_tokens
from enginesim.serving import Frontend, explain

if TYPE_CHECKING:
    from enginesim.llamacpp_app import LlamaFrontend
    from enginesim.sglang_app import SglangFrontend
    from enginesim.vllm_app import VllmFrontend

VLLM_MESSAGES_FROM = (0, 11, 1)
VLLM_COUNT_TOKENS_FROM = (0, 17, 0)
SGLANG_MESSAGES_FROM = (0, 5, 9)
LLAMACPP_MESSAGES_FROM = 7187
PATHS = ("/v1/messages", "/v1/messages/count_tokens")
Body = TypeVar("Body", bound=CountTokensRequest)


def anthropic_error(status: int, kind: str, message: str) -> Response:
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return JSONResponse(body, status_code=status)


def translated(refusal: Response) -> Response:
    """An OpenAI-shaped refusal (nested or flat) in Anthropic's envelope."""
    try:
        data = json.loads(bytes(getattr(refusal, "body", b"")))
    except ValueError:
        return refusal
    if not isinstance(data, dict):
        return refusal
    inner = data.get("error")
    found: dict[str, Any] = inner if isinstance(inner, dict) else data
    kind, message = str(found.get("type", "error")), str(found.get("message", ""))
    return anthropic_error(refusal.status_code, kind, message)


class Messages:
    """One engine's Messages API; each family subclass fills in the hooks."""

    request_model: type[MessagesRequest] = MessagesRequest

    def __init__(self, front: Frontend, counts: bool) -> None:
        self.front = front
        self.counts = counts

    def register(self, add: AddRoute) -> None:
        add("/v1/messages", self.create, methods=["POST"])
        if self.counts:
            add("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])

    # Family hooks -----------------------------------------------------------------------

    def invalid(self, data: Any, message: str) -> Response:
        """A body the engine cannot read, as its request validation answers it."""
        return self.front.error(400, message)

    def refused(self, refusal: Response) -> Response:
        return translated(refusal)

    def ids(self, request: Request, chat: ChatRequest) -> tuple[str, str]:
        """(the engine's request id, the message's id)."""
        return self.front.request_ids(request, chat, "chatcmpl-")

    def reply(self, work: Work, message_id: str, chat: ChatRequest) -> MessageReply:
        raise NotImplementedError

    # Routes -----------------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        read = await self._read(request, self.request_model)
        if isinstance(read, Response):
            return read
        body, chat = read
        refusal = self.front.check(chat) or await self.front.admit()
        if refusal is not None:
            return self.refused(refusal)
        front = self.front
        tokens, finish = front.plan_answer(front.tool_for(chat), body.max_tokens)
        rid, message_id = self.ids(request, chat)
        work = Work(rid, count_prompt_tokens(chat.prompt_text()), tokens, finish)
        reply = self.reply(work, message_id, chat)
        front.submit(work)
        return await front.respond(request, work, bool(body.stream), reply.events, reply.whole)

    async def count_tokens(self, request: Request) -> Response:
        read = await self._read(request, CountTokensRequest)
        if isinstance(read, Response):
            return read
        _, chat = read
        return JSONResponse({"input_tokens": count_prompt_tokens(chat.prompt_text())})

    async def _read(
        self, request: Request, model: type[Body]
    ) -> tuple[Body, ChatRequest] | Response:
        """The body as `model`, and the chat request it stands for; or why it is not one."""
        body = await self.front.read_json(request, model, self.invalid)
        if isinstance(body, Response):
            return body
        chat = self._chat(body)
        return chat if isinstance(chat, Response) else (body, chat)

    def _chat(self, body: CountTokensRequest) -> ChatRequest | Response:
        limit = body.max_tokens if isinstance(body, MessagesRequest) else None
        try:
            return ChatRequest(
                model=body.model,
                messages=body.chat_messages(),
                tools=body.chat_tools(),
                tool_choice=body.chat_tool_choice(),
                max_tokens=limit,
            )
        except ValidationError as exc:
            return self.invalid(body, explain(exc))


class VllmMessages(Messages):
    def __init__(self, front: VllmFrontend) -> None:
        super().__init__(front, counts=front.v >= VLLM_COUNT_TOKENS_FROM)
        self.vllm = front

    def reply(self, work: Work, message_id: str, chat: ChatRequest) -> MessageReply:
        call_id = self.vllm.dialect.new_tool_call_id()
        return MessageReply(work, message_id, self.vllm.args.served_names[0], call_id)


class SglangMessages(Messages):
    def __init__(self, front: SglangFrontend) -> None:
        super().__init__(front, counts=True)
        self.sglang = front

    def ids(self, request: Request, chat: ChatRequest) -> tuple[str, str]:
        rid, _ = super().ids(request, chat)
        return rid, f"msg_{uuid.uuid4().hex}"

    def reply(self, work: Work, message_id: str, chat: ChatRequest) -> MessageReply:
        call_id = self.sglang.dialect.new_tool_call_id()
        return SglangMessageReply(work, message_id, self.sglang.model_name(chat), call_id)


class LlamaMessages(Messages):
    request_model = LooseMessagesRequest

    def __init__(self, front: LlamaFrontend) -> None:
        super().__init__(front, counts=True)
        self.llama = front

    def invalid(self, data: Any, message: str) -> Response:
        if isinstance(data, dict) and "messages" not in data:
            return self.llama.error(500, "'messages' is required", "server_error")
        return self.llama.error(400, message, "invalid_request_error")

    def refused(self, refusal: Response) -> Response:
        return refusal

    def reply(self, work: Work, message_id: str, chat: ChatRequest) -> MessageReply:
        call_id = self.llama.dialect.new_tool_call_id()
        return LlamaMessageReply(work, message_id, self.llama.model_name(chat), call_id)


def register_vllm(add: AddRoute, front: VllmFrontend) -> None:
    if front.v >= VLLM_MESSAGES_FROM:
        VllmMessages(front).register(add)


def register_sglang(add: AddRoute, front: SglangFrontend) -> None:
    if version_tuple(front.version) >= SGLANG_MESSAGES_FROM:
        SglangMessages(front).register(add)


def register_llamacpp(add: AddRoute, front: LlamaFrontend) -> None:
    if front.build >= LLAMACPP_MESSAGES_FROM:
        LlamaMessages(front).register(add)
    else:
        for path in PATHS:
            add(path, llama_not_found, methods=["POST"])
