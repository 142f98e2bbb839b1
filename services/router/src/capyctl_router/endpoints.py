"""The inference endpoints, each declared once: `ENDPOINTS`.

An endpoint's kind (its path after /v1/, a dot for each further slash: "responses",
"messages.count_tokens", "tokenize") is also the API an engine serves it by
(`capycommon.engines.apis`); what the router adds to each is in docs/router.md.

The app builds both of its sides from this table, in one loop (`app._add_router_routes`): the
routes declared to FastAPI, which the OpenAPI document describes, and the table by path that
`RouterApp` serves them from ahead of FastAPI's routing. What an endpoint declares (its
method, the model that checks its body, the api it serves) holds on both, so an endpoint
cannot be served without being described, nor described without being served.
"""

from __future__ import annotations

from dataclasses import dataclass

from capycommon.domain.engines import Api
from capycommon.engines import apis
from capyctl_router.bodies import (
    ChatBody,
    CompletionBody,
    CountTokensBody,
    EmbeddingBody,
    InferenceBody,
    MessagesBody,
    RerankBody,
    ResponsesBody,
    ScoreBody,
    TokenizeBody,
    TranscriptionForm,
)
from capyctl_router.decisions import DecisionsRequest, SystemOneRequest
from capyctl_router.errors import Envelope
from capyctl_router.relay import AnswerKind

# A request body's model: an OpenAI body the router reads a few fields of, or a decision
# request, checked whole.
Body = InferenceBody | DecisionsRequest | SystemOneRequest
# The largest JSON body, and the largest form (OpenAI's limit on an audio file is 25 MB).
MAX_BODY = 4 << 20
MAX_FORM = 32 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """One inference endpoint, as the OpenAPI document describes it and the router serves it."""

    path: str
    method: str = "POST"
    # The request's kind on its way to the engine (`relay.Call.kind`).
    kind: str
    # The model that checks the body before the request takes a place; the document's body.
    body: type[Body]
    # The deployments it serves (their `api`); the others' models it refuses (`wrong_api`).
    api: Api
    # How its request ids begin, as OpenAI's ids for the same answers do.
    id_prefix: str
    summary: str
    # Whether a key given twice in one of the body's objects is refused: System One's
    # question ids are keys, and one given twice would be lost, not refused.
    unique_keys: bool = False
    # How the engine's answer is read (`relay.AnswerKind`).
    answer: AnswerKind = "chat"
    # Whose envelope its errors come in; Anthropic's routes also take the key as x-api-key.
    style: Envelope = "openai"
    # Its body is a multipart form (an audio upload), not JSON.
    form: bool = False
    # The largest body it takes.
    max_body: int = MAX_BODY

    @property
    def name(self) -> str:
        """The route's name, from which FastAPI makes its OpenAPI operation id."""
        return self.kind.replace(".", "_")


def _endpoint(
    path: str,
    body: type[Body],
    api: Api,
    id_prefix: str,
    summary: str,
    *,
    unique_keys: bool = False,
    answer: AnswerKind = "chat",
    style: Envelope = "openai",
    form: bool = False,
    max_body: int = MAX_BODY,
) -> Endpoint:
    """A POST endpoint whose request kind is its path after /v1/, a dot for each further
    slash ("/v1/chat/completions" is "chat.completions", "/tokenize" is "tokenize")."""
    kind = path.removeprefix("/v1/").strip("/").replace("/", ".")
    return Endpoint(
        path=path,
        kind=kind,
        body=body,
        api=api,
        id_prefix=id_prefix,
        summary=summary,
        unique_keys=unique_keys,
        answer=answer,
        style=style,
        form=form,
        max_body=max_body,
    )


ENDPOINTS = (
    _endpoint("/v1/chat/completions", ChatBody, "chat", "chatcmpl", "Chat completions"),
    _endpoint("/v1/completions", CompletionBody, "chat", "cmpl", "Completions"),
    _endpoint(
        "/v1/responses",
        ResponsesBody,
        "chat",
        "resp",
        "Responses (OpenAI's Responses API)",
        answer="events",
    ),
    _endpoint(
        "/v1/messages",
        MessagesBody,
        "chat",
        "msg",
        "Messages (Anthropic's Messages API)",
        answer="events",
        style="anthropic",
    ),
    _endpoint(
        "/v1/messages/count_tokens",
        CountTokensBody,
        "chat",
        "msgtok",
        "A message's input tokens, counted (Anthropic's Messages API)",
        answer="whole",
        style="anthropic",
    ),
    _endpoint("/v1/embeddings", EmbeddingBody, "chat", "embd", "Embeddings", answer="whole"),
    _endpoint(
        "/v1/rerank", RerankBody, "chat", "rerank", "Documents ranked by a query", answer="whole"
    ),
    _endpoint("/v1/score", ScoreBody, "chat", "score", "Pairs of texts scored", answer="whole"),
    _endpoint("/tokenize", TokenizeBody, "chat", "tok", "A text's tokens", answer="whole"),
    _endpoint("/detokenize", TokenizeBody, "chat", "detok", "Tokens' text", answer="whole"),
    _endpoint(
        "/v1/audio/transcriptions",
        TranscriptionForm,
        "chat",
        "trsc",
        "An audio file transcribed (a multipart form)",
        answer="whole",
        form=True,
        max_body=MAX_FORM,
    ),
    _endpoint(
        "/v1/decisions",
        DecisionsRequest,
        "decisions",
        "decision",
        "Decisions, answered by a decision model through System One",
    ),
    _endpoint(
        "/v1/systemone",
        SystemOneRequest,
        "decisions",
        "decision",
        "System One decisions, passed to the decision model as sent",
        unique_keys=True,
    ),
)


def endpoints_of(api: Api, family: str | None, version: str | None) -> list[str]:
    """The paths a model of `api` is served on, where its engine's family and version are
    known (a family alone: what some version of it serves); every path of `api` otherwise."""
    return [
        endpoint.path
        for endpoint in ENDPOINTS
        if endpoint.api == api
        and (family is None or api == "decisions" or apis.serves(family, version, endpoint.kind))
    ]


def serving(api: Api) -> str:
    """The endpoints that serve `api`, as a refusal names them: "POST /v1/a, /v1/b or /v1/c"."""
    *others, last = [endpoint.path for endpoint in ENDPOINTS if endpoint.api == api]
    listed = f"{', '.join(others)} or {last}" if others else last
    return f"POST {listed}"
