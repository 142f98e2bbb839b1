"""One conformance suite, run against each engine family: the simulator as vLLM, SGLang,
llama-server and TensorFold, real llama.cpp, and a custom engine (the simulated vLLM started
from a registered command). Every engine is registered and launched exactly as CapyCTL does
it (detection or registration, the adapter's argv, the closed environment) and driven through
the adapter's control client and the openai SDK."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx
import openai
import pytest

from capycommon import simgpu
from capycommon.domain.engines import Residency
from capycommon.engines import apis
from capycommon.engines.control import Load
from capycommon.engines.detect import custom_profile
from capycommon.engines.families import LOAD_UNREAD, Family
from capycommon.engines.registry import EngineProfile
from capycommon.errors import CapabilityMissing
from enginerun import KEY, RunningEngine, launch, make_devices, sparse_model
from engines.llamacpp.llama_server import write_wrapper
from engines.llamacpp.tinygguf import write_tiny_model
from enginesim.behaviour import Behaviour
from enginesim.install import (
    install_llama_server,
    install_python_engine,
    install_tensorfold,
    write_behaviour,
)
from support import short_dir, wait_for

GiB = 1 << 30
# Each verified version whose behaviour differs where CapyCTL calls: vLLM 0.29.0 and 0.32.0,
# SGLang 0.5.16 and 0.5.22 (the versions the 0.1.7 notes name).
TARGETS = (
    "vllm-0.29.0",
    "vllm-0.32.0",
    "sglang-0.5.16",
    "sglang-0.5.22",
    "llamacpp",
    "llamacpp-real",
    "tensorfold",
    "custom",
)
# A custom engine: an OpenAI-compatible server CapyCTL knows only by the command registered.
CUSTOM_COMMAND = (
    "{python} -m vllm.entrypoints.openai.api_server --model {{model}} --host {{host}} "
    "--port {{port}} --served-model-name {{served_name}} --gpu-memory-utilization 0.5"
)


@dataclass(frozen=True)
class Target:
    name: str
    family: Family
    install: Path
    model: Path
    simgpu: Path | None
    # A custom engine's registration (None: found by probing `install`).
    profile: EngineProfile | None = None

    @property
    def simulated(self) -> bool:
        return self.simgpu is not None

    @property
    def load_read(self) -> bool:
        return self.family not in LOAD_UNREAD


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    folder = short_dir("conf")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _target(name: str, root: Path) -> Target:
    simgpu = root / "simgpu"
    if not (simgpu / "devices.json").exists():
        make_devices(simgpu, "gpu0:24GiB")
    fast = Behaviour(load_seconds=0.3, warmup_seconds=0.2, tokens_per_second=200)
    if name.startswith(("vllm-", "sglang-")):
        family: Literal["vllm", "sglang"] = "vllm" if name.startswith("vllm-") else "sglang"
        version = name.partition("-")[2]
        install = install_python_engine(root / family, family, version, fast)
        model = sparse_model(root / "m-hf", 2 * GiB)
        return Target(name, Family(family), install, model, simgpu)
    if name == "tensorfold":
        install = install_tensorfold(root / "tensorfold", "0.6.6", fast)
        return Target(name, Family.TENSORFOLD, install, sparse_model(root / "m-hf", GiB), simgpu)
    if name == "custom":
        install = install_python_engine(root / "served", "vllm", "0.29.0", fast)
        command = CUSTOM_COMMAND.format(python=install / "bin" / "python")
        profile = custom_profile("served", command, "/health", "VLLM_API_KEY", "0.29.0")
        model = sparse_model(root / "m-hf", 2 * GiB)
        return Target(name, Family.CUSTOM, install, model, simgpu, profile)
    if name == "llamacpp":
        install = install_llama_server(root / "llama-sim", 6500, fast)
        model = sparse_model(root / "m-gguf", 1 * GiB, gguf=True)
        return Target(name, Family.LLAMACPP, install, model, simgpu)
    model_dir = root / "m-tiny"
    model_dir.mkdir(exist_ok=True)
    write_tiny_model(model_dir / "tiny.gguf")
    return Target(name, Family.LLAMACPP, write_wrapper(root / "llama-real"), model_dir, None)


@pytest.fixture(scope="module", params=TARGETS)
def target(request: pytest.FixtureRequest, workdir: Path) -> Target:
    return _target(str(request.param), workdir / str(request.param))


def _start(target: Target, work: Path, **kwargs: object) -> RunningEngine:
    install = target.profile or target.install
    return launch(install, work, target.model, simgpu_dir=target.simgpu, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(target: Target, workdir: Path) -> Iterator[RunningEngine]:
    running = _start(target, workdir / f"run-{target.name}")
    yield running
    running.stop()


def test_ready_engines_answer_the_canary(engine: RunningEngine) -> None:
    assert engine.control(lambda c: c.ready())
    answer = engine.control(lambda c: c.canary())
    assert isinstance(answer, str)


def test_models_lists_the_served_name(engine: RunningEngine) -> None:
    models = [m.id for m in engine.openai().models.list()]
    assert models == ["tiny"]


def test_chat_non_streamed(engine: RunningEngine) -> None:
    reply = engine.openai().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say hello"}], max_tokens=8
    )
    choice = reply.choices[0]
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in {"stop", "length"}
    assert reply.usage is not None
    assert reply.usage.prompt_tokens > 0
    assert reply.usage.completion_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_streamed_with_usage(engine: RunningEngine) -> None:
    stream = engine.openai().chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert len(finishes) == 1
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens > 0


def test_the_per_launch_key_is_required(engine: RunningEngine) -> None:
    with pytest.raises(openai.AuthenticationError):
        engine.openai("not-the-key").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    bare = httpx.post(
        f"{engine.base_url}/v1/chat/completions", json={"model": "tiny", "messages": []}
    )
    assert bare.status_code == 401


def test_an_idle_engine_reports_no_load(engine: RunningEngine, target: Target) -> None:
    if not target.load_read:
        with pytest.raises(CapabilityMissing, match="its load is the routers' places"):
            engine.control(lambda c: c.load())
        return
    load = engine.control(lambda c: c.load())
    assert load == Load(running=0, waiting=0)


def _stream_slowly(
    engine: RunningEngine, stop: threading.Event, request_id: str | None = None
) -> None:
    extra: dict[str, object] = {"rid": request_id} if request_id else {}
    headers = {"X-Request-Id": request_id} if request_id else {}
    stream = engine.openai().chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Tell a long story"}],
        max_tokens=4000,
        stream=True,
        extra_body=extra,
        extra_headers=headers,
    )
    with stream:
        for _ in stream:
            if stop.is_set():
                break


@pytest.fixture
def slow(target: Target, tmp_path: Path) -> Iterator[RunningEngine]:
    if not target.simulated:
        pytest.skip("real llama.cpp on a tiny model answers too fast to watch it run")
    write_behaviour(
        target.install, Behaviour(load_seconds=0.3, warmup_seconds=0.2, tokens_per_second=20)
    )
    running = _start(target, tmp_path)
    yield running
    running.stop()


def test_a_client_hang_up_stops_the_engines_work(slow: RunningEngine, target: Target) -> None:
    if not target.load_read:
        pytest.skip("CapyCTL reads no load to watch it by (the e2e test watches the places)")
    stop = threading.Event()
    client = threading.Thread(target=_stream_slowly, args=(slow, stop))
    client.start()
    wait_for(
        lambda: slow.control(lambda c: c.load()).running == 1, timeout=10, what="a running request"
    )
    stop.set()
    client.join(timeout=10)
    lag = 6 if target.family == Family.SGLANG else 2
    wait_for(lambda: slow.control(lambda c: c.load()).running == 0, timeout=lag, what="the abort")


def test_sglang_aborts_by_request_id(slow: RunningEngine, target: Target) -> None:
    if target.family != Family.SGLANG:
        pytest.skip("only SGLang aborts by request id")
    stop = threading.Event()
    client = threading.Thread(target=_stream_slowly, args=(slow, stop, "capy-req-1"))
    client.start()
    wait_for(
        lambda: slow.control(lambda c: c.load()).running == 1, timeout=10, what="a running request"
    )
    slow.control(lambda c: c.abort("capy-req-1"))
    wait_for(
        lambda: slow.control(lambda c: c.load()).running == 0, timeout=2, what="the abort by rid"
    )
    client.join(timeout=10)
    assert not client.is_alive(), "the aborted stream ended"


PARKING = [Residency.HOST_BACKED, Residency.DEEP]


@pytest.mark.parametrize("residency", PARKING, ids=str)
def test_park_frees_the_device_and_wake_restores_it(
    target: Target, tmp_path: Path, residency: Residency
) -> None:
    if target.family in (Family.LLAMACPP, *LOAD_UNREAD):
        pytest.skip(f"{target.family} cannot park: restart_only")
    write_behaviour(
        target.install, Behaviour(load_seconds=0.3, warmup_seconds=0.2, tokens_per_second=200)
    )
    # A device of its own: the module's engine holds half of the shared one, and SGLang's
    # budget is a fraction of the memory free when it starts.
    folder = tmp_path / "simgpu"
    make_devices(folder, "gpu0:24GiB")
    alone = Target(target.name, target.family, target.install, target.model, folder)
    running = _start(alone, tmp_path, residency=residency)
    try:
        budget = int(0.5 * 24 * GiB)
        wait_for(lambda: running.device_bytes()[0] == budget, timeout=5, what="the full budget")
        running.control(lambda c: c.park(residency))

        def released() -> tuple[int, int] | None:
            now = running.device_bytes()
            return now if now[0] < budget else None

        parked = wait_for(released, timeout=5, what="the device memory to be released")
        assert parked[0] <= 1 * GiB, "only a residue stays on the device"
        if residency == Residency.HOST_BACKED:
            assert parked[1] >= 2 * GiB, "the weights wait in host RAM"
        running.control(lambda c: c.wake(residency))
        wait_for(lambda: running.device_bytes()[0] == budget, timeout=5, what="the memory back")
        assert running.control(lambda c: c.canary()) != ""
    finally:
        running.stop()


def test_sigterm_to_the_group_leaves_nothing(target: Target, tmp_path: Path) -> None:
    running = _start(target, tmp_path)
    code = running.stop()
    assert code is not None
    if target.simulated:
        assert running.device_bytes() == (0, 0)


def test_a_full_device_refuses_the_start_with_the_engines_own_error(
    target: Target, tmp_path: Path
) -> None:
    if not target.simulated:
        pytest.skip("real llama.cpp here runs on the CPU")
    folder = tmp_path / "simgpu"
    (device,) = make_devices(folder, "gpu0:24GiB")
    # Another process holds all but half a GiB of the device.
    simgpu.write_claim(folder, os.getpid(), simgpu.Claim(uuid=device.uuid, bytes=47 * GiB // 2))
    full = Target(target.name, target.family, target.install, target.model, folder)
    running = _start(full, tmp_path, wait_ready=False)
    code = running.proc.wait(timeout=30)
    simgpu.remove_claim(folder, os.getpid())
    assert code != 0
    expected = {
        Family.VLLM: "Free memory on device",
        Family.SGLANG: "Not enough memory",
        Family.LLAMACPP: "out of memory",
        Family.TENSORFOLD: "CUDA out of memory",
        Family.CUSTOM: "Free memory on device",
    }[target.family]
    assert expected in running.output()


# A minimal request of each API beyond chat, as its route takes it (the engine's own fields).
API_REQUESTS: dict[str, dict[str, object]] = {
    "responses": {"input": "hi", "max_output_tokens": 4},
    "messages": {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "messages.count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
    "embeddings": {"input": "hi"},
    "rerank": {"query": "a", "documents": ["a", "b"]},
    "score": {"text_1": "a", "text_2": "b"},
    "tokenize": {"prompt": "hi", "content": "hi"},
    "detokenize": {"tokens": [1, 2]},
}


def _asked(engine: RunningEngine, api: str) -> httpx.Response:
    path = "/tokenize" if api == "tokenize" else "/detokenize" if api == "detokenize" else ""
    path = path or "/v1/" + api.replace(".", "/")
    headers = {"Authorization": f"Bearer {KEY}"}
    if api == "audio.transcriptions":
        form = {"model": "tiny"}
        files = {"file": ("a.wav", b"RIFF" + bytes(40), "audio/wav")}
        return httpx.post(engine.base_url + path, headers=headers, data=form, files=files)
    body = {"model": "tiny", **API_REQUESTS[api]}
    return httpx.post(engine.base_url + path, headers=headers, json=body, timeout=30)


def test_each_api_is_served_where_capyctl_says_its_version_serves_it(
    engine: RunningEngine, target: Target
) -> None:
    """CapyCTL's table of the APIs each family serves by version (`engines.apis`) holds for
    the engine: a route it says is served is there (answered, or refused for this model:
    400, 422, 501), one it says is not is the engine's 404."""
    profile = engine.spec.profile
    for api in apis.APIS[2:]:
        answer = _asked(engine, api)
        served = apis.serves(profile.family, profile.version, api)
        if served:
            assert answer.status_code != 404, (api, answer.text[:300])
        else:
            assert answer.status_code == 404, (api, answer.status_code, answer.text[:300])
