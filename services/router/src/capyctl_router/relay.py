"""Talking to an engine: the request rewritten for it, its answer rewritten for the client.

The router always streams from the engine, also for a client that asked for one JSON body,
and assembles that body itself. So it sees the engine's first output (which decides how a
cut request settles) and can close the engine connection the moment a client goes.

Engines answer errors in their own shapes: vLLM nests them (`{"error": {...}}`, from 0.10.1)
or not (`{"object": "error", ...}`, up to 0.10.0), SGLang is flat, llama.cpp nests
`{"code", "message", "type"}`, an auth refusal is `{"error": "Unauthorized"}`, and inside a
stream an error is an event of the same shapes. `engine_failure` and `event_failure` turn
each into one `EngineFailed`: the engine's status and message, in the OpenAI envelope.

An engine on a joined host is reached through the host's ingress (`capycommon.ingress`):
the same request on the same path, naming the instance it was admitted to instead of
carrying the engine's key. The ingress answers `409 stale_dispatch` when that instance no
longer runs there (`is_stale`); anything else is the engine's own answer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from capycommon import ingress
from capycommon.engineclient import Answer
from capycommon.engines import apis
from capycommon.errors import (
    ApiNotServed,
    CacheSaltUnsupported,
    EngineError,
    EngineFailed,
    InvalidRequest,
)
from capyctl_router.decisions import DecisionsRequest, SystemOneRequest, over_limits
from capyctl_router.errors import Envelope
from capyctl_router.forms import Form
from capyctl_router.table import Target

JsonDict = dict[str, Any]
# The one SSE event the router accepts from an engine, and the whole answer it collects.
# The families whose engines keep cached prompts apart by the salt CapyCTL passes them.
SALTED = frozenset({"vllm", "sglang"})
SHOWN = {"llamacpp": "llama.cpp", "tensorfold": "TensorFold", "custom": "a custom engine"}
MAX_EVENT = 1 << 20
MAX_ANSWER = 16 << 20
# What the router reads of an engine's error answer.
MAX_ERROR = 64 << 10


def engine_failure(status: int, raw: bytes) -> EngineFailed:
    """An engine's error answer (an HTTP status of 400 or more) as the client gets it."""
    text = raw.decode(errors="replace").strip()
    try:
        found: object = json.loads(text)
    except json.JSONDecodeError:
        found = None
    message, param, _ = _error_fields(found)
    return _failed(status, message or text[:2000] or f"the engine answered HTTP {status}", param)


# What an engine answers for a route it lacks (FastAPI's, llama.cpp's) or, with 501, for
# one it serves only when started for it (llama.cpp's embeddings and rerank).
ROUTE_MISSING = ("Not Found", "File Not Found")


def api_refused(call: Call, target: Target, status: int, raw: bytes) -> ApiNotServed | None:
    """An engine's answer that it does not serve the request's API (a 404 for a route it
    lacks, a 501 for one its model was not started for) as `capability_missing`; None for
    any other answer. Chat and completions are every engine's: their 404 is the engine's."""
    if call.kind in ("chat.completions", "completions") or status not in (404, 501):
        return None
    failed = engine_failure(status, raw)
    if status == 404 and failed.message not in ROUTE_MISSING:
        return None  # a thing it looked for and did not find: a previous response, a model
    engine = _engine(target.family, target.version)
    return ApiNotServed(
        f"model {call.route!r} runs on {engine}, which answered HTTP {status} to POST "
        f"{call.path} ({failed.message[:300]}): its engine does not serve this API for this "
        "model; start the model for it (for example llama.cpp's --embeddings or --reranking, "
        "vLLM's pooling runner) or send it to a model that serves it",
        api=call.kind,
    )


def is_stale(status: int, raw: bytes) -> bool:
    """Whether an ingress's error answer is its `409 stale_dispatch` (its code in the OpenAI
    envelope, nested or flat)."""
    if status != ingress.STALE_STATUS:
        return False
    try:
        found: object = json.loads(raw)
    except ValueError:  # not JSON, not UTF-8
        return False
    inner = found.get("error", found) if isinstance(found, dict) else None
    return isinstance(inner, dict) and inner.get("code") == ingress.STALE_CODE


def event_failure(event: JsonDict) -> EngineFailed | None:
    """An error event (Responses' and Anthropic's are typed `error`) as a failure with the
    status its `code` names (else 500); None for any other event."""
    if (
        event.get("error") is None
        and event.get("object") != "error"
        and event.get("type") != "error"
    ):
        return None
    message, param, code = _error_fields(event)
    status = code if code is not None and 400 <= code <= 599 else 500
    return _failed(status, message or "the engine sent an error event with no message", param)


def _failed(status: int, message: str, param: str | None) -> EngineFailed:
    if status in (401, 403):  # the engine refused the router's own key: not the client's fault
        return EngineFailed(500, f"the engine refused the router's key (HTTP {status}: {message})")
    return EngineFailed(status, message, param)


def _error_fields(found: object) -> tuple[str | None, str | None, int | None]:
    """(message, param, numeric code) of an engine's error, in any of the families' shapes;
    FastAPI's own `{"detail": ...}` too."""
    if not isinstance(found, dict):
        return None, None, None
    inner = found.get("error", found)
    if isinstance(inner, str):
        return inner, None, None
    if not isinstance(inner, dict):
        return None, None, None
    message = inner.get("message")
    if not isinstance(message, str) and "detail" in found:
        detail = found["detail"]
        message = detail if isinstance(detail, str) else json.dumps(detail)
    param = inner.get("param")
    code = inner.get("code")
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    return (
        message if isinstance(message, str) else None,
        param if isinstance(param, str) else None,
        code if isinstance(code, int) and not isinstance(code, bool) else None,
    )


# The decision routes; both reach the engine's System One route.
DECISION_KINDS = ("decisions", "systemone")
SYSTEMONE_PATH = "/v1/systemone"
# How an engine's answer is read: chunks of choices (chat, completions, a streamed
# transcription), typed events (responses, messages), or one whole answer.
AnswerKind = Literal["chat", "events", "whole"]
# The kinds whose body SGLang takes a request id in (`rid`).
RID_KINDS = frozenset({"chat.completions", "completions", "embeddings"})


@dataclass
class Call:
    """One request on its way to an engine."""

    kind: str  # the endpoint's kind: chat.completions, responses, decisions, ...
    # The body the engine gets (but for its model): the client's, or for decisions the
    # System One translation of `asked`.
    body: JsonDict
    route: str  # the model id the client sent
    request_id: str
    client_streams: bool
    client_usage: bool
    # Set once the engine sent any of its answer (an event, or a JSON body).
    answered: bool = False
    first_output_at: float | None = None
    usage: JsonDict | None = field(default=None)
    # A decision request as the client asked it (an OpenAI one's answer is translated back).
    asked: DecisionsRequest | SystemOneRequest | None = None
    # A streamed request whose client asked to see its model load (`CapyCTL-Progress: on`).
    progress: bool = False
    # The engine's path: the client's, or System One's for a decision request.
    path: str = ""
    answer: AnswerKind = "chat"
    # Whose envelope the client's errors come in.
    style: Envelope = "openai"
    # A multipart body (an audio upload), sent as it came but for its model.
    form: Form | None = None

    @property
    def decides(self) -> bool:
        """Whether it asks a decision model (one System One request to the engine)."""
        return self.kind in DECISION_KINDS

    @property
    def streamed_from_engine(self) -> bool:
        """Whether the engine is asked to stream: always for chunks and typed events (the
        router assembles a JSON body itself); for a whole answer, as the client asked."""
        return self.answer != "whole" or self.client_streams


def salt_digest(deployment: str, revision: int, salt: str) -> str:
    """The cache_salt an engine gets for a client's: 64 hex digits of the deployment, its
    revision and the salt. The same across restarts; another deployment or revision never
    shares a cached prefix with it, even in a shared cache."""
    named = json.dumps(["capyctl cache_salt", deployment, revision, salt]).encode()
    return hashlib.sha256(named).hexdigest()


SHOWN_FAMILIES = {"vllm": "vLLM", "sglang": "SGLang", **SHOWN}


def not_served(route: str, family: str, version: str | None, call: Call) -> ApiNotServed | None:
    """The refusal of a request whose model's engine does not serve its API; None if it
    does (or may: a custom engine, or a version not known yet)."""
    if call.decides or apis.serves(family, version, call.kind):
        return None
    shown = SHOWN_FAMILIES.get(family, family)
    first = apis.since(family, call.kind)
    later = (
        f"{shown} serves it from {first}: upgrade the engine, or serve the model elsewhere"
        if first
        else f"{shown} serves it in no version: serve the model on an engine that does"
    )
    return ApiNotServed(
        f"model {route!r} runs on {_engine(family, version)}, which does not serve POST "
        f"{call.path}; {later} "
        "(GET /v1/models lists each model's endpoints)",
        api=call.kind,
    )


def _engine(family: str, version: str | None) -> str:
    """An engine as a refusal names it: "vLLM 0.11.0", or its family alone."""
    shown = SHOWN_FAMILIES.get(family, family)
    return f"{shown} {version}" if version else shown


def engine_request(call: Call, target: Target) -> tuple[bytes, dict[str, str], str]:
    """The body, headers and content type the engine gets (`engine_body`); a multipart
    form as it came, but for its model, the engine's served name. A request for an API
    the engine does not serve is refused here, before it is sent."""
    refused = not_served(call.route, target.family, target.version, call)
    if refused is not None:
        raise refused
    if call.form is not None:
        body = call.form.with_field("model", target.served_name)
        return body, _headers(call, target), call.form.content_type
    found, headers = decision_request(call, target) if call.decides else engine_body(call, target)
    return dumps(found), headers, "application/json"


def engine_body(call: Call, target: Target) -> tuple[JsonDict, dict[str, str]]:
    """The JSON body and headers the engine gets: its served name, always streamed (chat
    with usage) but for an answer that is one JSON body, the request id where the family
    takes one, the per-launch key (behind an ingress, the instance the request was admitted
    to: the ingress adds the key), and a client's cache_salt as its digest (`salt_digest`);
    llama.cpp, which has no cache_salt, is refused one, and so is SGLang with LMCache, whose
    cache drops it."""
    body = {**call.body, "model": target.served_name}
    headers = _headers(call, target)
    if call.answer != "whole":
        body["stream"] = True
    if call.answer == "chat":
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True
        body["stream_options"] = options
    if target.family == "sglang" and call.kind in RID_KINDS:
        body["rid"] = call.request_id
    salt = body.get("cache_salt")
    if isinstance(salt, str):
        if target.family not in SALTED:
            shown = SHOWN.get(target.family, target.family)
            raise CacheSaltUnsupported(
                f"deployment {target.deployment!r} runs on {shown}, which CapyCTL cannot make "
                "keep cached prompts apart by cache_salt; drop cache_salt, or serve the model on "
                "vLLM or SGLang"
            )
        if target.family == "sglang" and target.lmcache:
            raise CacheSaltUnsupported(
                f"deployment {target.deployment!r} runs on SGLang with LMCache, which keys "
                "cached prompts by their tokens alone, so requests with other salts would share "
                "them; drop cache_salt, or set lmcache: off on the deployment"
            )
        body["cache_salt"] = salt_digest(target.deployment, target.revision, salt)
    return body, headers


def decision_request(call: Call, target: Target) -> tuple[JsonDict, dict[str, str]]:
    """A decision request's System One body and headers: the engine's served name, nothing
    else changed. More questions or options than the engine takes are refused here. A
    cache_salt is refused on llama.cpp, as for chat; SGLang runs decision models with its
    radix cache off, so no prompt is shared with another request at all."""
    asked = call.asked
    assert asked is not None
    too_many = over_limits(asked, target.family)
    if too_many is not None:
        raise InvalidRequest(f"questions: {too_many}; ask fewer in one request")
    salt = asked.cache_salt if isinstance(asked, DecisionsRequest) else None
    if salt is not None and target.family == "llamacpp":
        raise CacheSaltUnsupported(
            f"deployment {target.deployment!r} runs on llama.cpp, which cannot keep cached "
            "prompts apart by cache_salt; drop cache_salt"
        )
    body = {**call.body, "model": target.served_name}
    body.pop("cache_salt", None)
    return body, _headers(call, target)


def _headers(call: Call, target: Target) -> dict[str, str]:
    """The request id, and the per-launch key (behind an ingress, the instance the request
    was admitted to: the ingress adds the key)."""
    if target.ingress is None:
        return {"Authorization": f"Bearer {target.secret}", "X-Request-Id": call.request_id}
    return {
        ingress.DEPLOYMENT_HEADER: target.deployment,
        ingress.INSTANCE_HEADER: "0",
        ingress.GENERATION_HEADER: str(target.generation),
        "X-Request-Id": call.request_id,
    }


class Events:
    """The engine's SSE events as JSON, read from its answer as they arrive. A line
    `error: {...}` (some llama.cpp builds) is an error event too."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self._lines: list[bytes] = []
        self._partial = b""
        self._size = 0
        self._ended = False

    @property
    def ready(self) -> bool:
        """Whether `next` would answer at once: an event in hand (looking at what arrived,
        without waiting), or the answer's end."""
        if not self._lines and (chunk := self.answer.take()):
            self._absorb(chunk)
        return bool(self._lines) or self._ended or self.answer.over

    async def next(self, until: float) -> JsonDict | None:
        """The next event; None at `[DONE]` or at the answer's end. TimeoutError if it has
        not come by `until` (time.monotonic)."""
        while True:
            if self._lines:
                line = self._lines.pop()
                if line.startswith(b"error:"):
                    return _error_line(line[6:].strip().decode(errors="replace"))
                data = line[5:].strip()
                if data == b"[DONE]":
                    await self._to_end(until)
                    return None
                return self._event(data)
            if self._ended:
                return None
            chunk = await self.answer.receive(until)
            if chunk:
                self._absorb(chunk)
            else:
                self._ended = True
                if self._partial:
                    self._absorb(b"\n")

    def _absorb(self, chunk: bytes) -> None:
        """Take in a piece of the answer: its complete lines that are events, kept in
        order (popped from the end), the rest until its line ends."""
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_EVENT:
            raise _over_limits()
        events = [line for line in lines if line.startswith((b"data:", b"error:"))]
        events.reverse()
        self._lines = events + self._lines

    async def _to_end(self, until: float) -> None:
        """Read to the body's end (its last chunk follows at once), so that the engine
        connection goes back to the pool instead of being closed with the answer."""
        self._lines = []
        while not self._ended and await self.answer.receive(until):
            pass
        self._ended = True

    def _event(self, data: bytes) -> JsonDict:
        self._size += len(data)
        if len(data) > MAX_EVENT or self._size > MAX_ANSWER:
            raise _over_limits()
        try:
            event = loads(data)
        except ValueError:
            raise EngineError(
                f"the engine sent an event that is not JSON: {data[:200]!r}"
            ) from None
        if not isinstance(event, dict):
            raise EngineError("the engine sent an event that is not a JSON object")
        return event


def _over_limits() -> EngineError:
    return EngineError(
        "the engine's answer is over the router's limits (1 MiB an event, 16 MiB in all)"
    )


def loads(data: bytes | str) -> Any:
    """JSON, by orjson; by the standard parser what orjson refuses and it takes (NaN, an
    integer past 64 bits), as engines written in Python may send."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def dumps(value: Any) -> bytes:
    """JSON, by orjson; by the standard encoder what orjson cannot write (an integer past 64
    bits, which a client's body may hold)."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, ensure_ascii=False).encode()


def _error_line(data: str) -> JsonDict:
    try:
        found: object = json.loads(data)
    except json.JSONDecodeError:
        found = data
    if isinstance(found, dict) and "error" in found:
        return found
    return {"error": found if isinstance(found, dict) else {"message": str(found)}}
