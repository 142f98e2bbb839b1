"""`capyctl engine detect|add|add-custom|list|remove` against real installs: the engine
simulator's venvs and TensorFold, llama.cpp's own server, a custom server's command, and
folders that are not engines."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis
import yaml

from engines.llamacpp.llama_server import write_wrapper
from enginesim.install import install_python_engine, install_tensorfold
from support import capyctl, clean_env, short_dir, start_role, wait_for


@pytest.fixture(scope="module")
def installs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engines")
    plain = root / "plain-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(plain)], check=True)
    not_engine = root / "not-an-engine"
    not_engine.mkdir()
    (not_engine / "README").write_text("nothing here")
    return {
        "vllm": install_python_engine(root / "vllm-venv", "vllm", "0.29.0"),
        "sglang": install_python_engine(root / "sglang-venv", "sglang", "0.5.16"),
        "old-vllm": install_python_engine(root / "old-vllm", "vllm", "0.8.5"),
        "llamacpp": write_wrapper(root / "llama.cpp"),
        "tensorfold": install_tensorfold(root / "tensorfold", "0.6.6").parent,
        "old-tensorfold": install_tensorfold(root / "old-tensorfold", "0.5.9"),
        "plain": plain,
        "folder": not_engine,
    }


@pytest.fixture
def home() -> Iterator[Path]:
    folder = short_dir("home")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return capyctl(*args, "--state-dir", str(home / "state"), env=clean_env(HOME=str(home)))


def test_add_records_each_family(home: Path, installs: dict[str, Path]) -> None:
    for family in ("vllm", "sglang", "llamacpp", "tensorfold"):
        result = _cli(home, "engine", "add", str(installs[family]), "--json")
        assert result.returncode == 0, result.stderr
        added = json.loads(result.stdout)
        assert added["published"] == "published when capyctl starts"
        assert added["profile"]["family"] == family
    listed = json.loads(_cli(home, "engine", "list", "--json").stdout)
    profiles = {p["name"]: p for p in listed["profiles"]}
    assert set(profiles) == {"vllm", "sglang", "llamacpp", "tensorfold"}
    assert listed["revision"] == 4
    vllm = profiles["vllm"]
    assert vllm["version"] == "0.29.0"
    assert vllm["verified"] is True
    assert vllm["executable"] == str(installs["vllm"] / "bin" / "python")
    assert vllm["fingerprint"].startswith("0.29.0+sha256:")
    assert profiles["sglang"]["version"] == "0.5.16"
    assert profiles["llamacpp"]["verified"] is False, "llama.cpp builds are always custom"
    tensorfold = profiles["tensorfold"]
    assert (tensorfold["version"], tensorfold["verified"]) == ("0.6.6", False)
    assert tensorfold["executable"] == str(installs["tensorfold"] / "tensorfold")
    file = home / ".config" / "capyctl" / "engines.yaml"
    assert Path(listed["file"]) == file
    assert file.read_text().startswith("# capyctl-document-revision: 4\n")
    assert yaml.safe_load(file.read_text())["kind"] == "engines"


def test_the_fingerprint_changes_with_the_installed_files(
    home: Path, installs: dict[str, Path]
) -> None:
    venv = short_dir("fp") / "venv"
    try:
        install_python_engine(venv, "vllm", "0.29.0")
        first = json.loads(_cli(home, "engine", "add", str(venv), "--name", "a", "--json").stdout)
        init = next(venv.glob("lib/python*/site-packages/vllm/__init__.py"))
        init.write_text(init.read_text() + "\n# edited\n")
        second = json.loads(_cli(home, "engine", "add", str(venv), "--name", "b", "--json").stdout)
        assert first["profile"]["fingerprint"] != second["profile"]["fingerprint"]
    finally:
        shutil.rmtree(venv.parent, ignore_errors=True)


@pytest.mark.parametrize(
    ("install", "code", "exit_code", "message"),
    [
        (
            "plain",
            "engine_not_found",
            16,
            "is a virtual environment without vllm, sglang or lmcache",
        ),
        ("folder", "engine_not_found", 16, "is neither a virtual environment"),
        ("old-vllm", "engine_unsupported", 17, "vllm 0.8.5 is older than 0.11.0"),
        ("old-tensorfold", "engine_unsupported", 17, "tensorfold 0.5.9 is older than 0.6.0"),
    ],
)
def test_what_is_not_a_supported_engine_is_refused(
    home: Path, installs: dict[str, Path], install: str, code: str, exit_code: int, message: str
) -> None:
    result = _cli(home, "engine", "add", str(installs[install]))
    assert result.returncode == exit_code
    assert result.stderr.startswith(f"error [{code}]: ")
    assert message in result.stderr
    if code == "engine_not_found":
        assert str(installs[install]) in result.stderr
    assert not (home / ".config" / "capyctl" / "engines.yaml").exists()


def test_a_missing_path_and_a_taken_name(home: Path, installs: dict[str, Path]) -> None:
    missing = home / "nowhere"
    result = _cli(home, "engine", "add", str(missing))
    assert result.returncode == 16
    assert f"{missing} does not exist" in result.stderr
    assert _cli(home, "engine", "add", str(installs["vllm"])).returncode == 0
    again = _cli(home, "engine", "add", str(installs["vllm"]))
    assert again.returncode == 19
    assert again.stderr.startswith("error [profile_exists]: an engine named 'vllm'")


def test_a_custom_engine_is_registered_by_its_command(home: Path) -> None:
    program = home / "bin" / "serve"
    program.parent.mkdir(parents=True)
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o755)
    command = f"{program} --port {{port}} --model {{model}} --name '{{served_name}}'"
    added = _cli(home, "engine", "add-custom", "srv", "--command", command, "--key-env", "K")
    assert added.returncode == 0, added.stderr
    assert added.stdout.startswith("Registered custom unversioned as 'srv'.\n")
    assert f"command      {program} --port '{{port}}'" in added.stdout
    (profile,) = json.loads(_cli(home, "engine", "list", "--json").stdout)["profiles"]
    assert profile["command"] == [str(program), "--port", "{port}", "--model", "{model}",
                                  "--name", "{served_name}"]  # fmt: skip
    assert (profile["ready_path"], profile["key_env"]) == ("/health", "K")
    no_model = _cli(home, "engine", "add-custom", "two", "--command", f"{program} {{port}}")
    assert no_model.returncode == 2
    assert no_model.stderr.startswith("error [invalid_config]: custom engine 'two': command: ")
    assert "never names {model}" in no_model.stderr
    relative = _cli(home, "engine", "add-custom", "two", "--command", "serve {port} {model}")
    assert relative.returncode == 16
    assert "serve is not an executable file (absolute path)" in relative.stderr


def test_remove(home: Path, installs: dict[str, Path]) -> None:
    assert _cli(home, "engine", "add", str(installs["sglang"]), "--name", "sg").returncode == 0
    removed = _cli(home, "engine", "remove", "sg")
    assert removed.returncode == 0, removed.stderr
    assert "Removed 'sg'" in removed.stdout
    gone = _cli(home, "engine", "remove", "sg")
    assert gone.returncode == 2
    assert gone.stderr.startswith("error [not_found]: no engine named 'sg'")


def test_detect_finds_installs_and_marks_registered_ones(
    home: Path, installs: dict[str, Path]
) -> None:
    venvs = home / "venvs"
    venvs.mkdir()
    install_python_engine(venvs / "serving", "sglang", "0.5.16")
    assert _cli(home, "engine", "add", str(venvs / "serving")).returncode == 0
    result = _cli(home, "engine", "detect", "--path", str(installs["llamacpp"].parent), "--json")
    assert result.returncode == 0, result.stderr
    found = {row["path"]: row for row in json.loads(result.stdout)}
    assert found[str(venvs / "serving")]["registered"] == "sglang"
    assert found[str(venvs / "serving")]["family"] == "sglang"
    assert found[str(installs["llamacpp"])]["registered"] is None
    text = _cli(home, "engine", "detect")
    assert "sglang" in text.stdout


def test_the_registry_reaches_a_running_role(home: Path, installs: dict[str, Path]) -> None:
    assert _cli(home, "engine", "add", str(installs["vllm"])).returncode == 0
    role = start_role("standalone", state_dir=home / "state", env=clean_env(HOME=str(home)))
    try:
        client = redis.Redis(unix_socket_path=str(role.state_dir / "redis" / "redis.sock"))

        def published() -> dict[str, Any] | None:
            raw = cast(bytes | None, client.get("capyctl:host:local:engines"))
            return None if raw is None else cast(dict[str, Any], json.loads(raw))

        first = wait_for(published, timeout=10, what="hostd to publish the registry at start")
        assert [p["name"] for p in first["profiles"]] == ["vllm"]
        pubsub = client.pubsub()  # type: ignore[no-untyped-call]
        pubsub.subscribe("capyctl:host:local:notify")
        wait_for(lambda: pubsub.get_message(timeout=0.1), timeout=5, what="subscription")
        added = role.capyctl("engine", "add", str(installs["sglang"]))
        assert added.returncode == 0, added.stderr
        assert "published to the running standalone role (revision 2)" in added.stdout
        note = wait_for(lambda: pubsub.get_message(timeout=0.1), timeout=5, what="a notification")
        assert json.loads(note["data"]) == {"kind": "engines", "id": "registry", "version": 2}
        now = published()
        assert now is not None
        names = [p["name"] for p in now["profiles"]]
        assert names == ["sglang", "vllm"]
        listed = role.capyctl("engine", "list")
        assert "yes" in listed.stdout.splitlines()[1].split()[4]
        pubsub.close()
        client.close()
    finally:
        role.stop()
