"""`POST /v1/responses` (and `GET /v1/responses/{id}`) on the simulated engines, keyed by
family and version. A request becomes its chat conversion (instructions, any earlier turn,
then the input, as a system message and chat messages; function tools as chat's tools),
which decides the tool call and counts the prompt; it is then admitted, planned, queued,
timed and aborted on a client's hang-up exactly as chat is (`Frontend.answer`), and answered
as a Response (`enginesim.responses_wire`).

- vLLM, every version the simulator runs: errors in its envelope; function tools from 0.11.1
  (before, a request with tools is refused: only gpt-oss's harmony format had them); a tool
  call needs --enable-auto-tool-choice and --tool-call-parser for `tool_choice: "auto"`
  (without them the answer stays text). Responses are kept only when the engine runs with
  VLLM_ENABLE_RESPONSES_API_STORE=1 (and the request's `store`, true by default); without
  the store every `previous_response_id` is unknown: 404 `Response with id '...' not found.`
- SGLang, every version (>= 0.5.0): its nested `{"error": {...}}` on this route, its store
  always on (a request's `store: false` opts out), an id not beginning `resp_` refused
  (400). Its stream carries no item events for a model without the harmony format: created,
  in progress, then completed once the answer is whole. Before SGLANG_RESPONSES_FIXED its
  usage is zeros, tools are ignored, and a continued turn replays the request's
  instructions where the earlier answer belongs.
- llama.cpp from build LLAMACPP_RESPONSES_FROM: stateless, `previous_response_id` refused
  (400); older builds answer 404 as for any unknown path.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from enginesim.api_common import AddRoute, llama_not_found
from enginesim.behaviour import version_tuple
from enginesim.engine import Work
from enginesim.openai_chat import (
    ChatRequest,
    JsonDict,
    count_prompt_tokens,
    random_id,
    text_of,
)
from enginesim.responses_wire import (
    LlamaReply,
    Reply,
    ResponsesRequest,
    SglangReply,
)
from enginesim.serving import Frontend, explain

if TYPE_CHECKING:
    from enginesim.llamacpp_app import LlamaFrontend
    from enginesim.sglang_app import SglangFrontend
    from enginesim.vllm_app import VllmFrontend

STORE_FLAG = "VLLM_ENABLE_RESPONSES_API_STORE"
VLLM_FUNCTION_TOOLS_FROM = (0, 11, 1)  # vllm-project/vllm#26874
# sgl-project/sglang#25881 (merged 2026-05-20): the first release carrying it is estimated.
SGLANG_RESPONSES_FIXED = (0, 5, 14)
LLAMACPP_RESPONSES_FROM = 7793
Keep = Callable[[JsonDict], None]


@dataclass(frozen=True)
class Stored:
    """A kept response: the conversation it answered (chat messages) and the Response."""

    messages: list[JsonDict]
    response: JsonDict


def input_messages(value: str | list[JsonDict]) -> list[JsonDict]:
    """A request's input as chat messages: a string is the user's message; items are
    messages (content a string or text parts), function calls and their outputs."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return [_message_of(item) for item in value]


def _message_of(item: JsonDict) -> JsonDict:
    kind = item.get("type")
    if kind == "function_call":
        function = {"name": item.get("name", ""), "arguments": item.get("arguments", "")}
        call = {"id": item.get("call_id", ""), "type": "function", "function": function}
        return {"role": "assistant", "content": "", "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output", "")
        return {"role": "tool", "tool_call_id": item.get("call_id", ""), "content": str(output)}
    return {"role": item.get("role", "user"), "content": text_of(item.get("content"))}


class Responses:
    """One engine's Responses API; each family subclass fills in the hooks."""

    def __init__(self, front: Frontend, store: bool) -> None:
        self.front = front
        self.store = store
        self.stored: dict[str, Stored] = {}

    def register(self, add: AddRoute) -> None:
        add("/v1/responses", self.create, methods=["POST"])
        add("/v1/responses/{response_id}", self.retrieve, methods=["GET"])

    # Family hooks -----------------------------------------------------------------------

    def error(self, status: int, message: str, param: str | None = None) -> Response:
        raise NotImplementedError

    def invalid(self, data: Any, message: str) -> Response:
        """A body that is not a Responses request (the engine's validation error)."""
        return self.front.error(400, message)

    def find(self, response_id: str) -> Stored | Response:
        found = self.stored.get(response_id)
        if found is None:
            return self.error(404, f"Response with id '{response_id}' not found.")
        return found

    def replay(self, body: ResponsesRequest, stored: Stored) -> list[JsonDict]:
        """An earlier turn as context: its conversation, then its answer's text."""
        answer = [
            {"role": "assistant", "content": text_of(item.get("content"))}
            for item in stored.response["output"]
            if item.get("type") == "message"
        ]
        return [*stored.messages, *answer]

    def refusal(self, body: ResponsesRequest, chat: ChatRequest) -> Response | None:
        return None

    def tool(self, chat: ChatRequest) -> tuple[str, str] | None:
        return self.front.tool_for(chat)

    def response_id(self, body: ResponsesRequest) -> str:
        return body.request_id or f"resp_{uuid.uuid4().hex}"

    def reply(self, body: ResponsesRequest, work: Work, keep: Keep | None) -> Reply:
        raise NotImplementedError

    # Routes -----------------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        body = await self.front.read_json(request, ResponsesRequest, self.invalid)
        if isinstance(body, Response):
            return body
        history = self._history(body)
        if isinstance(history, Response):
            return history
        chat = self._chat(body, history)
        if isinstance(chat, Response):
            return chat
        refusal = self.refusal(body, chat) or await self.front.admit()
        if refusal is not None:
            return refusal
        front = self.front
        tokens, finish = front.plan_answer(self.tool(chat), body.max_output_tokens)
        work = Work(self.response_id(body), count_prompt_tokens(chat.prompt_text()), tokens, finish)
        reply = self.reply(body, work, self._keeper(body, chat))
        front.submit(work)
        return await front.respond(request, work, bool(body.stream), reply.events, reply.whole)

    async def retrieve(self, request: Request) -> Response:
        found = self.find(request.path_params["response_id"])
        if isinstance(found, Response):
            return found
        return JSONResponse(found.response, headers=self.front.response_headers(request))

    def _history(self, body: ResponsesRequest) -> list[JsonDict] | Response:
        if body.previous_response_id is None:
            return []
        found = self.find(body.previous_response_id)
        return found if isinstance(found, Response) else self.replay(body, found)

    def _chat(self, body: ResponsesRequest, history: list[JsonDict]) -> ChatRequest | Response:
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        try:
            return ChatRequest(
                model=body.model,
                messages=[*system, *history, *input_messages(body.input)],
                tools=body.chat_tools(),
                tool_choice=body.chat_tool_choice(),
                max_tokens=body.max_output_tokens,
            )
        except ValidationError as exc:
            return self.invalid(body, explain(exc))

    def _keeper(self, body: ResponsesRequest, chat: ChatRequest) -> Keep | None:
        """What keeps the response once whole, where the engine keeps it."""
        if not (self.store and body.store):
            return None

        def keep(response: JsonDict) -> None:
            self.stored[str(response["id"])] = Stored(chat.messages, response)

        return keep


class VllmResponses(Responses):
    def __init__(self, front: VllmFrontend) -> None:
        super().__init__(front, store=_flag(os.environ.get(STORE_FLAG)))
        self.vllm = front

    def error(self, status: int, message: str, param: str | None = None) -> Response:
        return self.vllm.error(status, message, "invalid_request_error")

    def refusal(self, body: ResponsesRequest, chat: ChatRequest) -> Response | None:
        unserved = self.vllm.unserved(body.model)
        if unserved is not None:
            return unserved
        if chat.tools and self.vllm.v < VLLM_FUNCTION_TOOLS_FROM:
            return self.vllm.error(
                400, "Tool use is not supported in Responses API without Harmony None"
            )
        prompt, most = count_prompt_tokens(chat.prompt_text()), self.vllm.args.max_model_len
        if prompt >= most:
            return self.error(
                400,
                f"The engine prompt length {prompt} exceeds the max_model_len {most}. "
                "Please reduce prompt.",
            )
        return None

    def tool(self, chat: ChatRequest) -> tuple[str, str] | None:
        args = self.vllm.args
        parses = args.enable_auto_tool_choice and args.tool_call_parser
        if chat.tool_choice in (None, "auto") and not parses:
            return None  # no parser reads the call out of the text
        return super().tool(chat)

    def reply(self, body: ResponsesRequest, work: Work, keep: Keep | None) -> Reply:
        args = self.vllm.args
        room = args.max_model_len - work.prompt_tokens
        limit = room if body.max_output_tokens is None else min(body.max_output_tokens, room)
        call_id = self.vllm.dialect.new_tool_call_id()
        return Reply(body, work, work.rid, args.served_names[0], call_id, keep, limit)


class SglangResponses(Responses):
    def __init__(self, front: SglangFrontend) -> None:
        super().__init__(front, store=True)
        self.sglang = front
        self.fixed = version_tuple(front.version) >= SGLANG_RESPONSES_FIXED

    def error(self, status: int, message: str, param: str | None = None) -> Response:
        inner = {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": status,
        }
        return JSONResponse({"error": inner}, status_code=status)

    def find(self, response_id: str) -> Stored | Response:
        if not response_id.startswith("resp_"):
            return self.error(
                400,
                f"Invalid 'response_id': '{response_id}'. Expected an ID that begins with 'resp'.",
                "response_id",
            )
        found = self.stored.get(response_id)
        if found is None:
            return self.error(404, f"Response with id '{response_id}' not found.", "response_id")
        return found

    def replay(self, body: ResponsesRequest, stored: Stored) -> list[JsonDict]:
        if self.fixed:
            return super().replay(body, stored)
        parts = [
            part
            for item in stored.response["output"]
            if item.get("type") != "reasoning"
            for part in item.get("content") or []
        ]
        return [
            *stored.messages,
            *({"role": "system", "content": body.instructions} for _ in parts),
        ]

    def tool(self, chat: ChatRequest) -> tuple[str, str] | None:
        return super().tool(chat) if self.fixed else None

    def reply(self, body: ResponsesRequest, work: Work, keep: Keep | None) -> Reply:
        call_id = self.sglang.dialect.new_tool_call_id()
        return SglangReply(body, work, work.rid, body.model, call_id, keep, fixed=self.fixed)


class LlamaResponses(Responses):
    def __init__(self, front: LlamaFrontend) -> None:
        super().__init__(front, store=False)
        self.llama = front

    def register(self, add: AddRoute) -> None:
        add("/v1/responses", self.create, methods=["POST"])

    def error(self, status: int, message: str, param: str | None = None) -> Response:
        return self.llama.error(status, message, "invalid_request_error")

    def invalid(self, data: Any, message: str) -> Response:
        if isinstance(data, dict) and "input" not in data:
            message = "'input' is required"
        return self.error(400, message)

    def find(self, response_id: str) -> Stored | Response:
        return self.error(400, "llama.cpp does not support 'previous_response_id'.")

    def refusal(self, body: ResponsesRequest, chat: ChatRequest) -> Response | None:
        return self.llama.check(chat)

    def response_id(self, body: ResponsesRequest) -> str:
        return f"resp_{random_id(32)}"

    def reply(self, body: ResponsesRequest, work: Work, keep: Keep | None) -> Reply:
        model = body.model or self.llama.args.alias or self.llama.args.model
        return LlamaReply(body, work, work.rid, model, self.llama.dialect.new_tool_call_id())


def _flag(value: str | None) -> bool:
    """vLLM's reading of a 0/1 variable."""
    try:
        return bool(int(value or "0"))
    except ValueError:
        return False


def register_vllm(add: AddRoute, front: VllmFrontend) -> None:
    VllmResponses(front).register(add)


def register_sglang(add: AddRoute, front: SglangFrontend) -> None:
    SglangResponses(front).register(add)


def register_llamacpp(add: AddRoute, front: LlamaFrontend) -> None:
    if front.build >= LLAMACPP_RESPONSES_FROM:
        LlamaResponses(front).register(add)
    else:
        add("/v1/responses", llama_not_found, methods=["POST"])
