"""GGUF files (llama, with experts Mixtral's; qwen2, qwen3, qwen3moe), dequantized to the run
dtype.

The header is read by `gguf_header.py`; tensor bytes are sliced from one read-only mmap and
dequantized with `gguf.quants.dequantize`.
"""

from __future__ import annotations

import mmap
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize
from torch import Tensor

from worker.loaders import progress
from worker.loaders.gguf_header import read_header
from worker.model import ModelArgs, StageModel, build_stage, check_layer_range
from worker.tokenizer import TokenizerInfo, gguf_tokenizer

# architecture -> (q/k stored permuted for llama.cpp's interleaved rope, qkv has a bias, model
# family: worker/models/; llama's with experts is Mixtral's)
ARCHITECTURES = {"llama": (True, False, "llama"), "qwen2": (False, True, "llama"),
                 "qwen3": (False, False, "qwen3"), "qwen3moe": (False, False, "qwen3_moe")}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # w: [n_heads * D, ...] with each head's rows in llama.cpp's interleaved (pairwise) order ->
    # HF's half-split order; the inverse of convert_hf_to_gguf's `permute`.
    return (
        w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


class GGUFSource:
    def __init__(self, path: str | Path, name: str | None = None):
        self.path = Path(path)
        self.name = name or self.path.stem
        with self.path.open("rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.meta, self._tensors, self._data_start = read_header(self._buf, self.path)
        arch = self.meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"{self.path}: GGUF architecture {arch!r} is not supported; supported: "
                f"{', '.join(ARCHITECTURES)}"
            )
        self._permuted, qkv_bias, family = ARCHITECTURES[arch]
        self.args = self._args(arch, qkv_bias, family)
        self._tokenizer: TokenizerInfo | None = None

    def _args(self, arch: str, qkv_bias: bool, family: str) -> ModelArgs:
        meta = self.meta

        def fact(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"{self.path}: GGUF metadata lacks {arch}.{key}")
            return value

        dim, n_heads = fact("embedding_length"), fact("attention.head_count")
        head_dim = fact("attention.key_length", dim // n_heads)
        if fact("rope.dimension_count", head_dim) != head_dim:
            raise ValueError(f"{self.path}: partial rotary embeddings are not supported")
        rope_scaling = None
        scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
        if scaling_type == "linear":
            factor = fact("rope.scaling.factor")
            rope_scaling = {"freq_factors": [factor] * (head_dim // 2)}
        elif scaling_type != "none":
            raise ValueError(f"{self.path}: rope scaling {scaling_type!r} is not supported")
        experts = {}
        if (n_experts := meta.get(f"{arch}.expert_count", 0)):
            family = "mixtral" if family == "llama" else family
            experts = {"n_experts": n_experts, "experts_per_token": fact("expert_used_count"),
                       "expert_ffn_dim": fact("expert_feed_forward_length",
                                              meta.get(f"{arch}.feed_forward_length")),
                       # llama.cpp renormalises the chosen experts' weights unless told not to
                       "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", True))}
        elif family == "qwen3_moe":
            raise ValueError(f"{self.path}: GGUF metadata lacks {arch}.expert_count")
        if "rope_freqs.weight" in self._tensors:
            # llama.cpp's form of Llama 3 scaling
            rope_scaling = {"freq_factors": self._read("rope_freqs.weight").tolist()}
        return ModelArgs(
            n_layers=fact("block_count"),
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=fact("attention.head_count_kv", n_heads),
            head_dim=head_dim,
            ffn_dim=fact("feed_forward_length", 0 if experts else None),
            vocab_size=fact("vocab_size", self._tensors["token_embd.weight"][0][0]),
            rope_theta=float(fact("rope.freq_base", 10000.0)),
            rms_eps=float(fact("attention.layer_norm_rms_epsilon")),
            max_context=fact("context_length"),
            qkv_bias=qkv_bias,
            tie_embeddings="output.weight" not in self._tensors,
            rope_scaling=rope_scaling,
            family=family,
            **experts,
        )

    @property
    def tokenizer(self) -> TokenizerInfo:
        if self._tokenizer is None:
            self._tokenizer = gguf_tokenizer(self.meta)
        return self._tokenizer

    def _read(self, name: str) -> np.ndarray:
        """One tensor, dequantized to float32, in torch shape."""
        shape, kind, offset = self._tensors[name]
        block, block_bytes = GGML_QUANT_SIZES[kind]
        row_bytes = shape[-1] // block * block_bytes
        raw = np.frombuffer(
            self._buf,
            dtype=np.uint8,
            count=prod(shape[:-1]) * row_bytes,
            offset=self._data_start + offset,
        )
        w = dequantize(raw.reshape(*shape[:-1], row_bytes), kind)
        # F32 comes back as a view of the read-only mapping
        return w if w.flags.writeable else w.copy()

    def _tensor(self, name: str, dtype: torch.dtype, device: str | torch.device) -> Tensor:
        return torch.from_numpy(self._read(name)).to(device=device, dtype=dtype)

    def _qkv(
        self, layer: int, suffix: str, dtype: torch.dtype, device: str | torch.device
    ) -> Tensor:
        a = self.args
        parts = [self._read(f"blk.{layer}.attn_{x}.{suffix}") for x in "qkv"]
        if self._permuted:
            parts[0] = _unpermute(parts[0], a.n_heads)
            parts[1] = _unpermute(parts[1], a.n_kv_heads)
        return torch.from_numpy(np.concatenate(parts)).to(device=device, dtype=dtype)

    def load_stage(
        self, layer_start: int, layer_end: int, dtype: torch.dtype, device: str | torch.device
    ) -> StageModel:
        a = self.args
        check_layer_range(a, layer_start, layer_end)
        t: dict[str, Tensor] = {}
        if layer_start == 0:
            t["embed.weight"] = self._tensor("token_embd.weight", dtype, device)
        for i in progress.layers(layer_start, layer_end):
            p, g = f"layers.{i - layer_start}.", f"blk.{i}."
            t[p + "attention_norm.weight"] = self._tensor(g + "attn_norm.weight", dtype, device)
            t[p + "attention.wqkv.weight"] = self._qkv(i, "weight", dtype, device)
            if a.qkv_bias:
                t[p + "attention.wqkv.bias"] = self._qkv(i, "bias", dtype, device)
            if a.family in ("qwen3", "qwen3_moe"):
                for x in "qk":
                    t[p + f"attention.{x}_norm.weight"] = self._tensor(
                        g + f"attn_{x}_norm.weight", dtype, device)
            t[p + "attention.wo.weight"] = self._tensor(g + "attn_output.weight", dtype, device)
            t[p + "ffn_norm.weight"] = self._tensor(g + "ffn_norm.weight", dtype, device)
            f, exps = p + "feed_forward.", "_exps" if a.n_experts else ""
            if a.n_experts:  # [experts, rows, columns]: stacked as the model keeps them
                t[f + "router.weight"] = self._tensor(g + "ffn_gate_inp.weight", dtype, device)
            gate_up = [self._read(g + f"ffn_gate{exps}.weight"),
                       self._read(g + f"ffn_up{exps}.weight")]
            t[f + ("w13" if a.n_experts else "w13.weight")] = torch.from_numpy(
                np.concatenate(gate_up, axis=-2)).to(device=device, dtype=dtype)
            t[f + ("w2" if a.n_experts else "w2.weight")] = self._tensor(
                g + f"ffn_down{exps}.weight", dtype, device)
        if layer_end == a.n_layers:
            t["norm.weight"] = self._tensor("output_norm.weight", dtype, device)
            if not a.tie_embeddings:
                t["output.weight"] = self._tensor("output.weight", dtype, device)
            elif layer_start > 0:
                t["output.weight"] = self._tensor("token_embd.weight", dtype, device)
        return build_stage(a, layer_start, layer_end, t)
