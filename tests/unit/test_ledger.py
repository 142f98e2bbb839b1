"""The memory ledger: derived domains, footprints, admission with its figures."""

from __future__ import annotations

import pytest

from capycommon.engines.families import Family
from capycommon.errors import DeviceUnobserved, InsufficientResources
from capyctl_scheduler.engineterms import CUDA_CONTEXT
from capyctl_scheduler.ledger import (
    Domain,
    GiB,
    Ledger,
    Limits,
    derive_discrete,
    derive_domains,
    derive_unified,
)
from unit.launches import terms
from unit.readings import idle_reading

MiB = 1 << 20


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
    vllm = terms(Family.VLLM, card.capacity)
    footprint = derive_discrete(
        gpu="gpu0", weights=weights, device=card, host_backed=True, terms=vllm
    )
    ready = footprint.charge("ready")
    budget = weights * 110 // 100 + 4 * GiB
    assert ready["gpu0"] == budget + 5 * GiB // 4
    assert footprint.engine_budget == budget
    assert ready["system"] == 4 * GiB + 12 * GiB, "host overhead plus 1.5 x weights parked copy"
    # vLLM 0.29 on a 48 GiB card: graphs of up to 512 sequences (2 x 256, its default), which
    # its sleep keeps beside the CUDA context.
    assert footprint.charge("parked")["gpu0"] == CUDA_CONTEXT + 512 * 2 * MiB
    # Its start stays within the budget it is told (27% of the card) plus its CUDA context and
    # 150 MiB: below the ready charge, which it is charged.
    told = card.capacity * 27 // 100
    assert vllm.startup_peak(weights, 4 * GiB, budget, card.capacity) == (
        CUDA_CONTEXT + told + 150 * MiB
    )
    assert footprint.charge("starting")["gpu0"] == ready["gpu0"]
    assert (footprint.device_provenance, footprint.host_provenance) == ("derived", "derived")
    assert footprint.charge("cold") == {}
    declared = derive_discrete(
        gpu="gpu0",
        weights=weights,
        device=card,
        host_backed=False,
        terms=vllm,
        startup=(20 * GiB, "declared"),
    )
    assert declared.charge("starting")["gpu0"] == 20 * GiB
    assert declared.charge("ready")["system"] == 4 * GiB
    assert declared.device_provenance == "declared"


def test_a_derived_peak_above_the_card_needs_the_card_empty() -> None:
    card = Domain("gpu0", 24 * GiB, 22 * GiB, 2 * GiB, 6 * GiB)
    # SGLang told to prefill 8192 tokens at a time: 12 GiB of activations beside its budget.
    chunked = terms(
        Family.SGLANG, card.capacity, engine_config={"extra_args": ["--chunked-prefill-size=8192"]}
    )
    footprint = derive_discrete(
        gpu="gpu0", weights=8 * GiB, device=card, host_backed=False, terms=chunked
    )
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
        terms=chunked,
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
        terms=terms(Family.VLLM, card.capacity),
        request=12 * GiB,
        kv_cache=2 * GiB,
    )
    assert footprint.charge("ready")["gpu0"] == 12 * GiB + 5 * GiB // 4
    assert (footprint.engine_budget, footprint.kv_cache) == (12 * GiB, 2 * GiB)


def test_unified_footprint() -> None:
    pool = Domain("unified", 128 * GiB, 64 * GiB, 25 * GiB, 32 * GiB)
    vllm = terms(Family.VLLM, pool.capacity)
    footprint = derive_unified(weights=40 * GiB, domain=pool, terms=vllm)
    margin = 40 * GiB * 15 // 100 + 4 * GiB  # above 8 GiB
    assert footprint.charge("ready") == {"unified": 40 * GiB + 4 * GiB + margin}
    assert footprint.charge("parked") == {"unified": 2 * GiB}
    assert footprint.charge("starting") == {"unified": 64 * GiB}, "2.25 x 40 GiB is above 64 GiB"
    assert footprint.device_provenance == "whole_device"
    small = derive_unified(weights=4 * GiB, domain=pool, terms=vllm)
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
    vllm = terms(Family.VLLM, card.capacity)
    plain = derive_discrete(gpu="gpu0", weights=8 * GiB, device=card, host_backed=False, terms=vllm)
    cached = plain.with_cache(6 * GiB, ("gpu0", 768 << 20), "derived")
    assert cached.cache_provenance == "derived"
    assert plain.cache_provenance is None
    assert cached.charge("cold") == {}
    for phase in ("starting", "ready", "waking", "parked"):
        before, after = plain.charge(phase), cached.charge(phase)
        assert after["system"] == before["system"] + 6 * GiB, phase
        assert after["gpu0"] == before["gpu0"] + (768 << 20), phase
    pool = Domain("unified", 128 * GiB, 64 * GiB, 25 * GiB, 32 * GiB)
    unified = derive_unified(weights=8 * GiB, domain=pool, terms=terms(Family.VLLM, pool.capacity))
    shared = unified.with_cache(6 * GiB, ("unified", 768 << 20), "measured")
    extra = 6 * GiB + (768 << 20)
    assert shared.charge("ready") == {"unified": unified.charge("ready")["unified"] + extra}
