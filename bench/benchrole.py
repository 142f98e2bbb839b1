"""What the benchmarks share to start a standalone role of their own: the engine simulator
installed and registered as vLLM, sparse model files, free ports, and `capyctl start
standalone` in a temporary state dir. The scripts run as `python bench/<name>.py`, so this
module is found beside them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import yaml

from capycommon.engines import detect, registry
from enginesim.behaviour import Behaviour
from enginesim.install import install_python_engine

GiB = 1 << 30
CAPYCTL = [sys.executable, "-m", "capyctl_cli"]
VLLM_VERSION = "0.29.0"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def role_env(root: Path) -> dict[str, str]:
    """This process's environment for the role and the CLI, with `root` as HOME and without
    CAPYCTL_ settings, which would point them at another role."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
    env["HOME"] = str(root)
    return env


def write_document(
    root: Path, host_ram: str, server: dict[str, Any] | None = None, **host: str
) -> Path:
    """The role's document, `kind: standalone` on one simulated 24 GiB GPU with `host_ram` of
    host RAM, its models under `root`/models (and any other `host` fields, and a `server`
    section where given), written into the config dir of the state dir `root`/state (made
    here, where the engines are registered too); its path."""
    config = root / "state" / "config"
    config.mkdir(parents=True)
    document = config / "standalone.yaml"
    fields = {
        "simulated_gpus": "gpu0:24GiB",
        "simulated_host_ram": host_ram,
        "models_root": str(root / "models"),
        **host,
    }
    found: dict[str, Any] = {"kind": "standalone", "host": fields}
    if server:
        found["server"] = server
    document.write_text(yaml.safe_dump(found))
    return document


def install_vllm(root: Path, config: Path, profile: str, behaviour: Behaviour) -> Path:
    """Install the simulator as vLLM into `root`/`profile` and register it under `profile` in
    the role's config dir; the install's path, which another role may register too."""
    venv = install_python_engine(root / profile, "vllm", VLLM_VERSION, behaviour)
    (found,) = detect.probe(venv)
    registry.add(config / registry.FILE_NAME, found.profile(profile))
    return venv


def sparse_model(folder: Path, size: int) -> None:
    """A model of `size` bytes that takes no disk: the simulator never reads its weights."""
    folder.mkdir(parents=True)
    with (folder / "model.safetensors").open("wb") as weights:
        weights.truncate(size)


def start_standalone(
    state: Path,
    document: Path,
    inference: str,
    log: IO[bytes],
    env: dict[str, str],
    host: str = "local",
    extra_flags: Sequence[str] = (),
    new_session: bool = False,
    capyctl: Sequence[str] = CAPYCTL,
) -> subprocess.Popen[bytes]:
    """`capyctl start standalone` listening for inference on `inference` (management on a
    free port), its output in `log`; `new_session` puts it in a process group of its own;
    `capyctl` runs the CLI (this clone's by default, or an installed executable)."""
    return subprocess.Popen(
        [
            *capyctl,
            "start",
            "standalone",
            "--state-dir",
            str(state),
            "--config",
            str(document),
            "--listen",
            inference,
            "--management-listen",
            f"127.0.0.1:{free_port()}",
            "--host-name",
            host,
            *extra_flags,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=new_session,
    )


def cli(
    state: Path,
    env: dict[str, str],
    *args: str,
    check: bool = False,
    capyctl: Sequence[str] = CAPYCTL,
) -> subprocess.CompletedProcess[str]:
    """`capyctl <args>` against the role in `state`; `check` stops the bench on a failure."""
    found = subprocess.run(
        [*capyctl, *args, "--state-dir", str(state)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if check and found.returncode:
        raise SystemExit(f"capyctl {' '.join(args)}: {found.stdout}{found.stderr}")
    return found
