"""A real cluster on the default model answers like the Hugging Face reference."""

import pytest

from protocol import Client

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors: red,"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(launch):
    return launch("--model", "smollm2-135m", "--workers", "1")


def hf_greedy(hf_reference, ids: list[int], n: int, stop_at_eos: bool = False) -> list[int]:
    import torch

    model = hf_reference.model
    eos = model.generation_config.eos_token_id if stop_at_eos else None
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             eos_token_id=eos, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_capital_of_france_is_paris(cluster):
    with Client(cluster.endpoint, timeout=600) as c:
        r = c.generate("The capital of France is", max_tokens=8)
    assert "Paris" in r.text
    assert r.finish_reason in ("length", "stop")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_the_hf_reference(cluster, hf_reference, prompt):
    tokenizer = hf_reference.tokenizer
    with Client(cluster.endpoint, timeout=600) as c:
        r = c.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert r.prompt_token_ids == tokenizer(prompt).input_ids
    assert r.token_ids == hf_greedy(hf_reference, r.prompt_token_ids, MAX_TOKENS)


def test_chat_template_prompt_equals_the_hf_reference(cluster, hf_reference):
    tokenizer = hf_reference.tokenizer
    with Client(cluster.endpoint, timeout=600) as c:
        r = c.chat(CHAT, max_tokens=MAX_TOKENS)
    expected_prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                    tokenize=True, return_dict=True)["input_ids"]
    assert r.prompt_token_ids == list(expected_prompt)
    assert r.token_ids == hf_greedy(hf_reference, r.prompt_token_ids, MAX_TOKENS, True)
    assert "Paris" in r.text
