"""The real LMCache, where an installation is at hand: `CAPYCTL_TEST_LMCACHE` names a virtual
environment with LMCache 0.5.x installed (the wheel needs torch, transformers and a CUDA
cupy, gigabytes that CI does not fetch; it runs on a CPU, with LMCache's stub device).

hostd's own server start, as a launch makes it: registered the way `capyctl engine add`
registers it, started with CapyCTL's flags (which it must accept), healthy through the path
it answers (0.5.6 serves /healthcheck, not /api/healthcheck), its status read where it keeps
it, and stopped."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import httpx
import pytest

from capycommon.engines import detect, lmcache
from capycommon.engines.families import Family
from capycommon.engines.registry import EngineProfile
from capyctl_hostd import cacheserver, engines
from capyctl_hostd.ports import PortLeaser
from support import group_members, short_dir

VENV = os.environ.get("CAPYCTL_TEST_LMCACHE")
pytestmark = pytest.mark.skipif(
    not VENV,
    reason="no LMCache installation: set CAPYCTL_TEST_LMCACHE to a venv with LMCache 0.5.6 "
    "or a later 0.5.x (pip install lmcache==0.5.6; it pulls torch and cupy-cuda13x)",
)


def test_a_real_lmcache_server_takes_capyctls_flags_and_is_healthy() -> None:
    assert VENV is not None
    found = [f for f in detect.probe(Path(VENV)) if f.family == Family.LMCACHE]
    assert found, f"{VENV} holds no lmcache"
    install = found[0].profile("lmcache")
    assert lmcache.qualified(install), install.version
    root = short_dir("real-lmc")
    try:
        asyncio.run(_run(install, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def _run(install: EngineProfile, root: Path) -> None:
    leaser = PortLeaser(28150, 28199)
    ports = lmcache.ServerPorts(leaser.lease(), leaser.lease(), leaser.lease())
    log = root / "a.log"
    writer = engines.open_log(log, "unused-secret")
    server = cacheserver.start("a:0", install, ports, 1, 1 << 30, (0, 0), "", log, writer, root)
    try:
        await cacheserver.wait_healthy(server, 180)
        assert server.health_path in ("/healthcheck", "/api/healthcheck")
        async with httpx.AsyncClient() as http:
            assert not await server.registered(http), "no engine registered yet"
            version = await http.get(f"http://127.0.0.1:{ports.http}/lmc_version")
        assert server.status_path in ("/status", "/api/status")
        assert version.json().startswith("0.5.")
        assert server.alive()
        assert cacheserver.resident_bytes(server)
    finally:
        await cacheserver.stop(server)
    assert group_members(server.pgid) == []
    text = log.read_text()
    assert "LMCache cache server is running" in text
