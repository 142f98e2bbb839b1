"""What the tests of the client APIs share, whether they call an engine (the simulator) or the
router in front of one: a clip to transcribe, and SGLang's stream of a response."""

from __future__ import annotations

import io
import wave
from collections.abc import Sequence

from openai.types.responses import Response, ResponseStreamEvent


def silent_wav(seconds: float) -> bytes:
    """A WAV file of `seconds` of silence: 16 kHz, 16-bit mono."""
    found = io.BytesIO()
    with wave.open(found, "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(2)
        clip.setframerate(16_000)
        clip.writeframes(b"\x00\x00" * int(16_000 * seconds))
    return found.getvalue()


def streamed_whole(events: Sequence[ResponseStreamEvent]) -> Response:
    """The response of a stream with no item events, as SGLang streams one: created, in
    progress, then the whole response."""
    assert [event.type for event in events] == [
        "response.created",
        "response.in_progress",
        "response.completed",
    ]
    done = events[-1]
    assert done.type == "response.completed"
    return done.response
