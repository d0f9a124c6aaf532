"""Hugging Face directories: config.json, *.safetensors (HF tensor names), tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from worker.loaders import progress
from worker.model import ModelArgs, StageModel, build_stage, check_layer_range
from worker.model_args import LLAMA3_KEYS
from worker.tokenizer import TokenizerInfo, hf_tokenizer

# architecture -> model family (worker/models/)
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                 "Qwen2ForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
                 "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}


def _rope_scaling(config: dict, head_dim: int, path: Path) -> dict | None:
    # transformers 5 writes `rope_parameters`; earlier versions `rope_scaling`
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return {"freq_factors": [scaling["factor"]] * (head_dim // 2)}
    if kind != "llama3":
        raise ValueError(
            f"{path}: rope scaling {kind!r} is not supported; supported: llama3, linear"
        )
    return {key: scaling[key] for key in LLAMA3_KEYS}


def read_args(config: dict, path: Path) -> ModelArgs:
    arch = (config.get("architectures") or ["<none>"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{path}: architecture {arch} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    family = ARCHITECTURES[arch]
    if config.get("hidden_act", "silu") != "silu" or config.get("mlp_bias", False):
        raise ValueError(f"{path}: only SwiGLU feed-forwards without bias are supported")
    experts = _experts(config, family, path)
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or dim // n_heads
    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    max_context = config["max_position_embeddings"]
    if config.get("sliding_window") and config.get("use_sliding_window", True):
        # Attention here is global: capping the context at the window keeps it exact.
        max_context = min(max_context, config["sliding_window"])
    return ModelArgs(
        n_layers=config["num_hidden_layers"],
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        ffn_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        rope_theta=float(theta or 10000.0),
        rms_eps=float(config["rms_norm_eps"]),
        max_context=max_context,
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_scaling=_rope_scaling(config, head_dim, path),
        family=family,
        **experts,
    )


def _experts(config: dict, family: str, path: Path) -> dict:
    """A mixture of experts' ModelArgs fields from its config (none for a dense family)."""
    if family not in ("qwen3_moe", "mixtral"):
        return {}
    if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
        raise ValueError(f"{path}: dense layers among the sparse ones (decoder_sparse_step, "
                         "mlp_only_layers) are not supported")
    # Qwen's own configs say num_experts, transformers 5 writes num_local_experts for both
    return {"n_experts": config.get("num_experts") or config["num_local_experts"],
            "experts_per_token": config["num_experts_per_tok"],
            "expert_ffn_dim": config.get("moe_intermediate_size") or config["intermediate_size"],
            # Mixtral always renormalises over the chosen experts
            "norm_topk_prob": family == "mixtral" or bool(config.get("norm_topk_prob", False))}


class SafetensorsSource:
    def __init__(self, directory: str | Path, name: str | None = None):
        self.directory = Path(directory)
        self.name = name or self.directory.name
        self.args = read_args(
            json.loads((self.directory / "config.json").read_text()), self.directory
        )
        self._files: dict[str, Path] = {}
        for file in sorted(self.directory.glob("*.safetensors")):
            with safe_open(file, framework="pt") as f:
                self._files.update(dict.fromkeys(f.keys(), file))
        if not self._files:
            raise ValueError(f"{self.directory} has no *.safetensors files")
        if "lm_head.weight" not in self._files:
            self.args.tie_embeddings = True
        self._tokenizer: TokenizerInfo | None = None

    @property
    def tokenizer(self) -> TokenizerInfo:
        if self._tokenizer is None:
            self._tokenizer = hf_tokenizer(self.directory)
        return self._tokenizer

    def _read(self, names: set[str]) -> dict[str, Tensor]:
        missing = names - self._files.keys()
        if missing:
            raise ValueError(f"{self.directory}: tensors missing: {sorted(missing)}")
        out = {}
        for file in {self._files[n] for n in names}:
            with safe_open(file, framework="pt") as f:
                out.update((n, f.get_tensor(n)) for n in names if self._files[n] == file)
        return out

    def load_stage(
        self, layer_start: int, layer_end: int, dtype: torch.dtype, device: str | torch.device
    ) -> StageModel:
        a = self.args
        check_layer_range(a, layer_start, layer_end)
        # stage tensor -> the HF tensors concatenated (rows) into it, or for each expert
        # (stacked) the HF tensors concatenated into its slice
        parts: dict[str, list[str]] = {}
        stacks: dict[str, list[list[str]]] = {}
        if layer_start == 0:
            parts["embed.weight"] = ["model.embed_tokens.weight"]
        for i in progress.layers(layer_start, layer_end):
            p, h = f"layers.{i - layer_start}.", f"model.layers.{i}."
            parts[p + "attention_norm.weight"] = [h + "input_layernorm.weight"]
            parts[p + "attention.wqkv.weight"] = [h + f"self_attn.{x}_proj.weight" for x in "qkv"]
            if a.qkv_bias:
                parts[p + "attention.wqkv.bias"] = [h + f"self_attn.{x}_proj.bias" for x in "qkv"]
            if a.family in ("qwen3", "qwen3_moe"):
                for x in "qk":
                    parts[p + f"attention.{x}_norm.weight"] = [h + f"self_attn.{x}_norm.weight"]
            parts[p + "attention.wo.weight"] = [h + "self_attn.o_proj.weight"]
            parts[p + "ffn_norm.weight"] = [h + "post_attention_layernorm.weight"]
            f = p + "feed_forward."
            if a.family == "mixtral":
                m = h + "block_sparse_moe."
                parts[f + "router.weight"] = [m + "gate.weight"]
                experts = [m + f"experts.{e}." for e in range(a.n_experts)]
                stacks[f + "w13"] = [[x + "w1.weight", x + "w3.weight"] for x in experts]
                stacks[f + "w2"] = [[x + "w2.weight"] for x in experts]
            elif a.n_experts:
                parts[f + "router.weight"] = [h + "mlp.gate.weight"]
                experts = [h + f"mlp.experts.{e}." for e in range(a.n_experts)]
                stacks[f + "w13"] = [[x + "gate_proj.weight", x + "up_proj.weight"]
                                     for x in experts]
                stacks[f + "w2"] = [[x + "down_proj.weight"] for x in experts]
            else:
                parts[f + "w13.weight"] = [h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"]
                parts[f + "w2.weight"] = [h + "mlp.down_proj.weight"]
        if layer_end == a.n_layers:
            parts["norm.weight"] = ["model.norm.weight"]
            if not a.tie_embeddings:
                parts["output.weight"] = ["lm_head.weight"]
            elif layer_start > 0:
                parts["output.weight"] = ["model.embed_tokens.weight"]
        raw = self._read({n for names in parts.values() for n in names}
                         | {n for slices in stacks.values() for names in slices for n in names})
        tensors = {
            key: torch.cat([raw[n] for n in names]).to(device=device, dtype=dtype)
            for key, names in parts.items()
        }
        for key, slices in stacks.items():
            tensors[key] = torch.stack(
                [torch.cat([raw[n] for n in names]) for names in slices]).to(device, dtype)
        return build_stage(a, layer_start, layer_end, tensors)
