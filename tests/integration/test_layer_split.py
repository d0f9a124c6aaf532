"""The same requests give byte-identical tokens on 1, 2 and 3 worker processes."""

from protocol import Client

REQUESTS = [
    ("The capital of France is", {"max_tokens": 16}),
    ("Write a haiku about the sea.", {"max_tokens": 20, "temperature": 0.8, "seed": 7}),
    ("1, 2, 3, 4,", {"max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 11}),
]


def run_all(endpoint: str) -> list[list[int]]:
    with Client(endpoint, timeout=600) as c:
        return [c.generate(p, ignore_eos=True, **kw).token_ids for p, kw in REQUESTS]


def test_tokens_are_identical_across_worker_counts(launch):
    results = {}
    for workers in (1, 2, 3):
        cluster = launch("--model", "smollm2-135m", "--workers", str(workers))
        with Client(cluster.endpoint) as c:
            layers = [tuple(w["layers"]) for w in c.status()["workers"]]
        assert len(layers) == workers and layers[0][0] == 0 and layers[-1][1] == 30
        results[workers] = run_all(cluster.endpoint)
        cluster.stop()
    assert results[1] == results[2] == results[3]
    assert all(len(ids) == kw["max_tokens"] for ids, (_, kw) in zip(results[1], REQUESTS))
