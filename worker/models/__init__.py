"""Model families, one module each, holding its layer (`Block`): what `StageModel` stacks
between the embedding and the head. A family is named by `ModelArgs.family`, which its loaders
set (worker/loaders/)."""

from __future__ import annotations

from torch import nn

from worker.model_args import ModelArgs

from . import llama, mixtral, qwen3, qwen3_moe

BLOCKS: dict[str, type[nn.Module]] = {"llama": llama.Block, "qwen3": qwen3.Block,
                                      "qwen3_moe": qwen3_moe.Block, "mixtral": mixtral.Block}


def block_type(args: ModelArgs) -> type[nn.Module]:
    """The layer of `args.family`: built as `Block(args)`, called as `block(x, cos, sin, step,
    layer)` (worker/model.py's `StepKV`)."""
    return BLOCKS[args.family]
