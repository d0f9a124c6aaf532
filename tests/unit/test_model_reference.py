"""StageModel against transformers' Llama on the same GGUF weights, in float32."""

from __future__ import annotations

import jinja2
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor

from worker.loaders import resolve
from worker.model import StageModel

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, there was a little",
    "The first five prime numbers are 2, 3,",
]
CHAT = [{"role": "user", "content": "What is the capital of Germany?"}]
N_NEW = 12


class DenseKV:
    """One sequence's keys and values of every layer, attended with plain causal attention: the
    step a `StageModel` sees (`positions` set before each step)."""

    def __init__(self, n_layers: int) -> None:
        self.k: list[Tensor | None] = [None] * n_layers
        self.v: list[Tensor | None] = [None] * n_layers
        self.positions: Tensor | None = None

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        old_k, old_v = self.k[layer], self.v[layer]
        self.k[layer] = k = k if old_k is None else torch.cat([old_k, k])
        self.v[layer] = v = v if old_v is None else torch.cat([old_v, v])
        t, s = q.shape[0], k.shape[0]
        # the t new queries are the last t of s positions
        mask = torch.ones(t, s, dtype=torch.bool).tril(s - t)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            enable_gqa=True,
        )
        return out.transpose(0, 1)


def prefill(stages: list[StageModel], ids: list[int]) -> Tensor:
    x, positions = torch.tensor(ids), torch.arange(len(ids))
    for stage in stages:
        kv = DenseKV(len(stage.layers))
        kv.positions = positions
        x = stage(x, kv)
    return x


def greedy(model: StageModel, ids: list[int], n: int, eos_ids: list[int]) -> list[int]:
    kv = DenseKV(len(model.layers))
    x, positions = torch.tensor(ids), torch.arange(len(ids))
    out: list[int] = []
    while len(out) < n:
        kv.positions = positions
        hidden = model(x, kv)
        token = int(model.logits(hidden[-1:]).argmax(-1))
        out.append(token)
        if token in eos_ids:
            break
        x, positions = torch.tensor([token]), positions[-1:] + 1
    return out


@pytest.fixture(scope="module")
def source():
    return resolve("smollm2-135m")


@pytest.fixture(scope="module")
def model(source) -> StageModel:
    return source.load_stage(0, source.args.n_layers, torch.float32, "cpu")


@pytest.fixture(scope="module")
def tokenizer(source) -> Tokenizer:
    return Tokenizer.from_str(source.tokenizer.tokenizer_json)


def hf_greedy(hf_reference, ids: list[int]) -> list[int]:
    out = hf_reference.model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids)),
        max_new_tokens=N_NEW,
        do_sample=False,
    )
    return out[0, len(ids) :].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_transformers(model, tokenizer, source, hf_reference, prompt):
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    ours = greedy(model, ids, N_NEW, source.tokenizer.eos_ids)
    assert ours == hf_greedy(hf_reference, ids)
    assert len(ours) == N_NEW


@pytest.mark.slow
def test_chat_prompt_greedy_tokens_equal_transformers(model, tokenizer, source, hf_reference):
    text = jinja2.Template(source.tokenizer.chat_template).render(
        messages=CHAT, add_generation_prompt=True
    )
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert ids[:1] == [tokenizer.token_to_id("<|im_start|>")]
    ours = greedy(model, ids, N_NEW, source.tokenizer.eos_ids)
    assert ours == hf_greedy(hf_reference, ids)
    assert "Berlin" in tokenizer.decode(ours)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_logits_match_transformers(model, tokenizer, hf_reference, prompt):
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    ours = model.logits(prefill([model], ids))
    with torch.no_grad():
        theirs = hf_reference.model(torch.tensor([ids])).logits[0]
    assert ours.shape == theirs.shape == (len(ids), 49152)
    assert (ours - theirs).abs().max().item() < 1e-3


@pytest.mark.slow
def test_two_stages_give_bit_identical_hidden_states(model, source, tokenizer):
    stages = [
        source.load_stage(0, 13, torch.float32, "cpu"),
        source.load_stage(13, 30, torch.float32, "cpu"),
    ]
    ids = tokenizer.encode(PROMPTS[0], add_special_tokens=False).ids
    split = prefill(stages, ids)
    whole = prefill([model], ids)
    assert torch.equal(split, whole)
    assert torch.equal(stages[1].logits(split), model.logits(whole))
