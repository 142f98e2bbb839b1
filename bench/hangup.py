"""How quickly each engine stops a request whose client hung up, through CapyCTL's router and
with the client at the engine itself (the baseline), side by side in one run.

    .venv/bin/python bench/hangup.py [--rounds N]

It starts a standalone role on a simulated 24 GiB GPU with one deployment each of the engine
simulator as vLLM 0.29.0, SGLang 0.5.16 and 0.5.22 and llama.cpp (llama-server build 6000),
answering 20 tokens a second, and of real llama.cpp (its server through xllamacpp, the tests'
launcher, on a tiny GGUF model that decodes a few hundred tokens a second on the CPU). Each
round sends a request that would run for seconds, waits until the engine counts it running
(a stream: until its first token came), closes the connection, and times until the engine's
own count of running requests drops (read from its metrics every 2 ms). The simulator stops
work on a hang-up as each real engine does (SGLang notices a closed connection 2 s late for a
stream, up to 4 s when not streamed; vLLM and llama.cpp at once), so what is measured on it is
what CapyCTL adds or saves.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import redis
import yaml

import benchrole
from benchrole import GiB
from capycommon.state import keys
from enginesim.behaviour import Behaviour
from enginesim.install import install_llama_server, install_python_engine
from wakestand import until

BEHAVIOUR = Behaviour(load_seconds=0.5, tokens_per_second=20, answer=" ".join(["word"] * 400))
# deployment -> (what it runs, the metric that counts its running requests)
ENGINES = {
    "vllm": ("vLLM 0.29.0", r"^vllm:num_requests_running\{[^}]*\} (\S+)$"),
    "sglang16": ("SGLang 0.5.16", r"^sglang:num_running_reqs\{[^}]*\} (\S+)$"),
    "sglang22": ("SGLang 0.5.22", r"^sglang:num_running_reqs\{[^}]*\} (\S+)$"),
    "llamacpp": ("llama.cpp b6000", r"^llamacpp:requests_processing(?:\{[^}]*\})? (\S+)$"),
    "llamareal": ("llama.cpp, real", r"^llamacpp:requests_processing(?:\{[^}]*\})? (\S+)$"),
}
# The tests' launcher of the real llama-server (xllamacpp) and its tiny model.
LLAMA_TESTS = Path(__file__).resolve().parents[1] / "tests" / "engines" / "llamacpp"
# The tiny model's answer is as long as its context allows: it runs a few seconds.
REAL_TOKENS = 3500
POLL_S = 0.002
UNTIL_S = 15.0


@dataclass
class Target:
    """Where a request goes (the router, or the engine itself) and with which key."""

    url: str
    key: str


def install(root: Path, name: str) -> Path:
    """The simulated engine of deployment `name`, as `capyctl engine add` takes it."""
    if name == "llamacpp":
        return install_llama_server(root / "e" / name, 6000, BEHAVIOUR)
    if name == "llamareal":
        return cast(Path, _llama_kit("llama_server").write_wrapper(root / "e" / name))
    if name == "vllm":
        return install_python_engine(root / "e" / name, "vllm", "0.29.0", BEHAVIOUR)
    version = {"sglang16": "0.5.16", "sglang22": "0.5.22"}[name]
    return install_python_engine(root / "e" / name, "sglang", version, BEHAVIOUR)


def _llama_kit(module: str) -> Any:
    """A module of the tests' real llama.cpp kit: its launcher, its tiny model."""
    if str(LLAMA_TESTS) not in sys.path:
        sys.path.insert(0, str(LLAMA_TESTS))
    return importlib.import_module(module)


class Stand:
    """The standalone role, one ready deployment per engine."""

    def __init__(self, root: Path) -> None:
        self.root, self.state = root, root / "state"
        self.env = benchrole.role_env(root)
        document = benchrole.write_document(root, "256GiB")
        benchrole.sparse_model(root / "models" / "m2", 2 * GiB)
        gguf = root / "models" / "g2"
        gguf.mkdir(parents=True)
        with (gguf / "model.gguf").open("wb") as weights:
            weights.truncate(2 * GiB)
        (root / "models" / "tiny").mkdir()
        _llama_kit("tinygguf").write_tiny_model(root / "models" / "tiny" / "tiny.gguf")
        self.inference = f"127.0.0.1:{benchrole.free_port()}"
        self.log = (root / "role.log").open("wb")
        self.role = benchrole.start_standalone(
            self.state, document, self.inference, self.log, self.env
        )
        try:
            self._deploy(root)
        except BaseException:  # the role never outlives a stand that failed to set up
            self.close()
            raise
        credentials = yaml.safe_load((self.state / "identity" / "credentials").read_text())
        self.router = Target(f"http://{self.inference}", credentials["api_key"])

    def _deploy(self, root: Path) -> None:
        """Each engine registered and its deployment ready."""
        until(lambda: self.cli("list", "deployments").returncode == 0, "the role")
        for name in ENGINES:
            self.cli("engine", "add", str(install(root, name)), "--name", name, check=True)
            path = root / f"{name}.yaml"
            model = {"llamacpp": "g2", "llamareal": "tiny"}.get(name, "m2")
            config: dict[str, Any] = {"memory": {"request": "3GiB"}}
            if name.startswith("llama"):
                # One slot: llama.cpp splits its context among its slots.
                config |= {"context_length": 4096, "max_concurrent_requests": 1}
            path.write_text(
                yaml.safe_dump(
                    {"name": name, "engine": name, "model": model, "engine_config": config}
                )
            )
            self.cli("deploy", "model", "--file", str(path), check=True)
            self.cli("start", "deployment", name, "--wait", check=True)

    def cli(self, *args: str, check: bool = False) -> Any:
        return benchrole.cli(self.state, self.env, *args, check=check)

    def engine(self, name: str) -> Target:
        """The deployment's engine, directly, with its per-launch key."""
        status = yaml.safe_load(self.cli("status", "deployment", name, "--json", check=True).stdout)
        port = status["instances"][0]["port"]
        with redis.Redis(unix_socket_path=str(self.state / "redis" / "redis.sock")) as client:
            secret = cast(bytes, client.get(keys.instance_secret("local", name, 0))).decode()
        return Target(f"http://127.0.0.1:{port}", secret)

    def close(self) -> None:
        self.cli("drain", "standalone")
        self.role.send_signal(signal.SIGTERM)
        self.role.wait(timeout=120)
        self.log.close()


async def running(http: httpx.AsyncClient, engine: Target, pattern: str) -> int:
    text = (await http.get(f"{engine.url}/metrics", headers=_auth(engine))).text
    found = re.search(pattern, text, re.M)
    if found is None:
        raise SystemExit(f"{engine.url}/metrics counts no running requests ({pattern})")
    return int(float(found[1]))


async def one_hang_up(
    name: str, target: Target, engine: Target, pattern: str, stream: bool
) -> float:
    """Seconds from the hang-up to the engine's count of running requests dropping."""
    body: dict[str, Any] = {"model": name, "messages": [{"role": "user", "content": "go"}]}
    body |= {"stream": stream, "max_tokens": 400}
    if name == "llamareal":
        body |= {"max_tokens": REAL_TOKENS, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as watch, httpx.AsyncClient(timeout=60) as client:
        first = asyncio.Event()

        async def send() -> None:
            url = f"{target.url}/v1/chat/completions"
            async with client.stream("POST", url, json=body, headers=_auth(target)) as answer:
                async for line in answer.aiter_lines():
                    if '"content"' in line:
                        first.set()
                await asyncio.Event().wait()

        task = asyncio.create_task(send())
        deadline = time.monotonic() + UNTIL_S
        while await running(watch, engine, pattern) < 1 or (stream and not first.is_set()):
            if time.monotonic() > deadline:
                raise SystemExit(f"{name}: the request never ran")
            await asyncio.sleep(POLL_S)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        hung_up = time.monotonic()
        while await running(watch, engine, pattern) > 0:
            if time.monotonic() - hung_up > UNTIL_S:
                return float("inf")
            await asyncio.sleep(POLL_S)
        return time.monotonic() - hung_up


def _auth(target: Target) -> dict[str, str]:
    return {"Authorization": f"Bearer {target.key}"}


def measure(stand: Stand, rounds: int) -> None:
    head = f"{'engine':16} {'request':14} {'engine alone':>14} {'through CapyCTL':>16}"
    print(f"{head} {'added':>9}  ratio")
    for name, (label, pattern) in ENGINES.items():
        engine = stand.engine(name)
        for stream in (True, False):
            sides: dict[str, list[float]] = {"direct": [], "router": []}
            for _ in range(rounds):  # interleaved: the two sides share the machine's moments
                for side, target in (("direct", engine), ("router", stand.router)):
                    seconds = asyncio.run(one_hang_up(name, target, engine, pattern, stream))
                    sides[side].append(seconds)
            direct = statistics.median(sides["direct"]) * 1000
            router = statistics.median(sides["router"]) * 1000
            kind = "streamed" if stream else "not streamed"
            if max(direct, router) == float("inf"):  # the median ran on past UNTIL_S
                print(f"{label:16} {kind:14} {_shown(direct):>14} {_shown(router):>16}")
                continue
            added = f"{router - direct:+.0f} ms"
            print(
                f"{label:16} {kind:14} {direct:11.0f} ms {router:13.0f} ms {added:>9}  "
                f"{router / direct:.3g}"
            )


def _shown(ms: float) -> str:
    return f"> {UNTIL_S:.0f} s" if ms == float("inf") else f"{ms:.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="hang-ups a side, engine and kind")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="capy-hangup-"))
    started = time.monotonic()
    stand = Stand(root)
    try:
        print(f"medians of {args.rounds} hang-ups each; a side is the engine alone or CapyCTL")
        measure(stand, args.rounds)
    finally:
        stand.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"the whole run took {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
