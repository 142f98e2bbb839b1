"""hostd follows an aborted request to its end in SGLang 0.5.22 and reports it in Redis."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import cast

import httpx

from capycommon.domain.commands import Abort
from capycommon.domain.hosts import RequestEnd
from capycommon.state import keys
from capycommon.state.settlement import FIELD
from enginesim.install import write_behaviour
from integration.hostd.harness import FAST, HOST, Hostd, launch
from support import wait_for

SLOW = FAST.model_copy(update={"tokens_per_second": 5, "answer": " ".join(["word"] * 200)})


def _ends(harness: Hostd) -> list[RequestEnd]:
    entries = cast(
        list[tuple[bytes, dict[bytes, bytes]]], harness.client.xrange(keys.request_ends(HOST))
    )
    return [RequestEnd.model_validate_json(fields[FIELD.encode()]) for _, fields in entries]


def _stream(url: str, key: str, rid: str, first: threading.Event) -> None:
    body = {
        "model": "a",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "rid": rid,
    }
    headers = {"Authorization": f"Bearer {key}"}
    # The engine is stopped under the request that keeps running at the end.
    with (
        contextlib.suppress(httpx.HTTPError),
        httpx.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60
        ) as response,
    ):
        for line in response.iter_lines():
            if '"content"' in line:
                first.set()


def test_an_aborted_request_is_reported_ended_while_others_run(
    hostd: tuple[Hostd, str], model: Path, installs: dict[str, Path]
) -> None:
    harness, gpu = hostd
    write_behaviour(installs["sglang22"], SLOW)
    harness.send(launch("a", 1, gpu, model, profile="sglang22", residency="restart_only"))
    ready = harness.wait_state("a", "ready")
    url, key = f"http://127.0.0.1:{ready.port}", harness.secret("a")
    started = {rid: threading.Event() for rid in ("keeps-running", "cut-1")}
    clients = [
        threading.Thread(target=_stream, args=(url, key, rid, first), daemon=True)
        for rid, first in started.items()
    ]
    for client in clients:
        client.start()
    for first in started.values():
        assert first.wait(15), "both requests run"
    harness.send(Abort(deployment="a", generation=1, request_id="cut-1"))
    harness.send(Abort(deployment="a", generation=1, request_id="never-came"))

    def reported() -> list[RequestEnd] | None:
        found = _ends(harness)
        return found if len(found) == 2 else None

    ends = {end.request_id: end for end in wait_for(reported, timeout=10, what="two ends")}
    assert ends["cut-1"].held, "the engine held the request it was asked to abort"
    assert (ends["cut-1"].deployment, ends["cut-1"].generation) == ("a", 1)
    assert not ends["never-came"].held, "nothing proves a request the engine never held"
    assert clients[0].is_alive(), "the other request still runs: the engine never read idle"
    metrics = httpx.get(f"{url}/metrics", timeout=5).text
    assert 'sglang:num_running_reqs{model_name="a"} 1.0' in metrics, metrics


def test_older_sglang_is_not_followed(hostd: tuple[Hostd, str], model: Path) -> None:
    harness, gpu = hostd
    harness.send(launch("a", 1, gpu, model, profile="sglang", residency="restart_only"))
    harness.wait_state("a", "ready")
    harness.send(Abort(deployment="a", generation=1, request_id="never-came"))
    harness.send(Abort(deployment="a", generation=2, request_id="stale"))
    wait_for(
        lambda: any(e["kind"] == "refused" for e in harness.events()),
        timeout=10,
        what="the stale abort refused",
    )
    assert _ends(harness) == [], "0.5.16 keeps settling on the idle reading or at the stop"
