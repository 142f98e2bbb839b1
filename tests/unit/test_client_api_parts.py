"""The parts behind the router's other APIs: which engine serves which API from which
version, a multipart form read and rebuilt, a response and a message assembled from their
events, and each API's error envelope."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from capycommon.engines import apis
from capycommon.errors import EngineError, InvalidRequest
from capyctl_router import forms, typed
from capyctl_router.errors import error_body


@pytest.mark.parametrize(
    ("family", "version", "api", "served"),
    [
        ("vllm", "0.11.0", "messages", False),
        ("vllm", "0.11.1", "messages", True),
        ("vllm", "0.16.0", "messages.count_tokens", False),
        ("vllm", "0.17.0", "messages.count_tokens", True),
        ("vllm", "0.11.0", "responses", True),
        ("sglang", "0.5.8", "messages", False),
        ("sglang", "0.5.3", "tokenize", False),
        ("sglang", "0.5.3.post1", "tokenize", True),
        ("sglang", "0.5.10", "audio.transcriptions", True),
        ("llamacpp", "7792", "responses", False),
        ("llamacpp", "7793", "responses", True),
        ("llamacpp", "9000", "score", False),
        ("tensorfold", "0.6.0", "messages", False),
        ("custom", "1.0", "score", True),
        ("vllm", None, "messages", True),
    ],
)
def test_each_family_serves_each_api_from_its_first_version(
    family: str, version: str | None, api: str, served: bool
) -> None:
    assert apis.serves(family, version, api) is served


def _form(fields: dict[str, str], file: bytes) -> tuple[str, bytes]:
    request = httpx.Request(
        "POST", "http://x/", data=fields, files={"file": ("a.wav", file, "audio/wav")}
    )
    return request.headers["content-type"], request.read()


@given(
    model=st.text(min_size=1, max_size=40),
    file=st.binary(max_size=2000),
    language=st.text(max_size=10),
)
def test_a_form_rebuilt_with_another_model_keeps_every_other_byte(
    model: str, file: bytes, language: str
) -> None:
    content_type, body = _form({"model": model, "language": language}, file)
    form = forms.parse(content_type, body)
    assert form.fields() == {"model": model, "language": language}
    assert form.files() == ("file",)
    rebuilt = forms.parse(content_type, form.with_field("model", "served"))
    assert rebuilt.fields() == {"model": "served", "language": language}
    assert rebuilt.parts[-1].data == file


@pytest.mark.parametrize(
    ("content_type", "body", "says"),
    [
        ("application/json", b"{}", "not multipart/form-data"),
        ("multipart/form-data", b"", "names no boundary"),
        ("multipart/form-data; boundary=b", b"--b\r\nx", "no closing boundary"),
        ("multipart/form-data; boundary=b", b"x--b--", "does not begin with its boundary"),
        (
            "multipart/form-data; boundary=b",
            b"--b\r\nContent-Type: text/plain\r\n\r\nx\r\n--b--\r\n",
            "no Content-Disposition name",
        ),
        (
            "multipart/form-data; boundary=b",
            b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\n\xff\r\n--b--\r\n',
            "'model' is not UTF-8",
        ),
    ],
)
def test_a_broken_form_is_refused_naming_what_is_wrong(
    content_type: str, body: bytes, says: str
) -> None:
    with pytest.raises(InvalidRequest, match=says):
        forms.parse(content_type, body).fields()


def test_a_stream_field_is_read_as_true_or_false() -> None:
    content_type, body = _form({"model": "m", "stream": "True"}, b"x")
    assert forms.fields_of(forms.parse(content_type, body))["stream"] is True
    content_type, body = _form({"model": "m", "stream": "yes"}, b"x")
    with pytest.raises(InvalidRequest, match="send true or false"):
        forms.fields_of(forms.parse(content_type, body))


def test_a_response_is_the_one_its_last_event_carries() -> None:
    assembly = typed.ResponseAssembly("route")
    assembly.add({"type": "response.created", "response": {"id": "resp_1", "status": "x"}})
    with pytest.raises(EngineError, match="ended before the response did"):
        assembly.body()
    done = {"id": "resp_1", "status": "completed", "model": "served", "output": []}
    assembly.add({"type": "response.completed", "response": done})
    assert assembly.body() == {**done, "model": "route"}


def test_a_message_whose_tool_input_is_not_json_is_the_engines_failure() -> None:
    assembly = typed.MessageAssembly("route", "msg-1")
    assembly.add({"type": "message_start", "message": {"id": "msg_e", "content": []}})
    assembly.add({"type": "content_block_start", "index": 0, "content_block": {"type": "tool_use"}})
    delta = {"type": "input_json_delta", "partial_json": '{"a": '}
    assembly.add({"type": "content_block_delta", "index": 0, "delta": delta})
    with pytest.raises(EngineError, match="tool input is not JSON"):
        assembly.body()
    with pytest.raises(EngineError, match="content block index"):
        assembly.add({"type": "content_block_delta", "index": -1, "delta": delta})


def test_each_api_errs_in_its_own_envelope() -> None:
    assert error_body(503, "queue_full", "full", style="anthropic") == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "full", "code": "queue_full"},
    }
    assert error_body(400, "invalid_request", "no", style="anthropic")["error"]["type"] == (
        "invalid_request_error"
    )
    assert typed.error_event("responses", 500, "engine_error", "broke") == {
        "type": "error",
        "code": "engine_error",
        "message": "broke",
        "param": None,
    }
    event = {"type": "message_delta", "delta": {}}
    assert typed.sse(event, lambda e: b"{}") == b"event: message_delta\ndata: {}\n\n"
