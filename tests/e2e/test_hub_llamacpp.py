"""Real llama.cpp serves a GGUF pulled from the Hub, end to end on a standalone role: the
deployment names `model: {hf: ..., files: ["*.gguf"]}`, the first request waits while hostd
downloads only the GGUF into the model store, and llama.cpp (xllamacpp's build of
llama-server, on the CPU) answers from there. The Hub is the mock hub on loopback; the model is
the tiny generated one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import xllamacpp as xlc  # type: ignore[import-untyped]  # no stubs

from cluster import SMALL, Cluster, on_hub
from engines.llamacpp.llama_server import write_wrapper
from engines.llamacpp.tinygguf import write_tiny_model
from mockhub import HubFile, MockHub, one_commit_repo
from support import processes_mentioning

REPO = "acme/tiny-gguf"
README = b"# tiny-gguf\n\nA tiny random llama for tests.\n"
CONFIG = b'{"model_type": "llama"}\n'


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_tiny_model(tmp_path_factory.mktemp("gguf") / "model.gguf").read_bytes()


@pytest.fixture(scope="module")
def hub(gguf: bytes) -> Iterator[MockHub]:
    files = [
        HubFile("README.md", README, lfs=False),
        HubFile("config.json", CONFIG, lfs=False),
        HubFile("model.gguf", gguf, lfs=True),
    ]
    with MockHub.start([one_commit_repo(REPO, files)]) as served:
        yield served


@pytest.fixture(scope="module")
def cluster(hub: MockHub) -> Iterator[Cluster]:
    yield from on_hub("hub-llama", hub)


def test_real_llamacpp_serves_a_gguf_pulled_from_the_hub(
    hub: MockHub, cluster: Cluster, gguf: bytes
) -> None:
    wrapper = write_wrapper(cluster.root / "llama.cpp")
    cluster.ok("engine", "add", str(wrapper), "--name", "llamacpp")
    cluster.deploy(
        "tiny-gguf",
        engine="llamacpp",
        model={"hf": REPO, "files": ["*.gguf"]},
        residency="restart_only",
        engine_config={"context_length": 512, **SMALL},
    )
    commit = hub.repos[REPO].refs["main"]
    assert cluster.status("tiny-gguf")["document"]["model"]["hf"] == f"{REPO}@{commit}"

    # The first request starts the model: hostd downloads it, then llama.cpp serves it.
    answer = cluster.openai().chat.completions.create(
        model="tiny-gguf",
        messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=16,
        temperature=0,
    )
    assert answer.choices[0].message.content
    assert answer.model == "tiny-gguf"
    assert answer.usage is not None
    assert answer.usage.prompt_tokens > 0
    assert answer.usage.completion_tokens > 0
    # llama.cpp signs its answers with its build: xllamacpp's, not the simulator's.
    build = xlc.BUILD_INFO
    assert answer.system_fingerprint == f"b{build['build_number']}-{build['commit']}"

    # Only the GGUF came down: `files` kept the README and the config on the Hub.
    folder = cluster.root / "models" / "sources" / "huggingface"
    (store,) = folder.glob(f"acme--tiny-gguf@{commit}*")
    assert sorted(p.name for p in store.iterdir() if not p.name.startswith(".")) == ["model.gguf"]
    weights = store / "model.gguf"
    assert weights.read_bytes() == gguf
    fetched = {r.path.rsplit("/", 1)[-1] for r in hub.requests if "/resolve/" in r.path}
    assert fetched == {"model.gguf"}, "the Hub was asked for the GGUF alone"

    # The engine is the registered llama-server, loading the store's file.
    (engine,) = processes_mentioning(str(weights))
    argv = Path(f"/proc/{engine}/cmdline").read_bytes().decode().split("\0")
    assert str(wrapper) in argv[:2], argv
    assert argv[argv.index("-m") + 1] == str(weights)
