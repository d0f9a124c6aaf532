"""`siding bench serve`'s load: one client process (`python -m benchmarks.serve_load`) running its
share of a point's streams, through siding's `AsyncClient` or the official `openai` client, and
handing its per-request records back as JSON (`client_main`)."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from protocol import AsyncClient, RequestError

from .decode import LOWEST_PROMPT_ID

DRAIN_S = 60.0  # how long requests in flight at the window's end may take to finish


def poisson_arrivals(rate: float, seconds: float, rng: random.Random) -> list[float]:
    """Arrival times in [0, seconds) of a Poisson process of `rate` per second."""
    times, t = [], rng.expovariate(rate)
    while t < seconds:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def draw_request(rng: random.Random, spec: dict[str, Any]) -> tuple[list[int], int]:
    """(prompt token ids, output length) of one request."""
    n, out = spec["prompt_len"], spec["output_len"]
    if spec["len_dist"] == "uniform":
        n = rng.randint(max(1, n // 2), n * 3 // 2)
        out = rng.randint(max(1, out // 2), out * 3 // 2)
    return [rng.randrange(LOWEST_PROMPT_ID, spec["vocab_size"]) for _ in range(n)], out


class ZmqLoad:
    """Streams through siding's own client."""

    def __init__(self, endpoint: str):
        self.client = AsyncClient(endpoint)

    async def connect(self) -> None:
        await self.client.status()

    async def stream(self, prompt: list[int], output_len: int) -> AsyncIterator[int]:
        """The number of tokens in each chunk that has any."""
        async for chunk in self.client.stream(prompt_token_ids=prompt, max_tokens=output_len,
                                              ignore_eos=True):
            if chunk.token_ids:
                yield len(chunk.token_ids)

    async def close(self) -> None:
        await self.client.close()


class HttpLoad:
    """Streams through the OpenAI API with the official client, as an application would."""

    def __init__(self, url: str):
        import openai

        try:  # what the openai client is built on: httpx, or its successor httpx2
            import httpx2 as httpx
        except ImportError:
            import httpx

        self.errors = (openai.APIError,)
        # One client for every stream of a process, as an application keeps one: a pool with
        # a connection per stream.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.client = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="bench", max_retries=0, timeout=DRAIN_S * 2,
            http_client=openai.DefaultAsyncHttpxClient(limits=limits))
        self.model = ""

    async def connect(self) -> None:
        self.model = (await self.client.models.list()).data[0].id

    async def stream(self, prompt: list[int], output_len: int) -> AsyncIterator[int]:
        stream = await self.client.completions.create(
            model=self.model, prompt=prompt, max_tokens=output_len, temperature=0.0,
            stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
        try:
            async for chunk in stream:
                for c in chunk.choices:
                    if n := len(c.model_extra.get("token_ids") or ()):
                        yield n
        finally:
            await stream.close()

    async def close(self) -> None:
        await self.client.close()


def load_clients(api: str, endpoints: list[str], keys,
                 per_socket: int = 1) -> dict[Any, ZmqLoad | HttpLoad]:
    """A client for each of `keys` (closed loop: each stream; open: each endpoint), key i on
    endpoint i % N: for siding's client a socket each, or one per `per_socket` keys in turn
    (streams multiplexed as an application's would be); one shared pool per endpoint for
    HTTP."""
    keys = list(keys)
    if api == "zmq":
        sockets = [ZmqLoad(endpoints[g % len(endpoints)])
                   for g in range(-(-len(keys) // per_socket))]
        return {k: sockets[i // per_socket] for i, k in enumerate(keys)}
    shared = {e: HttpLoad(e) for e in endpoints}
    return {k: shared[endpoints[i % len(endpoints)]] for i, k in enumerate(keys)}


async def one_request(client: ZmqLoad | HttpLoad, records: list[dict[str, Any]], who: int,
                      prompt: list[int], output_len: int) -> None:
    """Stream one request, recording into a record listed before it is sent, so that one cut
    off (cancelled) still shows what it got, with `end` None."""
    chunks: list[list[float]] = []  # [monotonic seconds, tokens in the chunk]
    rec = {"client": who, "sent": time.monotonic(), "end": None, "chunks": chunks,
           "prompt_len": len(prompt), "output_len": output_len, "error": None}
    records.append(rec)
    try:
        async for n in client.stream(prompt, output_len):
            chunks.append([time.monotonic(), n])
    except RequestError as e:
        rec["error"] = e.code
    except Exception as e:  # the OpenAI client's errors
        if not isinstance(client, HttpLoad) or not isinstance(e, client.errors):
            raise
        rec["error"] = type(e).__name__
    rec["end"] = time.monotonic()


async def closed_client(client: ZmqLoad | HttpLoad, records: list[dict[str, Any]], c: int,
                        spec: dict[str, Any], start: float, t0: float, t1: float | None) -> None:
    """Requests one after another from `start`, until `t1`, or until `requests_per_client`
    were sent from `t0` on."""
    rng = random.Random(f"{spec['seed']}-closed-{c}")
    limit, counted = spec["requests_per_client"], 0
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    while (t1 is None or time.monotonic() < t1) and (limit is None or counted < limit):
        if time.monotonic() >= t0:
            counted += 1
        await one_request(client, records, c, *draw_request(rng, spec))


async def run_load(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """One client process's share of a point, from `spec["begin"]` on."""
    endpoints, begin = spec["endpoints"], spec["begin"]
    t0 = begin + spec["warmup"]
    t1 = None if spec["duration"] is None else t0 + spec["duration"]
    records: list[dict[str, Any]] = []
    if spec["mode"] == "closed":
        clients = load_clients(spec["api"], endpoints, spec["clients"],
                               spec.get("streams_per_socket", 1))
        n = spec["concurrency"]
        tasks = [closed_client(client, records, c, spec, begin + spec["warmup"] / 2 * c / n,
                               t0, t1) for c, client in clients.items()]
    else:
        clients = load_clients(spec["api"], endpoints, range(len(endpoints)))
        tasks = [open_arrivals(clients, records, spec)]
    unique = list({id(c): c for c in clients.values()}.values())
    for client in unique:
        await client.connect()  # before the clock starts
    deadline = None if t1 is None else t1 + DRAIN_S - time.monotonic()
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), deadline)
    except asyncio.TimeoutError:
        pass  # the cut-off requests are aborted and keep `end` None
    for client in unique:
        await client.close()
    return records


async def open_arrivals(clients: dict[int, ZmqLoad | HttpLoad], records: list[dict[str, Any]],
                        spec: dict[str, Any]) -> None:
    tasks = []
    for j, at in spec["arrivals"]:
        await asyncio.sleep(max(0.0, spec["begin"] + at - time.monotonic()))
        rng = random.Random(f"{spec['seed']}-open-{j}")
        tasks.append(asyncio.create_task(
            one_request(clients[j % len(clients)], records, j, *draw_request(rng, spec))))
    await asyncio.gather(*tasks)


def client_main() -> None:
    """A client process: a spec line on stdin, "ready", a go line with the start time, then the
    load; "done" when it is over, then its records as one JSON line."""
    spec = json.loads(sys.stdin.readline())
    print("ready", flush=True)
    spec["begin"] = float(sys.stdin.readline())
    records = asyncio.run(run_load(spec))
    print("done", flush=True)
    print(json.dumps(records), flush=True)




if __name__ == "__main__":
    client_main()
