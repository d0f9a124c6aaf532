"""The Hugging Face transformers model a benchmark compares siding against, on the same weights.

The default model loads through transformers' own GGUF reader, an independent path to the same
dequantized tensors. Any other spec is rebuilt as `LlamaForCausalLM` from our `ModelArgs`, with
the weights taken from our StageModel: the fused `wqkv` and `w13` split back into q/k/v and
gate/up. Both models rotate in the rotate-half layout, so no weight is permuted.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from worker.loaders import DEFAULT_MODEL, resolve, smollm2_path
from worker.model import ModelArgs, StageModel


def reference_model(spec: str, dtype: torch.dtype, device: str) -> PreTrainedModel:
    """The whole model of `spec` in `dtype` on `device`, in eval mode."""
    if spec == DEFAULT_MODEL:
        path = smollm2_path()
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        return model.to(device).eval()
    source = resolve(spec)
    return from_stage(source.load_stage(0, source.args.n_layers, dtype, device))


def llama_config(args: ModelArgs) -> LlamaConfig:
    scaling = args.rope_scaling
    if scaling is not None and "freq_factors" in scaling:
        raise ValueError(
            "this model scales RoPE by per-frequency factors (a GGUF rope_freqs tensor), which "
            "transformers' LlamaConfig cannot express; run with --no-hf"
        )
    return LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_context,
        rms_norm_eps=args.rms_eps,
        rope_theta=args.rope_theta,
        rope_scaling=None if scaling is None else {"rope_type": "llama3", **scaling},
        # Llama's flag also gives o_proj a bias; ours has none, so it is set to zeros.
        attention_bias=args.qkv_bias,
        tie_word_embeddings=args.tie_embeddings,
    )


def hf_state_dict(stage: StageModel) -> dict[str, Tensor]:
    """`LlamaForCausalLM` parameter names -> our tensors (views, not copies)."""
    a = stage.args
    sd = {
        "model.embed_tokens.weight": stage.embed.weight,
        "model.norm.weight": stage.norm.weight,
        "lm_head.weight": stage.output.weight,  # the embedding's storage when tied
    }
    for i, layer in enumerate(stage.layers):
        p = f"model.layers.{i}."
        attn, ffn = layer.attention, layer.feed_forward
        for name, w in zip("qkv", attn.wqkv.weight.split([a.q_dim, a.kv_dim, a.kv_dim])):
            sd[f"{p}self_attn.{name}_proj.weight"] = w
        if a.qkv_bias:
            for name, b in zip("qkv", attn.wqkv.bias.split([a.q_dim, a.kv_dim, a.kv_dim])):
                sd[f"{p}self_attn.{name}_proj.bias"] = b
            sd[f"{p}self_attn.o_proj.bias"] = attn.wo.weight.new_zeros(a.dim)
        sd[f"{p}self_attn.o_proj.weight"] = attn.wo.weight
        gate, up = ffn.w13.weight.chunk(2)
        sd[f"{p}mlp.gate_proj.weight"] = gate
        sd[f"{p}mlp.up_proj.weight"] = up
        sd[f"{p}mlp.down_proj.weight"] = ffn.w2.weight
        sd[f"{p}input_layernorm.weight"] = layer.attention_norm.weight
        sd[f"{p}post_attention_layernorm.weight"] = layer.ffn_norm.weight
    return sd


def from_stage(stage: StageModel) -> LlamaForCausalLM:
    """The whole-model `stage` as transformers' Llama, sharing its tensors."""
    if not (stage.first and stage.last):
        raise ValueError("a reference model needs every layer, the embedding and the head")
    config = llama_config(stage.args)
    # Built on meta so no random init runs; every parameter is then our tensor.
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(hf_state_dict(stage), strict=True, assign=True)
    device = stage.embed.weight.device
    # The rotary tables are buffers computed at construction, so they are rebuilt off meta.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config).to(device)
    model.config.dtype = stage.embed.weight.dtype
    return model.requires_grad_(False).eval()
