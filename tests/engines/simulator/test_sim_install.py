"""Installs made by enginesim.install look like real ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from engines.simulator.helpers import (
    FAST,
    Installs,
    Launcher,
    closed_env,
    make_simgpu,
    recorded,
    sha256,
    site_packages,
)
from enginesim import (
    Behaviour,
    install_llama_server,
    install_python_engine,
    write_behaviour,
)
from enginesim.behaviour import load_behaviour
from enginesim.install import PythonFamily, behaviour_path

PROBE = "import importlib.metadata as m; print(m.version('{name}'))"


def test_python_installs_are_real_distributions(installs: Installs) -> None:
    made: tuple[tuple[PythonFamily, str], ...] = (("vllm", "0.17.0"), ("sglang", "0.5.10"))
    for family, version in made:
        venv = installs.python(family, version)
        probe = subprocess.run(
            [str(venv / "bin" / "python"), "-c", PROBE.format(name=family)],
            env={"PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            check=True,
        )
        assert probe.stdout == f"{version}\n"
        files = recorded(venv, family, version)
        assert venv / "bin" / family in {path for path, _ in files}
        for path, digest in files:
            assert sha256(path) == digest, path
        assert behaviour_path(venv).parent == site_packages(venv) / family


def test_rewriting_the_behaviour_leaves_the_recorded_files_alone(installs: Installs) -> None:
    venv = installs.python("vllm", "0.17.0")
    before = recorded(venv, "vllm", "0.17.0")
    slow = Behaviour(tokens_per_second=1, answer="changed")
    write_behaviour(venv, slow)
    try:
        assert load_behaviour(behaviour_path(venv)) == slow
        assert recorded(venv, "vllm", "0.17.0") == before
        assert all(sha256(path) == digest for path, digest in before)
    finally:
        write_behaviour(venv, FAST)


def test_llama_server_is_an_executable_with_its_behaviour_beside_it(tmp_path: Path) -> None:
    executable = install_llama_server(tmp_path / "bin", 6500, FAST)
    assert executable.name == "llama-server"
    assert executable.stat().st_mode & 0o111
    assert executable.read_text().startswith(f"#!{sys.executable}\n")
    assert behaviour_path(executable) == executable.with_name("llama-server.sim.json")
    assert load_behaviour(behaviour_path(executable)) == FAST


def test_module_form_installs_and_runs_an_engine(
    tmp_path: Path, launcher: Launcher, model_dir: Path
) -> None:
    behaviour = tmp_path / "fast.json"
    behaviour.write_text(FAST.model_dump_json())
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "enginesim",
            "install",
            "llamacpp",
            str(tmp_path / "llama"),
            "--version",
            "6100",
            "--behaviour",
            str(behaviour),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert made.stdout.strip() == str(tmp_path / "llama" / "llama-server")
    gpu = make_simgpu(tmp_path / "simgpu")
    argv = [
        sys.executable,
        "-m",
        "enginesim",
        "--family",
        "vllm",
        "--version",
        "0.17.0",
        "--behaviour",
        str(behaviour),
        "--",
        "serve",
        str(model_dir),
        "--port",
        "{port}",
    ]
    engine = launcher.start(argv, {**closed_env(None, tmp_path), **gpu.env()})
    engine.wait_status(200)
    assert engine.get("/version").json() == {"version": "0.17.0"}
    assert engine.stop() == 0


def test_install_python_engine_returns_the_venv(tmp_path: Path) -> None:
    venv = install_python_engine(tmp_path / "sg", "sglang", "0.5.2")
    assert venv == tmp_path / "sg"
    assert (venv / "bin" / "sglang").is_file()
    assert load_behaviour(behaviour_path(venv)) == Behaviour()
