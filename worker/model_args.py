"""A model's family and shape, as its checkpoint's metadata gives it. Nothing here imports
torch, so the coordinator reads a model's facts (its layer count) without loading a worker."""

from __future__ import annotations

from dataclasses import dataclass, field

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class ModelArgs:
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float
    rms_eps: float
    max_context: int
    family: str = "llama"  # its layer's module, worker/models/<family>.py
    qkv_bias: bool = False
    # a mixture-of-experts feed-forward (worker/models/moe.py): experts, chosen per token, each
    # expert's hidden size, whether the chosen experts' weights are renormalised to sum to 1
    n_experts: int = 0
    experts_per_token: int = 0
    expert_ffn_dim: int = 0
    norm_topk_prob: bool = True
    tie_embeddings: bool = False
    # None, Llama 3 style (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings), or {"freq_factors": [head_dim // 2 divisors of the
    # frequencies]} (llama.cpp's rope_freqs tensor; linear scaling).
    rope_scaling: dict | None = None
    q_dim: int = field(init=False)
    kv_dim: int = field(init=False)

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        scaling = self.rope_scaling
        if scaling is not None and "freq_factors" in scaling:
            if len(scaling["freq_factors"]) != self.head_dim // 2:
                raise ValueError(f"rope_scaling needs {self.head_dim // 2} freq_factors")
        elif scaling is not None:
            missing = [key for key in LLAMA3_KEYS if key not in scaling]
            if missing:
                raise ValueError(
                    f"rope_scaling {scaling} lacks {missing}; only Llama 3 scaling is supported"
                )
        if self.n_experts and not 0 < self.experts_per_token <= self.n_experts:
            raise ValueError(f"{self.experts_per_token} experts a token of {self.n_experts}")
        self.q_dim = self.n_heads * self.head_dim
        self.kv_dim = self.n_kv_heads * self.head_dim
