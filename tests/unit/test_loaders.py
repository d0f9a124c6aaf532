"""Model specs, metadata facts, per-stage loading, and logits against transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers.gguf_files import gguf_writer, permute_like_llama_cpp
from tokenizers import Tokenizer
from torch import Tensor

from worker.loaders import layer_count, resolve
from worker.model import ModelArgs, StageModel
from worker.tokenizer import SYNTHETIC_CHAT_TEMPLATE, byte_level_tokenizer

SMOLLM2_LAYER_PARAMS = 2 * 576 + 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536


class CausalKV:
    """Prefill only: the step's rows are the whole sequence, at `positions`."""

    def __init__(self, positions: Tensor):
        self.positions = positions

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        )
        return out.transpose(0, 1)


def same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(t, sb[k]) for k, t in sa.items())


def run(stages: list[StageModel], ids: list[int]) -> Tensor:
    x, positions = torch.tensor(ids), torch.arange(len(ids))
    for stage in stages:
        x = stage(x, CausalKV(positions))
    return x


@pytest.fixture(scope="module")
def smollm2():
    return resolve("smollm2-135m")


@pytest.fixture(scope="module")
def smollm2_full(smollm2) -> StageModel:
    return smollm2.load_stage(0, 30, torch.float32, "cpu")


def test_default_model_facts(smollm2):
    assert smollm2.name == "smollm2-135m"
    assert smollm2.args == ModelArgs(
        n_layers=30,
        dim=576,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        ffn_dim=1536,
        vocab_size=49152,
        rope_theta=100000.0,
        rms_eps=float(np.float32(1e-5)),
        max_context=8192,
        qkv_bias=False,
        tie_embeddings=True,
        rope_scaling=None,
    )
    assert (smollm2.args.q_dim, smollm2.args.kv_dim) == (576, 192)
    assert smollm2.args.n_heads // smollm2.args.n_kv_heads == 3
    info = smollm2.tokenizer
    assert (info.eos_ids, info.add_bos, info.bos_id) == ([2], False, 1)
    assert info.chat_template.startswith("{% for message in messages %}")


def test_default_model_path_fixture_is_the_resolved_file(smollm2, smollm2_gguf_path):
    assert str(smollm2.path) == smollm2_gguf_path


def test_middle_stage_loads_only_its_layers(smollm2, smollm2_full):
    stage = smollm2.load_stage(10, 20, torch.float32, "cpu")
    assert (stage.embed, stage.norm, stage.output) == (None, None, None)
    assert len(stage.layers) == 10
    assert sum(p.numel() for p in stage.parameters()) == 10 * SMOLLM2_LAYER_PARAMS
    assert all(
        same_params(a, b) for a, b in zip(stage.layers, smollm2_full.layers[10:20], strict=True)
    )


def test_last_stage_head_is_the_tied_embedding(smollm2, smollm2_full):
    stage = smollm2.load_stage(29, 30, torch.float32, "cpu")
    assert stage.embed is None and len(stage.layers) == 1
    assert torch.equal(stage.output.weight, smollm2_full.embed.weight)
    assert smollm2_full.output.weight.data_ptr() == smollm2_full.embed.weight.data_ptr()


def test_stage_is_frozen_in_eval_mode_in_the_requested_dtype(smollm2):
    stage = smollm2.load_stage(0, 2, torch.bfloat16, "cpu")
    assert stage.output is None and stage.embed.weight.shape == (49152, 576)
    assert {p.dtype for p in stage.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in stage.parameters())
    assert not stage.training
    assert stage.rope.cos.dtype == torch.float32


@pytest.mark.parametrize("start,end", [(0, 0), (3, 2), (-1, 4), (20, 31)])
def test_load_stage_rejects_bad_ranges(smollm2, start, end):
    with pytest.raises(ValueError, match="layer range"):
        smollm2.load_stage(start, end, torch.float32, "cpu")


def test_synthetic_weights_are_deterministic_and_split_consistent():
    source = resolve("synthetic:tiny")
    whole = source.load_stage(0, 4, torch.float32, "cpu")
    head, tail = (
        source.load_stage(0, 1, torch.float32, "cpu"),
        source.load_stage(1, 4, torch.float32, "cpu"),
    )
    assert same_params(whole, resolve("synthetic:tiny").load_stage(0, 4, torch.float32, "cpu"))
    assert torch.equal(head.embed.weight, whole.embed.weight)
    assert all(
        same_params(a, b) for a, b in zip([*head.layers, *tail.layers], whole.layers, strict=True)
    )
    assert same_params(tail.norm, whole.norm) and same_params(tail.output, whole.output)
    bf16 = source.load_stage(0, 1, torch.bfloat16, "cpu").layers[0].attention.wqkv.weight
    assert torch.equal(bf16, whole.layers[0].attention.wqkv.weight.bfloat16())
    ids = list(range(0, 500, 7))
    hidden = run([whole], ids)
    assert torch.equal(run([head, tail], ids), hidden)
    assert 0.05 < hidden.pow(2).mean().sqrt().item() < 10
    assert torch.isfinite(whole.logits(hidden)).all()


def test_synthetic_shapes_are_distinct_and_named():
    tiny = resolve("synthetic:tiny")
    small = resolve("synthetic:smollm2-135m").load_stage(29, 30, torch.float32, "cpu")
    assert tiny.name == "synthetic:tiny"
    assert not torch.equal(
        tiny.load_stage(0, 1, torch.float32, "cpu").layers[0].attention.wo.weight[:8, :8],
        small.layers[0].attention.wo.weight[:8, :8],
    )
    assert small.output.weight.shape == (49152, 576)


def test_synthetic_llama_shapes():
    llama3_rope = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    llama3_rope["original_max_position_embeddings"] = 8192
    assert resolve("synthetic:llama-1b").args == ModelArgs(
        n_layers=16,
        dim=2048,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        ffn_dim=8192,
        vocab_size=128256,
        rope_theta=500000.0,
        rms_eps=1e-5,
        max_context=131072,
        tie_embeddings=True,
        rope_scaling={"factor": 32.0, **llama3_rope},
    )
    assert resolve("synthetic:llama-8b").args == ModelArgs(
        n_layers=32,
        dim=4096,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        ffn_dim=14336,
        vocab_size=128256,
        rope_theta=500000.0,
        rms_eps=1e-5,
        max_context=131072,
        rope_scaling={"factor": 8.0, **llama3_rope},
    )


@pytest.mark.parametrize(
    "spec", ["no-such-model", "synthetic:nope", "/nonexistent/model.gguf", "/nonexistent/dir"]
)
def test_unknown_spec_is_a_value_error(spec):
    with pytest.raises(ValueError, match="synthetic"):
        resolve(spec)


def test_the_layer_count_comes_from_metadata_without_torch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 7}))
    assert [layer_count(s) for s in ("smollm2-135m", "synthetic:llama-8b", str(tmp_path))] == [
        30, 32, 7]
    probe = ("import sys; from worker.loaders import layer_count; "
             "layer_count('smollm2-135m'); assert 'torch' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 0


def test_unsupported_gguf_architecture_is_a_clear_error(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gemma")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gemma' is not supported"):
        resolve(str(tmp_path / "m.gguf"))


# ---- against transformers, on tiny random models ----------------------------------------------

HF_KINDS = {
    # llama: llama3 rope scaling, untied head; llama-linear: linear rope scaling;
    # qwen2: qkv bias, tied head
    "llama": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
    "llama-linear": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "qwen2": dict(rope_theta=10000.0, tie_word_embeddings=True),
}


def tiny_hf_model(kind: str, vocab_size: int):
    config_class = (
        transformers.LlamaConfig if kind.startswith("llama") else transformers.Qwen2Config
    )
    model_class = (
        transformers.LlamaForCausalLM if kind.startswith("llama") else transformers.Qwen2ForCausalLM
    )
    config = config_class(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=vocab_size,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=258,
        # large weights make attention peaked, so rope or layout mistakes move the logits
        initializer_range=0.2,
        **HF_KINDS[kind],
    )
    torch.manual_seed(0)
    model = model_class(config).eval()
    if kind == "qwen2":
        with torch.no_grad():
            for layer in model.model.layers:
                for name in ("q_proj", "k_proj", "v_proj"):
                    getattr(layer.self_attn, name).bias.normal_(0, 0.2)
    return model


def hf_logits(model, ids: list[int]) -> Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


PROBE = list(range(3, 250, 9))


@pytest.mark.parametrize("kind", list(HF_KINDS))
def test_hf_safetensors_dir_logits_match_transformers(tmp_path, kind):
    model = tiny_hf_model(kind, vocab_size=512)
    model.save_pretrained(tmp_path)
    info = byte_level_tokenizer(512)
    (tmp_path / "tokenizer.json").write_text(info.tokenizer_json)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": SYNTHETIC_CHAT_TEMPLATE, "eos_token": "<|im_end|>"})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [258, 256]}))

    source = resolve(str(tmp_path))
    assert (source.args.n_layers, source.args.qkv_bias) == (3, kind == "qwen2")
    assert source.args.tie_embeddings == (kind == "qwen2")
    ours = run([source.load_stage(0, 3, torch.float32, "cpu")], PROBE)
    split = run(
        [
            source.load_stage(0, 1, torch.float32, "cpu"),
            source.load_stage(1, 3, torch.float32, "cpu"),
        ],
        PROBE,
    )
    assert torch.equal(ours, split)
    logits = source.load_stage(2, 3, torch.float32, "cpu").logits(ours)
    assert (logits - hf_logits(model, PROBE)).abs().max().item() < 1e-4

    tok = source.tokenizer
    assert tok.chat_template == SYNTHETIC_CHAT_TEMPLATE
    assert (tok.eos_ids, tok.bos_id, tok.add_bos) == ([258, 256], None, False)
    assert tok.tokenizer_json == info.tokenizer_json


# A SentencePiece vocabulary: llama.cpp's token types 1 normal, 2 unknown, 3 control,
# 4 user-defined, 6 byte.
SP_PIECES = ["▁", "e", "h", "l", "o", "w", "r", "d", "▁h", "ll", "▁he", "▁hell", "▁hello", "▁w",
             "or", "▁wor", "▁worl", "▁world", "lo", "he", "!", "▁!"]  # fmt: skip
SP_TOKENS = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *SP_PIECES, "<sep>"]
SP_TYPES = [2, 3, 3, *[6] * 256, *[1] * len(SP_PIECES), 4]
SP_SCORES = [0.0, 0.0, 0.0, *[0.0] * 256, *[-float(i) for i in range(len(SP_PIECES))], 0.0]
SP_TEXTS = [
    "hello world",
    " hello  world!",
    "hello\nworld",
    "héllo wörld",
    "<s>hello</s>",
    "he<sep>llo",
]


Q = gguf.GGMLQuantizationType


def write_gguf(path: Path, model, kind: str, matrix_type: Q) -> None:
    """`model` as llama.cpp's converter writes it: matrices in `matrix_type`, F32 norms and biases,
    llama's q/k permuted."""
    c = model.config
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    with gguf_writer(path, kind, c) as w:
        w.add_feed_forward_length(c.intermediate_size)
        w.add_tokenizer_model("llama")
        w.add_token_list(SP_TOKENS)
        w.add_token_scores(SP_SCORES)
        w.add_token_types(SP_TYPES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)

        def matrix(name: str, m: np.ndarray) -> None:
            w.add_tensor(name, gguf.quants.quantize(m, matrix_type), raw_dtype=matrix_type)

        matrix("token_embd.weight", sd["model.embed_tokens.weight"])
        for i in range(c.num_hidden_layers):
            h, g = f"model.layers.{i}.", f"blk.{i}."
            q, k = sd[h + "self_attn.q_proj.weight"], sd[h + "self_attn.k_proj.weight"]
            if kind == "llama":
                q = permute_like_llama_cpp(q, c.num_attention_heads)
                k = permute_like_llama_cpp(k, c.num_key_value_heads)
            w.add_tensor(g + "attn_norm.weight", sd[h + "input_layernorm.weight"])
            matrix(g + "attn_q.weight", q)
            matrix(g + "attn_k.weight", k)
            matrix(g + "attn_v.weight", sd[h + "self_attn.v_proj.weight"])
            if kind == "qwen2":
                for x in "qkv":
                    w.add_tensor(g + f"attn_{x}.bias", sd[h + f"self_attn.{x}_proj.bias"])
            matrix(g + "attn_output.weight", sd[h + "self_attn.o_proj.weight"])
            w.add_tensor(g + "ffn_norm.weight", sd[h + "post_attention_layernorm.weight"])
            matrix(g + "ffn_gate.weight", sd[h + "mlp.gate_proj.weight"])
            matrix(g + "ffn_up.weight", sd[h + "mlp.up_proj.weight"])
            matrix(g + "ffn_down.weight", sd[h + "mlp.down_proj.weight"])
        w.add_tensor("output_norm.weight", sd["model.norm.weight"])
        if not c.tie_word_embeddings:
            matrix("output.weight", sd["lm_head.weight"])


@pytest.mark.parametrize(
    "kind,matrix_type", [("llama", Q.F16), ("llama", Q.BF16), ("llama", Q.Q8_0), ("qwen2", Q.Q8_0)]
)
def test_gguf_logits_match_transformers_loading_the_same_file(tmp_path, kind, matrix_type):
    model = tiny_hf_model(kind, vocab_size=len(SP_TOKENS))
    write_gguf(tmp_path / "tiny.gguf", model, kind, matrix_type)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf", dtype=torch.float32
    )
    source = resolve(str(tmp_path / "tiny.gguf"))
    assert source.args.tie_embeddings == (kind == "qwen2")
    ours = source.load_stage(0, 3, torch.float32, "cpu")
    ids = [i % len(SP_TOKENS) for i in PROBE]
    logits = ours.logits(run([ours], ids))
    assert (logits - hf_logits(reference, ids)).abs().max().item() < 1e-4


def test_gguf_sentencepiece_tokenizer_matches_transformers(tmp_path):
    model = tiny_hf_model("llama", vocab_size=len(SP_TOKENS))
    write_gguf(tmp_path / "tiny.gguf", model, "llama", Q.F16)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    info = resolve(str(tmp_path / "tiny.gguf")).tokenizer
    assert (info.bos_id, info.eos_ids, info.add_bos) == (1, [2], True)
    tokenizer = Tokenizer.from_str(info.tokenizer_json)
    for text in SP_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids), text
    assert tokenizer.encode("hello world", add_special_tokens=False).ids == [271, 276]
