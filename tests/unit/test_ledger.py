"""The memory ledger: derived domains, footprints, admission with its figures."""

from __future__ import annotations

import pytest

from capycommon.errors import DeviceUnobserved, InsufficientResources
from capyctl_scheduler.ledger import (
    Domain,
    GiB,
    Ledger,
    Limits,
    derive_discrete,
    derive_domains,
    derive_unified,
)
from capyctl_scheduler.placement import place
from unit.readings import idle_reading


def test_discrete_domains_follow_the_standalone_policy() -> None:
    system, gpu0 = derive_domains(idle_reading((24 * GiB, False)))
    assert system == Domain("system", 64 * GiB, 32 * GiB, 64 * GiB // 5, 16 * GiB)
    reserve = 24 * GiB * 8 // 100  # 8% beats the 1 GiB floor
    assert gpu0 == Domain("gpu0", 24 * GiB, 24 * GiB - reserve, reserve, 6 * GiB)
    _, small = derive_domains(idle_reading((8 * GiB, False)))
    assert small.free_reserve == GiB, "a small card keeps at least 1 GiB"


def test_a_unified_machine_has_one_domain() -> None:
    (domain,) = derive_domains(idle_reading((128 * GiB, True), ram=128 * GiB))
    assert domain == Domain("unified", 128 * GiB, 64 * GiB, 128 * GiB // 5, 32 * GiB)


def test_three_models_of_14_gib_take_turns_on_one_24_gib_card() -> None:
    ledger = Ledger({d.name: d for d in derive_domains(idle_reading((24 * GiB, False)))})
    charge = {"gpu0": 14 * GiB, "system": 4 * GiB}
    ledger = ledger.admit("a:0", charge)
    with pytest.raises(InsufficientResources) as caught:
        ledger.admit("b:0", charge)
    free = 24 * GiB - 24 * GiB * 8 // 100 - 14 * GiB
    assert caught.value.message == (
        f"needs 14.0 GiB on gpu0, {free / GiB:.1f} GiB free, 1.9 GiB reserve"
    )
    assert caught.value.exit_code == 4
    parked = ledger.admit("a:0", {"gpu0": GiB, "system": 4 * GiB})  # a's charge is replaced
    assert parked.total("gpu0") == GiB
    both = parked.admit("b:0", charge)
    assert both.total("gpu0") == 15 * GiB
    third = both.release("a:0").release("b:0").admit("c:0", charge)
    assert third.total("gpu0") == 14 * GiB


def test_every_domain_must_fit() -> None:
    ledger = Ledger(
        {d.name: d for d in derive_domains(idle_reading((80 * GiB, False), ram=16 * GiB))}
    )
    with pytest.raises(InsufficientResources, match="on system"):
        ledger.admit("a:0", {"gpu0": 10 * GiB, "system": 12 * GiB})


def test_an_unobserved_domain_admits_nothing() -> None:
    ledger = Ledger({d.name: d for d in derive_domains(idle_reading((24 * GiB, False)))})
    with pytest.raises(DeviceUnobserved):
        ledger.admit("a:0", {"gpu1": GiB})


def test_derived_footprint_of_a_discrete_deployment() -> None:
    weights = 8 * GiB
    card = Domain("gpu0", 48 * GiB, 44 * GiB, 4 * GiB, 8 * GiB)
    footprint = derive_discrete(gpu="gpu0", weights=weights, device=card, host_backed=True)
    ready = footprint.charge("ready")
    assert ready["gpu0"] == weights * 110 // 100 + 4 * GiB + 5 * GiB // 4
    assert footprint.engine_budget == weights * 110 // 100 + 4 * GiB
    assert ready["system"] == 4 * GiB + 12 * GiB, "host overhead plus 1.5 x weights parked copy"
    assert footprint.charge("parked")["gpu0"] == GiB
    assert footprint.charge("starting")["gpu0"] == weights * 9 // 4 + 8 * GiB
    assert footprint.charge("starting")["gpu0"] == weights * 9 // 4 + 8 * GiB
    assert (footprint.device_provenance, footprint.host_provenance) == ("derived", "derived")
    assert footprint.charge("cold") == {}
    declared = derive_discrete(
        gpu="gpu0", weights=weights, device=card, host_backed=False, startup=(20 * GiB, "declared")
    )
    assert declared.charge("starting")["gpu0"] == 20 * GiB
    assert declared.charge("ready")["system"] == 4 * GiB
    assert declared.device_provenance == "declared"


def test_placement() -> None:
    two = Ledger(
        {d.name: d for d in derive_domains(idle_reading((24 * GiB, False), (24 * GiB, False)))}
    )
    assert place(two, ["gpu0", "gpu1"]) == "gpu0", "a tie goes to the lowest index"
    busy = two.admit("a:0", {"gpu0": 10 * GiB})
    assert place(busy, ["gpu0", "gpu1"]) == "gpu1", "the most headroom"
    assert place(busy, ["gpu0", "gpu1"], pinned="gpu0") == "gpu0"
    assert place(busy, ["gpu0", "gpu1"], parked_on="gpu0") == "gpu0", "wake where it parked"
    with pytest.raises(DeviceUnobserved, match="gpu7"):
        place(busy, ["gpu0", "gpu1"], pinned="gpu7")
    with pytest.raises(DeviceUnobserved):
        place(busy, ["gpu3"])


def test_a_derived_peak_above_the_card_needs_the_card_empty() -> None:
    card = Domain("gpu0", 24 * GiB, 22 * GiB, 2 * GiB, 6 * GiB)
    footprint = derive_discrete(gpu="gpu0", weights=8 * GiB, device=card, host_backed=False)
    assert footprint.charge("starting")["gpu0"] == 22 * GiB
    assert footprint.device_provenance == "whole_device"
    ledger = Ledger(
        {"gpu0": card, "system": Domain("system", 64 * GiB, 32 * GiB, 8 * GiB, 16 * GiB)}
    )
    with pytest.raises(InsufficientResources, match=r"needs 22\.0 GiB on gpu0"):
        ledger.admit("b:0", {"gpu0": GiB}).admit("a:0", footprint.charge("starting"))
    measured = derive_discrete(
        gpu="gpu0",
        weights=8 * GiB,
        device=card,
        host_backed=False,
        startup=(16 * GiB, "measured"),
        startup_host=(6 * GiB, "measured"),
    )
    assert measured.charge("starting") == {"gpu0": 16 * GiB, "system": 6 * GiB}
    assert (measured.device_provenance, measured.host_provenance) == ("measured", "measured")


def test_a_declared_request_replaces_the_derived_one() -> None:
    card = Domain("gpu0", 24 * GiB, 22 * GiB, 2 * GiB, 6 * GiB)
    footprint = derive_discrete(
        gpu="gpu0",
        weights=8 * GiB,
        device=card,
        host_backed=False,
        request=12 * GiB,
        kv_cache=2 * GiB,
    )
    assert footprint.charge("ready")["gpu0"] == 12 * GiB + 5 * GiB // 4
    assert (footprint.engine_budget, footprint.kv_cache) == (12 * GiB, 2 * GiB)


def test_unified_footprint() -> None:
    pool = Domain("unified", 128 * GiB, 64 * GiB, 25 * GiB, 32 * GiB)
    footprint = derive_unified(weights=40 * GiB, domain=pool)
    margin = 40 * GiB * 15 // 100 + 4 * GiB  # above 8 GiB
    assert footprint.charge("ready") == {"unified": 40 * GiB + 4 * GiB + margin}
    assert footprint.charge("parked") == {"unified": 2 * GiB}
    assert footprint.charge("starting") == {"unified": 64 * GiB}, "2.25 x 40 GiB is above 64 GiB"
    assert footprint.device_provenance == "whole_device"
    small = derive_unified(weights=4 * GiB, domain=pool)
    assert small.charge("ready") == {"unified": 4 * GiB + 4 * GiB + 8 * GiB}
    assert small.charge("starting") == {"unified": 16 * GiB + 5 * GiB // 4}
    assert small.device_provenance == "derived"


def test_limits_override_the_derived_policy() -> None:
    found = derive_domains(
        idle_reading((24 * GiB, False)),
        system=Limits(managed_limit="80%", parked_limit="10GiB"),
        gpu=Limits(free_reserve="3GiB"),
    )
    system, gpu0 = found
    assert (system.managed_limit, system.parked_limit) == (64 * GiB * 80 // 100, 10 * GiB)
    assert system.free_reserve == 64 * GiB // 5, "what is not overridden stays derived"
    assert gpu0.free_reserve == 3 * GiB


def test_an_lmcache_server_is_charged_beside_its_engine_in_every_phase_but_cold() -> None:
    card = Domain("gpu0", 24 * GiB, 22 * GiB, 2 * GiB, 6 * GiB)
    plain = derive_discrete(gpu="gpu0", weights=8 * GiB, device=card, host_backed=False)
    cached = plain.with_cache(6 * GiB, ("gpu0", 768 << 20), "derived")
    assert cached.cache_provenance == "derived"
    assert plain.cache_provenance is None
    assert cached.charge("cold") == {}
    for phase in ("starting", "ready", "waking", "parked"):
        before, after = plain.charge(phase), cached.charge(phase)
        assert after["system"] == before["system"] + 6 * GiB, phase
        assert after["gpu0"] == before["gpu0"] + (768 << 20), phase
    pool = Domain("unified", 128 * GiB, 64 * GiB, 25 * GiB, 32 * GiB)
    unified = derive_unified(weights=8 * GiB, domain=pool)
    shared = unified.with_cache(6 * GiB, ("unified", 768 << 20), "measured")
    extra = 6 * GiB + (768 << 20)
    assert shared.charge("ready") == {"unified": unified.charge("ready")["unified"] + extra}
