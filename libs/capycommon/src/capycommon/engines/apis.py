"""Which of the router's APIs each engine family serves, from which version: `serves`.

Each first version is where the route appeared in the engine's own source: vLLM's
`entrypoints/openai/api_server.py` and its `serving_*.py`, SGLang's `http_server.py`,
llama.cpp's `tools/server/server.cpp` (its builds are numbered). A family's versions older
than CapyCTL's minimum (`families.MINIMUM`) are never run, so a route older than that minimum
is served by every version CapyCTL runs. A custom engine's routes are unknown: every request
is passed to it, and it answers what it cannot serve itself.

Serving a route is not serving every model on it: vLLM answers embeddings, rerank and score
only for a pooling model, transcriptions only for a speech model; llama.cpp answers
embeddings only when started with `--embeddings`, rerank with `--reranking`. Where the
engine refuses such a model with a 404 or a 501, the router answers `capability_missing` too
(`capyctl_router.relay.api_refused`); another refusal (SGLang's 400 for a model not started
with `--is-embedding`) is the engine's own, relayed.
"""

from __future__ import annotations

import functools

from packaging.version import Version

from capycommon.engines.families import Family, parse_version
from capycommon.errors import EngineUnsupported

# The router's APIs, by the request kind of their route (its path after /v1/, a dot for
# each further slash).
APIS = (
    "chat.completions",
    "completions",
    "embeddings",
    "responses",
    "messages",
    "messages.count_tokens",
    "rerank",
    "score",
    "tokenize",
    "detokenize",
    "audio.transcriptions",
)
# Served by every version CapyCTL runs.
ALWAYS = "0"

# The first version of each family serving each API; an API not named is not served.
SINCE: dict[Family, dict[str, str]] = {
    Family.VLLM: {
        "chat.completions": ALWAYS,
        "completions": ALWAYS,
        "embeddings": ALWAYS,  # 0.4.3
        # 0.10.0 (streamed from 0.10.1); previous_response_id needs its store, which is off
        # unless the engine runs with VLLM_ENABLE_RESPONSES_API_STORE=1.
        "responses": ALWAYS,
        "messages": "0.11.1",
        "messages.count_tokens": "0.17.0",
        "rerank": ALWAYS,  # 0.7.0
        "score": ALWAYS,  # 0.6.5
        "tokenize": ALWAYS,  # 0.5.1
        "detokenize": ALWAYS,
        "audio.transcriptions": ALWAYS,  # 0.7.3
    },
    Family.SGLANG: {
        "chat.completions": ALWAYS,
        "completions": ALWAYS,
        "embeddings": ALWAYS,  # 0.2.12, for a model started with --is-embedding
        # 0.5.0; it keeps every response up to 0.5.19, from 0.5.20 only with
        # --enable-response-store
        "responses": ALWAYS,
        "messages": "0.5.9",
        "messages.count_tokens": "0.5.9",
        "rerank": ALWAYS,  # 0.4.7.post1
        "score": ALWAYS,  # 0.4.7
        "tokenize": "0.5.3.post1",
        "detokenize": "0.5.3.post1",
        "audio.transcriptions": "0.5.10",
    },
    Family.LLAMACPP: {
        "chat.completions": ALWAYS,
        "completions": ALWAYS,
        "embeddings": ALWAYS,  # with --embeddings
        "responses": "7793",  # stateless: previous_response_id is refused
        "messages": "7187",
        "messages.count_tokens": "7187",
        "rerank": ALWAYS,  # with --reranking
        "tokenize": ALWAYS,
        "detokenize": ALWAYS,
        "audio.transcriptions": "8784",
    },
    # What CapyCTL assumes of TensorFold's server (`engines.tensorfold`): chat alone.
    Family.TENSORFOLD: {"chat.completions": ALWAYS, "completions": ALWAYS},
}

# Families that keep a response's state themselves, so that a later request may name it by
# `previous_response_id` (each only while its store is on); llama.cpp's responses are
# stateless.
STATEFUL_RESPONSES = frozenset({Family.VLLM, Family.SGLANG, Family.CUSTOM})


@functools.lru_cache(maxsize=4096)  # asked twice a request: versions are few, parsing is not
def serves(family: str, version: str | None, api: str) -> bool:
    """Whether `family` at `version` serves `api`; True for a custom engine, whose routes
    are its own, and for a version not known yet (the engine is asked, and answers)."""
    try:
        known = Family(family)
    except ValueError:
        return True
    if known not in SINCE:
        return True
    since = SINCE[known].get(api)
    if since is None:
        return False
    if version is None or since == ALWAYS:
        return True
    try:
        return parse_version(known, version) >= Version(since)
    except EngineUnsupported:  # a version CapyCTL cannot read was refused at registration
        return True


def served(family: str, version: str | None) -> tuple[str, ...]:
    """The APIs `family` at `version` serves, in `APIS` order."""
    return tuple(api for api in APIS if serves(family, version, api))


def since(family: str, api: str) -> str | None:
    """The first version of `family` serving `api` ("0": every version CapyCTL runs); None
    where it serves none."""
    try:
        return SINCE.get(Family(family), {}).get(api)
    except ValueError:
        return None
