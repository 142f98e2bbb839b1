"""The host ingress's wire: how a server's router sends a request to an engine on a joined
host, through the ingress hostd serves there over mutual TLS.

The router presents its own client certificate (`urn:capyctl:router:<id>`, issued by the
server's authority at each start, `paths.router_certificate`); the ingress refuses any other
kind, a host's certificate included. The ingress presents the host's certificate
(`urn:capyctl:host:<host id>`), which the router checks against the host it meant to reach.

A request names the instance it was admitted to, and the ingress forwards it to that
engine only while the engine runs that generation; otherwise it answers 409 with the code
`stale_dispatch` (the instance stopped or moved). Only the inference paths pass; the engine's
key is the ingress's to add, so it never crosses the network.
"""

from __future__ import annotations

# The paths an ingress forwards, the router's inference paths; anything else is 404.
PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/embeddings",
        "/v1/rerank",
        "/v1/score",
        "/tokenize",
        "/detokenize",
        "/v1/audio/transcriptions",
        "/v1/systemone",
    }
)

# Request headers naming the instance a request was admitted to.
DEPLOYMENT_HEADER = "x-capyctl-deployment"
INSTANCE_HEADER = "x-capyctl-instance"
GENERATION_HEADER = "x-capyctl-generation"

# The ingress's answer to a request for an instance that is not running that generation.
STALE_STATUS = 409
STALE_CODE = "stale_dispatch"
