"""What the API-key check costs on the router's hot path.

Times GET /v1/models (bearer key, constant-time compare, OpenAI list) against the
unauthenticated GET /health on the same in-process app, and prints both with their ratio.

    .venv/bin/python bench/router_auth.py [--requests N]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx

from capycommon.credentials import generate
from capyctl_router.app import create_app


async def _time(client: httpx.AsyncClient, path: str, headers: dict[str, str], n: int) -> float:
    for _ in range(50):  # warm up
        await client.get(path, headers=headers)
    start = time.perf_counter()
    for _ in range(n):
        response = await client.get(path, headers=headers)
        assert response.status_code == 200
    return (time.perf_counter() - start) / n


async def main(n: int) -> None:
    credentials = generate()
    transport = httpx.ASGITransport(app=create_app(credentials))
    async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
        auth = {"Authorization": f"Bearer {credentials.api_key}"}
        baseline = await _time(client, "/health", {}, n)
        guarded = await _time(client, "/v1/models", auth, n)
    print(f"{'path':<12} {'us/request':>11}")
    print(f"{'/health':<12} {baseline * 1e6:>11.1f}   (baseline, no key)")
    print(f"{'/v1/models':<12} {guarded * 1e6:>11.1f}   (API key checked)")
    print(f"ratio {guarded / baseline:.2f}x over {n} requests each")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    asyncio.run(main(parser.parse_args().requests))
