"""The inference requests' bodies: what the router reads of each, checked before admission.

The models type the fields the router reads or rewrites (`model`, `stream`,
`stream_options`, `n`, `cache_salt`) and the one each kind cannot do without (`messages`), and take
`prompt` and `input` in every shape an engine takes. Every other field is the engine's
business: it passes through as the client sent it (the router forwards the body it parsed,
never a model's dump). The same models are the request bodies of the OpenAPI document.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

# The longest cache_salt taken (a 256-bit random salt is 43 to 64 characters).
MAX_SALT = 1024


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: bool | None = Field(
        None, description="true or false (true: a last chunk with the usage)"
    )


class InferenceBody(BaseModel):
    """What every inference request has; fields the router does not read are the engine's."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1, description="the id of a model, as GET /v1/models lists")
    stream: bool = Field(
        False, description="true or false (true: the answer as server-sent events)"
    )
    n: int = Field(1, description="1 (one choice a request)")
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_SALT,
        description="a non-empty string: requests share cached prefixes only with the same salt",
    )

    @property
    def client_usage(self) -> bool:
        """Whether the client gets the usage: always in one JSON answer."""
        return not self.stream


class StreamableBody(InferenceBody):
    stream_options: StreamOptions | None = Field(
        None, description='an object such as {"include_usage": true}'
    )

    @property
    def client_usage(self) -> bool:
        options = self.stream_options
        return not self.stream or bool(options and options.include_usage)


class ChatBody(StreamableBody):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]] = Field(
        description='a list of message objects such as {"role": "user", "content": "hi"}'
    )


class CompletionBody(StreamableBody):
    """POST /v1/completions."""

    prompt: str | list[Any] | dict[str, Any] | None = Field(
        None,
        description="a text, a list of texts or of token ids, or (llama.cpp) an object with "
        "multimodal data",
    )


class EmbeddingBody(InferenceBody):
    """POST /v1/embeddings."""

    input: str | list[Any] | None = Field(
        None, description="a text, or a list of texts or of token ids"
    )
    stream: bool = Field(False, description="false (embeddings are never streamed)")

    @field_validator("stream")
    @classmethod
    def _never_streamed(cls, stream: bool) -> bool:
        if stream:
            raise ValueError("embeddings are never streamed; send false or leave it out")
        return stream
