"""One adapter per engine family, each with the same parts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import httpx

from capycommon.engines import llamacpp, sglang, vllm
from capycommon.engines.control import EngineControl, Timeouts
from capycommon.engines.families import Family
from capycommon.engines.launch import Capabilities, LaunchPlan, LaunchSpec


@dataclass(frozen=True)
class Adapter:
    family: Family
    reserved: frozenset[str]
    capabilities: Callable[[str], Capabilities]
    plan: Callable[[LaunchSpec], LaunchPlan]
    control_class: type[EngineControl]

    def control(
        self,
        spec: LaunchSpec,
        timeouts: Timeouts | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> EngineControl:
        caps = self.capabilities(spec.profile.version)
        return self.control_class(spec, caps, timeouts, transport)


ADAPTERS: dict[Family, Adapter] = {
    Family.VLLM: Adapter(
        Family.VLLM, vllm.RESERVED, vllm.capabilities, vllm.plan, vllm.VllmControl
    ),
    Family.SGLANG: Adapter(
        Family.SGLANG, sglang.RESERVED, sglang.capabilities, sglang.plan, sglang.SglangControl
    ),
    Family.LLAMACPP: Adapter(
        Family.LLAMACPP,
        llamacpp.RESERVED,
        llamacpp.capabilities,
        llamacpp.plan,
        llamacpp.LlamacppControl,
    ),
}


def adapter_for(family: Family) -> Adapter:
    return ADAPTERS[family]
