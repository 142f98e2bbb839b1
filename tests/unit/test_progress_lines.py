"""What a request waiting for its model is told (`CapyCTL-Progress: on`): each line as the
instance's state, the last start's duration and a download make it."""

from __future__ import annotations

from capycommon.domain.hosts import Download
from capycommon.domain.instances import InstanceRecord, InstanceState
from capyctl_router.progress import progress_line

GiB = 1 << 30


def instance(state: InstanceState, since: float = 100.0) -> InstanceRecord:
    return InstanceRecord(
        deployment="qwen", instance=0, revision=1, generation=2, state=state, since=since, host="h"
    )


def test_a_start_against_the_last_one_and_never_past_99() -> None:
    starting = instance(InstanceState.STARTING)
    assert (
        progress_line("qwen3-8b", starting, False, 10.0, None, 104.5)
        == "capyctl loading model qwen3-8b, starting 45%"
    )
    assert progress_line("qwen3-8b", starting, False, 10.0, None, 130.0).endswith("starting 99%")
    assert progress_line("qwen3-8b", starting, False, 10.0, None, 99.0).endswith("starting 0%")
    assert (
        progress_line("qwen3-8b", starting, False, None, None, 104.0)
        == "capyctl loading model qwen3-8b, starting"
    ), "no earlier start: no percentage"


def test_a_wake_a_download_and_the_rest() -> None:
    waking = instance(InstanceState.WAKING)
    assert (
        progress_line("m", waking, False, 2.0, None, 101.0) == "capyctl loading model m, waking 50%"
    )
    download = Download(
        repo="o/m",
        commit="0" * 40,
        done_bytes=int(1.2 * GiB),
        total_bytes=3 * GiB,
        rate=1.0,
        started_at=0.0,
        at=1.0,
    )
    starting = instance(InstanceState.STARTING)
    assert (
        progress_line("m", starting, False, 10.0, download, 104.0)
        == "capyctl loading model m, downloading 1.2 GiB of 3.0 GiB"
    )
    for state in (InstanceState.PARKED, InstanceState.STOPPED, InstanceState.STOPPING):
        assert progress_line("m", instance(state), False, 2.0, None, 101.0) == (
            "capyctl loading model m"
        )
    assert progress_line("m", None, False, None, None, 0.0) == "capyctl loading model m"
    ready = instance(InstanceState.READY)
    assert progress_line("m", ready, True, 2.0, None, 101.0) == "capyctl waiting for a place on m"
