"""Rerank and score as each family answers them, and the embeddings llama.cpp and SGLang serve
only when started for them.

A rerank, a score, or an embedding of SGLang or llama.cpp, is one request in the engine with
no tokens to generate: it waits for a slot, counts as running and in the family's metrics (its
prompt: every text or pair of texts, 4 characters a token), and a client that goes away aborts
it as the family aborts a request. A pair's relevance is the cosine of the two texts'
simulated embeddings (`serving.embedding_of`) taken to 0..1, so rerank, score and
/v1/embeddings agree; SGLang's label probabilities are a digest of the item's prompt and the
label.

- vLLM (every version; the served model is taken to be a pooling model): POST /rerank,
  /v1/rerank, /v2/rerank -> `{id: rerank-<X-Request-Id or random>, model, usage:
  {total_tokens}, results: [{index, document: {text, multi_modal}, relevance_score}]}`, best
  first, cut to `top_n` when it is above 0; POST /score, /v1/score (`text_1`, `text_2`: 1:1,
  1:N or N:N) -> `{id: score-..., object: list, created, model, data: [{index, object: score,
  score}], usage}`. A model it does not serve is a 404; only the /v1 and /v2 paths need the key.
- SGLang (every version run): POST|PUT /v1/rerank answers a bare list of `{score, document,
  index, meta_info}`, best first (`top_n`, `return_documents`), and only for a model served
  with --is-embedding: without it the tokenizer manager's 400; POST /v1/score (`query`,
  `items`, `label_token_ids`, `apply_softmax`, `item_first`) -> `{scores: [[p per label] per
  item], model, usage: null, object: scoring}`; /v1/embeddings only with --is-embedding.
- llama.cpp: /rerank, /reranking, /v1/rerank, /v1/reranking (Jina's shape, or TEI's bare list
  when the body names `texts`) only with --reranking (or --embeddings --pooling rank), else
  501; /v1/embeddings and /embeddings only with --embeddings (or --reranking), else 501, and
  /v1/embeddings with --pooling none is a 400. It has no score route: /score and /v1/score
  answer its 404.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from enginesim.api_common import AddRoute, llama_not_found, request_base, run
from enginesim.bodies import Tolerant
from enginesim.openai_chat import EmbeddingRequest, JsonDict, count_prompt_tokens
from enginesim.serving import Frontend, embedding_of
from enginesim.tokenize_api import VOCAB_SIZE

if TYPE_CHECKING:
    from enginesim.llamacpp_app import LlamaFrontend
    from enginesim.sglang_app import SglangFrontend
    from enginesim.vllm_app import VllmFrontend

NOT_EMBEDDING = (
    "This model does not appear to be an embedding model by default. "
    "Please add `--is-embedding` when launching the server or try another model."
)


def relevance(query: str, document: str) -> float:
    cosine = sum(a * b for a, b in zip(embedding_of(query), embedding_of(document), strict=True))
    return round(min(1.0, max(0.0, (1 + cosine) / 2)), 6)


def pair_tokens(pairs: list[tuple[str, str]]) -> int:
    return sum(count_prompt_tokens(first) + count_prompt_tokens(second) for first, second in pairs)


def label_probabilities(prompt: str, labels: list[int], softmax: bool) -> list[float]:
    """Each label's probability as the next token: half the mass over the labels, or all of
    it with `softmax` (normalised over them)."""
    weights = [1 + hashlib.sha256(f"{prompt}\x00{label}".encode()).digest()[0] for label in labels]
    total = sum(weights) * (1 if softmax else 2)
    return [round(weight / total, 6) for weight in weights]


async def counted_embeddings(front: Frontend, request: Request) -> Response:
    """`Frontend.embeddings` run as one request in the engine (its inputs the prompt), so
    that it is counted and waits for a slot as the engine's embeddings do."""
    body = await front.read_json(request, EmbeddingRequest)
    if isinstance(body, Response):
        return body
    texts = [body.input] if isinstance(body.input, str) else body.input
    tokens = sum(count_prompt_tokens(str(text)) for text in texts)
    work = await run(front, request, f"embd-{uuid.uuid4().hex}", tokens)
    return work if isinstance(work, Response) else await front.embeddings(request)


# vLLM -----------------------------------------------------------------------------------


class _VllmPooled(Tolerant):
    model: str | None = None


VllmBody = TypeVar("VllmBody", bound=_VllmPooled)


class _VllmRerank(_VllmPooled):
    query: str
    documents: list[str]
    top_n: int = 0


class _VllmScore(_VllmPooled):
    text_1: str | list[str]
    text_2: str | list[str]


def vllm_pairs(first: list[str], second: list[str]) -> list[tuple[str, str]] | str:
    """vLLM's pairing of the two inputs, or why it refuses them."""
    if len(first) > 1 and len(first) != len(second):
        return "Input lengths must be either 1:1, 1:N or N:N"
    if not first:
        return "At least one text element must be given"
    if not second:
        return "At least one text_pair element must be given"
    return list(zip(first * len(second) if len(first) == 1 else first, second, strict=True))


class VllmPooling:
    def __init__(self, front: VllmFrontend) -> None:
        self.front = front

    async def _read(
        self, request: Request, model: type[VllmBody]
    ) -> tuple[VllmBody, str] | Response:
        """The body as `model`, and the name of the served model it asks for (or the 404)."""
        body = await self.front.read_json(request, model)
        if isinstance(body, Response):
            return body
        if body.model is None:
            return body, self.front.args.served_names[0]
        return self.front.unserved(body.model) or (body, body.model)

    async def rerank(self, request: Request) -> Response:
        read = await self._read(request, _VllmRerank)
        if isinstance(read, Response):
            return read
        body, name = read
        pairs = vllm_pairs([body.query], body.documents)
        if isinstance(pairs, str):
            return self.front.error(400, pairs)
        rid = f"rerank-{request_base(request)}"
        work = await run(self.front, request, rid, pair_tokens(pairs))
        if isinstance(work, Response):
            return work
        results: list[JsonDict] = [
            {
                "index": i,
                "document": {"text": doc, "multi_modal": None},
                "relevance_score": relevance(body.query, doc),
            }
            for i, doc in enumerate(body.documents)
        ]
        results.sort(key=lambda result: -float(result["relevance_score"]))
        if 0 < body.top_n < len(results):
            results = results[: body.top_n]
        usage = {"total_tokens": work.prompt_tokens}
        answer = {"id": rid, "model": name, "usage": usage, "results": results}
        return JSONResponse(answer, headers=self.front.response_headers(request))

    async def score(self, request: Request) -> Response:
        read = await self._read(request, _VllmScore)
        if isinstance(read, Response):
            return read
        body, name = read
        first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        pairs = vllm_pairs(first, second)
        if isinstance(pairs, str):
            return self.front.error(400, pairs)
        rid = f"score-{request_base(request)}"
        created = int(time.time())
        work = await run(self.front, request, rid, pair_tokens(pairs))
        if isinstance(work, Response):
            return work
        data = [
            {"index": i, "object": "score", "score": relevance(a, b)}
            for i, (a, b) in enumerate(pairs)
        ]
        tokens = work.prompt_tokens
        usage = {
            "prompt_tokens": tokens,
            "total_tokens": tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        }
        answer = {"id": rid, "object": "list", "created": created, "model": name, "data": data}
        answer["usage"] = usage
        return JSONResponse(answer, headers=self.front.response_headers(request))


def register_vllm(add: AddRoute, front: VllmFrontend) -> None:
    api = VllmPooling(front)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        add(path, api.rerank, methods=["POST"])
    for path in ("/score", "/v1/score"):
        add(path, api.score, methods=["POST"])


# SGLang ---------------------------------------------------------------------------------


class _SglangRerank(Tolerant):
    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = True


class _SglangScore(Tolerant):
    query: str | list[int] | None = None
    items: str | list[str] | list[list[int]] | None = None
    label_token_ids: list[int] | None = None
    apply_softmax: bool = False
    item_first: bool = False
    model: str = "default"


def sglang_rerank_problem(body: _SglangRerank) -> str | None:
    """The serving layer's checks of a rerank request, in its order."""
    documents = body.documents
    checks = (
        (not body.query, "Query cannot be empty"),
        (not body.query.strip(), "Query cannot be empty or whitespace only"),
        (not documents, "Documents cannot be empty"),
        (not all(documents), "Each document must be a non-empty string"),
        (
            not all(doc.strip() for doc in documents),
            "Each document cannot be empty or whitespace only",
        ),
        (
            body.top_n is not None and body.top_n < 1,
            "top_n: Value error, parameter top_n should be larger than 0.",
        ),
    )
    return next((problem for failed, problem in checks if failed), None)


def sglang_prompts(body: _SglangScore) -> list[tuple[str, int]] | str:
    """(prompt, its tokens) per item, or why the tokenizer manager refuses the request."""
    if body.label_token_ids is None:
        return "label_token_ids must be provided"
    for token in body.label_token_ids:
        if token >= VOCAB_SIZE:
            return f"Token ID {token} is out of vocabulary (vocab size: {VOCAB_SIZE})"
    query, items = body.query, body.items
    if isinstance(query, str) and isinstance(items, str | list):
        texts = [items] if isinstance(items, str) else items
        if all(isinstance(item, str) for item in texts):
            joined = [f"{item}{query}" if body.item_first else f"{query}{item}" for item in texts]
            return [(str(text), count_prompt_tokens(str(text))) for text in joined]
    if (
        isinstance(query, list)
        and isinstance(items, list)
        and all(isinstance(item, list) for item in items)
    ):
        return [(json.dumps([*query, *item]), len(query) + len(item)) for item in items]
    return "Invalid combination of query/items types for score_request."


class SglangPooling:
    def __init__(self, front: SglangFrontend) -> None:
        self.front = front

    async def rerank(self, request: Request) -> Response:
        body = await self.front.read_json(request, _SglangRerank)
        if isinstance(body, Response):
            return body
        problem = sglang_rerank_problem(body)
        if problem is None and not self.front.args.is_embedding:
            problem = NOT_EMBEDDING
        if problem is not None:
            return self.front.error(400, problem)
        pairs = [(body.query, doc) for doc in body.documents]
        rid = uuid.uuid4().hex
        work = await run(self.front, request, rid, pair_tokens(pairs))
        if isinstance(work, Response):
            return work
        latency = round(time.monotonic() - work.created, 6)
        answers: list[JsonDict] = []
        for i, doc in enumerate(body.documents):
            tokens = pair_tokens([(body.query, doc)])
            meta = {"id": f"{rid}-{i}", "prompt_tokens": tokens, "e2e_latency": latency}
            answer: JsonDict = {"score": relevance(body.query, doc), "index": i, "meta_info": meta}
            if body.return_documents:
                answer["document"] = doc
            answers.append(answer)
        answers.sort(key=lambda answer: -float(answer["score"]))
        return JSONResponse(answers[: body.top_n] if body.top_n else answers)

    async def score(self, request: Request) -> Response:
        body = await self.front.read_json(request, _SglangScore)
        if isinstance(body, Response):
            return body
        prompts = sglang_prompts(body)
        if isinstance(prompts, str):
            return self.front.error(400, prompts)
        tokens = sum(count for _, count in prompts)
        work = await run(self.front, request, f"score-{uuid.uuid4().hex}", tokens)
        if isinstance(work, Response):
            return work
        labels = body.label_token_ids or []
        scores = [label_probabilities(text, labels, body.apply_softmax) for text, _ in prompts]
        answer = {"scores": scores, "model": body.model, "usage": None, "object": "scoring"}
        return JSONResponse(answer)

    async def embeddings(self, request: Request) -> Response:
        refusal = self.front.precheck(request)
        if refusal is None and not self.front.args.is_embedding:
            refusal = self.front.error(400, NOT_EMBEDDING)
        return refusal or await counted_embeddings(self.front, request)


def register_sglang(add: AddRoute, front: SglangFrontend) -> None:
    api = SglangPooling(front)
    add("/v1/rerank", api.rerank, methods=["POST", "PUT"])
    add("/v1/score", api.score, methods=["POST"])
    add("/v1/embeddings", api.embeddings, methods=["POST"])


# llama.cpp ------------------------------------------------------------------------------


class LlamaPooling:
    def __init__(self, front: LlamaFrontend) -> None:
        self.front = front

    def _unsupported(self, what: str, flag: str) -> Response:
        message = f"This server does not support {what}. Start it with `{flag}`"
        return self.front.error(501, message, "not_supported_error")

    async def embeddings(self, request: Request) -> Response:
        args = self.front.args
        if not args.embeddings:
            return self._unsupported("embeddings", "--embeddings")
        if args.pooling == "none" and request.url.path == "/v1/embeddings":
            return self.front.error(
                400,
                "Pooling type 'none' is not OAI compatible. Please use a different pooling type",
            )
        return await counted_embeddings(self.front, request)

    async def rerank(self, request: Request) -> Response:
        args = self.front.args
        if not args.embeddings or args.pooling != "rank":
            return self._unsupported("reranking", "--reranking")
        data = await self._object(request)
        if isinstance(data, Response):
            return data
        query = data.get("query")
        if "query" not in data or not isinstance(query, str):
            problem = '"query" must be a string' if "query" in data else '"query" must be provided'
            return self.front.error(400, problem)
        documents = _texts(data.get("documents")) or _texts(data.get("texts"))
        if not documents:
            return self.front.error(400, '"documents" must be a non-empty string array')
        pairs = [(query, doc) for doc in documents]
        work = await run(self.front, request, f"rerank-{uuid.uuid4().hex}", pair_tokens(pairs))
        if isinstance(work, Response):
            return work
        return JSONResponse(self._ranked(data, query, documents, work.prompt_tokens))

    def _ranked(self, data: JsonDict, query: str, documents: list[str], tokens: int) -> Any:
        tei = "texts" in data
        label = "score" if tei else "relevance_score"
        ranks: list[JsonDict] = []
        for i, doc in enumerate(documents):
            rank: JsonDict = {"index": i, label: relevance(query, doc)}
            if tei and data.get("return_text") is True:
                rank["text"] = doc
            ranks.append(rank)
        ranks.sort(key=lambda rank: -float(rank[label]))
        top_n = data.get("top_n")
        ranks = ranks[: top_n if isinstance(top_n, int) else len(ranks)]
        if tei:
            return ranks
        model = data.get("model")
        name = model if isinstance(model, str) else self.front.args.alias or self.front.args.model
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"model": name, "object": "list", "usage": usage, "results": ranks}

    async def _object(self, request: Request) -> JsonDict | Response:
        try:
            data = json.loads(await request.body())
        except ValueError as exc:
            return self.front.error(500, f"parse error: {exc}", "server_error")
        if not isinstance(data, dict):
            return self.front.error(400, '"query" must be provided')
        return data


def _texts(value: object) -> list[str]:
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return [str(item) for item in value]
    return []


def register_llamacpp(add: AddRoute, front: LlamaFrontend) -> None:
    api = LlamaPooling(front)
    for path in ("/v1/embeddings", "/embeddings"):
        add(path, api.embeddings, methods=["POST"])
    for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
        add(path, api.rerank, methods=["POST"])
    for path in ("/score", "/v1/score"):  # none: its own 404, for the paths other engines serve
        add(path, llama_not_found, methods=["POST"])
