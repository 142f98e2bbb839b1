"""The simulated TensorFold (CapyCTL's assumed CLI, not a verified engine): its command line,
key, loading, memory claims, update check, parallel slots and hang-ups."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engines.simulator.helpers import (
    FAST,
    GIB,
    HELLO,
    Engine,
    Engines,
    Installs,
    SimGpu,
    claim,
    closed_env,
    make_simgpu,
    serving,
    sse_events,
    wait_claim,
)
from enginesim import Behaviour, write_behaviour
from support import holds_for, wait_for

VERSION = "0.6.6"
KEY = "tf-key"
CONTEXT = 4096
WEIGHTS = 2 * GIB  # the `model_dir` fixture's two sparse safetensors files
KV = CONTEXT * 8 * (64 << 10)  # --context-length 4096 x the default --parallel 8 x 64 KiB
UNAUTHORIZED = {
    "error": {"message": "invalid api key", "type": "authentication_error", "code": 401}
}
UPDATE_CHECK = "tensorfold: checking for updates at https://updates.tensorfold.ai/check"
# Answers that go on until hung up on (ignore_eos), at a pace a loaded machine follows.
PACED = FAST.model_copy(update={"tokens_per_second": 20})
ENDLESS: dict[str, Any] = {
    "messages": HELLO,
    "stream": True,
    "max_tokens": 4000,
    "ignore_eos": True,
}


def serve_argv(executable: Path, model: Path, *extra: str) -> list[str]:
    """`tensorfold serve --model MODEL --port {port} --context-length 4096 EXTRA`."""
    return [
        str(executable),
        "serve",
        "--model",
        str(model),
        "--port",
        "{port}",
        "--context-length",
        str(CONTEXT),
        *extra,
    ]


def start(engines: Engines, behaviour: Behaviour, *extra: str, **env: str) -> Engine:
    """Launch `tensorfold serve` with `behaviour` on the test's GPU; it may still be loading."""
    executable = engines.installs.tensorfold(VERSION)
    write_behaviour(executable, behaviour)
    argv = serve_argv(executable, engines.model, *extra)
    env_all = closed_env(None, engines.home, **engines.gpu.env(), **env)
    return engines.launcher.start(argv, env_all, key=env.get("TENSORFOLD_API_KEY"))


def run(engines: Engines, *argv: str, **env: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a `tensorfold` command that ends by itself."""
    executable = str(engines.installs.tensorfold(VERSION))
    done = engines.launcher.run([executable, *argv], closed_env(None, engines.home, **env))
    return done.returncode, done.stdout, done.stderr


@pytest.fixture(scope="module")
def served(
    installs: Installs, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    folder = tmp_path_factory.mktemp("tensorfold-served")
    executable = installs.tensorfold(VERSION)
    write_behaviour(executable, FAST)
    extra = ("--served-model-name", "tiny", "--max-tokens", "512", "--thinking", "on")
    argv = serve_argv(executable, model_dir, *extra)
    gpu = make_simgpu(folder / "simgpu")
    env = closed_env(
        None, folder, **gpu.env(), TENSORFOLD_API_KEY=KEY, TENSORFOLD_NO_UPDATE_CHECK="1"
    )
    with serving(folder, argv, env, KEY) as engine:
        yield engine


def test_version(engines: Engines) -> None:
    assert run(engines, "--version") == (0, f"tensorfold {VERSION}\n", "")


def test_openai_sdk_with_the_key_streamed_and_not(served: Engine) -> None:
    client = served.openai()
    models = client.models.list().data
    assert [(m.id, m.owned_by) for m in models] == [("tiny", "tensorfold")]
    completion = client.chat.completions.create(model="tiny", messages=HELLO)
    assert completion.choices[0].message.content == FAST.answer
    assert completion.choices[0].finish_reason == "stop"
    assert completion.model == "tiny"
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=HELLO, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == FAST.answer
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens > 0
    assert client.completions.create(model="tiny", prompt="Hi").choices[0].text == FAST.answer
    streamed = client.completions.create(model="tiny", prompt="Hi", stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == FAST.answer
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="other", messages=HELLO)
    assert missing.value.status_code == 404


def test_refuses_without_the_key_but_health(served: Engine) -> None:
    assert httpx.get(f"{served.base}/health").json() == {"status": "ok"}
    for method, path in (
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/metrics"),
        ("POST", "/health"),
    ):
        refused = httpx.request(method, served.base + path, json={})
        assert (refused.status_code, refused.json()) == (401, UNAUTHORIZED), path
        wrong = httpx.request(method, served.base + path, headers={"Authorization": "Bearer x"})
        assert wrong.status_code == 401, path
    wrong_key = openai.OpenAI(base_url=f"{served.base}/v1", api_key="wrong", max_retries=0)
    with wrong_key, pytest.raises(openai.AuthenticationError):
        wrong_key.chat.completions.create(model="tiny", messages=HELLO)
    assert served.status("/metrics") == 404  # with the key: there is no such route


def test_health_is_loading_then_ok_and_sigterm_exits_0(engines: Engines, gpu: SimGpu) -> None:
    # A load long enough that a loaded machine still asks while it runs.
    engine = start(engines, FAST.model_copy(update={"load_seconds": 6}))
    engine.wait_status(503)
    loading = httpx.get(f"{engine.base}/health")
    assert (loading.status_code, loading.json()) == (503, {"status": "loading"})
    engine.wait_status(200)
    assert httpx.get(f"{engine.base}/health").json() == {"status": "ok"}
    assert engine.stop() == 0
    assert sorted(p.name for p in gpu.folder.iterdir()) == ["devices.json"]


@pytest.mark.parametrize(
    ("limit", "expected"),
    [("3.5", 7 * GIB // 2), ("8", WEIGHTS + KV), ("2.25", 9 * GIB // 4)],
)
def test_memory_limit_claims_the_smaller_of_it_and_weights_and_kv(
    engines: Engines, gpu: SimGpu, limit: str, expected: int
) -> None:
    engine = start(engines, FAST, TENSORFOLD_CUDA_MEMORY_LIMIT_GB=limit)
    engine.wait_status(200)
    wait_claim(gpu, engine.proc.pid, (expected, 0))
    assert engine.stop() == 0
    assert claim(gpu, engine.proc.pid) is None


def test_without_a_limit_it_takes_nine_tenths_of_the_free_memory(
    engines: Engines, gpu: SimGpu
) -> None:
    gpu.occupy(4 * GIB)
    engine = start(engines, FAST, "--parallel", "2")
    engine.wait_status(200)
    wait_claim(gpu, engine.proc.pid, ((gpu.total - 4 * GIB) * 9 // 10, 0))
    assert engine.stop() == 0
    assert claim(gpu, engine.proc.pid) is None


def test_a_limit_below_the_weights_is_out_of_memory(engines: Engines, gpu: SimGpu) -> None:
    engine = start(engines, FAST, TENSORFOLD_CUDA_MEMORY_LIMIT_GB="1.5")
    assert engine.wait_exit() == 1
    assert (
        "CUDA out of memory: TENSORFOLD_CUDA_MEMORY_LIMIT_GB=1.5 is below the model's "
        "weights (2.00 GiB)"
    ) in engine.output()
    assert claim(gpu, engine.proc.pid) is None
    status, _, err = run(
        engines, "serve", "--model", str(engines.model), "--context-length", "8",
        TENSORFOLD_CUDA_MEMORY_LIMIT_GB="lots",
    )  # fmt: skip
    assert status == 2
    assert "error: TENSORFOLD_CUDA_MEMORY_LIMIT_GB must be a number of GiB" in err


def test_bad_command_lines_exit_2(engines: Engines) -> None:
    model = str(engines.model)
    status, _, err = run(engines, "serve", "--model", model)
    assert status == 2
    assert err.splitlines()[-1].endswith(
        "error: the following arguments are required: --context-length"
    )
    status, _, err = run(engines, "serve", "--model", model, "--context-length", "8", "--bogus")
    assert (status, err.splitlines()[-1]) == (
        2,
        "tensorfold: error: unrecognized arguments: --bogus",
    )
    for bad in (["-m", model], ["--thinking", "maybe"], ["--max-tokens", "x"], ["--cont", "8"]):
        status, _, err = run(engines, "serve", "--model", model, "--context-length", "8", *bad)
        assert status == 2, bad
        assert "error:" in err, bad


def test_update_check_line_unless_turned_off(engines: Engines) -> None:
    checks = start(engines, FAST)
    quiet = start(engines, FAST, TENSORFOLD_NO_UPDATE_CHECK="1")
    checks.wait_status(200)
    quiet.wait_status(200)
    assert checks.output().count(UPDATE_CHECK) == 1
    assert UPDATE_CHECK not in quiet.output()
    assert "listening on" in quiet.output()


@dataclass
class Waiting:
    """A streamed request read in a thread: `sent` once its answer's head came (the engine
    has it), `started` at its first content."""

    sent: threading.Event = field(default_factory=threading.Event)
    started: threading.Event = field(default_factory=threading.Event)
    started_at: float = 0.0


def first_content(events: Iterator[dict[str, Any] | str]) -> None:
    next(e for e in events if isinstance(e, dict) and e["choices"][0]["delta"].get("content"))


def send_in_thread(engine: Engine) -> Waiting:
    """Send an endless stream in a thread that hangs up after its first content."""
    waiting = Waiting()

    def read() -> None:
        # The engine's end at the test's cleanup ends the read: nothing to report then.
        with (
            contextlib.suppress(httpx.HTTPError, StopIteration),
            httpx.stream(
                "POST",
                f"{engine.base}/v1/chat/completions",
                json=ENDLESS,
                headers=engine.headers,
                timeout=60,
            ) as streamed,
        ):
            waiting.sent.set()
            first_content(sse_events(streamed.iter_lines()))
            waiting.started_at = time.monotonic()
            waiting.started.set()

    threading.Thread(target=read, daemon=True).start()
    return waiting


def open_stream(client: httpx.Client) -> tuple[httpx.Response, Iterator[dict[str, Any] | str]]:
    """An endless stream, once its first content came."""
    request = client.build_request("POST", "/v1/chat/completions", json=ENDLESS)
    response = client.send(request, stream=True)
    events = sse_events(response.iter_lines())
    first_content(events)
    return response, events


def test_parallel_2_generate_while_a_third_waits(engines: Engines) -> None:
    engine = start(engines, PACED, "--parallel", "2")
    engine.wait_status(200)
    with httpx.Client(base_url=engine.base, timeout=30) as client:
        first, first_events = open_stream(client)
        second, second_events = open_stream(client)
        third = send_in_thread(engine)
        wait_for(third.sent.is_set, 10, "the third request to reach the engine")
        # Either running stream gives a token every 50 ms; the third gets none meanwhile.
        holds_for(lambda: not third.started.is_set(), 1.5, "the third request waiting")
        first_content(first_events)
        first_content(second_events)
        first.close()  # a hang-up: its slot goes to the third
        wait_for(third.started.is_set, 10, "the third request to start")
        first_content(second_events)
        second.close()


def test_a_hung_up_stream_frees_its_slot_at_once(engines: Engines) -> None:
    engine = start(engines, PACED, "--parallel", "1")
    engine.wait_status(200)
    with httpx.Client(base_url=engine.base, timeout=30) as client:
        running, _ = open_stream(client)
        waiting = send_in_thread(engine)
        wait_for(waiting.sent.is_set, 10, "the second request to reach the engine")
        holds_for(lambda: not waiting.started.is_set(), 0.5, "the second request waiting")
        hung_up = time.monotonic()
        running.close()
        # The first had 200 s of tokens left: the second starts as soon as the slot is free.
        wait_for(waiting.started.is_set, 10, "the second request to start")
    assert waiting.started_at - hung_up < 1.5
