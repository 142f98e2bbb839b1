"""The inference requests' bodies: what the router reads of each, checked before admission.

The models type the fields the router reads or rewrites (`model`, `stream`,
`stream_options`, `n`, `cache_salt`), the ones each kind cannot do without (`messages`,
Anthropic's `max_tokens`), and `prompt` and `input` in every shape an engine takes. Every
other field is the engine's business: it passes through as the client sent it (the router
forwards the body it parsed, never a model's dump). The same models are the request bodies
of the OpenAPI document.
"""

from __future__ import annotations

from typing import Any, ClassVar

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


class WholeBody(InferenceBody):
    """A request answered in one JSON body, never streamed."""

    # What its answers are, as a refusal names them.
    ANSWERS: ClassVar[str] = "answers"

    stream: bool = Field(False, description="false (this answer is never streamed)")

    @field_validator("stream")
    @classmethod
    def _never_streamed(cls, stream: bool) -> bool:
        if stream:
            raise ValueError(f"{cls.ANSWERS} are never streamed; send false or leave it out")
        return stream


class EmbeddingBody(WholeBody):
    """POST /v1/embeddings."""

    ANSWERS = "embeddings"

    input: str | list[Any] | None = Field(
        None, description="a text, or a list of texts or of token ids"
    )


class RerankBody(WholeBody):
    """POST /v1/rerank: the documents ranked by their relevance to the query."""

    ANSWERS = "rankings"

    query: str | dict[str, Any] | None = Field(None, description="the query, a text")
    documents: list[Any] | None = Field(None, description="a list of texts to rank")


class ScoreBody(WholeBody):
    """POST /v1/score: vLLM's text_1 and text_2, or SGLang's query and items."""

    ANSWERS = "scores"


class TokenizeBody(WholeBody):
    """POST /tokenize and /detokenize: the engine's own fields (vLLM's prompt or messages,
    llama.cpp's content; tokens to detokenize)."""

    ANSWERS = "tokens"


class ResponsesBody(InferenceBody):
    """POST /v1/responses, OpenAI's Responses API."""

    input: str | list[Any] | None = Field(None, description="a text, or a list of input items")
    previous_response_id: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="the id of an earlier response of the same model, where its engine keeps them",
    )
    background: bool = Field(False, description="false (a response is answered while asked)")

    @field_validator("background")
    @classmethod
    def _not_in_background(cls, background: bool) -> bool:
        if background:
            raise ValueError(
                "CapyCTL answers a response while the request waits for it; send false or "
                "leave it out, and stream the response to see it as it is written"
            )
        return background

    @property
    def client_usage(self) -> bool:
        return True  # a response always carries its usage


class MessagesBody(InferenceBody):
    """POST /v1/messages, Anthropic's Messages API."""

    messages: list[dict[str, Any]] = Field(
        description='a list of message objects such as {"role": "user", "content": "hi"}'
    )
    max_tokens: int = Field(ge=1, description="the most tokens the answer may have, 1 or more")

    @property
    def client_usage(self) -> bool:
        return True  # a message always carries its usage


class CountTokensBody(WholeBody):
    """POST /v1/messages/count_tokens."""

    ANSWERS = "token counts"

    messages: list[dict[str, Any]] = Field(
        description='a list of message objects such as {"role": "user", "content": "hi"}'
    )


class TranscriptionForm(InferenceBody):
    """POST /v1/audio/transcriptions: a multipart form's text fields (the `file` part is
    checked by `forms`); the engine reads the rest."""

    stream: bool = Field(False, description="true or false (true: the text as server-sent events)")

    @property
    def client_usage(self) -> bool:
        return True
