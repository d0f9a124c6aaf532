"""`siding bench decode`'s streams: a batch's requests sent at once through siding's
`AsyncClient`, each token's arrival timed; in the bench's process, or spread over client
processes of their own (`python -m benchmarks.decode_load`, `--client-procs`; a baseline
cluster's always, run from its checkout: a client speaks its own tree's protocol, so this module
imports nothing of the bench's but the client, and a checkout from before it takes a copy).

One asyncio client reads some 10-13 thousand chunks a second (an H200 host, 83eb69b's client),
less than a cluster streams at batch 32: past that a single client times itself, not the
cluster. Each client process connects, says `ready`, reads the moment to start (a
`time.monotonic()` value, one clock for every process of the machine), streams its share, and
writes its arrivals as JSON.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from protocol import AsyncClient


async def stream(client: AsyncClient, prompt: list[int], tokens: int, seed: int,
                 sampling: dict[str, float]) -> list[float]:
    """When each token of one request arrived (time.monotonic())."""
    times: list[float] = []
    options = {**sampling, "seed": seed} if sampling else {}
    async for chunk in client.stream(prompt_token_ids=prompt, max_tokens=tokens,
                                     ignore_eos=True, **options):
        now = time.monotonic()
        times += [now] * len(chunk.token_ids)
    if len(times) != tokens:
        raise RuntimeError(f"siding streamed {len(times)} tokens where {tokens} were asked")
    return times


async def streams(endpoint: str, requests: list[tuple[int, list[int]]], tokens: int,
                  sampling: dict[str, float], ready=None) -> tuple[float, list[list[float]]]:
    """(when the first was sent, each request's arrivals) of `requests` ((seed, prompt) pairs)
    sent at once; `ready()`, if given, returns the moment to send them, once connected."""
    client = AsyncClient(endpoint, timeout=600.0)
    try:
        await client.status()  # connected before the clock starts
        if ready is not None:
            await asyncio.sleep(max(0.0, ready() - time.monotonic()))
        start = time.monotonic()
        arrivals = await asyncio.gather(*(stream(client, prompt, tokens, seed, sampling)
                                          for seed, prompt in requests))
    finally:
        await client.close()
    return start, arrivals


def client_main() -> None:
    spec: dict[str, Any] = json.loads(sys.stdin.readline())

    def ready() -> float:
        print("ready", flush=True)
        return float(sys.stdin.readline())

    start, arrivals = asyncio.run(streams(
        spec["endpoint"], [(seed, prompt) for seed, prompt in spec["requests"]],
        spec["tokens"], spec["sampling"], ready))
    json.dump({"start": start, "arrivals": arrivals}, sys.stdout)


if __name__ == "__main__":
    client_main()
