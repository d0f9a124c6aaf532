"""Requests run alone and in staggered crowds against a live cluster: the exactness matrix's
cells, shared by tests/exactness (CPU) and tests/gpu."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from coordinator.local_cluster import LocalCluster
from protocol import Client

GREEDY = ()
SAMPLED = (("temperature", 1.0), ("top_p", 0.9))


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]  # token ids below 500: valid in every model's vocabulary
    max_tokens: int
    sampling: tuple = GREEDY  # generate() options as pairs; sampled requests carry a seed

    def options(self) -> dict:
        return dict(self.sampling, prompt_token_ids=list(self.prompt), max_tokens=self.max_tokens,
                    ignore_eos=True)


def target(sampling: tuple, max_tokens: int = 24) -> Request:
    seed = (("seed", 1234),) if sampling else ()
    return Request(tuple(range(101, 138)), max_tokens, sampling + seed)


def neighbours(n: int, max_tokens: int = 40) -> list[Request]:
    """n requests of different prompt and output lengths, half of them sampled."""
    out = []
    for i in range(n):
        length = 3 + (i * 37) % 95
        prompt = tuple(3 + (i * 131 + j * 17) % 490 for j in range(length))
        sampling = SAMPLED + (("seed", i),) if i % 2 else GREEDY
        out.append(Request(prompt, 6 + (i * 13) % (max_tokens - 5), sampling))
    return out


def with_target(target: Request, others: list[Request]) -> list[Request]:
    """The target arrives in the middle of the others."""
    return others[: len(others) // 2] + [target] + others[len(others) // 2 :]


@dataclass
class Outcome:
    tokens: list[list[int]]  # per request, in order
    preemptions: int  # over all requests


def run_alone(endpoint: str, requests: list[Request]) -> Outcome:
    with Client(endpoint, timeout=300) as c:
        done = [c.generate(**r.options()).choices[0] for r in requests]
    return Outcome([ch.token_ids for ch in done], sum(ch.preemptions for ch in done))


def run_crowd(endpoint: str, requests: list[Request], gap: float = 0.02) -> Outcome:
    """Every request at once from its own client, request i arriving i * gap seconds late."""
    done, errors = {}, []

    def client(i: int) -> None:
        time.sleep(i * gap)
        try:
            with Client(endpoint, timeout=300) as c:
                done[i] = c.generate(**requests[i].options()).choices[0]
        except Exception as e:  # raised below: a lost neighbour must not pass as a clean cell
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors or len(done) != len(requests):
        raise RuntimeError(f"{len(done)} of {len(requests)} requests finished: {errors}")
    choices = [done[i] for i in range(len(requests))]
    return Outcome([ch.token_ids for ch in choices], sum(ch.preemptions for ch in choices))


@contextmanager
def cluster(*args: str):
    c = LocalCluster(*args, timeout=300)
    c.start()
    try:
        yield c
    finally:
        c.stop()
