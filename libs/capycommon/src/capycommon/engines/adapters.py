"""One adapter per engine family, each with the same parts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import httpx

from capycommon.engines import custom, llamacpp, sglang, tensorfold, vllm
from capycommon.engines.control import EngineControl, Timeouts, UnmeteredControl
from capycommon.engines.families import Family
from capycommon.engines.launch import Capabilities, LaunchPlan, LaunchSpec
from capycommon.engines.registry import EngineProfile


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

    def reserved_for(self, profile: EngineProfile) -> frozenset[str]:
        """The options CapyCTL sets for `profile`: a custom engine's are its template's."""
        if self.family == Family.CUSTOM:
            return custom.reserved_flags(profile.command)
        return self.reserved


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
    Family.TENSORFOLD: Adapter(
        Family.TENSORFOLD,
        tensorfold.RESERVED,
        tensorfold.capabilities,
        tensorfold.plan,
        UnmeteredControl,
    ),
    Family.CUSTOM: Adapter(
        Family.CUSTOM, custom.RESERVED, custom.capabilities, custom.plan, UnmeteredControl
    ),
}


def adapter_for(family: Family) -> Adapter:
    return ADAPTERS[family]
