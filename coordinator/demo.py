"""`siding demo`: a real cluster on the default model, a few prompts, then a clean stop."""

from __future__ import annotations

import sys
import time

from protocol import Client

from .local_cluster import LocalCluster

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def run_demo(model: str, workers: int) -> None:
    print(f"siding demo: launching {model} on {workers} CPU worker processes...", flush=True)
    t0 = time.monotonic()
    with LocalCluster("--model", model, "--workers", str(workers)) as cluster:
        print(f"ready at {cluster.endpoint} in {time.monotonic() - t0:.1f}s\n", flush=True)
        with Client(cluster.endpoint, timeout=300) as c:
            for prompt in PROMPTS:
                r = c.generate(prompt, max_tokens=24)
                print(f"> {prompt}\n{prompt}{r.text}\n   [{r.usage['completion_tokens']} tokens, "
                      f"{r.finish_reason}]\n", flush=True)
            print(f"> chat: {CHAT[0]['content']}", flush=True)
            t1 = time.monotonic()
            n = 0
            for chunk in c.chat_stream(CHAT, max_tokens=48):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                n += len(chunk.token_ids)
            dt = time.monotonic() - t1
            print(f"\n   [streamed {n} tokens in {dt:.2f}s]\n")
            s = c.status()
            print(f"status: {len(s['workers'])} workers, layers "
                  f"{[tuple(w['layers']) for w in s['workers']]}, "
                  f"{s['pool']['pages_used']} KV pages in use")
    print("stopped.")
