"""The prefix cache's cluster workload (a shared prefix: misses, hits, a partial hit and a
repeat, greedy and seeded), shared by the CPU and the CUDA tests."""

from __future__ import annotations

import asyncio

from protocol import AsyncClient, Client

MODEL = ("--model", "smollm2-135m", "--page-size", "16")
PREFIX = [1 + (i * 37) % 4000 for i in range(150)]  # 9 full pages and 6 tokens
QUESTIONS = [[4001 + 13 * q + j for j in range(5 + q)] for q in range(3)]
GREEDY = {"max_tokens": 8, "ignore_eos": True}
SEEDED = {"max_tokens": 8, "ignore_eos": True, "temperature": 0.8, "top_p": 0.9, "seed": 3}


def workload(options: tuple[dict, ...] = (GREEDY, SEEDED)) -> list[tuple[list[int], dict]]:
    """For each sampling: a miss, a hit of the prefix's pages, a partial hit and a repeat of a
    whole earlier prompt, in this order."""
    out = []
    for o in options:
        out += [(PREFIX + QUESTIONS[0], o), (PREFIX + QUESTIONS[1], o),
                (PREFIX[:70] + QUESTIONS[2], o),  # 4 of the prefix's pages
                (PREFIX + QUESTIONS[0], o)]
    return out


def tokens(endpoint: str, crowd: bool, options: tuple[dict, ...] = (GREEDY, SEEDED)
           ) -> list[list[int]]:
    """Each request's tokens, one after another; with `crowd`, beside other requests whose
    prompts are chunked with them, so the cached pages come from steps of other shapes."""
    async def main() -> list[list[int]]:
        async with AsyncClient(endpoint, timeout=300) as c:
            out = []
            for prompt, o in workload(options):
                others = [c.generate(prompt_token_ids=[7 + k] * (20 + 9 * k), max_tokens=4,
                                     ignore_eos=True) for k in range(2 if crowd else 0)]
                r, *_ = await asyncio.gather(c.generate(prompt_token_ids=prompt, **o), *others)
                out.append(r.token_ids)
            return out
    return asyncio.run(main())


def cache_figures(endpoint: str) -> dict:
    with Client(endpoint, timeout=60) as c:
        return c.status()["prefix_cache"]
