from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from worker.kernels import exact_cpu
from worker.loaders import smollm2_path

# The exactness tests run exact kernels in this process, whose BLAS must be pinned before its
# first product (exact_cpu.pin_blas). One product latches it; the variable is then taken back so
# that the clusters the tests start choose for themselves (their workers pin it in exact mode).
if "MKL_CBWR" not in os.environ:
    exact_cpu.pin_blas()
    torch.ones(8, 8) @ torch.ones(8, 8)
    del os.environ["MKL_CBWR"]


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    return str(smollm2_path())


@pytest.fixture(scope="session")
def hf_reference(smollm2_gguf_path: str) -> SimpleNamespace:
    """transformers' float32 model and tokenizer from the default GGUF (~30 s, once a session)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(smollm2_gguf_path)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return SimpleNamespace(model=model.eval(), tokenizer=tokenizer)
