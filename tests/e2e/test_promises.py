"""The promises of the release notes on one machine, end to end with the openai SDK: no
request waits without bound, first starts get the room their engine says they need, idle
models give their memory back, and a restart_only model parks by stopping."""

from __future__ import annotations

import threading
import time
from typing import Any

import openai
import pytest

from cluster import Cluster, running
from support import wait_for

HELLO = [{"role": "user", "content": "hello"}]


def sdk(cluster: Cluster, timeout: float = 120.0) -> openai.OpenAI:
    return cluster.openai(timeout)


def ask(cluster: Cluster, model: str) -> str:
    with sdk(cluster) as client:
        answer = client.chat.completions.create(model=model, messages=HELLO)  # type: ignore[arg-type]
    content = answer.choices[0].message.content
    assert content, f"{model} answered nothing"
    return content


def error_of(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.body
    assert isinstance(body, dict), body
    return body.get("error", body)  # type: ignore[no-any-return]


def test_three_first_starts_park_the_model_in_their_way_and_peaks_are_measured(
    cluster: Cluster,
) -> None:
    # The case a new user met: three 6 GiB models with nothing but a name, an engine and a
    # model, on one 24 GiB card. A first start is charged as vLLM sizes itself, the share of
    # the card it is told (10.8 GiB) with its CUDA context: the 11.85 GiB ready charge. Two do
    # not fit, so each first start parks the model in its way, which leaves it room.
    # This engine takes 6 GiB more while it loads than vLLM's own sizing says: memwatch
    # measures that on the first start, and the measured peak replaces the estimate.
    for name in "abc":
        cluster.deploy(name, engine="peaky", model="six")
    for name in "abc":
        ask(cluster, name)
        assert cluster.state(name) == "ready"
    history = {name: cluster.transitions(name) for name in "abc"}
    parked = [name for name in "ab" if any(to == "parking" for _, to, _ in history[name])]
    assert parked == ["a", "b"], (
        f"b's and c's first starts parked the model in their way: {history}"
    )
    assert not any(to == "stopping" for name in "abc" for _, to, _ in history[name]), history
    ask(cluster, "a")
    assert cluster.state("a") == "ready"
    final = [to for _, to, _ in cluster.transitions("c")][-1]
    assert final == "parked", f"a's wake parked c: {cluster.transitions('c')}"
    # memwatch stores a peak only for a start it watched whole (under heavy load it may not);
    # what it stores is the load's, 6 GiB above the estimate.
    startup = cluster.status("a")["startup"]
    if startup["device_provenance"] == "measured":
        peak = startup["device_bytes"]
        assert 16 * (1 << 30) < peak < 18 * (1 << 30), f"the load's peak, measured: {peak}"
    else:
        assert startup["device_provenance"] == "derived", startup


def test_a_model_bigger_than_the_card_is_refused_at_once_with_figures(cluster: Cluster) -> None:
    cluster.deploy("huge", model="huge")
    began = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        ask(cluster, "huge")
    assert time.monotonic() - began < 10, "at once, not at the request deadline"
    assert refused.value.status_code == 503
    assert refused.value.response.headers["x-should-retry"] == "false", "the SDK does not retry"
    error = error_of(refused.value)
    assert error["code"] == "insufficient_resources"
    message = error["message"]
    assert "needs " in message
    assert "on gpu0, which holds at most 22.1 GiB for models" in message
    assert "stopping every model that may be evicted frees" in message
    again = cluster.cli("start", "deployment", "huge", "--wait")
    assert again.returncode == 4, again.stderr
    assert "error [insufficient_resources]" in again.stderr


def test_a_request_that_waits_past_its_deadline_gets_an_error(cluster: Cluster) -> None:
    cluster.deploy("late", engine="slowload", model="small", request_deadline="3s")
    began = time.monotonic()
    with pytest.raises(openai.APIStatusError) as late:
        ask(cluster, "late")
    waited = time.monotonic() - began
    assert 2.5 < waited < 15, waited
    assert late.value.status_code == 503
    assert error_of(late.value)["code"] == "unavailable"
    assert "within the request deadline (3s)" in error_of(late.value)["message"]


@pytest.mark.parametrize(
    ("verb", "status", "code"),
    [("stop", 409, "deployment_stopped"), ("delete", 404, "unknown_model")],
)
def test_waiting_requests_are_told_when_their_deployment_goes(
    cluster: Cluster, verb: str, status: int, code: str
) -> None:
    cluster.deploy("slow", engine="slowload", model="small")
    found: list[BaseException] = []

    def waiter() -> None:
        try:
            ask(cluster, "slow")
        except openai.APIStatusError as exc:
            found.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    wait_for(lambda: cluster.state("slow") == "starting", timeout=30, what="the slow start")
    cluster.ok(verb, "deployment", "slow")
    thread.join(timeout=20)
    assert not thread.is_alive(), "the waiting request was answered"
    (exc,) = found
    assert isinstance(exc, openai.APIStatusError)
    assert (exc.status_code, error_of(exc)["code"]) == (status, code)


def test_a_restart_only_park_stops_the_engine_and_a_request_cold_starts_it(
    cluster: Cluster,
) -> None:
    cluster.deploy("ro", model="gguf", engine="llama", engine_config={"context_length": 4096})
    cluster.start("ro")
    assert "parked" in cluster.ok("park", "deployment", "ro", "--wait")
    instance = cluster.instance("ro")
    assert instance is not None
    assert instance.state == "stopped", "a restart_only park stops the engine"
    assert "parked" in cluster.ok("status", "deployment", "ro")
    ask(cluster, "ro")
    assert cluster.state("ro") == "ready"
    starts = {e.generation for e in cluster.events("ro") if e.to_state == "starting"}
    assert len(starts) == 2, "the request cold-started it"


def test_status_says_when_the_model_will_next_park(cluster: Cluster) -> None:
    cluster.deploy("soon", model="small")
    ask(cluster, "soon")
    idle = cluster.status("soon")["idle"]
    assert (idle["ready_idle_timeout"], idle["parked_idle_timeout"]) == (300.0, 1800.0)
    assert idle["next"]["action"] == "park"
    assert 250 < idle["next"]["at"] - time.time() <= 300
    text = cluster.ok("status", "deployment", "soon")
    assert "parks at " in text
    assert "ready 5m, parked 30m" in text


def test_status_names_a_folder_model_as_it_was_declared(cluster: Cluster) -> None:
    """A model from a folder is shown by that folder, as the document wrote it: the status's
    canonical document carries `hf: null` beside the path, which once printed `hf None`."""
    cluster.deploy("folder", model="small")
    lines = cluster.ok("status", "deployment", "folder").splitlines()
    shown = [line.split() for line in lines if line.startswith("model ")]
    assert shown == [["model", "small"]], lines
    assert not any(line.startswith("commit ") for line in lines), lines


def test_the_roles_idle_defaults_park_then_stop_unless_a_deployment_says_never() -> None:
    scheduling = {
        "drain_timeout": 10,
        "park_verify_timeout": 3,
        "ready_idle_timeout": "2s",
        "parked_idle_timeout": "2s",
    }
    with running("idle", scheduling=scheduling) as cluster:
        cluster.deploy("idle", model="small")
        cluster.deploy("kept", model="small", lifecycle={"ready_idle_timeout": "never"})
        ask(cluster, "idle")
        ask(cluster, "kept")
        try:
            wait_for(lambda: cluster.state("idle") == "stopped", timeout=30, what="idle steps")
        except AssertionError:
            raise AssertionError(
                f"{cluster.transitions('idle')} {cluster.status('idle')}"
            ) from None
        assert cluster.status("idle")["state"] == "idle", "an idle stop keeps it on demand"
        reasons = [(to, reason) for _, to, reason in cluster.transitions("idle")]
        assert ("draining", "drain: idle for 2s") in reasons
        assert "parked" in [to for to, _ in reasons], reasons
        assert ("stopping", "stop: parked idle for 2s") in reasons
        assert cluster.state("kept") == "ready", "never: it keeps its memory"
        assert cluster.status("kept")["idle"]["next"] is None
