"""A real llama.cpp server (xllamacpp's build of llama-server) with a tiny generated model, on CPU.

Each test talks to a real process started through the `llama-server` wrapper, with the flags
CapyCTL's llamacpp adapter passes, over HTTP, with the `openai` SDK where a client would use it.
"""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from engines.llamacpp.llama_server import write_wrapper
from engines.llamacpp.tinygguf import write_tiny_model
from ports import free_port
from support import clean_env, wait_for

API_KEY = "test-key"
ALIAS = "tiny-random"
START_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0


@dataclass
class LlamaServer:
    """A `llama-server` process under test."""

    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> httpx.Response | None:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=2)
        except httpx.TransportError:
            return None

    def healthy(self) -> bool:
        """True once /health answers 200; fails the test if the process has exited."""
        if self.proc.poll() is not None:
            raise AssertionError(f"llama-server exited {self.proc.returncode}:\n{self.output()}")
        response = self.health()
        return response is not None and response.status_code == 200

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


@dataclass(frozen=True)
class Install:
    """A folder holding the `llama-server` wrapper and the tiny model."""

    llama_server: Path
    model: Path


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Install:
    folder = tmp_path_factory.mktemp("llamacpp")
    return Install(write_wrapper(folder), write_tiny_model(folder / "tiny.gguf"))


def launch(install: Install, model: Path | None = None) -> LlamaServer:
    """Start llama-server with the flags and environment CapyCTL's adapter uses."""
    port = free_port()
    log_path = install.model.parent / f"llama-server-{port}.log"
    argv = [
        str(install.llama_server),
        "-m",
        str(model or install.model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--alias",
        ALIAS,
        "-c",
        "1024",
        "-np",
        "2",
        "--metrics",
        "--no-webui",
        "-ngl",
        "0",
        "--jinja",
        "--reasoning-format",
        "none",
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=clean_env(LLAMA_API_KEY=API_KEY)
        )
    return LlamaServer(proc, f"http://127.0.0.1:{port}", log_path)


@contextmanager
def running(install: Install) -> Iterator[LlamaServer]:
    """A healthy llama-server for the block, stopped after it whatever happens."""
    server = launch(install)
    try:
        wait_for(server.healthy, timeout=START_TIMEOUT, what="llama-server's /health to be 200")
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(install: Install) -> Iterator[LlamaServer]:
    with running(install) as handle:
        yield handle


def run(install: Install, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(install.llama_server), *args], capture_output=True, text=True, timeout=30, check=False
    )


def test_version_prints_the_llamacpp_build(install: Install) -> None:
    result = run(install, "--version")
    assert result.returncode == 0, result.stderr
    assert re.match(r"version: [1-9]\d* \(\w+\)\nbuilt with .+ for .+\n", result.stderr)


def test_an_unknown_flag_fails(install: Install) -> None:
    result = run(install, "-m", str(install.model), "--no-such-flag")
    assert result.returncode == 1
    assert "--no-such-flag" in result.stderr


def test_a_model_that_does_not_load_exits_1(install: Install) -> None:
    broken = install.model.parent / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    server = launch(install, model=broken)
    assert server.proc.wait(timeout=START_TIMEOUT) == 1
    assert "exiting due to model loading error" in server.output()


def test_models_lists_the_alias(server: LlamaServer) -> None:
    with server.client() as client:
        models = client.models.list().data
    assert [m.id for m in models] == [ALIAS]
    assert models[0].owned_by == "llamacpp"


def test_chat_completion(server: LlamaServer) -> None:
    with server.client() as client:
        reply = client.chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": "Hello, capybara!"}], max_tokens=16
        )
    choice = reply.choices[0]
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage is not None
    assert reply.usage.prompt_tokens > 0
    assert 0 < reply.usage.completion_tokens <= 16
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_completion_streamed(server: LlamaServer) -> None:
    with server.client() as client:
        stream = client.chat.completions.create(
            model=ALIAS,
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishing) == 1
    assert finishing[0].choices[0].finish_reason in ("stop", "length")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == []  # the usage chunk comes last
    assert chunks[-1].usage is not None
    assert 0 < chunks[-1].usage.completion_tokens <= 16
    assert all(isinstance(c.choices[0].delta.content or "", str) for c in chunks if c.choices)


def test_stream_ends_with_done_on_the_wire(server: LlamaServer) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/chat/completions", json=body, headers=headers, timeout=30
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_a_wrong_key_gets_401_and_health_stays_public(server: LlamaServer) -> None:
    with (
        server.client(api_key="wrong-key") as client,
        pytest.raises(openai.AuthenticationError) as caught,
    ):
        client.chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
        )
    assert caught.value.status_code == 401
    assert caught.value.body == {
        "message": "Invalid API Key",
        "type": "authentication_error",
        "code": 401,
    }
    health = httpx.get(f"{server.base_url}/health", timeout=5)
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    # Unlike older builds (engines.md 3.2), this llama.cpp guards the model list too.
    assert httpx.get(f"{server.base_url}/v1/models", timeout=5).status_code == 401


def test_sigterm_stops_it_with_exit_0(install: Install) -> None:
    with running(install) as server:
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=STOP_TIMEOUT) == 0
        assert server.health() is None
