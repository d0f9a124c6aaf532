"""The named shapes of `synthetic:NAME` models. Nothing here imports torch."""

from __future__ import annotations

from worker.model_args import ModelArgs

_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

SHAPES = {
    "tiny": ModelArgs(
        n_layers=4, dim=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512, vocab_size=512,
        rope_theta=10000.0, rms_eps=1e-5, max_context=4096,
    ),
    "smollm2-135m": ModelArgs(
        n_layers=30, dim=576, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536,
        vocab_size=49152, rope_theta=100000.0, rms_eps=1e-5, max_context=8192,
        tie_embeddings=True,
    ),
    "llama-1b": ModelArgs(
        n_layers=16, dim=2048, n_heads=32, n_kv_heads=8, head_dim=64, ffn_dim=8192,
        vocab_size=128256, rope_theta=500000.0, rms_eps=1e-5, max_context=131072,
        tie_embeddings=True, rope_scaling={"factor": 32.0, **_LLAMA3_ROPE},
    ),
    "llama-8b": ModelArgs(
        n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336,
        vocab_size=128256, rope_theta=500000.0, rms_eps=1e-5, max_context=131072,
        rope_scaling={"factor": 8.0, **_LLAMA3_ROPE},
    ),
    # Qwen3 (per-head q/k norms) and Qwen3-MoE: the small ones for quick runs, then the
    # published shapes (Qwen3-8B, Qwen3-30B-A3B)
    "qwen3-tiny": ModelArgs(
        n_layers=4, dim=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512, vocab_size=512,
        rope_theta=1000000.0, rms_eps=1e-6, max_context=4096, family="qwen3",
    ),
    "moe-tiny": ModelArgs(
        n_layers=4, dim=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512, vocab_size=512,
        rope_theta=1000000.0, rms_eps=1e-6, max_context=4096, family="qwen3_moe",
        n_experts=16, experts_per_token=4, expert_ffn_dim=128,
    ),
    "qwen3-8b": ModelArgs(
        n_layers=36, dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=12288,
        vocab_size=151936, rope_theta=1000000.0, rms_eps=1e-6, max_context=40960,
        family="qwen3",
    ),
    "qwen3-30b-a3b": ModelArgs(
        n_layers=48, dim=2048, n_heads=32, n_kv_heads=4, head_dim=128, ffn_dim=6144,
        vocab_size=151936, rope_theta=1000000.0, rms_eps=1e-6, max_context=40960,
        family="qwen3_moe", n_experts=128, experts_per_token=8, expert_ffn_dim=768,
    ),
}  # fmt: skip


def named_shape(name: str) -> ModelArgs:
    if name not in SHAPES:
        raise ValueError(f"unknown synthetic model {name!r}; known: {', '.join(SHAPES)}")
    return SHAPES[name]
