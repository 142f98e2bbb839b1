"""`capyctl demo`, the README's first command: a working endpoint on a machine with no GPU."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess

import openai

from support import CAPYCTL, clean_env, free_port, processes_mentioning, short_dir, wait_for


def test_the_demo_serves_switches_and_cleans_up() -> None:
    root = short_dir("demo")
    state = root / "state"
    inference, management = free_port(), free_port()
    log = root / "demo.out"
    with log.open("wb") as out:
        demo = subprocess.Popen(
            [CAPYCTL, "demo", "--state-dir", str(state), "--listen", f"127.0.0.1:{inference}",
             "--management-listen", f"127.0.0.1:{management}"],
            stdout=out, stderr=subprocess.STDOUT, env=clean_env(HOME=str(root)),
        )  # fmt: skip
    try:
        wait_for(lambda: "Ctrl-C stops" in log.read_text(), timeout=120,
                 what="the demo's instructions")  # fmt: skip
        usage = log.read_text()
        key = re.search(r'api_key="([^"]+)"', usage)
        assert key is not None, usage
        assert f"http://127.0.0.1:{inference}/v1" in usage
        assert "curl -s" in usage
        assert "capyctl park deployment" in usage
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{inference}/v1", api_key=key[1],
                               max_retries=0, timeout=120)  # fmt: skip
        models = sorted(m.id for m in client.models.list().data)
        assert models == ["llama-3.1-8b", "mistral-7b", "qwen", "qwen3-8b"]
        for model in ("llama-3.1-8b", "qwen3-8b", "mistral-7b", "llama-3.1-8b"):
            answer = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hello"}]
            )
            assert answer.choices[0].message.content
        demo.send_signal(signal.SIGINT)  # Ctrl-C
        assert demo.wait(timeout=90) == 0
        assert processes_mentioning(str(state)) == [], "no engine, no service left behind"
    finally:
        if demo.poll() is None:
            demo.kill()
        shutil.rmtree(root, ignore_errors=True)
