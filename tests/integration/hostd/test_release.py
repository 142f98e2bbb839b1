"""Judging a park from memwatch's readings: which reading counts, and the reasons' figures."""

from __future__ import annotations

from capyctl_hostd.release import Seen, judge, observe
from unit.readings import GiB, held_reading

MiB = 1 << 20
# The instance's GPU, the reading's GPU 1.
UUID = "GPU-1"
PARKED_AT = 1000.0


def test_only_the_groups_processes_on_the_instances_gpu_count() -> None:
    reading = held_reading(PARKED_AT + 1, {1: {10: 300 * MiB, 11: 200 * MiB, 99: 40 * GiB}})
    seen = observe(Seen(UUID, None), reading, (UUID,), [10, 11, 12], PARKED_AT, PARKED_AT + 1.5)
    assert seen == Seen("gpu1", 500 * MiB)
    assert seen.within(512 * MiB)
    assert not seen.within(499 * MiB)


def test_a_reading_before_the_park_or_stale_names_the_gpu_but_gives_no_figure() -> None:
    start = Seen(UUID, None)
    before = held_reading(PARKED_AT - 0.1, {1: {10: 0}})
    assert observe(start, before, (UUID,), [10], PARKED_AT, PARKED_AT + 1) == Seen("gpu1", None)
    stale = held_reading(PARKED_AT + 1, {1: {10: 0}})
    assert observe(start, stale, (UUID,), [10], PARKED_AT, PARKED_AT + 7) == Seen("gpu1", None)
    held = Seen("gpu1", 6 * GiB)
    assert observe(held, stale, (UUID,), [10], PARKED_AT, PARKED_AT + 7) == held, "the last figure"


def test_no_reading_or_another_gpu_changes_nothing() -> None:
    start = Seen(UUID, None)
    assert observe(start, None, (UUID,), [10], PARKED_AT, PARKED_AT + 1) == start
    other = held_reading(PARKED_AT + 1, {2: {10: 0}})
    assert observe(start, other, (UUID,), [10], PARKED_AT, PARKED_AT + 1) == start


def test_the_reasons_give_the_figures() -> None:
    assert judge(Seen("gpu0", 512 * MiB), GiB, 15, "host_backed") == (
        True,
        "parked (host_backed): 512.0 MiB left on gpu0, within the 1.0 GiB parked charge",
    )
    assert judge(Seen("gpu0", int(13.5 * GiB)), GiB, 15, "deep") == (
        False,
        "park: memory not released: 13.5 GiB still held on gpu0 after 15s (parked charge 1.0 GiB)",
    )
    assert judge(Seen("gpu0", None), GiB, 0.5, "deep") == (
        False,
        "park: memory release unobserved: no fresh memwatch reading of gpu0 within 500ms "
        "(parked charge 1.0 GiB)",
    )


def test_an_engine_across_two_gpus_is_judged_by_its_fullest_gpu() -> None:
    first = held_reading(PARKED_AT + 1, {1: {10: 300 * MiB}})
    both = held_reading(PARKED_AT + 1, {1: {10: 300 * MiB}, 2: {11: 2 * GiB}})
    uuids = (UUID, "GPU-2")
    seen = observe(Seen(UUID, None), both, uuids, [10, 11], PARKED_AT, PARKED_AT + 1.5)
    assert seen == Seen("gpu2", 2 * GiB), "rank 1 still holds its weights"
    assert not seen.within(GiB)
    # A reading that lacks one of the GPUs judges nothing.
    assert observe(Seen(UUID, None), first, uuids, [10], PARKED_AT, PARKED_AT + 1.5) == Seen(
        UUID, None
    )
