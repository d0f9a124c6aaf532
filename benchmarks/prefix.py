"""`siding bench prefix`: time to first token and throughput with the prefix cache on and off.

Two workloads through a real cluster (`siding launch`, token ids, streaming clients), each run
against a cluster with the cache and one with `--no-prefix-cache`, the two started in turn:
- **shared prefix**: a `--prefix`-token prefix (a system prompt, a document) and `--questions`
  distinct questions after it. One request computes the prefix first; then each question alone
  (its TTFT), then all of them at once (tokens/s);
- **chat**: a conversation of `--turns` turns, each request the whole conversation so far (the
  last reply included) and a new user message, one after another (each turn's TTFT).

A request timed alone is sent `IDLE_PAUSE_S` after the last one ended: the engine core plans
steps ahead (docs/overlap-scheduling.md), so when a stream ends on a stop token a row planned
past it may still be on the device, and a request sent at once would wait for it (on llama-8b on
an H200, 5-6 ms a step).

Prompts are random token ids of a fixed seed, so both clusters see the same requests.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import time
from typing import Any

from coordinator.local_cluster import LocalCluster
from protocol import AsyncClient
from protocol.help_formatter import HelpFormatter
from worker.loaders import resolve

from .decode import LOWEST_PROMPT_ID
from .report import (
    Series,
    Spread,
    format_table,
    log_path,
    machine_info,
    progress,
    ratio,
    result_paths,
    timestamp,
    write_json,
    write_plot,
)

SCENARIO = "prefix"
QUESTION_TOKENS = 24
TURN_TOKENS = 32  # a user message of the chat
IDLE_PAUSE_S = 0.2  # before a request timed alone: longer than a step


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="siding bench prefix", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="any `siding launch --model` spec")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    p.add_argument("--dtype", default="auto", help="as `siding launch --dtype`")
    p.add_argument("--prefix", type=int, default=2000, help="tokens of the shared prefix")
    p.add_argument("--questions", type=int, default=64, help="distinct questions after it")
    p.add_argument("--turns", type=int, default=8, help="turns of the chat")
    p.add_argument("--tokens", type=int, default=16, help="tokens generated per request")
    p.add_argument("--kv-pages", type=int, default=4096, help="as `siding launch --kv-pages`")
    p.add_argument("--extra", default="", help="more `siding launch` flags, one string")
    p.add_argument("--out", default="bench-results",
                   help="directory for the JSON, the PNG and each cluster's log")
    a = p.parse_args(argv)
    for name in ("prefix", "questions", "turns", "tokens"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    a.vocab = resolve(a.model).args.vocab_size  # prompt ids stay below it
    return a


def ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    """Random prompt ids of a model whose vocabulary is `vocab` ids (the same ids for any
    vocabulary of 30,000 or more)."""
    return [rng.randrange(LOWEST_PROMPT_ID, min(30000, vocab)) for _ in range(n)]


async def first_token(c: AsyncClient, prompt: list[int], tokens: int
                      ) -> tuple[float, list[int]]:
    """(seconds to the first token, every token) of one streamed request, sent once the engine
    is idle."""
    await asyncio.sleep(IDLE_PAUSE_S)
    t0 = time.perf_counter()
    ttft, out = None, []
    async for chunk in c.stream(prompt_token_ids=prompt, max_tokens=tokens, ignore_eos=True):
        if chunk.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        out += chunk.token_ids
    return ttft, out


async def shared_prefix(endpoint: str, a: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(1)
    prefix = ids(rng, a.prefix, a.vocab)
    questions = [ids(rng, QUESTION_TOKENS, a.vocab) for _ in range(a.questions)]
    async with AsyncClient(endpoint, timeout=1800) as c:
        first, _ = await first_token(c, prefix + ids(rng, QUESTION_TOKENS, a.vocab), a.tokens)
        alone = [(await first_token(c, prefix + q, a.tokens))[0] for q in questions]
        t0 = time.perf_counter()
        await asyncio.gather(*(c.generate(prompt_token_ids=prefix + q, max_tokens=a.tokens,
                                          ignore_eos=True) for q in questions))
        together = time.perf_counter() - t0
    return {"first_ttft_s": first, "ttft_s": Spread.of(alone),
            "tokens_per_s": a.questions * a.tokens / together}


async def chat(endpoint: str, a: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(2)
    conversation = ids(rng, TURN_TOKENS, a.vocab)
    ttfts = []
    async with AsyncClient(endpoint, timeout=1800) as c:
        for _ in range(a.turns):
            ttft, reply = await first_token(c, conversation, a.tokens)
            ttfts.append(ttft)
            conversation += reply + ids(rng, TURN_TOKENS, a.vocab)
    return {"ttft_s": ttfts, "last_prompt_tokens": len(conversation) - TURN_TOKENS}


def run(a: argparse.Namespace, cache: bool, stamp: str) -> dict[str, Any]:
    args = ["--model", a.model, "--devices", a.device, "--dtype", a.dtype, "--kv-pages",
            str(a.kv_pages), "--max-batch-tokens", str(max(512, a.prefix + 64)),
            *shlex.split(a.extra)]
    if not cache:
        args.append("--no-prefix-cache")
    label = "on" if cache else "off"
    progress(SCENARIO, f"cache {label}: starting siding {' '.join(args)}")
    with LocalCluster(*args, timeout=1800,
                      log=log_path(a.out, SCENARIO, stamp, f"cache-{label}")) as cluster:
        progress(SCENARIO, f"cache {label}: shared prefix of {a.prefix} tokens, "
                 f"{a.questions} questions")
        shared = asyncio.run(shared_prefix(cluster.endpoint, a))
        progress(SCENARIO, f"cache {label}: chat of {a.turns} turns")
        talk = asyncio.run(chat(cluster.endpoint, a))
    return {"shared": shared, "chat": talk}


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    stamp = timestamp()
    on, off = run(a, cache=True, stamp=stamp), run(a, cache=False, stamp=stamp)
    s_on, s_off = on["shared"], off["shared"]
    speedup = ratio(s_off["ttft_s"], s_on["ttft_s"])
    rows = [
        ["shared prefix: TTFT of a question, ms", s_on["ttft_s"].text(1e3),
         s_off["ttft_s"].text(1e3), f"{speedup:.2f}x"],
        ["shared prefix: the first request's TTFT, ms", f"{s_on['first_ttft_s'] * 1e3:.1f}",
         f"{s_off['first_ttft_s'] * 1e3:.1f}", ""],
        ["shared prefix: all questions at once, tok/s", f"{s_on['tokens_per_s']:.1f}",
         f"{s_off['tokens_per_s']:.1f}", f"{s_on['tokens_per_s'] / s_off['tokens_per_s']:.2f}x"],
    ]
    for turn, (t_on, t_off) in enumerate(zip(on["chat"]["ttft_s"], off["chat"]["ttft_s"])):
        rows.append([f"chat turn {turn + 1}: TTFT, ms", f"{t_on * 1e3:.1f}",
                     f"{t_off * 1e3:.1f}", f"{t_off / t_on:.2f}x"])
    table = format_table(["", "cache on", "cache off", "off / on"], rows)
    json_path, png_path = result_paths(a.out, SCENARIO, stamp)
    write_json(json_path, {
        "scenario": SCENARIO, "command": "siding bench prefix " + " ".join(argv or []),
        "machine": machine_info(a.device), "config": vars(a),
        "cache_on": on, "cache_off": off, "question_ttft_speedup": speedup,
    })
    turns = list(range(1, a.turns + 1))
    write_plot(png_path, [
        Series(label, turns, [Spread.of([t]) for t in result["chat"]["ttft_s"]])
        for label, result in (("cache on", on), ("cache off", off))],
        f"chat TTFT per turn, {a.model} on {a.device}", "turn", "TTFT (s)", log_x=False)
    print(table)
    print(f"results: {json_path}, {png_path}")
