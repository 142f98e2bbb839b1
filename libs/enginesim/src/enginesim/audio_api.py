"""Audio transcriptions, `POST /v1/audio/transcriptions` with a multipart form (`file`,
`model`, `language`, `prompt`, `response_format`, `temperature`, `stream`), as each family
answers them.

The clip's length is read from its WAV header, else taken as 16 kHz 16-bit mono PCM; the
transcript is 2.5 words a second of it (3 to 400 words), each picked by a digest of the
uploaded bytes, so the same upload is always heard the same way. A transcription is one
request in the engine: its prompt is 50 tokens a second of audio, each word is a token made
at the behaviour's pace, it counts in the metrics, and a client that hangs up aborts it as
the family aborts a chat (streamed or not). An engine whose answers are garbage (a bad wake)
hears garbage too.

- vLLM (every version; the served model is taken to be a speech model): `json` and `text`
  both answer `{text, usage: {type: duration, seconds}}` (no usage before 0.10.2), as its
  route returns every non-streamed response as JSON; `verbose_json` adds `duration`,
  `language` and one segment; `srt` and `vtt` are refused (400), as is `verbose_json`
  streamed. A model it does not serve is a 404. `stream=true` sends `transcription.chunk`
  events (`choices[0].delta.content`), a last one with `finish_reason`, a usage chunk with
  `stream_include_usage` (or --enable-force-include-usage), then `[DONE]`.
- SGLang from 0.5.10: `json` -> `{text, usage}`, `text` -> text/plain, `verbose_json` with
  `task`, `language`, `duration` and one segment; any other format is a bare
  `{"error": {"message"}}` 400. Streamed chunks carry SGLang's whole delta (role, content,
  reasoning_content, tool_calls), then one with `finish_reason`, then `[DONE]`. Earlier
  releases have no such route (FastAPI's 404).
- llama.cpp from build 8784 (also at /audio/transcriptions): only for a model started with
  an audio projector (--mmproj), else 501; `json` is the only format; it answers
  `{type: transcript.text.done, text, usage}`, and with `stream` exactly `true` sends
  `transcript.text.delta` events, the `done` event, then `[DONE]`. Earlier builds answer
  their 404.
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from enginesim.api_common import DONE, AddRoute, at_least, llama_not_found, request_base, sse
from enginesim.behaviour import GARBAGE_ANSWER
from enginesim.engine import Token, Work
from enginesim.multipart import Form, read_form
from enginesim.openai_chat import JsonDict, pieces
from enginesim.serving import Frontend

if TYPE_CHECKING:
    from enginesim.llamacpp_app import LlamaFrontend
    from enginesim.sglang_app import SglangFrontend
    from enginesim.vllm_app import VllmFrontend

SGLANG_FROM = "0.5.10"
LLAMA_FROM_BUILD = 8784  # the first llama-server build with the route
VLLM_USAGE_FROM = (0, 10, 2)
BYTES_PER_SECOND = 32_000  # 16 kHz, 16-bit mono PCM
WORDS_PER_SECOND = 2.5
WORDS = (
    *("the", "engine", "hears", "a", "voice", "that", "speaks", "of", "rivers"),
    *("and", "quiet", "hills", "where", "simulated", "birds", "sing", "softly", "today"),
)
VLLM_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
VLLM_FORMAT_REFUSED = "Currently only support response_format`text`, `json` or `verbose_json`"
VLLM_SWITCHES = ("stream", "stream_include_usage", "stream_continuous_usage_stats")
TRUE = frozenset({"1", "true", "on", "yes", "t", "y"})
FALSE = frozenset({"0", "false", "off", "no", "f", "n"})


@dataclass(frozen=True)
class Clip:
    """An uploaded clip as the simulated model hears it."""

    seconds: float
    text: str

    @property
    def prompt_tokens(self) -> int:
        return max(1, math.ceil(self.seconds * 50))

    @property
    def billed_seconds(self) -> int:
        return math.ceil(self.seconds)

    def plan(self) -> list[Token]:
        return [Token("content", piece) for piece in pieces(self.text)]


def clip_of(audio: bytes, garbage: bool = False) -> Clip:
    seconds = duration_of(audio)
    return Clip(seconds, GARBAGE_ANSWER if garbage else transcript_of(audio, seconds))


def duration_of(audio: bytes) -> float:
    if len(audio) >= 44 and audio[:4] == b"RIFF" and audio[8:12] == b"WAVE":
        byte_rate = int.from_bytes(audio[28:32], "little")
        if byte_rate > 0:
            return (len(audio) - 44) / byte_rate
    return len(audio) / BYTES_PER_SECOND


def transcript_of(audio: bytes, seconds: float) -> str:
    count = min(400, max(3, math.ceil(seconds * WORDS_PER_SECOND)))
    seed, stream = hashlib.sha256(audio).digest(), b""
    while len(stream) < count:
        stream += seed
        seed = hashlib.sha256(seed).digest()
    return " ".join(WORDS[byte % len(WORDS)] for byte in stream[:count]).capitalize() + "."


def form_bool(value: str | None) -> bool | None:
    """A form field read as pydantic reads a boolean (absent: False); None when it is not one."""
    if value is None:
        return False
    lowered = value.strip().lower()
    return True if lowered in TRUE else False if lowered in FALSE else None


def duration_usage(clip: Clip) -> JsonDict:
    return {"type": "duration", "seconds": clip.billed_seconds}


def token_usage(work: Work) -> JsonDict:
    prompt, completion = work.prompt_tokens, work.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def error_event(work: Work) -> str:
    message = work.error or "internal error"
    return sse(
        {"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}}
    )


async def start(front: Frontend, rid: str, audio: bytes) -> tuple[Work, Clip] | Response:
    """The transcription admitted, the clip heard (as the engine hears by then) and handed to
    the engine; or the family's refusal to take it."""
    refusal = await front.admit()
    if refusal is not None:
        return refusal
    clip = clip_of(audio, garbage=front.engine.answer() == GARBAGE_ANSWER)
    work = Work(rid, clip.prompt_tokens, clip.plan(), "stop")
    front.submit(work)
    return work, clip


def _text(batch: list[Token]) -> str:
    return "".join(token.text for token in batch)


@dataclass(frozen=True)
class _Ask:
    """A transcription as the family reads its form."""

    audio: bytes


AskT = TypeVar("AskT", bound=_Ask)
FrontT = TypeVar("FrontT", bound=Frontend)


class _Transcriber(Generic[FrontT, AskT]):
    """One family's route: the form read and checked its way, the clip heard and handed to
    the engine (`start`), then answered in the family's wire format."""

    def __init__(self, front: FrontT) -> None:
        self.front = front

    def _ask(self, form: Form) -> AskT | Response:
        raise NotImplementedError

    def _rid(self, request: Request) -> str:
        raise NotImplementedError

    async def _answer(
        self, request: Request, ask: AskT, rid: str, work: Work, clip: Clip
    ) -> Response:
        raise NotImplementedError

    async def transcribe(self, request: Request) -> Response:
        ask = self._ask(await read_form(request))
        if isinstance(ask, Response):
            return ask
        rid = self._rid(request)
        started = await start(self.front, rid, ask.audio)
        if isinstance(started, Response):
            return started
        work, clip = started
        return await self._answer(request, ask, rid, work, clip)


# vLLM -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _VllmAsk(_Ask):
    model: str
    fmt: str
    stream: bool
    usage: bool  # stream_include_usage
    continuous: bool  # stream_continuous_usage_stats
    language: str | None
    temperature: float


class VllmAudio(_Transcriber["VllmFrontend", _VllmAsk]):
    def _ask(self, form: Form) -> _VllmAsk | Response:
        """The form as vLLM validates it (its fields), then the model, then what it serves."""
        ask = self._fields(form)
        if isinstance(ask, Response):
            return ask
        refusal = self.front.unserved(ask.model)
        if refusal is not None:
            return refusal
        error = self.front.error
        if ask.fmt not in ("text", "json", "verbose_json"):
            return error(400, VLLM_FORMAT_REFUSED)
        if ask.fmt == "verbose_json" and ask.stream:
            return error(400, "verbose_json format doesn't support streaming case")
        return ask

    def _fields(self, form: Form) -> _VllmAsk | Response:
        fields, error = form.fields, self.front.error
        audio = form.files.get("file")
        if audio is None:
            return error(400, "file: Field required")
        fmt = fields.get("response_format", "json")
        if fmt not in VLLM_FORMATS:
            return error(400, "response_format: Input should be " + " or ".join(VLLM_FORMATS))
        flags = [form_bool(fields.get(name)) for name in VLLM_SWITCHES]
        temperature = _number(fields.get("temperature", "0"))
        unread = [name for name, flag in zip(VLLM_SWITCHES, flags, strict=True) if flag is None]
        if unread:
            return error(400, f"{unread[0]}: Input should be a valid boolean")
        if temperature is None:
            return error(400, "temperature: Input should be a valid number")
        model = fields.get("model") or self.front.args.served_names[0]
        stream, usage, continuous = (bool(flag) for flag in flags)
        language = fields.get("language")
        return _VllmAsk(audio, model, fmt, stream, usage, continuous, language, temperature)

    def _rid(self, request: Request) -> str:
        return f"transcribe-{request_base(request)}"

    async def _answer(
        self, request: Request, ask: _VllmAsk, rid: str, work: Work, clip: Clip
    ) -> Response:
        events = functools.partial(self._events, ask, rid, work)
        body = functools.partial(self._body, ask, clip)
        return await self.front.respond(request, work, ask.stream, events, body)

    def _body(self, ask: _VllmAsk, clip: Clip) -> JsonDict:
        if ask.fmt == "verbose_json":
            segment: JsonDict = {
                "id": 0,
                "avg_logprob": None,
                "compression_ratio": None,
                "end": clip.seconds,
                "no_speech_prob": None,
                "seek": 0,
                "start": 0.0,
                "temperature": ask.temperature,
                "text": clip.text,
                "tokens": [],
            }
            return {
                "duration": str(clip.seconds),
                "language": ask.language,
                "text": clip.text,
                "segments": [segment],
                "words": None,
            }
        if self.front.v < VLLM_USAGE_FROM:
            return {"text": clip.text}
        return {"text": clip.text, "usage": duration_usage(clip)}

    async def _events(self, ask: _VllmAsk, rid: str, work: Work) -> AsyncIterator[str]:
        head = {"id": rid, "object": "transcription.chunk", "created": int(time.time())}
        head["model"] = ask.model
        usage = ask.usage or self.front.force_usage
        continuous = usage and ask.continuous
        async for batch in work.batches():
            chunk = {**head, "choices": [{"delta": {"content": _text(batch)}}]}
            yield sse({**chunk, "usage": token_usage(work)} if continuous else chunk)
        if work.finish == "error":
            yield error_event(work)
        else:
            last = {"delta": {"content": ""}, "finish_reason": work.finish, "stop_reason": None}
            chunk = {**head, "choices": [last]}
            yield sse({**chunk, "usage": token_usage(work)} if continuous else chunk)
            if usage:
                yield sse({**head, "choices": [], "usage": token_usage(work)})
        yield DONE


def register_vllm(add: AddRoute, front: VllmFrontend) -> None:
    add("/v1/audio/transcriptions", VllmAudio(front).transcribe, methods=["POST"])


# SGLang ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _SglangAsk(_Ask):
    model: str
    fmt: str
    stream: bool
    language: str | None


class SglangAudio(_Transcriber["SglangFrontend", _SglangAsk]):
    def _ask(self, form: Form) -> _SglangAsk | Response:
        audio, fields = form.files.get("file"), form.fields
        if audio is None:
            return self.front.error(400, "file: Field required")
        stream = form_bool(fields.get("stream"))
        if stream is None:
            return self.front.error(400, "stream: Input should be a valid boolean")
        fmt = fields.get("response_format", "json")
        if fmt not in ("json", "text", "verbose_json"):
            message = "Only 'json', 'text', and 'verbose_json' formats supported"
            return JSONResponse({"error": {"message": message}}, status_code=400)
        model = fields.get("model", "default")
        return _SglangAsk(audio, model, fmt, stream, fields.get("language"))

    def _rid(self, request: Request) -> str:
        return f"trsc-{uuid.uuid4().hex}"

    async def _answer(
        self, request: Request, ask: _SglangAsk, rid: str, work: Work, clip: Clip
    ) -> Response:
        if ask.stream:
            events = functools.partial(self._events, ask, rid, work)
            return await self.front.respond(request, work, True, events, dict)
        await self.front._until_done(request, work, stream=False)
        if work.finish == "error":
            return self.front.error(500, work.error or "internal error", "InternalServerError")
        if ask.fmt == "text":
            return PlainTextResponse(clip.text)
        body: JsonDict = {"text": clip.text, "usage": duration_usage(clip)}
        if ask.fmt == "verbose_json":
            segment = {"id": 0, "start": 0.0, "end": clip.seconds, "text": clip.text}
            body = {"task": "transcribe", "language": ask.language, "duration": clip.seconds}
            body |= {"text": clip.text, "segments": [segment], "usage": duration_usage(clip)}
        return JSONResponse(body)

    async def _events(self, ask: _SglangAsk, rid: str, work: Work) -> AsyncIterator[str]:
        head = {"id": rid, "object": "transcription.chunk", "created": int(time.time())}
        head["model"] = ask.model
        delta: JsonDict = {
            "role": None,
            "content": None,
            "reasoning_content": None,
            "tool_calls": None,
        }
        async for batch in work.batches():
            choice = {"delta": {**delta, "content": _text(batch)}, "finish_reason": None}
            yield sse({**head, "choices": [choice], "usage": None})
        if work.finish == "error":
            yield error_event(work)
        else:
            last: JsonDict = {"delta": delta, "finish_reason": work.finish}
            yield sse({**head, "choices": [last], "usage": None})
        yield DONE


def register_sglang(add: AddRoute, front: SglangFrontend) -> None:
    if at_least(front.version, SGLANG_FROM):
        add("/v1/audio/transcriptions", SglangAudio(front).transcribe, methods=["POST"])


# llama.cpp ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _LlamaAsk(_Ask):
    stream: bool  # `stream` exactly "true", compared as text, as llama-server does


class LlamaAudio(_Transcriber["LlamaFrontend", _LlamaAsk]):
    def _ask(self, form: Form) -> _LlamaAsk | Response:
        """Its checks, in its order: the model's audio input, the file, the format."""
        if self.front.args.mmproj is None:
            message = "The current model does not support audio input."
            return self.front.error(501, message, "not_supported_error")
        if "file" not in form.files:
            return self.front.error(400, "No input file found for transcription")
        if form.fields.get("response_format", "json") != "json":
            message = "Only 'json' response_format is supported for transcription"
            return self.front.error(400, message)
        return _LlamaAsk(form.files["file"], form.fields.get("stream") == "true")

    def _rid(self, request: Request) -> str:
        return f"asr-{uuid.uuid4().hex}"

    async def _answer(
        self, request: Request, ask: _LlamaAsk, rid: str, work: Work, clip: Clip
    ) -> Response:
        events = functools.partial(self._events, work, clip)
        body = functools.partial(_done, work, clip)
        return await self.front.respond(request, work, ask.stream, events, body)

    async def _events(self, work: Work, clip: Clip) -> AsyncIterator[str]:
        async for batch in work.batches():
            yield sse({"type": "transcript.text.delta", "delta": _text(batch)})
        yield error_event(work) if work.finish == "error" else sse(_done(work, clip))
        yield DONE


def _done(work: Work, clip: Clip) -> JsonDict:
    prompt, completion = work.prompt_tokens, work.completion_tokens
    usage = {
        "type": "tokens",
        "input_tokens": prompt,
        "output_tokens": completion,
        "total_tokens": prompt + completion,
        "input_tokens_details": {"cached_tokens": 0},
    }
    return {"type": "transcript.text.done", "text": clip.text, "usage": usage}


def register_llamacpp(add: AddRoute, front: LlamaFrontend) -> None:
    served = front.build >= LLAMA_FROM_BUILD
    handler = LlamaAudio(front).transcribe if served else llama_not_found
    for path in ("/v1/audio/transcriptions", "/audio/transcriptions"):
        add(path, handler, methods=["POST"])


def _number(value: str) -> float | None:
    try:
        found = float(value)
    except ValueError:
        return None
    return found if math.isfinite(found) else None
