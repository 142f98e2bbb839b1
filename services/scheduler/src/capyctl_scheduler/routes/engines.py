"""The engines' route: the engines each host has registered, as its hostd published them."""

from __future__ import annotations

from fastapi import APIRouter

from capycommon import management as wire
from capyctl_scheduler.manage import Manager


def routes(manager: Manager) -> APIRouter:
    api = APIRouter()

    @api.get(f"{wire.PREFIX}/engines")
    async def engines() -> wire.EngineList:
        return wire.EngineList(engines=await manager.engines())

    return api
