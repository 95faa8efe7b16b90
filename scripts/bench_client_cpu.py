"""The CPU an HTTP client spends on one streamed completion: httpx against aiohttp.

    python scripts/bench_client_cpu.py --url http://127.0.0.1:8000 --requests 40

Sends the same 16-token greedy streamed completion over and over, alternating the two
clients (which goes first alternates), and prints per client the median CPU seconds this
process spent per request (`time.process_time`: nothing else runs in it) and the median wall
time. On a host whose cores the server shares with its benchmark, the client's CPU is taken
from the server's steps, so it shows as the server's overhead.
"""
import argparse
import asyncio
import json
import statistics
import time

import aiohttp
import httpx

BODY = {"prompt": list(range(200, 232)), "max_tokens": 16, "temperature": 0,
        "ignore_eos": True, "stream": True, "return_token_ids": True}


def tokens(line: str) -> int:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return 0
    return sum(len(c.get("token_ids") or []) for c in json.loads(line[6:])["choices"])


async def with_httpx(http, body) -> int:
    async with http.stream("POST", "/v1/completions", json=body) as r:
        return sum([tokens(line) async for line in r.aiter_lines()])


async def with_aiohttp(session, body) -> int:
    async with session.post("/v1/completions", json=body) as r:
        return sum([tokens(raw.decode().rstrip("\r\n")) async for raw in r.content])


async def main(url: str, n: int) -> None:
    http = httpx.AsyncClient(base_url=url, timeout=None)
    session = aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=None))
    body = dict(BODY, model=(await http.get("/v1/models")).json()["data"][0]["id"])
    calls = {"httpx": lambda: with_httpx(http, body),
             "aiohttp": lambda: with_aiohttp(session, body)}
    rows: dict = {name: [] for name in calls}
    for i in range(n):
        for name in list(calls)[::1 if i % 2 else -1]:
            cpu, wall = time.process_time(), time.perf_counter()
            got = await calls[name]()
            rows[name].append((time.process_time() - cpu, time.perf_counter() - wall))
            assert got == BODY["max_tokens"], f"{name}: {got} tokens"
    for name, times in rows.items():
        times = times[2:]  # warm-up
        print(f"{name}: CPU per request median {statistics.median(t[0] for t in times) * 1e3:.2f}"
              f" ms, wall median {statistics.median(t[1] for t in times) * 1e3:.1f} ms "
              f"({len(times)} requests)")
    await http.aclose()
    await session.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--requests", type=int, default=40)
    args = ap.parse_args()
    asyncio.run(main(args.url, args.requests))
