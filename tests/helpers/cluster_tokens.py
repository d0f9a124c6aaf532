"""Token ids from a running cluster for the requests the KV tests compare between `--kv device`
and `--kv host` (alone, side by side, and a concurrent crowd), and a worker's metrics scraped."""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from protocol import AsyncClient, Client

MODEL = ("--model", "smollm2-135m")
# A 180-token prompt is 12 pages: at depth 2 its ring (4 slots, 24 KiB a page and layer in
# float32) passes a 1 MiB budget, so its steps decline; the short request after it recovers.
ALONE = [
    {"prompt_token_ids": list(range(100, 280)), "max_tokens": 4},
    {"prompt": "The capital of France is", "max_tokens": 8},
]
# Three completions of one prompt decode side by side in the same batches on every run, and
# share the prompt's pages (the partly filled tail is copied on write).
TOGETHER = {"prompt": "Once upon a time", "max_tokens": 8, "n": 3, "temperature": 0.8, "seed": 5}
# Arriving together, these batch differently from run to run: exact mode makes that invisible.
CROWD = [{"prompt_token_ids": [3 + (i * 131 + j * 17) % 490 for j in range(5 + 17 * i)],
          "max_tokens": 4 + 2 * i} for i in range(3)]


def outputs(endpoint: str) -> list[list[int]]:
    with Client(endpoint, timeout=300) as c:
        out = [c.generate(**kw, ignore_eos=True).token_ids for kw in ALONE]
        out += [ch.token_ids for ch in c.generate(**TOGETHER, ignore_eos=True).choices]
    return out


def crowd(endpoint: str) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with AsyncClient(endpoint, timeout=300) as c:
            done = await asyncio.gather(*(c.generate(**kw, ignore_eos=True) for kw in CROWD))
        return [r.token_ids for r in done]

    return asyncio.run(run())


def scrape(port: int) -> dict[tuple[str, str], float]:
    """(sample name, the label that tells its series apart) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            label = next((s.labels[k] for k in ("path", "reason", "action", "outcome")
                          if k in s.labels), "")
            values[s.name, label] = s.value
    return values


def exact_crowd(launch) -> list[list[int]]:
    """The crowd's tokens from an exact-mode cluster of two workers on device KV."""
    device = launch(*MODEL, "--exact", "--workers", "2")
    out = crowd(device.endpoint)
    device.stop()
    return out
