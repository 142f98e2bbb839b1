"""`capyctl demo`: a working endpoint on any machine, in one command.

It runs the standalone role on a simulated 24 GiB GPU with three example deployments whose
engines are CapyCTL's engine simulator (vLLM and SGLang as they behave on the wire and as
processes), then prints how to send a request and how to watch a park and a wake. Its state
lives apart (`~/.local/state/capyctl-demo`). Ctrl-C stops the engines and the role, and so do a
closed terminal (SIGHUP) and SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from capycommon import credentials
from capycommon.deployments import load_deployment
from capycommon.engines import detect, registry
from capycommon.errors import ActivationTimeout, CapyError, Internal
from capycommon.paths import StatePaths
from capycommon.yamldoc import load_yaml_document
from capyctl_cli import output
from capyctl_cli.bundled import bundled
from capyctl_cli.management import Management
from enginesim.behaviour import Behaviour
from enginesim.install import PythonFamily, install_python_engine

GiB = 1 << 30
GPUS = "gpu0:24GiB"
HOST_RAM = "128GiB"
# The example models' folders, and the size of their (sparse) weight files.
MODELS = {"Qwen3-8B": 7 * GiB, "Llama-3.1-8B-Instruct": 7 * GiB, "Mistral-7B-Instruct": 7 * GiB}
ENGINES: dict[PythonFamily, str] = {"vllm": "0.29.0", "sglang": "0.5.16"}
# A simulated engine that feels like a real one: a few seconds to load, quick to answer.
BEHAVIOUR = Behaviour(
    load_seconds=3.0,
    wake_seconds=1.0,
    tokens_per_second=40,
    answer="Hello! I am a simulated model, served by CapyCTL.",
)


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "capyctl-demo"


def examples_dir() -> Path:
    """The example deployments: the installed package's copy, else the repository's
    `examples/deployments`."""
    return bundled("examples/deployments")


def has_gpu() -> bool:
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return False
    found = subprocess.run([nvidia_smi, "-L"], capture_output=True, timeout=10, check=False)
    return found.returncode == 0 and b"GPU" in found.stdout


def prepare(state: Path) -> Path:
    """The demo's role document, engines and model folders (made once, reused after)."""
    demo = state / "demo"
    models = demo / "models"
    config = state / "config"
    config.mkdir(parents=True, exist_ok=True, mode=0o700)
    document = config / "standalone.yaml"
    host = {"simulated_gpus": GPUS, "simulated_host_ram": HOST_RAM, "models_root": str(models)}
    document.write_text(yaml.safe_dump({"kind": "standalone", "host": host}))
    engines_file = config / registry.FILE_NAME  # the demo's own, beside its role document
    known = registry.read(engines_file).document.profiles if engines_file.exists() else {}
    for family, version in ENGINES.items():
        if family in known:
            continue
        output.echo(f"demo: installing the engine simulator as {family} {version} ...")
        venv = install_python_engine(demo / "engines" / family, family, version, BEHAVIOUR)
        (found,) = detect.probe(venv)
        registry.add(engines_file, found.profile(family))
    for folder, size in MODELS.items():
        path = models / folder
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
        with (path / "model.safetensors").open("ab") as weights:
            weights.truncate(size)  # sparse: it takes no disk
    return document


def run(state: Path, listen: str, management: str) -> int:
    state = state.expanduser()
    if has_gpu():
        output.echo(
            "demo: this machine has an NVIDIA GPU; the demo still runs on a simulated "
            "one. For your real engines: capyctl engine add, capyctl start standalone, "
            "then capyctl deploy model (see docs/deployments.md)."
        )
    document = prepare(state)
    examples = sorted(examples_dir().glob("*.yaml"))
    for example in examples:
        load_deployment(example)  # a broken example fails here, naming its file
    start = [sys.executable, "-m", "capyctl_cli", "start", "standalone", "--state-dir", str(state)]
    start += ["--config", str(document), "--listen", listen, "--management-listen", management]
    log = state / "demo" / "role.log"
    _stop_on_hangup()
    output.echo(f"demo: starting the standalone role (its log: {log}) ...")
    # Its own session: Ctrl-C reaches the demo alone, which stops the engines, then the role.
    with log.open("ab") as out:
        role = subprocess.Popen(start, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        paths = StatePaths(state)
        api = _wait_for_api(paths, role)
        with api:
            for example in examples:
                api.deploy(load_yaml_document(example))
        _print_usage(state, paths, listen, management, examples)
        return _wait(role)
    except KeyboardInterrupt:
        return _stop(state, role)
    finally:
        if role.poll() is None:
            _stop(state, role)


def _wait(role: subprocess.Popen[bytes]) -> int:
    """The role's exit code. Waited for a second at a time: Python runs a signal's handler
    only between its own steps, so a Ctrl-C is acted on within a second even when the
    kernel hands it to a thread other than the one blocked in waitpid."""
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return role.wait(timeout=1.0)


class Hangup(KeyboardInterrupt):
    """The demo's terminal closed (SIGHUP) or it was told to stop (SIGTERM): it stops the
    engines and the role as on Ctrl-C. The role runs in a session of its own, so it never
    sees the terminal go."""


def _stop_on_hangup() -> None:
    def hang_up(signum: int, _: object) -> None:
        for each in (signal.SIGHUP, signal.SIGTERM):
            signal.signal(each, signal.SIG_IGN)  # the stop runs to its end
        raise Hangup(signal.Signals(signum).name)

    for signum in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, hang_up)


def _say(text: str) -> None:
    """Print, unless the terminal is gone (a write to a hung-up terminal fails with EIO)."""
    with contextlib.suppress(OSError):
        output.echo(text)


def _wait_for_api(paths: StatePaths, role: subprocess.Popen[bytes]) -> Management:
    deadline = time.monotonic() + 60
    while True:
        if role.poll() is not None:
            raise Internal(f"the standalone role exited with {role.returncode}; see its log")
        with contextlib.suppress(CapyError):
            api = Management(paths, timeout=5)
            try:
                api.health()
                return api
            except CapyError:
                api.http.close()
        if time.monotonic() > deadline:
            raise ActivationTimeout("the standalone role did not come up within 60 s; see its log")
        time.sleep(0.5)


def _stop(state: Path, role: subprocess.Popen[bytes]) -> int:
    """Engines outlive their role by design; a demo stops them first, then the role."""
    for signum in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)  # a terminal closed meanwhile: go on stopping
    _say("\ndemo: stopping the engines and the role ...")
    with contextlib.suppress(CapyError), Management(StatePaths(state), timeout=10) as api:
        for host in api.hosts():
            api.drain(host.name)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not any(row.hosts for row in api.deployments()):
                break
            time.sleep(0.5)
    if role.poll() is None:
        role.send_signal(signal.SIGTERM)
    return role.wait(timeout=60)


def _print_usage(
    state: Path, paths: StatePaths, listen: str, management: str, examples: list[Path]
) -> None:
    found = credentials.load(paths.credentials)
    key = found.api_key
    host, _, port = listen.rpartition(":")
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/v1"
    first = examples[0].stem
    flag = f"--state-dir {state}"
    names = ", ".join(example.stem for example in examples)
    output.echo(f"""
CapyCTL demo: {len(examples)} models ({names}) behind {url},
on a simulated {GPUS.split(":")[1]} GPU; the engines are CapyCTL's engine simulator.
Two of the models fit on the GPU at once: asking for a third switches (parks) one.

Send a request (the first one for a model starts its engine):

  curl -s {url}/chat/completions -H "Authorization: Bearer {key}" \\
    -H "Content-Type: application/json" \\
    -d '{{"model": "{first}", "messages": [{{"role": "user", "content": "Hello"}}]}}'

  python3 -c 'from openai import OpenAI
  c = OpenAI(base_url="{url}", api_key="{key}")
  r = c.chat.completions.create(model="{first}", messages=[{{"role": "user", "content": "Hi"}}])
  print(r.choices[0].message.content)'

Watch a park and a wake, in another terminal:

  capyctl list deployments {flag}          # ask each model in turn, then look again
  capyctl park deployment {first} {flag} --wait
  capyctl status deployment {first} {flag}  # parked; the next request wakes it

Or watch it live on the status page: open http://{management}/ and log in with the admin
token {found.admin_token}

Ctrl-C stops the engines and the role.
""")
