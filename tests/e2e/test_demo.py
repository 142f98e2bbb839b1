"""`capyctl demo`, the README's first command: a working endpoint on a machine with no GPU."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from subprocess import Popen
from typing import IO

import openai

from ports import engine_ports, free_port
from support import (
    CAPYCTL,
    clean_env,
    ctrl_c_heard,
    live_processes,
    processes_mentioning,
    short_dir,
    wait_for,
)

HELLO: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]


def _start(root: Path, inference: int, out: int | IO[bytes], pty: bool = False) -> Popen[bytes]:
    """The demo, writing to `out`. With `pty`, as a shell in a terminal window runs it: the
    leader of a session of its own whose controlling terminal is `out` (setsid execs in
    place, so the process is the demo's)."""
    argv = [
        CAPYCTL,
        "demo",
        "--state-dir",
        str(root / "state"),
        "--listen",
        f"127.0.0.1:{inference}",
        "--management-listen",
        f"127.0.0.1:{free_port()}",
    ]
    env = clean_env(HOME=str(root), CAPYCTL_ENGINE_PORTS=engine_ports(8))
    with ctrl_c_heard():  # the demo stops on its Ctrl-C
        if not pty:
            return Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        return Popen(["setsid", "--ctty", *argv], stdin=out, stdout=out, stderr=out, env=env)


def _client(usage: str, inference: int) -> openai.OpenAI:
    key = re.search(r'api_key="([^"]+)"', usage)
    assert key is not None, usage
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{inference}/v1", api_key=key[1], max_retries=0, timeout=120
    )


def test_the_demo_serves_switches_and_cleans_up() -> None:
    root = short_dir("demo")
    state = root / "state"
    inference = free_port()
    log = root / "demo.out"
    with log.open("wb") as out:
        demo = _start(root, inference, out)
    try:
        try:
            wait_for(
                lambda: "Ctrl-C stops" in log.read_text(),
                timeout=120,
                what="the demo's instructions",
            )
        except AssertionError as exc:  # what the demo said instead
            raise AssertionError(f"{exc}; it printed:\n{log.read_text()[-6000:]}") from None
        usage = log.read_text()
        assert f"http://127.0.0.1:{inference}/v1" in usage
        assert "curl -s" in usage
        assert "capyctl park deployment" in usage
        with _client(usage, inference) as client:
            models = sorted(m.id for m in client.models.list().data)
            assert models == ["llama-3.1-8b", "mistral-7b", "qwen", "qwen3-8b"]
            for model in ("llama-3.1-8b", "qwen3-8b", "mistral-7b", "llama-3.1-8b"):
                answer = client.chat.completions.create(model=model, messages=HELLO)
                assert answer.choices[0].message.content
        demo.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            # Past the demo's own bounds (30 s for the engines, 60 s for the role), so that a
            # demo that overruns them says so itself.
            code = demo.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the demo did not stop:\n{log.read_text()[-6000:]}") from None
        assert code == 0
        assert processes_mentioning(str(state)) == [], "no engine, no service left behind"
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        for pid in processes_mentioning(str(state)):  # a killed demo leaves its role behind
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


class Terminal:
    """The terminal side of a pty: what the demo printed, read as it comes."""

    def __init__(self, master: int) -> None:
        self.master = master
        self.text = ""
        os.set_blocking(master, False)

    def read(self) -> str:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except BlockingIOError:
                return self.text
            if not chunk:
                return self.text
            self.text += chunk.decode(errors="replace")

    def shown(self, text: str) -> Callable[[], str | None]:
        """A condition: everything printed so far, once it contains `text`."""
        return lambda: self.text if text in self.read() else None


def test_a_closed_terminal_stops_the_engines_and_the_role() -> None:
    root = short_dir("demohup")
    state = root / "state"
    inference = free_port()
    master, slave = os.openpty()
    demo = _start(root, inference, slave, pty=True)
    os.close(slave)
    terminal = Terminal(master)
    try:
        usage = wait_for(
            terminal.shown("Ctrl-C stops"), timeout=120, what="the demo's instructions"
        )
        with _client(usage, inference) as client:
            answer = client.chat.completions.create(model="qwen3-8b", messages=HELLO)
        assert answer.choices[0].message.content
        mine = [p.cmdline for p in live_processes() if str(state) in p.cmdline]
        assert any("supervisord" in c for c in mine), mine
        assert any("redis-server" in c for c in mine), mine
        assert any("/engines/" in c for c in mine), f"an engine runs: {mine}"
        os.close(master)  # the window closes: the kernel hangs up the demo's terminal
        master = -1
        assert demo.wait(timeout=90) == 0
        assert processes_mentioning(str(state)) == [], "no engine, no service left behind"
    finally:
        if master >= 0:
            os.close(master)
        if demo.poll() is None:
            demo.kill()
        shutil.rmtree(root, ignore_errors=True)
