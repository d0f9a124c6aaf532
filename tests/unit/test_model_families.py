"""Qwen3, Qwen3-MoE and Mixtral against transformers, on tiny random checkpoints written by its
own `save_pretrained` and the same weights written as GGUF: greedy tokens over 32 new tokens
equal to `generate`'s, prefill logits within float32 tolerance, the chat template from the
checkpoint. The tokens run through the worker's own path: paged KV pools, eager steps, two
stages (a layer split)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from helpers.gguf_files import gguf_writer, permute_like_llama_cpp

from worker.batch import build_meta
from worker.build import load_stage, make_pool
from worker.loaders import resolve
from worker.step import run_eagerly
from worker.tokenizer import SYNTHETIC_CHAT_TEMPLATE, byte_level_tokenizer

VOCAB = 512
N_NEW = 32
PROMPT = [3, 141, 59, 26, 53, 58, 97, 93, 238, 46, 264, 33, 83]
PROBE = list(range(3, 250, 9))

# family -> (config class, what differs from the common shape)
FAMILIES = {
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16, tie_word_embeddings=True)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
        norm_topk_prob=True)),
    "qwen3_moe-unnormed": (transformers.Qwen3MoeConfig, dict(
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=False)),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2,
                                                 intermediate_size=48)),
}


def tiny_model(kind: str):
    config_class, extra = FAMILIES[kind]
    config = config_class(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=extra.pop("intermediate_size", 128), vocab_size=VOCAB,
        max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=258,
        rope_theta=10000.0, initializer_range=0.1, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None  # every run makes all N_NEW tokens
    return model


def save_checkpoint(model, path: Path) -> None:
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(byte_level_tokenizer(VOCAB).tokenizer_json)
    (path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": SYNTHETIC_CHAT_TEMPLATE, "eos_token": "<|im_end|>"}))


def hf_greedy(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def greedy(stages, ids: list[int], exact: bool = False, page: int = 16) -> list[int]:
    """N_NEW greedy tokens through the stages' paged pools, one eager step a token."""
    pools = [make_pool(s, 8, page, "cpu", exact=exact) for s in stages]
    table = list(range(-(-(len(ids) + N_NEW) // page)))
    rows, start, out = ids, 0, []
    with torch.inference_mode():
        while len(out) < N_NEW:
            meta = build_meta([start], [len(rows)], [table], [True], page, "cpu")
            x = torch.tensor(rows)
            for stage, pool in zip(stages, pools, strict=True):
                x = run_eagerly(stage, pool, meta, x)
            out.append(int(stages[-1].logits(x[-1:]).argmax(-1)))
            start, rows = start + len(rows), out[-1:]
    return out


def split_stages(spec: str, exact: bool = False):
    return [load_stage(spec, torch.float32, "cpu", layers=r, exact=exact)
            for r in ((0, 1), (1, 3))]


def prefill_logits(stages, ids: list[int]) -> torch.Tensor:
    pools = [make_pool(s, 8, 16, "cpu") for s in stages]
    meta = build_meta([0], [len(ids)], [list(range(8))], [True], 16, "cpu")
    x = torch.tensor(ids)
    with torch.inference_mode():
        for stage, pool in zip(stages, pools, strict=True):
            x = run_eagerly(stage, pool, meta, x)
        return stages[-1].logits(x)


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    model = tiny_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    save_checkpoint(model, path)
    return request.param, model, path, hf_greedy(model, PROMPT)


def test_a_transformers_checkpoint_gives_the_tokens_of_generate_and_its_logits(checkpoint):
    kind, model, path, want = checkpoint
    source = resolve(str(path))
    assert source.args.family == kind.split("-")[0]
    stages = split_stages(str(path))
    assert greedy(stages, PROMPT) == want
    with torch.no_grad():
        reference = model(torch.tensor([PROBE])).logits[0]
    assert (prefill_logits(stages, PROBE) - reference).abs().max().item() < 1e-4
    assert source.tokenizer.chat_template == SYNTHETIC_CHAT_TEMPLATE


def test_the_same_weights_as_gguf_give_the_tokens_of_generate(checkpoint, tmp_path):
    kind, model, _, want = checkpoint
    write_gguf(tmp_path / "m.gguf", model, kind)
    source = resolve(str(tmp_path / "m.gguf"))
    assert source.args.family == kind.split("-")[0]
    assert greedy(split_stages(str(tmp_path / "m.gguf")), PROMPT) == want


# ---- GGUF, as llama.cpp's converter writes these architectures --------------------------------

GGUF_ARCH = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe", "mixtral": "llama"}


def write_gguf(path: Path, model, kind: str) -> None:
    """F32 tensors (the weights exactly), expert matrices stacked [experts, rows, columns], the
    llama architecture's q and k permuted."""
    family = kind.split("-")[0]
    c, arch = model.config, GGUF_ARCH[family]
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    with gguf_writer(path, arch, c) as w:
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_vocab_size(c.vocab_size)
        if family == "qwen3":
            w.add_feed_forward_length(c.intermediate_size)
        else:
            n = c.num_experts if family == "qwen3_moe" else c.num_local_experts
            w.add_expert_count(n)
            w.add_expert_used_count(c.num_experts_per_tok)
            if family == "qwen3_moe":
                w.add_expert_feed_forward_length(c.moe_intermediate_size)
                w.add_expert_weights_norm(c.norm_topk_prob)
            else:
                w.add_feed_forward_length(c.intermediate_size)
        w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
        for i in range(c.num_hidden_layers):
            h, g = f"model.layers.{i}.", f"blk.{i}."
            q, k = sd[h + "self_attn.q_proj.weight"], sd[h + "self_attn.k_proj.weight"]
            if arch == "llama":
                q = permute_like_llama_cpp(q, c.num_attention_heads)
                k = permute_like_llama_cpp(k, c.num_key_value_heads)
            w.add_tensor(g + "attn_norm.weight", sd[h + "input_layernorm.weight"])
            w.add_tensor(g + "attn_q.weight", q)
            w.add_tensor(g + "attn_k.weight", k)
            w.add_tensor(g + "attn_v.weight", sd[h + "self_attn.v_proj.weight"])
            if family != "mixtral":
                w.add_tensor(g + "attn_q_norm.weight", sd[h + "self_attn.q_norm.weight"])
                w.add_tensor(g + "attn_k_norm.weight", sd[h + "self_attn.k_norm.weight"])
            w.add_tensor(g + "attn_output.weight", sd[h + "self_attn.o_proj.weight"])
            w.add_tensor(g + "ffn_norm.weight", sd[h + "post_attention_layernorm.weight"])
            if family == "qwen3":
                for x in ("gate", "up", "down"):
                    w.add_tensor(g + f"ffn_{x}.weight", sd[h + f"mlp.{x}_proj.weight"])
                continue
            moe = model.model.layers[i].mlp
            w.add_tensor(g + "ffn_gate_inp.weight", moe.gate.weight.detach().numpy())
            gate, up = np.split(moe.experts.gate_up_proj.detach().numpy(), 2, axis=1)
            w.add_tensor(g + "ffn_gate_exps.weight", np.ascontiguousarray(gate))
            w.add_tensor(g + "ffn_up_exps.weight", np.ascontiguousarray(up))
            w.add_tensor(g + "ffn_down_exps.weight", moe.experts.down_proj.detach().numpy())
        w.add_tensor("output_norm.weight", sd["model.norm.weight"])
        if not c.tie_word_embeddings:
            w.add_tensor("output.weight", sd["lm_head.weight"])
