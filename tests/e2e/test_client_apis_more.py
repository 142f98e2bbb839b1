"""The router's one-answer APIs (rerank, score, tokenize and detokenize) with httpx, audio
transcriptions with the openai SDK and as a multipart form, and a client's hang-up on each
streamed route of the newer APIs (responses, messages, a streamed transcription), through a
real standalone role. The engine simulator runs as vLLM 0.29.0 (also at 8 tokens a second),
SGLang 0.5.16 (also with --is-embedding) and llama.cpp build 8800 started with --reranking."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from clientapis import silent_wav, streamed_whole
from cluster import SMALL, Cluster, running
from enginesim.install import install_llama_server
from support import cancel, wait_for

HI: list[Any] = [{"role": "user", "content": "hi"}]
LLAMA_BUILD = 8800


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """One role for the file, on a GPU every model fits on together: `vl` (vLLM 0.29.0),
    `sg` (SGLang 0.5.16), `sge` (SGLang 0.5.16 with --is-embedding), `slow` (vLLM at 8
    tokens a second) and `ll` (llama.cpp build 8800 with --reranking), each started once."""
    with running("client-apis-more", gpus="gpu0:80GiB") as found:
        llama = install_llama_server(found.root / "e" / "llama88", LLAMA_BUILD)
        found.ok("engine", "add", str(llama), "--name", "llama88")
        found.deploy("vl", engine="vllm", model="small", engine_config=SMALL)
        found.deploy("sg", engine="sglang", model="small", engine_config=SMALL)
        embedding = {**SMALL, "extra_args": ["--is-embedding"]}
        found.deploy("sge", engine="sglang", model="small", engine_config=embedding)
        found.deploy("slow", engine="slow", model="small", engine_config=SMALL)
        found.deploy(
            "ll",
            engine="llama88",
            model="gguf",
            engine_config={"context_length": 4096, "extra_args": ["--reranking"]},
        )
        for name in ("vl", "sg", "sge", "slow", "ll"):
            found.start(name)
        yield found


def http(cluster: Cluster, timeout: float = 60) -> httpx.Client:
    """An httpx client of the router's root (the tokenizer routes are not under /v1)."""
    return httpx.Client(
        base_url=cluster.base_url.removesuffix("/v1"),
        headers={"Authorization": f"Bearer {cluster.api_key}"},
        timeout=timeout,
    )


def ok(answer: httpx.Response) -> dict[str, Any]:
    assert answer.status_code == 200, answer.text
    found = answer.json()
    assert isinstance(found, dict)
    return found


def test_rerank_score_and_embeddings(cluster: Cluster) -> None:
    """Each engine's own shape, under the model asked for: vLLM's and llama.cpp's rerank
    results best first (the document that is the query itself first, at 1.0), vLLM's
    scores of pairs, SGLang's label probabilities per item, and SGLang's embeddings."""
    documents = ["a dog", "a cat", "a car"]
    with http(cluster) as client:
        for model in ("vl", "ll"):
            asked = {"model": model, "query": "a cat", "documents": documents}
            ranked = ok(client.post("/v1/rerank", json=asked))
            assert ranked["model"] == model
            results = ranked["results"]
            assert sorted(result["index"] for result in results) == [0, 1, 2]
            scores = [result["relevance_score"] for result in results]
            assert scores == sorted(scores, reverse=True)
            assert (results[0]["index"], scores[0]) == (1, 1.0)
            assert ranked["usage"]["total_tokens"] > 0
            top = ok(client.post("/v1/rerank", json={**asked, "top_n": 1}))
            assert [result["index"] for result in top["results"]] == [1]
        pairs = {"model": "vl", "text_1": "a cat", "text_2": ["a cat", "a dog"]}
        scored = ok(client.post("/v1/score", json=pairs))
        assert scored["model"] == "vl"
        assert [item["index"] for item in scored["data"]] == [0, 1]
        first, second = (item["score"] for item in scored["data"])
        assert first == 1.0 > second
        items = {"query": "Is it a cat? ", "items": ["yes", "no"], "apply_softmax": True}
        labels = ok(
            client.post("/v1/score", json={"model": "sg", "label_token_ids": [9, 27], **items})
        )
        assert labels["model"] == "sg"
        assert [len(pair) for pair in labels["scores"]] == [2, 2]
        for pair in labels["scores"]:
            assert sum(pair) == pytest.approx(1, abs=1e-5)
        streamed = {"model": "vl", "query": "a", "documents": ["b"], "stream": True}
        refused = client.post("/v1/rerank", json=streamed)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "invalid_request"
    assert "rankings are never streamed" in error["message"]
    vectors = cluster.openai(timeout=60).embeddings.create(model="sge", input=["a cat", "a"])
    assert vectors.model == "sge"
    assert [len(item.embedding) > 0 for item in vectors.data] == [True, True]


def test_rerank_answered_as_a_list(cluster: Cluster) -> None:
    """SGLang (for a model started with --is-embedding) ranks in a bare list, best first;
    llama.cpp does too for a request in TEI's shape."""
    documents = ["a dog", "a cat", "a car"]
    with http(cluster) as client:
        ranked = client.post(
            "/v1/rerank", json={"model": "sge", "query": "a cat", "documents": documents}
        )
        tei = client.post("/v1/rerank", json={"model": "ll", "query": "a cat", "texts": documents})
    for answer in (ranked, tei):
        assert answer.status_code == 200, answer.text
        results = answer.json()
        assert isinstance(results, list)
        assert results[0]["index"] == 1
        assert sorted(result["index"] for result in results) == [0, 1, 2]


def test_tokenize_and_detokenize(cluster: Cluster) -> None:
    """Each family's own fields; what an engine tokenized it detokenizes back."""
    text = "Hello, tokenizer!"
    asked: list[tuple[str, dict[str, Any], str, str]] = [
        ("vl", {"prompt": text}, "tokens", "prompt"),
        ("sg", {"prompt": text}, "tokens", "text"),
        ("ll", {"content": text}, "tokens", "content"),
    ]
    with http(cluster) as client:
        for model, fields, tokens_field, text_field in asked:
            tokens = ok(client.post("/tokenize", json={"model": model, **fields}))[tokens_field]
            assert len(tokens) == 5, "four characters a token"
            assert all(isinstance(token, int) for token in tokens)
            back = ok(client.post("/detokenize", json={"model": model, "tokens": tokens}))
            assert back[text_field] == text, model
        counted = ok(
            client.post(
                "/tokenize", json={"model": "vl", "prompt": text, "return_token_strs": True}
            )
        )
        assert counted["count"] == 5
        assert "".join(counted["token_strs"]) == text
        refused = client.post("/tokenize", json={"model": "vl", "prompt": text, "stream": True})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "invalid_request"


def test_transcriptions(cluster: Cluster) -> None:
    """An upload through the openai SDK and as an httpx form. The simulated model hears a
    clip by its bytes, so every engine hears one upload the same: vLLM answers JSON (for
    response_format text too), SGLang's text is text/plain, passed on as it came."""
    audio = silent_wav(2)
    client = cluster.openai(timeout=60)
    heard = client.audio.transcriptions.create(model="vl", file=("clip.wav", audio, "audio/wav"))
    assert re.fullmatch(r"[A-Z][a-z ]+\.", heard.text), heard.text
    upload = {"file": ("clip.wav", audio, "audio/wav")}
    with http(cluster) as raw:
        as_json = raw.post(
            "/v1/audio/transcriptions",
            files=upload,
            data={"model": "vl", "response_format": "text"},
        )
        assert ok(as_json)["text"] == heard.text
        as_text = raw.post(
            "/v1/audio/transcriptions",
            files=upload,
            data={"model": "sg", "response_format": "text"},
        )
        assert as_text.status_code == 200, as_text.text
        assert as_text.headers["content-type"].startswith("text/plain")
        assert as_text.text == heard.text
        assert as_text.headers["X-CapyCTL-Request-Id"].startswith("trsc-")
        # Streamed: chunks of the text, ended by [DONE].
        with raw.stream(
            "POST", "/v1/audio/transcriptions", files=upload, data={"model": "vl", "stream": "true"}
        ) as streamed:
            assert streamed.status_code == 200
            lines = [line for line in streamed.iter_lines() if line.startswith("data:")]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[5:]) for line in lines[:-1]]
        assert {chunk["model"] for chunk in chunks} == {"vl"}
        text = "".join(
            chunk["choices"][0]["delta"].get("content") or ""
            for chunk in chunks
            if chunk["choices"]
        )
        assert text == heard.text
        # llama.cpp hears only with an audio projector (--mmproj): its 501.
        unheard = raw.post("/v1/audio/transcriptions", files=upload, data={"model": "ll"})
        assert unheard.status_code == 400
        assert unheard.json()["error"]["code"] == "capability_missing:audio.transcriptions"
        # The form is checked before the request takes a place.
        wrong = raw.post(
            "/v1/audio/transcriptions", files=upload, data={"model": "vl", "stream": "maybe"}
        )
        assert wrong.status_code == 400
        assert "form field 'stream' is 'maybe'" in wrong.json()["error"]["message"]
        nofile = raw.post(
            "/v1/audio/transcriptions", files={"audio": ("clip.wav", audio)}, data={"model": "vl"}
        )
        assert nofile.status_code == 400
        assert "no file part named 'file'" in nofile.json()["error"]["message"]


def test_a_hang_up_stops_the_engines_work_on_each_streamed_route(cluster: Cluster) -> None:
    """A client that goes after the first event of a streamed response, message or
    transcription (the engine has 10 s and more of it left, at 8 tokens a second): the
    engine stops working on it at once, and the router counts it cancelled, by route."""
    streamed: list[tuple[str, dict[str, Any]]] = [
        ("/v1/responses", {"json": {"model": "slow", "input": "hi", "stream": True}}),
        (
            "/v1/messages",
            {"json": {"model": "slow", "max_tokens": 400, "messages": HI, "stream": True}},
        ),
        (
            "/v1/audio/transcriptions",
            {
                "files": {"file": ("long.wav", silent_wav(60), "audio/wav")},
                "data": {"model": "slow", "stream": "true"},
            },
        ),
    ]
    for path, request in streamed:
        _hang_up(cluster, path, request)
        wait_for(
            lambda: cluster.engine_running("slow") == 0,
            timeout=2,
            what=f"the engine to stop the work of the cut request on {path}",
        )
        # Its place comes back once hostd reads the engine idle.
        wait_for(
            lambda: cluster.status("slow")["requests"]["running"] == 0,
            timeout=30,
            what="the cut request to settle once the engine reads idle",
        )
    with http(cluster) as client:
        text = client.get("/metrics").text
    for route in ("responses", "messages", "audio.transcriptions"):
        counted = (
            f'capyctl_requests_total{{deployment="slow",outcome="cancelled",route="{route}"}} 1.0'
        )
        assert counted in text, route


def _hang_up(cluster: Cluster, path: str, request: dict[str, Any]) -> None:
    """Send a streamed request, read its first event, check the engine works on it, then
    hang up (the connection closed as a cancelled client closes it)."""

    async def cut() -> None:
        headers = {"Authorization": f"Bearer {cluster.api_key}"}
        root = cluster.base_url.removesuffix("/v1")
        async with httpx.AsyncClient(base_url=root, headers=headers, timeout=30) as client:
            first = asyncio.Event()
            seen: list[str] = []  # the router's status, and the first event

            async def send() -> None:
                async with client.stream("POST", path, **request) as response:
                    seen.append(str(response.status_code))
                    # Held until the hang-up: a line iterator left behind is finalized at
                    # once, and its finalization closes the connection (a hang-up too soon).
                    lines = response.aiter_lines()
                    async for line in lines:
                        if line.startswith("data:"):
                            seen.append(line[:300])
                            first.set()
                            break
                    await asyncio.Event().wait()  # held until the hang-up cancels it

            task = asyncio.create_task(send())
            try:
                await asyncio.wait_for(first.wait(), 20)
            except TimeoutError:
                await cancel(task)
                raise AssertionError(f"no first event on {path}: {seen}") from None
            assert seen[0] == "200", seen
            await asyncio.to_thread(
                wait_for,
                lambda: cluster.engine_running("slow") == 1,
                timeout=10,
                what=f"the engine to work on the request on {path}",
            )
            await cancel(task)

    asyncio.run(cut())


def test_sglang_keeps_responses_without_being_asked(cluster: Cluster) -> None:
    """SGLang up to 0.5.19 keeps every response: previous_response_id continues one with no
    flag. Its stream has no item events: created, in progress, then the whole response."""
    client = cluster.openai(timeout=60)
    first = client.responses.create(model="sg", input="My name is Ada.")
    assert first.output_text
    alone = client.responses.create(model="sg", input="What is my name?")
    second = client.responses.create(
        model="sg", input="What is my name?", previous_response_id=first.id
    )
    assert second.output_text == first.output_text
    assert second.usage is not None
    assert alone.usage is not None
    assert second.usage.input_tokens > alone.usage.input_tokens, "the earlier turn was read"
    events = list(client.responses.create(model="sg", input="hi", stream=True))
    done = streamed_whole(events)
    assert (done.model, done.output_text) == ("sg", first.output_text)
