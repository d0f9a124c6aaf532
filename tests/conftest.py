from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from worker.loaders import smollm2_path


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
