"""The container setup: the Dockerfile, compose/docker-compose.yml and its GPU override.

No Docker engine is needed: the compose files are validated against the Compose
Specification's JSON schema (vendored in check-jsonschema), then read for what the
architecture asks of them.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from capyctl_cli.roles import PROCESSES

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "compose"
COMPOSE = COMPOSE_DIR / "docker-compose.yml"
GPU_OVERRIDE = COMPOSE_DIR / "docker-compose.gpu.yml"
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


@pytest.mark.parametrize("path", [COMPOSE, GPU_OVERRIDE], ids=lambda p: p.name)
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


def test_every_service_uses_the_one_image_built_from_the_dockerfile() -> None:
    found = services(COMPOSE)
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
