"""The simulated engines' rerank, score, tokenizer, embeddings and audio transcription APIs,
per family and version: shapes, refusals, keys, metrics, and a streamed transcription that is
aborted when its client hangs up."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from clientapis import silent_wav
from engines.simulator.helpers import (
    FAST,
    Engine,
    Servers,
    parse_metric,
    sse_events,
)
from enginesim import api_common, audio_api, multipart, pooling_api, tokenize_api
from support import wait_for

PACED = FAST.model_copy(update={"tokens_per_second": 40})
VLLM = "0.17.0"
SGLANG = "0.5.10"
LLAMA_BUILD = audio_api.LLAMA_FROM_BUILD
QUERY = "Where do rivers start?"
DOCUMENTS = ["Rivers start in the hills.", "Bread needs flour.", "Springs feed the streams."]
NOT_FOUND = {"detail": "Not Found"}


SHORT = silent_wav(2)  # 5 words
LONG = silent_wav(120)  # 300 words: 7.5 s at 40 tokens a second


def transcribe(engine: Engine, audio: bytes, **fields: str) -> httpx.Response:
    files = {"file": ("clip.wav", audio, "audio/wav")}
    return engine.post("/v1/audio/transcriptions", files=files, data=fields)


def events(response: httpx.Response) -> list[dict[str, Any] | str]:
    return list(sse_events(iter(response.text.splitlines())))


def hang_up_stream(engine: Engine, running: str, **fields: str) -> None:
    """A long transcription streamed, hung up after its first words: the engine stops it."""
    files = {"file": ("clip.wav", LONG, "audio/wav")}
    url = f"{engine.base}/v1/audio/transcriptions"
    data = {"stream": "true", **fields}
    with httpx.stream("POST", url, files=files, data=data, headers=engine.headers) as streamed:
        lines = streamed.iter_lines()  # kept: dropping it would close the connection
        next(line for line in lines if line.startswith("data: {"))
        assert engine.metric(running) == 1
    wait_for(lambda: engine.metric(running) == 0, 10, "the hung-up transcription to stop")


# vLLM -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm(servers: Servers) -> Iterator[Engine]:
    flags = ("--served-model-name", "tiny", "other", "--enable-request-id-headers")
    with servers.python("vllm-pooling", "vllm", VLLM, PACED, *flags) as engine:
        yield engine


def test_vllm_rerank_on_each_path_best_first_behind_the_key_prefixes(vllm: Engine) -> None:
    body = {"model": "tiny", "query": QUERY, "documents": DOCUMENTS}
    assert httpx.post(f"{vllm.base}/v1/rerank", json=body).status_code == 401
    assert httpx.post(f"{vllm.base}/v2/rerank", json=body).status_code == 401
    open_answer = httpx.post(f"{vllm.base}/rerank", json=body, headers={"x-request-id": "r1"})
    assert open_answer.status_code == 200
    answer = open_answer.json()
    assert (answer["id"], answer["model"], open_answer.headers["x-request-id"]) == (
        "rerank-r1",
        "tiny",
        "r1",
    )
    scores = [result["relevance_score"] for result in answer["results"]]
    assert scores == sorted(scores, reverse=True)
    assert sorted(result["index"] for result in answer["results"]) == [0, 1, 2]
    for result in answer["results"]:
        expected = pooling_api.relevance(QUERY, DOCUMENTS[result["index"]])
        assert result["relevance_score"] == expected
        assert result["document"] == {"text": DOCUMENTS[result["index"]], "multi_modal": None}
    assert answer["usage"] == {
        "total_tokens": pooling_api.pair_tokens([(QUERY, d) for d in DOCUMENTS])
    }
    for path in ("/v1/rerank", "/v2/rerank"):
        top = vllm.post(path, json={**body, "top_n": 2}).json()
        assert top["results"] == answer["results"][:2]
        assert top["id"].startswith("rerank-")


def test_vllm_score_pairs_and_refusals(vllm: Engine) -> None:
    body = {"text_1": QUERY, "text_2": DOCUMENTS}
    answer = vllm.post("/v1/score", json=body).json()
    assert (answer["object"], answer["model"]) == ("list", "tiny")
    assert answer["id"].startswith("score-")
    assert [(d["index"], d["object"]) for d in answer["data"]] == [(i, "score") for i in range(3)]
    assert [d["score"] for d in answer["data"]] == [
        pooling_api.relevance(QUERY, doc) for doc in DOCUMENTS
    ]
    tokens = pooling_api.pair_tokens([(QUERY, doc) for doc in DOCUMENTS])
    assert answer["usage"] == {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }
    assert (
        httpx.post(f"{vllm.base}/score", json={**body, "model": "other"}).json()["model"] == "other"
    )
    uneven = vllm.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert uneven.status_code == 400
    assert uneven.json()["error"]["message"] == "Input lengths must be either 1:1, 1:N or N:N"
    unserved = vllm.post("/v1/score", json={**body, "model": "nope"})
    assert unserved.status_code == 404
    assert unserved.json()["error"] == {
        "message": "The model `nope` does not exist.",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }


def test_vllm_embeddings_agree_with_rerank(vllm: Engine) -> None:
    vectors = vllm.openai().embeddings.create(model="tiny", input=[QUERY, DOCUMENTS[0]])
    first, second = (item.embedding for item in vectors.data)
    cosine = sum(a * b for a, b in zip(first, second, strict=True))
    assert math.isclose(pooling_api.relevance(QUERY, DOCUMENTS[0]), (1 + cosine) / 2, abs_tol=1e-5)


def test_vllm_tokenize_and_detokenize_round_trip_without_the_key(vllm: Engine) -> None:
    text = "Hello from a tokenizer test"
    answer = httpx.post(
        f"{vllm.base}/tokenize", json={"prompt": text, "return_token_strs": True}
    ).json()
    assert answer["count"] == len(answer["tokens"]) == math.ceil(len(text) / 4)
    assert answer["max_model_len"] == vllm.get("/v1/models").json()["data"][0]["max_model_len"]
    assert "".join(answer["token_strs"]) == text
    back = httpx.post(f"{vllm.base}/detokenize", json={"tokens": answer["tokens"]}).json()
    assert back == {"prompt": text}
    chat = httpx.post(
        f"{vllm.base}/tokenize",
        json={"model": "other", "messages": [{"role": "user", "content": text}]},
    ).json()
    assert (chat["tokens"], chat["token_strs"]) == (answer["tokens"], None)
    unserved = httpx.post(f"{vllm.base}/detokenize", json={"model": "nope", "tokens": [1]})
    assert unserved.status_code == 404
    neither = httpx.post(f"{vllm.base}/tokenize", json={"model": "tiny"})
    assert neither.status_code == 400


def test_vllm_transcriptions_in_each_format(vllm: Engine) -> None:
    clip = audio_api.clip_of(SHORT)
    client = vllm.openai()
    transcript = client.audio.transcriptions.create(model="tiny", file=("clip.wav", SHORT))
    assert transcript.text == clip.text
    assert len(clip.text.split()) == 5
    plain = transcribe(vllm, SHORT, response_format="text")
    assert plain.json() == {"text": clip.text, "usage": {"type": "duration", "seconds": 2}}
    verbose = transcribe(vllm, SHORT, response_format="verbose_json", language="en").json()
    assert (verbose["text"], verbose["language"], float(verbose["duration"])) == (
        clip.text,
        "en",
        clip.seconds,
    )
    assert verbose["segments"][0]["end"] == clip.seconds
    srt = transcribe(vllm, SHORT, response_format="srt")
    assert srt.status_code == 400
    assert srt.json()["error"]["message"] == audio_api.VLLM_FORMAT_REFUSED
    streamed_verbose = transcribe(vllm, SHORT, response_format="verbose_json", stream="true")
    assert streamed_verbose.status_code == 400
    assert transcribe(vllm, SHORT, model="nope").status_code == 404
    no_file = vllm.post("/v1/audio/transcriptions", data={"model": "tiny"})
    assert no_file.status_code == 400
    bare = httpx.post(f"{vllm.base}/v1/audio/transcriptions", files={"file": SHORT})
    assert bare.status_code == 401


def test_vllm_streamed_transcription_chunks_and_usage(vllm: Engine) -> None:
    clip = audio_api.clip_of(SHORT)
    found = events(transcribe(vllm, SHORT, stream="true", stream_include_usage="true"))
    assert found[-1] == "[DONE]"
    chunks = [e for e in found if isinstance(e, dict)]
    assert {c["object"] for c in chunks} == {"transcription.chunk"}
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert chunks[0]["id"].startswith("transcribe-")
    words = [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]]
    assert "".join(words) == clip.text
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert "finish_reason" not in chunks[0]["choices"][0]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": clip.prompt_tokens,
        "completion_tokens": 5,
        "total_tokens": clip.prompt_tokens + 5,
    }


def test_vllm_counts_each_api_request_and_aborts_a_hung_up_stream(vllm: Engine) -> None:
    def finished(reason: str) -> float:
        lines = vllm.get("/metrics").text.splitlines()
        label = f'finished_reason="{reason}"'
        mine = "\n".join(line for line in lines if label in line)
        return parse_metric(mine, "vllm:request_success_total")

    stopped, aborted = finished("stop"), finished("abort")
    prompt = vllm.metric("vllm:prompt_tokens_total")
    vllm.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS})
    vllm.post("/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS[0]})
    transcribe(vllm, SHORT)
    assert finished("stop") == stopped + 3
    assert vllm.metric("vllm:prompt_tokens_total") > prompt
    hang_up_stream(vllm, "vllm:num_requests_running", model="tiny")
    assert finished("abort") == aborted + 1


# SGLang ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sglang(servers: Servers) -> Iterator[Engine]:
    flags = ("--served-model-name", "tiny", "--enable-metrics", "--skip-server-warmup")
    embedding = "--is-embedding"
    with servers.python("sglang-pooling", "sglang", SGLANG, PACED, *flags, embedding) as engine:
        yield engine


@pytest.fixture(scope="module")
def sglang_old(servers: Servers) -> Iterator[Engine]:
    """SGLang 0.5.3, a generation model (no --is-embedding)."""
    with servers.python("sglang-old", "sglang", "0.5.3", FAST, "--skip-server-warmup") as engine:
        yield engine


def test_sglang_rerank_answers_a_bare_list(sglang: Engine) -> None:
    body = {"query": QUERY, "documents": DOCUMENTS}
    assert httpx.post(f"{sglang.base}/v1/rerank", json=body).status_code == 401
    answer = sglang.post("/v1/rerank", json=body).json()
    assert isinstance(answer, list)
    assert [a["score"] for a in answer] == sorted((a["score"] for a in answer), reverse=True)
    for item in answer:
        assert item["document"] == DOCUMENTS[item["index"]]
        assert item["score"] == pooling_api.relevance(QUERY, item["document"])
        assert item["meta_info"]["prompt_tokens"] > 0
    top = sglang.post("/v1/rerank", json={**body, "top_n": 1, "return_documents": False}).json()
    assert len(top) == 1
    assert "document" not in top[0]
    assert top[0]["index"] == answer[0]["index"]
    empty = sglang.post("/v1/rerank", json={"query": " ", "documents": DOCUMENTS})
    assert empty.status_code == 400
    assert empty.json()["message"] == "Query cannot be empty or whitespace only"
    as_text = sglang.post(
        "/v1/rerank", content=json.dumps(body), headers={"content-type": "text/plain"}
    )
    assert as_text.status_code == 400


def test_sglang_score_and_embeddings(sglang: Engine) -> None:
    body = {
        "query": "Is it ",
        "items": ["yes", "no"],
        "label_token_ids": [9454, 2753],
        "model": "tiny",
    }
    answer = sglang.post("/v1/score", json={**body, "apply_softmax": True}).json()
    assert (answer["model"], answer["object"], answer["usage"]) == ("tiny", "scoring", None)
    assert len(answer["scores"]) == 2
    assert all(math.isclose(sum(probs), 1, abs_tol=1e-5) for probs in answer["scores"])
    raw = sglang.post("/v1/score", json=body).json()["scores"]
    assert all(math.isclose(sum(probs), 0.5, abs_tol=1e-5) for probs in raw)
    missing = sglang.post("/v1/score", json={"query": "q", "items": ["a"]})
    assert (missing.status_code, missing.json()["message"]) == (
        400,
        "label_token_ids must be provided",
    )
    counted = sglang.metric("sglang:num_requests_total")
    vectors = sglang.openai().embeddings.create(model="tiny", input="hello")
    assert len(vectors.data[0].embedding) == 8
    assert sglang.metric("sglang:num_requests_total") == counted + 1


def test_sglang_tokenize_from_0_5_3_post1(sglang: Engine, sglang_old: Engine) -> None:
    texts = ["one text", "and another one"]
    answer = sglang.post("/v1/tokenize", json={"prompt": texts}).json()
    assert answer["count"] == [len(ids) for ids in answer["tokens"]] == [2, 4]
    assert answer["max_model_len"] == 4096
    back = sglang.post("/detokenize", json={"tokens": answer["tokens"]}).json()
    assert back == {"text": texts}
    single = sglang.post("/tokenize", json={"prompt": texts[0]}).json()
    assert single["tokens"] == answer["tokens"][0]
    assert httpx.post(f"{sglang.base}/tokenize", json={"prompt": "x"}).status_code == 401
    for path in ("/tokenize", "/v1/detokenize", "/v1/audio/transcriptions"):
        gone = sglang_old.post(path, json={"prompt": "x"})
        assert (gone.status_code, gone.json()) == (404, NOT_FOUND), path
    assert api_common.at_least("0.5.3.post1", tokenize_api.SGLANG_TOKENIZE_FROM)
    assert not api_common.at_least("0.5.3", tokenize_api.SGLANG_TOKENIZE_FROM)
    assert api_common.at_least("0.5.4", tokenize_api.SGLANG_TOKENIZE_FROM)


def test_sglang_generation_model_refuses_rerank_and_embeddings(sglang_old: Engine) -> None:
    rerank = sglang_old.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS})
    embed = sglang_old.post("/v1/embeddings", json={"input": "hello"})
    for refused in (rerank, embed):
        assert refused.status_code == 400
        assert refused.json()["message"] == pooling_api.NOT_EMBEDDING
    body = {"query": "q", "items": "a", "label_token_ids": [1]}
    assert len(sglang_old.post("/v1/score", json=body).json()["scores"]) == 1


def test_sglang_transcriptions(sglang: Engine) -> None:
    clip = audio_api.clip_of(SHORT)
    assert sglang.openai().audio.transcriptions.create(model="tiny", file=SHORT).text == clip.text
    plain = transcribe(sglang, SHORT, response_format="text")
    assert (plain.text, plain.headers["content-type"]) == (clip.text, "text/plain; charset=utf-8")
    verbose = transcribe(sglang, SHORT, response_format="verbose_json").json()
    assert (verbose["task"], verbose["duration"], verbose["usage"]["seconds"]) == (
        "transcribe",
        clip.seconds,
        2,
    )
    vtt = transcribe(sglang, SHORT, response_format="vtt")
    assert vtt.status_code == 400
    assert vtt.json() == {
        "error": {"message": "Only 'json', 'text', and 'verbose_json' formats supported"}
    }
    found = events(transcribe(sglang, SHORT, stream="true", model="tiny"))
    chunks = [e for e in found if isinstance(e, dict)]
    assert found[-1] == "[DONE]"
    assert "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks) == clip.text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-2:] == [None, "stop"]
    assert {c["model"] for c in chunks} == {"tiny"}
    assert chunks[0]["id"].startswith("trsc-")


def test_sglang_aborts_a_hung_up_transcription(sglang: Engine) -> None:
    hang_up_stream(sglang, "sglang:num_running_reqs")


# llama.cpp ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(servers: Servers) -> Iterator[Engine]:
    extra = ("--reranking", "--mmproj", str(servers.gguf), "--metrics", "--alias", "tiny")
    with servers.llama("llama-pooling", LLAMA_BUILD, PACED, *extra) as engine:
        yield engine


@pytest.fixture(scope="module")
def llama_bare(servers: Servers) -> Iterator[Engine]:
    """The first build with transcriptions, started without --reranking, --embeddings or
    --mmproj."""
    with servers.llama("llama-bare", LLAMA_BUILD, FAST) as engine:
        yield engine


def test_llamacpp_rerank_in_jina_and_tei_shapes(llama: Engine) -> None:
    for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
        assert httpx.post(llama.base + path, json={"query": QUERY}).status_code == 401
        jina = llama.post(path, json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2})
        answer = jina.json()
        assert (answer["model"], answer["object"], len(answer["results"])) == ("tiny", "list", 2)
        assert set(answer["results"][0]) == {"index", "relevance_score"}
        tokens = pooling_api.pair_tokens([(QUERY, d) for d in DOCUMENTS])
        assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    tei = llama.post("/rerank", json={"query": QUERY, "texts": DOCUMENTS, "return_text": True})
    ranks = tei.json()
    assert [r["text"] for r in ranks] == [DOCUMENTS[r["index"]] for r in ranks]
    assert [r["score"] for r in ranks] == sorted((r["score"] for r in ranks), reverse=True)
    missing = llama.post("/rerank", json={"documents": DOCUMENTS})
    assert missing.json() == {
        "error": {
            "code": 400,
            "message": '"query" must be provided',
            "type": "invalid_request_error",
        }
    }
    embedded = llama.openai().embeddings.create(model="tiny", input=["a", "b"])
    assert len(embedded.data) == 2


def test_llamacpp_tokenize_with_pieces_and_no_score_route(llama: Engine) -> None:
    text = "Tokenize me, please"
    pieces = llama.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == text
    ids = llama.post("/tokenize", json={"content": text}).json()["tokens"]
    assert ids == [p["id"] for p in pieces]
    assert llama.post("/detokenize", json={"tokens": ids}).json() == {"content": text}
    assert httpx.post(f"{llama.base}/tokenize", json={"content": text}).status_code == 401
    for path in ("/score", "/v1/score"):
        gone = llama.post(path, json={"text_1": "a", "text_2": "b"})
        assert (gone.status_code, gone.json()) == (404, api_common.LLAMA_NOT_FOUND), path


def test_llamacpp_transcriptions(llama: Engine) -> None:
    clip = audio_api.clip_of(SHORT)
    assert llama.openai().audio.transcriptions.create(model="x", file=SHORT).text == clip.text
    done = transcribe(llama, SHORT).json()
    assert (done["type"], done["text"]) == ("transcript.text.done", clip.text)
    assert done["usage"] == {
        "type": "tokens",
        "input_tokens": clip.prompt_tokens,
        "output_tokens": 5,
        "total_tokens": clip.prompt_tokens + 5,
        "input_tokens_details": {"cached_tokens": 0},
    }
    found = events(transcribe(llama, SHORT, stream="true"))
    assert found[-1] == "[DONE]"
    deltas = [e for e in found if isinstance(e, dict) and e["type"] == "transcript.text.delta"]
    assert "".join(e["delta"] for e in deltas) == clip.text
    assert found[-2] == done
    not_json = transcribe(llama, SHORT, response_format="text")
    assert (not_json.status_code, not_json.json()["error"]["message"]) == (
        400,
        "Only 'json' response_format is supported for transcription",
    )
    no_file = llama.post("/audio/transcriptions", data={"model": "x"})
    assert no_file.json()["error"]["message"] == "No input file found for transcription"
    hang_up_stream(llama, "llamacpp:requests_processing")


def test_llamacpp_refuses_what_it_was_not_started_for(llama_bare: Engine) -> None:
    rerank = llama_bare.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS})
    embed = llama_bare.post("/v1/embeddings", json={"input": "hello"})
    audio = transcribe(llama_bare, SHORT)
    for refused, message in (
        (rerank, "This server does not support reranking. Start it with `--reranking`"),
        (embed, "This server does not support embeddings. Start it with `--embeddings`"),
        (audio, "The current model does not support audio input."),
    ):
        assert refused.status_code == 501
        assert refused.json() == {
            "error": {"code": 501, "message": message, "type": "not_supported_error"}
        }


def test_llamacpp_before_transcriptions_answers_its_404(servers: Servers) -> None:
    extra = ("--mmproj", str(servers.gguf), "--embeddings")
    with servers.llama("llama-older", LLAMA_BUILD - 1, FAST, *extra) as engine:
        for path in ("/v1/audio/transcriptions", "/audio/transcriptions"):
            gone = transcribe(engine, SHORT) if path.startswith("/v1") else engine.post(path)
            assert (gone.status_code, gone.json()) == (404, api_common.LLAMA_NOT_FOUND), path
        assert engine.post("/embeddings", json={"input": "hello"}).status_code == 200
        rerank = engine.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS})
        assert rerank.status_code == 501


# Units ----------------------------------------------------------------------------------


def test_a_multipart_form_reads_fields_and_files() -> None:
    request = httpx.Request(
        "POST",
        "http://sim/",
        data={"model": "tiny", "stream": "true"},
        files={"file": ("a.wav", b"\r\n--not-the-end\r\n\x00")},
    )
    form = multipart.parse_form(request.headers["content-type"], request.read())
    assert form.fields == {"model": "tiny", "stream": "true"}
    assert form.files == {"file": b"\r\n--not-the-end\r\n\x00"}
    assert form.filenames == {"file": "a.wav"}
    assert multipart.parse_form("application/json", b"{}") == multipart.Form()


def test_a_clip_is_heard_from_its_length_and_bytes() -> None:
    assert audio_api.duration_of(silent_wav(3)) == 3
    assert audio_api.duration_of(b"\x01" * 64_000) == 2
    assert audio_api.clip_of(SHORT) == audio_api.clip_of(SHORT)
    assert audio_api.clip_of(SHORT).text != audio_api.clip_of(silent_wav(2.5)).text
    assert len(audio_api.clip_of(LONG).text.split()) == 300
    assert audio_api.form_bool("TRUE") is True
    assert audio_api.form_bool(None) is False
    assert audio_api.form_bool("maybe") is None
