"""Request bodies read strictly, for the inference and the management API alike.

A client's mistake is a 400 that names it, found before anything acts on the request: the
router takes no place for it, the scheduler claims no Idempotency-Key. The body is read
within a size bound, an idle bound (a body shorter than its Content-Length ends in a 400, not
in a held connection) and a bound on its whole reading (a body trickled a byte at a time ends
in a 408 request_timeout), then parsed as strict JSON: UTF-8 only, no lone surrogate, no NaN
or Infinity, no number that would not survive being written out again, no nesting deeper
than MAX_DEPTH. What passes, any JSON writer can write again, so nothing in it can fail once
the request is admitted (an engine's request body is such a writer's output).

The models of the bodies (pydantic, with their descriptions) check the fields' types; an
error names each wrong field, what is wrong, and what the field takes.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request, params
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from pydantic_core import ErrorDetails

from capycommon.errors import BodyTooLarge, InvalidRequest, RequestTimeout
from capycommon.version import __version__

# No request of ours nests deeper; a tool's JSON schema rarely passes 10 levels.
MAX_DEPTH = 64
# No engine takes a longer integer (a seed is 64 bits, 20 digits); Python refuses to convert
# one of more than 4,300 digits at all.
MAX_DIGITS = 100
# A client that sends nothing of its body for this long is refused, not waited for.
READ_IDLE_S = 5.0
# The longest a whole body may take to arrive, unless the caller says (the inference
# listener's body_timeout): 4 MiB at 1 Mbit/s take 34 s.
READ_TOTAL_S = 60.0
# One lone UTF-16 surrogate: JSON lets `\ud800` be written, UTF-8 cannot carry it.
_SURROGATE = re.compile("[\ud800-\udfff]")
M = TypeVar("M", bound=BaseModel)
App = TypeVar("App", bound=FastAPI)


async def read(request: Request, limit: int, total_s: float = READ_TOTAL_S) -> bytes:
    """The whole body, at most `limit` bytes (else 413 body_too_large), each part coming within
    READ_IDLE_S of the one before (else 400: the body is shorter than it said), all of it
    within `total_s` (else 408 request_timeout)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(_too_large(limit))
    body = bytearray()
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(total_s) as whole:
            async with asyncio.timeout(READ_IDLE_S) as idle:
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > limit:
                        raise BodyTooLarge(_too_large(limit))
                    idle.reschedule(loop.time() + READ_IDLE_S)
    except TimeoutError:
        announced = f" of the {declared} its Content-Length announced" if declared else ""
        if whole.expired():
            raise RequestTimeout(
                f"the body took longer than {total_s:g} s to arrive ({len(body)} bytes"
                f"{announced} came); send it whole within that"
            ) from None
        raise InvalidRequest(
            f"the body stopped after {len(body)} bytes{announced} (nothing came for "
            f"{READ_IDLE_S:g} s); send the whole body"
        ) from None
    return bytes(body)


def _too_large(limit: int) -> str:
    return f"the body is over {limit >> 20} MiB"


def parse_object(raw: bytes, unique_keys: bool = False) -> dict[str, Any]:
    """The body as a JSON object, parsed strictly; an error names what is wrong and where.
    With `unique_keys`, a key given twice in one object is refused too (JSON keeps the last
    one silently; where keys are ids, as System One's questions, that loses one)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(
            f"the body is not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
            "send JSON encoded as UTF-8"
        ) from None
    try:
        found = _load(text, unique_keys)
    except RecursionError:
        raise InvalidRequest(f"the body: {_too_deep()}") from None
    except _Twice as twice:
        raise InvalidRequest(
            f"the body gives the key {twice.key!r} twice in one object; give each once"
        ) from None
    except ValueError as exc:  # the parser's JSONDecodeError, and anything else it raises
        raise InvalidRequest(f"the body is not JSON ({exc}); send one JSON object") from None
    if not isinstance(found, dict):
        raise InvalidRequest(f"the body is a JSON {_kind(found)}; send one JSON object")
    try:
        _check(found, 1)
    except _Refusal as refusal:
        raise InvalidRequest(f"{_dotted(reversed(refusal.path))}: {refusal.what}") from None
    return found


def validated(model: type[M], body: dict[str, Any]) -> M:
    """The body as its model; every wrong field is named, with what is wrong and what the
    field takes (its description), in one 400 invalid_request."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        problems: dict[str, str] = {}  # one a place: each member of a union fails there
        for error in exc.errors(include_url=False):
            path = _located(error["loc"], body)
            problems.setdefault(path, _problem(model, path, error))
        raise InvalidRequest("; ".join(problems.values())) from None


# pydantic's words for a JSON body's types.
_REASONS = {
    "model_type": "should be a JSON object",
    "dict_type": "should be a JSON object",
    "list_type": "should be a JSON array",
}


def _problem(model: type[BaseModel], path: str, error: ErrorDetails) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"unknown field {path!r}; remove it or correct its spelling"
    if kind == "value_error":  # the model's own words, fix included
        return f"{path}: {error['msg'].removeprefix('Value error, ')}"
    said = (
        f"{path} is required"
        if kind == "missing"
        else f"{path}: {_REASONS.get(kind, error['msg'])}"
    )
    name = str(error["loc"][0]) if error["loc"] else ""
    field = model.model_fields.get(name)
    if field is None or field.description is None:
        return said
    return f"{said}; {name} takes {field.description}"


# Parsing --------------------------------------------------------------------------------


class _Refused:
    """A number the parser met that a strict body refuses; the check names its field."""

    def __init__(self, what: str) -> None:
        self.what = what


class _Refusal(Exception):
    """What is wrong, and its path, gathered innermost first on the way out."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what
        self.path: list[str | int] = []


class _Twice(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _Twice(key)
        found[key] = value
    return found


def _load(text: str, unique_keys: bool = False) -> object:
    """The JSON in `text`, numbers it refuses kept as `_Refused`. Integers are the C parser's
    own; one past Python's bound (4,300 digits) fails it, and a second pass, integers by
    `_integer`, finds where (a body with one is hostile: it may wait)."""
    hook = _unique if unique_keys else None
    try:
        return json.loads(text, parse_float=_real, parse_constant=_constant, object_pairs_hook=hook)
    except json.JSONDecodeError:
        raise
    except ValueError:
        return json.loads(
            text,
            parse_int=_integer,
            parse_float=_real,
            parse_constant=_constant,
            object_pairs_hook=hook,
        )


def _integer(text: str) -> int | _Refused:
    digits = len(text.lstrip("-"))
    return _Refused(_too_long(digits)) if digits > MAX_DIGITS else int(text)


def _real(text: str) -> float | _Refused:
    value = float(text)
    if math.isinf(value):
        shown = text if len(text) <= 24 else f"{text[:20]}..."
        return _Refused(f"{shown} is beyond a 64-bit float; send a smaller number")
    return value


def _constant(text: str) -> _Refused:
    return _Refused(f"{text} is not JSON; send a number, or null")


def _too_long(digits: int) -> str:
    return f"an integer of {digits} digits; send at most {MAX_DIGITS}"


_LIMIT = 10**MAX_DIGITS


def _check(node: dict[str, Any] | list[Any], depth: int) -> None:
    """Refuse, in `node` and all it holds, nesting past MAX_DEPTH, a lone surrogate, an
    integer past MAX_DIGITS and what the parser kept for refusal. A body may hold a million
    numbers: a plain one costs a type test."""
    if depth > MAX_DEPTH:
        raise _Refusal(_too_deep())
    items: Iterable[tuple[str | int, object]]
    if isinstance(node, dict):
        for key in node:
            _check_text(key, "a key")
        items = node.items()
    else:
        items = enumerate(node)
    for place, item in items:
        if type(item) is int:
            if -_LIMIT < item < _LIMIT:
                continue
        elif type(item) is str:
            if item.isascii():
                continue
        elif not isinstance(item, dict | list | _Refused):
            continue  # a float (the parser kept the infinite ones for refusal), a bool, null
        try:
            _check_item(item, depth + 1)
        except _Refusal as refusal:
            refusal.path.append(place)
            raise


def _check_item(item: object, depth: int) -> None:
    if isinstance(item, dict | list):
        _check(item, depth)
    elif isinstance(item, str):
        _check_text(item, "text")
    elif isinstance(item, int):
        raise _Refusal(_too_long(len(str(abs(item)))))
    elif isinstance(item, _Refused):
        raise _Refusal(item.what)


def _check_text(text: str, what: str) -> None:
    if not text.isascii() and (found := _SURROGATE.search(text)) is not None:
        raise _Refusal(
            f"{what} holds a lone surrogate (\\u{ord(found.group()):04x}), which is not "
            "Unicode; escape a character beyond U+FFFF as its surrogate pair, or send it as "
            "UTF-8"
        )


def _too_deep() -> str:
    return f"nested deeper than {MAX_DEPTH} levels; send a flatter body"


def _kind(value: object) -> str:
    names = {list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _dotted(path: Iterable[str | int]) -> str:
    """('messages', 0, 'content') -> messages[0].content; the top level is `the body`."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text or "the body"


def _located(loc: tuple[int | str, ...], body: object) -> str:
    """A validation error's place in the body. The location pydantic gives also names the
    member of a union that failed (`prompt.str`): only steps that exist in the body count,
    and a missing field last of all."""
    steps: list[int | str] = []
    node = body
    for index, part in enumerate(loc):
        found, child = _child(node, part)
        if found or (isinstance(node, dict) and index == len(loc) - 1):
            steps.append(part)
            node = child
    return _dotted(steps)


def _child(node: object, part: int | str) -> tuple[bool, object]:
    """Whether `node` has `part` (a key, an index), and what is there."""
    if isinstance(node, dict) and part in node:
        return True, node[part]
    if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
        return True, node[part]
    return False, None


# Describing -----------------------------------------------------------------------------

_SCHEMAS = "#/components/schemas/"


def openapi_body(
    model: type[BaseModel], required: bool = True, files: Sequence[str] = ()
) -> dict[str, Any]:
    """A route's `openapi_extra` when it reads its body itself: the body `model` describes
    as JSON; with `files`, a multipart form of the model's fields and those file parts."""
    schema: dict[str, Any] = {"$ref": f"{_SCHEMAS}{model.__name__}"}
    if not files:
        content = {"application/json": {"schema": schema}}
        return {"requestBody": {"required": required, "content": content}}
    parts = {name: {"type": "string", "format": "binary"} for name in files}
    form = {"allOf": [schema, {"type": "object", "required": list(files), "properties": parts}]}
    return {
        "requestBody": {"required": required, "content": {"multipart/form-data": {"schema": form}}}
    }


def new_app(kind: type[App], title: str, **options: Any) -> App:
    """An app of `kind` (FastAPI or a subclass) at CapyCTL's version, without FastAPI's own
    documentation routes (/docs, /redoc, /openapi.json), which would be open to all: an app
    publishes its document itself (`publish_openapi`), behind the dependencies it chooses,
    or not at all."""
    return kind(
        title=title,
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        **options,
    )


def publish_openapi(
    app: FastAPI,
    path: str,
    bodies: Iterable[type[BaseModel]],
    dependencies: Sequence[params.Depends] = (),
) -> None:
    """Serve the app's OpenAPI document at `path`, behind the app's own dependencies and
    `dependencies` (none: open to all), built on its first request when every route is
    there."""
    models = tuple(bodies)

    async def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app, models)
        return app.openapi_schema

    app.add_api_route(
        path, openapi, methods=["GET"], include_in_schema=False, dependencies=dependencies
    )


def openapi_document(app: FastAPI, bodies: Iterable[type[BaseModel]]) -> dict[str, Any]:
    """The app's OpenAPI document: its routes, the models of the bodies they read themselves,
    and the bearer token they take (a route that takes none says `security: []`)."""
    document = get_openapi(title=app.title, version=app.version, routes=app.routes)
    _, found = models_json_schema(
        [(model, "validation") for model in bodies], ref_template=_SCHEMAS + "{model}"
    )
    components = document.setdefault("components", {})
    components.setdefault("schemas", {}).update(found.get("$defs", {}))
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    document["security"] = [{"bearer": []}]
    return document
