"""An engine that crashes while it serves: hostd sees it at once, the request it was answering
ends with an error that carries its id, the first restart is immediate, and the requests that
arrive meanwhile are served once it is back."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import openai
import pytest

from cluster import HOST, SMALL, Cluster
from support import wait_for

pytestmark = pytest.mark.slow
HELLO = [{"role": "user", "content": "hello"}]


def _client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=cluster.base_url, api_key=cluster.api_key, timeout=120, max_retries=0
    )


def test_a_crashed_engine_fails_its_request_and_comes_back_at_once(cluster: Cluster) -> None:
    # 80 words at 8 tokens/s: the first request is still streaming when its engine dies.
    cluster.deploy("crash", engine="slow", model="small")
    with _client(cluster) as client:
        client.chat.completions.create(model="crash", messages=HELLO, max_tokens=1)  # type: ignore[arg-type]
    instance = cluster.instance("crash")
    assert instance is not None
    assert instance.process is not None
    crashed_generation = instance.generation

    ended: list[BaseException | None] = []
    streaming = threading.Event()

    def stream() -> None:
        try:
            with _client(cluster) as client:
                chunks = client.chat.completions.create(
                    model="crash",
                    messages=HELLO,  # type: ignore[arg-type]
                    stream=True,
                )
                for _ in chunks:
                    streaming.set()
            ended.append(None)
        except Exception as exc:  # the test reads what it was
            ended.append(exc)

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert streaming.wait(30), "the stream began"

    killed_at, killed_wall = time.monotonic(), time.time()
    os.kill(instance.process.pgid, signal.SIGKILL)
    streamer.join(timeout=30)
    cut_after = time.monotonic() - killed_at
    assert ended, "the stream on the dead engine ended"
    assert ended[0] is not None, "the stream on the dead engine ended in an error"
    assert "(request chatcmpl-" in str(ended[0]), "the error names the request"
    failed = wait_for(
        lambda: [e for e in cluster.events("crash") if e.to_state == "failed"],
        timeout=10,
        what="hostd to record the crash",
    )
    seen_after = failed[-1].at - killed_wall
    assert "the engine exited on its own" in (failed[-1].reason or "")

    # A request sent now waits for the restart, which does not wait out a cooldown.
    with _client(cluster) as client:
        answer = client.chat.completions.create(model="crash", messages=HELLO, max_tokens=1)  # type: ignore[arg-type]
    stall = time.monotonic() - killed_at
    assert answer.choices[0].message.content
    again = cluster.instance("crash")
    assert again is not None
    assert again.generation > crashed_generation
    reasons = [d["reason"] for d in cluster.choices("crash")]
    retried = [reason for reason in reasons if "retrying now" in reason]
    assert retried, reasons
    assert "the engine exited on its own (code -9); last log lines: " in retried[0]
    print(
        f"crash: stream cut after {cut_after:.2f} s, failed recorded after {seen_after:.2f} s, "
        f"next request served {stall:.2f} s after the kill; the stream got: {ended[0]}"
    )
    assert stall < 20, f"the next request waited {stall:.1f} s for the restart"


def test_a_model_that_cannot_start_fails_its_waiting_request_with_the_engines_words(
    cluster: Cluster,
) -> None:
    cluster.deploy(
        "broken", engine="crashy", model="small", engine_config={"memory": {"request": "4GiB"}}
    )
    began = time.monotonic()
    with _client(cluster) as client, pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model="broken", messages=HELLO, max_tokens=1)  # type: ignore[arg-type]
    # Two starts (the first failure is retried at once), not the retry's cooldown or the
    # request deadline: the waiting request is told as soon as the second start fails.
    assert time.monotonic() - began < 20
    said = json.dumps(caught.value.body)
    assert "activation_failed" in said, said
    assert "simulated crash" in said, said
    assert "again in 30 s" in said, said
    # The cooldown counts down in the status (the status may be read seconds later).
    reason = cluster.status("broken")["last_operation"]["reason"]
    waits = re.search(r"retry in (\d+)s(?: after)?: launch failed", reason)
    assert waits is not None, reason
    assert 0 < int(waits[1]) <= 30
    cluster.ok("stop", "deployment", "broken")


def test_capyctl_logs_shows_an_engines_recent_lines_from_its_file_or_its_memory(
    cluster: Cluster,
) -> None:
    cluster.deploy("kept", engine="vllm", model="small", engine_config=SMALL)
    cluster.start("kept")
    shown = cluster.ok("logs", "deployment", "kept", "--lines", "5")
    head, *lines = shown.splitlines()
    assert head == f"# kept on host {HOST}: its log file"
    assert 0 < len(lines) <= 5
    cluster.deploy("zero", engine="vllm", model="small", engine_config=SMALL, retention="zero")
    cluster.start("zero")
    found = json.loads(cluster.ok("logs", "deployment", "zero", "--json"))
    assert found["kept"] == "memory"
    assert any("vLLM API server version" in line for line in found["lines"]), found["lines"]
    assert "memory only (retention: zero)" in cluster.ok("logs", "deployment", "zero")
    missing = cluster.cli("logs", "deployment", "nobody")
    assert missing.returncode == 2
    assert "[not_found]" in missing.stderr
