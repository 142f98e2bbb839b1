"""Tokenize and detokenize as each family answers them.

The simulated tokenizer cuts a text into pieces of 4 characters (the prompt count every
answer's usage reports, `openai_chat.CHARS_PER_TOKEN`; no special tokens are added). A
piece's id is a stable hash of it below the vocabulary size, the same in every engine and
run; each engine maps the pieces it has tokenized back, so detokenizing what it tokenized
gives the text again, and an id it never made reads as `<|id|>`. Neither route runs a request
in the engine (the real ones only call the tokenizer), so neither is counted in the metrics.

- vLLM (every version): POST /tokenize (`prompt`, or chat `messages`) -> `count`,
  `max_model_len`, `tokens`, `token_strs` (with `return_token_strs`); POST /detokenize
  (`tokens`) -> `prompt`. A model it does not serve is a 404. Neither path is under an
  API-key prefix, so neither needs the key.
- SGLang from 0.5.3.post1: POST /tokenize and /v1/tokenize (`prompt`, a text or a list of
  them, or `messages`) -> `tokens`, `count`, `max_model_len`; POST /detokenize and
  /v1/detokenize (`tokens`, a list or a list of lists) -> `text`. JSON bodies only; any model
  name is taken. Earlier releases have no such route (FastAPI's 404).
- llama.cpp (every build): POST /tokenize (`content`, `with_pieces`) -> `tokens` (ids, or
  `{id, piece}`); POST /detokenize (`tokens`) -> `content`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pydantic import model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from enginesim.api_common import AddRoute, at_least
from enginesim.bodies import Tolerant
from enginesim.openai_chat import CHARS_PER_TOKEN, ChatRequest, JsonDict
from enginesim.serving import Frontend

if TYPE_CHECKING:
    from enginesim.llamacpp_app import LlamaFrontend
    from enginesim.sglang_app import SglangFrontend
    from enginesim.vllm_app import VllmFrontend

VOCAB_SIZE = 151936
SGLANG_TOKENIZE_FROM = "0.5.3.post1"
FrontT = TypeVar("FrontT", bound=Frontend)


class Vocabulary:
    """The simulated tokenizer of one engine (see the module's docstring)."""

    def __init__(self) -> None:
        self._pieces: dict[int, str] = {}

    def encode(self, text: str) -> list[tuple[int, str]]:
        """(id, piece) for each 4-character piece of `text`."""
        found = []
        for start in range(0, len(text), CHARS_PER_TOKEN):
            piece = text[start : start + CHARS_PER_TOKEN]
            digest = hashlib.sha256(piece.encode()).digest()
            token = int.from_bytes(digest[:4], "big") % VOCAB_SIZE
            self._pieces[token] = piece
            found.append((token, piece))
        return found

    def ids(self, text: str) -> list[int]:
        return [token for token, _ in self.encode(text)]

    def decode(self, tokens: list[int]) -> str:
        return "".join(self._pieces.get(token, f"<|{token}|>") for token in tokens)


class _Tokenizer(Generic[FrontT]):
    """One family's two routes, on one engine's vocabulary."""

    def __init__(self, front: FrontT) -> None:
        self.front = front
        self.vocab = Vocabulary()

    def register(self, add: AddRoute, prefixes: Sequence[str] = ("",)) -> None:
        for prefix in prefixes:
            add(f"{prefix}/tokenize", self.tokenize, methods=["POST"])
            add(f"{prefix}/detokenize", self.detokenize, methods=["POST"])

    async def tokenize(self, request: Request) -> Response:
        raise NotImplementedError

    async def detokenize(self, request: Request) -> Response:
        raise NotImplementedError


class _Tokenize(Tolerant):
    """A text (`prompt`) or a chat (`messages`), as vLLM's and SGLang's tokenize read them."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[JsonDict] | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_input(self) -> _Tokenize:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("Exactly one of 'prompt' or 'messages' must be provided.")
        return self

    def texts(self) -> list[str] | str:
        if self.messages is not None:
            return ChatRequest.model_validate({"messages": self.messages}).prompt_text()
        assert self.prompt is not None
        return self.prompt


class _Detokenize(Tolerant):
    model: str | None = None
    tokens: list[int] | list[list[int]]


# vLLM -----------------------------------------------------------------------------------


class VllmTokenizer(_Tokenizer["VllmFrontend"]):
    def _text(self, body: _Tokenize) -> str | Response:
        """The one text (not a batch) it tokenizes, for a model it serves."""
        text = body.texts()
        if not isinstance(text, str):
            return self.front.error(400, "prompt: Input should be a valid string")
        return self.front.unserved(body.model) or text

    async def tokenize(self, request: Request) -> Response:
        body = await self.front.read_json(request, _Tokenize)
        if isinstance(body, Response):
            return body
        text = self._text(body)
        if isinstance(text, Response):
            return text
        pieces = self.vocab.encode(text)
        return JSONResponse(
            {
                "count": len(pieces),
                "max_model_len": self.front.args.max_model_len,
                "tokens": [token for token, _ in pieces],
                "token_strs": [piece for _, piece in pieces] if body.return_token_strs else None,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        body = await self.front.read_json(request, _Detokenize)
        if isinstance(body, Response):
            return body
        if any(isinstance(token, list) for token in body.tokens):
            return self.front.error(400, "tokens: Input should be a valid integer")
        refusal = self.front.unserved(body.model)
        if refusal is not None:
            return refusal
        return JSONResponse({"prompt": self.vocab.decode(_flat(body.tokens))})


def register_vllm(add: AddRoute, front: VllmFrontend) -> None:
    VllmTokenizer(front).register(add)


# SGLang ---------------------------------------------------------------------------------


class SglangTokenizer(_Tokenizer["SglangFrontend"]):
    async def tokenize(self, request: Request) -> Response:
        body = await self.front.read_json(request, _Tokenize)
        if isinstance(body, Response):
            return body
        text = body.texts()
        tokens: Any
        if isinstance(text, str):
            tokens = self.vocab.ids(text)
            count: Any = len(tokens)
        else:
            tokens = [self.vocab.ids(one) for one in text]
            count = [len(ids) for ids in tokens]
        limit = self.front.args.context_length
        return JSONResponse({"tokens": tokens, "count": count, "max_model_len": limit})

    async def detokenize(self, request: Request) -> Response:
        body = await self.front.read_json(request, _Detokenize)
        if isinstance(body, Response):
            return body
        tokens = body.tokens
        if tokens and isinstance(tokens[0], list):
            texts = [self.vocab.decode(one) for one in tokens if isinstance(one, list)]
            return JSONResponse({"text": texts})
        return JSONResponse({"text": self.vocab.decode(_flat(tokens))})


def register_sglang(add: AddRoute, front: SglangFrontend) -> None:
    if at_least(front.version, SGLANG_TOKENIZE_FROM):
        SglangTokenizer(front).register(add, ("", "/v1"))


# llama.cpp ------------------------------------------------------------------------------


class _LlamaTokenize(Tolerant):
    content: str | None = None
    with_pieces: bool = False


class _LlamaDetokenize(Tolerant):
    tokens: list[int] | None = None


class LlamaTokenizer(_Tokenizer["LlamaFrontend"]):
    async def tokenize(self, request: Request) -> Response:
        body = await self.front.read_json(request, _LlamaTokenize)
        if isinstance(body, Response):
            return body
        pieces = self.vocab.encode(body.content or "")
        tokens: list[Any] = [token for token, _ in pieces]
        if body.with_pieces:
            tokens = [{"id": token, "piece": piece} for token, piece in pieces]
        return JSONResponse({"tokens": tokens})

    async def detokenize(self, request: Request) -> Response:
        body = await self.front.read_json(request, _LlamaDetokenize)
        if isinstance(body, Response):
            return body
        return JSONResponse({"content": self.vocab.decode(body.tokens or [])})


def register_llamacpp(add: AddRoute, front: LlamaFrontend) -> None:
    LlamaTokenizer(front).register(add)


def _flat(tokens: list[int] | list[list[int]]) -> list[int]:
    return [token for token in tokens if isinstance(token, int)]
