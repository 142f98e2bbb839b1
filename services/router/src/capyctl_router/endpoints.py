"""The inference endpoints, each declared once: `ENDPOINTS`.

The app builds both of its sides from this table, in one loop (`app._add_router_routes`): the
routes declared to FastAPI, which the OpenAPI document describes, and the table by path that
`RouterApp` serves them from ahead of FastAPI's routing. What an endpoint declares (its
method, the model that checks its body, the api it serves) holds on both, so an endpoint
cannot be served without being described, nor described without being served.
"""

from __future__ import annotations

from dataclasses import dataclass

from capycommon.domain.engines import Api
from capyctl_router.bodies import ChatBody, CompletionBody, EmbeddingBody, InferenceBody
from capyctl_router.decisions import DecisionsRequest, SystemOneRequest

# A request body's model: an OpenAI body the router reads a few fields of, or a decision
# request, checked whole.
Body = InferenceBody | DecisionsRequest | SystemOneRequest


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
) -> Endpoint:
    """A POST endpoint whose request kind is its path after /v1/, a dot for each further
    slash ("/v1/chat/completions" is "chat.completions")."""
    kind = path.removeprefix("/v1/").replace("/", ".")
    return Endpoint(
        path=path,
        kind=kind,
        body=body,
        api=api,
        id_prefix=id_prefix,
        summary=summary,
        unique_keys=unique_keys,
    )


ENDPOINTS = (
    _endpoint("/v1/chat/completions", ChatBody, "chat", "chatcmpl", "Chat completions"),
    _endpoint("/v1/completions", CompletionBody, "chat", "cmpl", "Completions"),
    _endpoint("/v1/embeddings", EmbeddingBody, "chat", "embd", "Embeddings"),
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


def serving(api: Api) -> str:
    """The endpoints that serve `api`, as a refusal names them: "POST /v1/a, /v1/b or /v1/c"."""
    *others, last = [endpoint.path for endpoint in ENDPOINTS if endpoint.api == api]
    listed = f"{', '.join(others)} or {last}" if others else last
    return f"POST {listed}"
