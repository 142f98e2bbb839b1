"""Engine keys are secret: no process of an engine hostd launched (its process group, and the
children of its members wherever their group) shows the per-launch key on its command line,
which every local user can read; the environment that holds it is its owner's alone. The
engine still refuses a call without the key and answers one with it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from capycommon.domain.instances import InstanceRecord
from capycommon.engines import detect, registry
from enginerun import sparse_model
from enginesim import Faults, SchedulerDies, write_behaviour
from enginesim.install import install_llama_server
from integration.hostd.harness import FAST, HOST, GiB, Hostd, assert_group_gone, launch
from support import live_processes, wait_for

# deployment -> the registered engine it runs on
ENGINES = {"a": "vllm", "b": "sglang", "c": "llama"}
# deployment -> a path its engine guards with the key (llama-server, like upstream's, leaves
# /v1/models open to all)
GUARDED = {"a": "/v1/models", "b": "/v1/models", "c": "/props"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A simulated llama-server and a GGUF model for it."""
    root = tmp_path_factory.mktemp("llama")
    server = install_llama_server(root / "bin", 6500, FAST)
    return server, sparse_model(root / "gguf", 1 * GiB, gguf=True)


@pytest.fixture
def engines(
    hostd: tuple[Hostd, str], model: Path, llama: tuple[Path, Path]
) -> tuple[Hostd, dict[str, InstanceRecord]]:
    """One ready engine of each family, launched through hostd."""
    harness, gpu = hostd
    server, gguf = llama
    (found,) = detect.probe(server)
    registry.add(registry.locate(None, harness.home), found.profile("llama"))
    for name, profile in ENGINES.items():
        residency = "restart_only" if profile == "llama" else "host_backed"
        served = gguf if profile == "llama" else model
        harness.send(launch(name, 1, gpu, served, profile=profile, residency=residency))
    return harness, {name: harness.wait_state(name, "ready") for name in ENGINES}


def secret(harness: Hostd, deployment: str) -> str:
    """The engine's key, read from Redis as the router reads it."""

    key = harness.read(lambda s: s.instances(HOST).secret(deployment, 0))
    assert key, f"no key kept for {deployment}"
    return key


def engine_processes(record: InstanceRecord) -> list[int]:
    """The engine's process group, and the children of its members wherever their group."""
    assert record.process is not None
    live = live_processes()
    found = {p.pid for p in live if p.pgid == record.process.pgid}
    while more := {p.pid for p in live if p.ppid in found} - found:
        found |= more
    assert record.process.pid in found, "the engine's leader runs"
    return sorted(found)


def assert_key_hidden(record: InstanceRecord, key: str) -> list[int]:
    """No process of the engine shows the key on its command line, and none lets another
    user read its environment (the kernel makes /proc/<pid>/environ 0400). Returns them."""
    pids = engine_processes(record)
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert key.encode() not in cmdline, f"{record.deployment}: the key is in {pid}'s argv"
        mode = os.stat(f"/proc/{pid}/environ").st_mode
        assert mode & 0o044 == 0, f"{record.deployment}: {pid}'s environment is readable"
    return pids


def test_no_engine_process_shows_its_key_and_each_engine_still_needs_it(
    engines: tuple[Hostd, dict[str, InstanceRecord]],
) -> None:
    harness, records = engines
    for name, record in records.items():
        key = secret(harness, name)
        assert_key_hidden(record, key)
        engine = f"http://127.0.0.1:{record.port}"
        bearer = {"Authorization": f"Bearer {key}"}
        refused = httpx.get(engine + GUARDED[name], timeout=10)
        assert refused.status_code == 401, f"{name} answered a call without its key"
        answered = httpx.get(engine + GUARDED[name], headers=bearer, timeout=10)
        assert answered.status_code == 200, f"{name} refused its own key: {answered.text}"
        models = httpx.get(engine + "/v1/models", headers=bearer, timeout=10)
        assert models.status_code == 200, f"{name}: {models.status_code} {models.text}"
        assert [card["id"] for card in models.json()["data"]] == [name], models.text


def test_another_user_sees_no_key(engines: tuple[Hostd, dict[str, InstanceRecord]]) -> None:
    runuser = shutil.which("runuser")
    if os.geteuid() != 0 or runuser is None:
        pytest.skip("reading as user nobody needs root and runuser")
    harness, records = engines
    for name, record in records.items():
        key = secret(harness, name)
        for pid in assert_key_hidden(record, key):
            as_nobody = [runuser, "-u", "nobody", "--", "cat"]
            cmdline = subprocess.run(
                [*as_nobody, f"/proc/{pid}/cmdline"], capture_output=True, check=True
            )
            assert cmdline.stdout, f"nobody reads {pid}'s command line"
            assert key.encode() not in cmdline.stdout, f"{name}: nobody sees the key in {pid}"
            environ = subprocess.run(
                [*as_nobody, f"/proc/{pid}/environ"], capture_output=True, check=False
            )
            assert environ.returncode != 0, f"{name}: nobody reads {pid}'s environment"
            assert key.encode() not in environ.stdout


def test_sglangs_children_get_no_key(
    hostd: tuple[Hostd, str], model: Path, installs: dict[str, Path]
) -> None:
    """SGLang's scheduler and detokenizer (children of its server) see the key neither on
    their command lines nor in their environments: the launcher took it out before SGLang
    started anything."""
    harness, gpu = hostd
    dies = SchedulerDies(after_seconds=5, message="RuntimeError: CUDA error: out of memory")
    write_behaviour(
        installs["sglang22"], FAST.model_copy(update={"faults": Faults(scheduler_dies=dies)})
    )
    harness.send(launch("a", 1, gpu, model, profile="sglang22", residency="restart_only"))

    def with_children() -> InstanceRecord | None:
        record = harness.record("a")
        if record is None or record.process is None:
            return None
        return record if len(engine_processes(record)) >= 3 else None

    record = wait_for(with_children, timeout=15, what="the server's scheduler and detokenizer")
    assert record.process is not None
    key = secret(harness, "a")
    children = [pid for pid in assert_key_hidden(record, key) if pid != record.process.pid]
    assert len(children) >= 2
    for pid in children:
        assert key.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
    assert_group_gone(harness.wait_state("a", "failed", timeout=60))
