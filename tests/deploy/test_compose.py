"""The container setup: the Dockerfile, compose/docker-compose.yml and its GPU override, and
compose/docker-compose.server.yml (a server role and a host that joins it).

No Docker engine is needed: the compose files are validated against the Compose
Specification's JSON schema (vendored in check-jsonschema), then read for what the
architecture asks of them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from capycommon.enrollsettings import EnrollmentSection
from capycommon.settingvalues import split_address
from capyctl_cli.roles import PROCESSES

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "compose"
COMPOSE = COMPOSE_DIR / "docker-compose.yml"
GPU_OVERRIDE = COMPOSE_DIR / "docker-compose.gpu.yml"
SERVER_COMPOSE = COMPOSE_DIR / "docker-compose.server.yml"
DOCKERFILE = REPO / "Dockerfile"
CHECK_JSONSCHEMA = Path(sys.executable).parent / "check-jsonschema"

STATE_DIR = "/var/lib/capyctl"
REDIS_SOCKET = f"{STATE_DIR}/redis/redis.sock"
# The standalone role runs every process of the architecture.
PROCESS_NAMES = PROCESSES["standalone"]
# Every package of the monorepo: each folder with a pyproject.toml of its own.
PACKAGES = sorted(
    str(p.parent.relative_to(REPO))
    for pattern in ("libs/*/pyproject.toml", "services/*/pyproject.toml", "cli/pyproject.toml")
    for p in REPO.glob(pattern)
)


def load(path: Path) -> dict[str, Any]:
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(document, dict), f"{path} is not a mapping"
    return document


def services(path: Path) -> dict[str, dict[str, Any]]:
    found = load(path)["services"]
    assert isinstance(found, dict)
    return found


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text(encoding="utf-8"))
    result = []
    for line in joined.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            instruction, _, arguments = stripped.partition(" ")
            result.append((instruction.upper(), " ".join(arguments.split())))
    return result


def test_the_monorepo_has_seven_packages() -> None:
    assert len(PACKAGES) == 7
    assert all((REPO / package / "pyproject.toml").is_file() for package in PACKAGES)


@pytest.mark.parametrize("path", [COMPOSE, GPU_OVERRIDE, SERVER_COMPOSE], ids=lambda p: p.name)
def test_compose_file_matches_the_compose_schema(path: Path) -> None:
    assert CHECK_JSONSCHEMA.is_file(), f"{CHECK_JSONSCHEMA} is missing; run scripts/setup"
    result = subprocess.run(
        [str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_runs_every_process_of_the_architecture() -> None:
    found = services(COMPOSE)
    assert set(found) == {"init", *PROCESS_NAMES}
    assert found["init"]["command"] == ["capyctl", "init", "standalone"]
    for name in PROCESS_NAMES:
        assert found[name]["command"] == ["capyctl", "run", name, "--role", "standalone"]


@pytest.mark.parametrize("path", [COMPOSE, SERVER_COMPOSE], ids=lambda p: p.name)
def test_every_service_uses_the_one_image_built_from_the_dockerfile(path: Path) -> None:
    found = services(path)
    images = {service["image"] for service in found.values()}
    assert len(images) == 1, f"the services use several images: {images}"
    for name, service in found.items():
        build = service["build"]
        assert (COMPOSE_DIR / build["context"]).resolve() == REPO, name
        assert (COMPOSE_DIR / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    assert DOCKERFILE.is_file()


def test_the_services_share_the_state_volume() -> None:
    document = load(COMPOSE)
    for name, service in document["services"].items():
        assert f"state:{STATE_DIR}" in service["volumes"], name
        assert service["environment"]["CAPYCTL_STATE_DIR"] == STATE_DIR, name
    assert "state" in document["volumes"]


def test_redis_is_reached_through_its_socket_only() -> None:
    redis = services(COMPOSE)["redis"]
    assert "ports" not in redis
    assert "expose" not in redis
    assert "network_mode" not in redis
    test = " ".join(redis["healthcheck"]["test"])
    assert f"redis-cli -s {REDIS_SOCKET} ping" in test


def test_only_the_router_publishes_a_port() -> None:
    found = services(COMPOSE)
    published = {name: service["ports"] for name, service in found.items() if "ports" in service}
    assert published == {"router": ["8443:8443"]}
    assert found["router"]["environment"]["CAPYCTL_INFERENCE_ADDR"] == "0.0.0.0:8443"
    # The management API stays on loopback, inside the scheduler's container.
    management = found["scheduler"]["environment"].get("CAPYCTL_MANAGEMENT_ADDR", "127.0.0.1:")
    assert management.startswith("127.0.0.1:")


def test_the_services_wait_for_init_and_a_healthy_redis() -> None:
    found = services(COMPOSE)
    assert "depends_on" not in found["init"]
    assert found["init"]["restart"] == "no"
    completed = {"condition": "service_completed_successfully"}
    assert found["redis"]["depends_on"] == {"init": completed}
    for name in PROCESS_NAMES:
        if name != "redis":
            assert found[name]["depends_on"] == {
                "init": completed,
                "redis": {"condition": "service_healthy"},
            }, name


def test_gpu_override_reserves_the_gpus_for_hostd() -> None:
    override = services(GPU_OVERRIDE)
    assert set(override) <= set(services(COMPOSE)), "the override adds no services"
    devices = override["hostd"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert "deploy" not in services(COMPOSE)["hostd"], "the base file runs without GPUs"


def test_dockerfile_builds_a_non_root_image_with_redis() -> None:
    instructions = dockerfile_instructions()
    assert instructions[0] == ("FROM", "python:3.11-slim-bookworm")
    runs = [arguments for instruction, arguments in instructions if instruction == "RUN"]
    assert any("apt-get install" in run and "redis-server" in run.split() for run in runs)
    assert any(re.search(r"\buseradd --uid 1000 .*\bcapyctl\b", run) for run in runs)
    users = [arguments for instruction, arguments in instructions if instruction == "USER"]
    assert users[-1] == "capyctl"


@pytest.mark.parametrize("package", PACKAGES)
def test_dockerfile_installs_each_package(package: str) -> None:
    installs = [
        arguments
        for instruction, arguments in dockerfile_instructions()
        if instruction == "RUN" and "pip install" in arguments
    ]
    assert len(installs) == 1
    words = installs[0].split()
    assert "-e" not in words
    assert "--editable" not in words
    # A folder, not a name pip would look up on an index: "cli" alone would be.
    assert any(word.endswith(f"/{package}") for word in words), f"{package} is not installed"


def test_dockerignore_keeps_local_environments_out() -> None:
    ignored = (REPO / ".dockerignore").read_text(encoding="utf-8").split()
    assert ".git" in ignored
    assert ".venv" in ignored


# The server and its joined host: docker-compose.server.yml.
JOIN_DIR = "/run/join"
JOIN_FILE = f"{JOIN_DIR}/host.join"
JOINED = f"{STATE_DIR}/identity/joined.json"
# The uid of the image's capyctl user (the Dockerfile's useradd).
CAPYCTL_UID = "1000"
SERVER_NAME = "${CAPYCTL_SERVER_NAME:-server}"


def port_of(bind: str) -> int:
    return split_address(bind)[1]


def test_server_compose_runs_a_server_and_a_host_that_joins_it() -> None:
    found = services(SERVER_COMPOSE)
    assert set(found) == {"join-dir", "server", "host"}
    assert found["server"]["command"] == ["capyctl", "start", "server"]
    for name in ("server", "host"):
        assert found[name]["environment"]["CAPYCTL_STATE_DIR"] == STATE_DIR, name
    # Each role has a state dir of its own: the host never sees the server's authority key.
    assert f"server-state:{STATE_DIR}" in found["server"]["volumes"]
    assert found["host"]["volumes"] == [f"host-state:{STATE_DIR}", f"join:{JOIN_DIR}:ro"]
    assert f"join:{JOIN_DIR}" in found["server"]["volumes"]
    assert set(load(SERVER_COMPOSE)["volumes"]) == {"server-state", "host-state", "join"}


def test_server_compose_publishes_inference_bootstrap_and_control() -> None:
    server = services(SERVER_COMPOSE)["server"]
    environment = server["environment"]
    defaults = EnrollmentSection()
    bootstrap = port_of(defaults.bootstrap_bind)
    control = port_of(defaults.control_bind)
    assert (bootstrap, control) == (7444, 7445)
    assert environment["CAPYCTL_INFERENCE_ADDR"] == "0.0.0.0:8443"
    # Other containers and machines reach the enrollment listeners; the bootstrap default
    # is loopback only.
    assert environment["CAPYCTL_ENROLLMENT_BOOTSTRAP_BIND"] == f"0.0.0.0:{bootstrap}"
    assert environment["CAPYCTL_ENROLLMENT_CONTROL_BIND"] == f"0.0.0.0:{control}"
    assert server["ports"] == ["8443:8443", f"{bootstrap}:{bootstrap}", f"{control}:{control}"]
    # Join files name the server as the host container resolves it.
    assert environment["CAPYCTL_ENROLLMENT_BOOTSTRAP_ADDRESS"] == f"{SERVER_NAME}:{bootstrap}"
    assert environment["CAPYCTL_ENROLLMENT_CONTROL_ADDRESS"] == f"{SERVER_NAME}:{control}"
    assert server["networks"]["default"]["aliases"] == [SERVER_NAME]
    # The management API stays on loopback, inside the server's container.
    assert environment["CAPYCTL_MANAGEMENT_ADDR"].startswith("127.0.0.1:")
    assert "ports" not in services(SERVER_COMPOSE)["host"]


def test_server_compose_orders_the_join_volume_the_server_and_the_host() -> None:
    found = services(SERVER_COMPOSE)
    join_dir = found["join-dir"]
    # A new volume is root's: only this one-shot runs as root, to hand it to capyctl.
    assert join_dir["user"] == "0"
    assert join_dir["restart"] == "no"
    script = join_dir["command"][-1]
    assert f"chown {CAPYCTL_UID}:{CAPYCTL_UID} {JOIN_DIR}" in script
    assert f"chmod 0700 {JOIN_DIR}" in script
    assert all("user" not in found[name] for name in ("server", "host"))
    completed = {"condition": "service_completed_successfully"}
    assert found["server"]["depends_on"] == {"join-dir": completed}
    # The host joins once the server's scheduler answers, and with it the bootstrap listener.
    assert found["host"]["depends_on"] == {"server": {"condition": "service_healthy"}}
    assert found["server"]["healthcheck"]["test"] == ["CMD", "capyctl", "list", "hosts"]


def host_entrypoint() -> list[str]:
    command = services(SERVER_COMPOSE)["host"]["command"]
    assert isinstance(command, list)
    assert command[:2] == ["sh", "-c"]
    return [str(word) for word in command]


def run_entrypoint(tmp_path: Path, *, joined: bool, join_exit: int) -> tuple[int, list[str]]:
    """Run the host's entrypoint with its state dir and join folder under tmp_path and a
    stand-in capyctl on PATH that records each command and, for `join`, exits join_exit
    (a real join needs a running server: tests/e2e/test_hosts_join.py)."""
    state = tmp_path / "state"
    (state / "identity").mkdir(parents=True)
    if joined:
        (state / "identity" / "joined.json").write_text("{}", encoding="utf-8")
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "capyctl"
    stand_in.write_text(
        '#!/bin/sh\nprintf "%s\\n" "$*" >> "$CALLS"\n'
        f'[ "$1" = join ] && exit {join_exit}\nexit 0\n',
        encoding="utf-8",
    )
    stand_in.chmod(0o755)
    argv = host_entrypoint()
    assert STATE_DIR in argv[2]
    argv[2] = argv[2].replace(STATE_DIR, str(state)).replace(JOIN_DIR, str(tmp_path / "join"))
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls)}
    result = subprocess.run(argv, env=env, capture_output=True, timeout=30, check=False)
    lines = calls.read_text(encoding="utf-8").splitlines() if calls.exists() else []
    return result.returncode, lines


def test_the_host_entrypoint_joins_once_then_starts_the_host(tmp_path: Path) -> None:
    script = host_entrypoint()[2]
    assert f"[ ! -e {JOINED} ]" in script
    assert f"capyctl join host --join-file {JOIN_FILE}" in script

    new = tmp_path / "new"
    code, calls = run_entrypoint(new, joined=False, join_exit=0)
    assert code == 0
    assert calls == [f"join host --join-file {new / 'join' / 'host.join'}", "start host"]

    code, calls = run_entrypoint(tmp_path / "joined", joined=True, join_exit=0)
    assert (code, calls) == (0, ["start host"])


def test_the_host_entrypoint_stops_when_the_join_fails(tmp_path: Path) -> None:
    code, calls = run_entrypoint(tmp_path, joined=False, join_exit=3)
    # The join's own exit code (3: invitation_refused), and no start without an identity.
    assert code == 3
    assert calls == [f"join host --join-file {tmp_path / 'join' / 'host.join'}"]
