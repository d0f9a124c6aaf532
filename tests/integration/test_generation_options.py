"""Stop strings and tokens, max_tokens, n, seeds, chunked prefill and the CLI, on a real model."""

import json
import subprocess
import sys

import pytest

from protocol import Client


@pytest.fixture(scope="module")
def cluster(launch):
    return launch("--model", "smollm2-135m", "--max-batch-tokens", "7")


@pytest.fixture(scope="module")
def reference(cluster):
    with Client(cluster.endpoint, timeout=600) as c:
        return c.generate("The capital of France is", max_tokens=16, ignore_eos=True)


def test_stop_string_cuts_the_text_and_ends_the_request(cluster, reference):
    assert "\n" in reference.text
    with Client(cluster.endpoint, timeout=600) as c:
        r = c.generate("The capital of France is", max_tokens=16, stop=["\n"], ignore_eos=True)
    assert r.finish_reason == "stop"
    assert r.text == reference.text.split("\n")[0]
    assert r.token_ids == reference.token_ids[:len(r.token_ids)]


def test_stop_strings_are_held_back_from_the_stream(cluster, reference):
    with Client(cluster.endpoint, timeout=600) as c:
        chunks = list(c.stream("The capital of France is", max_tokens=16, stop=[" answer is"],
                               ignore_eos=True))
    text = "".join(ch.text for ch in chunks)
    assert text == reference.text.split(" answer is")[0]
    assert chunks[-1].finish_reason == "stop"


def test_stop_token_ids_end_the_request_with_that_token(cluster, reference):
    stop = reference.token_ids[3]
    with Client(cluster.endpoint, timeout=600) as c:
        r = c.generate("The capital of France is", max_tokens=16, stop_token_ids=[stop],
                       ignore_eos=True)
    assert r.finish_reason == "stop"
    assert r.token_ids == reference.token_ids[:reference.token_ids.index(stop) + 1]


def test_max_tokens_and_usage(cluster):
    with Client(cluster.endpoint, timeout=600) as c:
        r = c.generate("Hello", max_tokens=5, ignore_eos=True)
    assert len(r.token_ids) == 5 and r.finish_reason == "length"
    assert r.usage == {"prompt_tokens": len(r.prompt_token_ids), "completion_tokens": 5}


def test_chunked_prefill_matches_the_one_token_prompt_path(cluster, reference):
    # the cluster's --max-batch-tokens 7 splits this 5-token prompt into one chunk and the
    # 40-token prompt below into six; the reference above was produced the same way
    long_prompt = "Paris is a city. " * 8
    with Client(cluster.endpoint, timeout=600) as c:
        a = c.generate(long_prompt, max_tokens=8, ignore_eos=True)
        b = c.generate(prompt_token_ids=a.prompt_token_ids, max_tokens=8, ignore_eos=True)
    assert len(a.prompt_token_ids) > 7
    assert a.token_ids == b.token_ids


def test_n_completions_with_a_seed_are_distinct_and_reproducible(cluster):
    kw = dict(max_tokens=10, temperature=1.0, seed=1234, n=3, ignore_eos=True)
    with Client(cluster.endpoint, timeout=600) as c:
        a = c.generate("My favourite animal is", **kw)
        b = c.generate("My favourite animal is", **kw)
    assert [ch.token_ids for ch in a.choices] == [ch.token_ids for ch in b.choices]
    assert len({tuple(ch.token_ids) for ch in a.choices}) == 3
    assert [ch.index for ch in a.choices] == [0, 1, 2]


def test_different_seeds_sample_differently(cluster):
    with Client(cluster.endpoint, timeout=600) as c:
        outs = {tuple(c.generate("Once upon a time", max_tokens=10, temperature=1.0, seed=s,
                                 ignore_eos=True).token_ids) for s in range(4)}
    assert len(outs) > 1


def test_cli_generate_and_status(cluster, reference):
    cmd = [sys.executable, "-m", "coordinator"]
    out = subprocess.run(cmd + ["generate", "--endpoint", cluster.endpoint, "--json",
                                "--max-tokens", "16", "The capital of France is"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["token_ids"] == reference.token_ids[:len(got["token_ids"])]
    status = subprocess.run(cmd + ["status", "--endpoint", cluster.endpoint], capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "smollm2-135m" in status.stdout and "0-29" in status.stdout


def test_cli_reports_an_unreachable_cluster_in_one_line():
    out = subprocess.run([sys.executable, "-m", "coordinator", "generate", "--endpoint",
                          "tcp://127.0.0.1:9", "--timeout", "1", "hello"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.startswith("siding: error:") and "Traceback" not in out.stderr


def test_n_greedy_completions_share_the_prompt_and_equal_one(cluster, reference):
    long_prompt = "The capital of France is"
    with Client(cluster.endpoint, timeout=600) as c:
        r = c.generate(long_prompt, max_tokens=16, n=3, ignore_eos=True)
        assert c.status()["pool"]["pages_used"] == 0
    assert [ch.token_ids for ch in r.choices] == [reference.token_ids] * 3
