"""A sparse mixture-of-experts feed-forward (Qwen3-MoE, Mixtral): a router picks each token's
top k of n SwiGLU experts, and the token's output is their outputs weighted by the router's
probabilities (softmax over all n, renormalised over the k where `norm_topk_prob`).

Tokens are grouped by expert, each group multiplied by its expert's weights through `linear`
(`F.linear`; exact mode's batch-invariant one, worker/exact.py), and each token's k outputs are
added in the order of their expert ids. So under exact mode a token's bits depend only on the
token: not on how many others chose its experts nor on where they routed. Which experts the
step uses is read on the host, so these layers are not captured in CUDA graphs (`capturable`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worker.model_args import ModelArgs
from worker.norm import rowwise


class SparseMoE(nn.Module):
    capturable = False  # the experts a step routes to are read on the host

    def __init__(self, args: ModelArgs):
        super().__init__()
        e, f = args.n_experts, args.expert_ffn_dim
        self.top_k, self.norm_topk_prob = args.experts_per_token, args.norm_topk_prob
        self.router = nn.Linear(args.dim, e, bias=False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * f, args.dim))  # each: gate rows, then up rows
        self.w2 = nn.Parameter(torch.empty(e, args.dim, f))
        self.linear = F.linear

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, dim] -> [T, dim]
        probs = torch.softmax(self.router(x).float(), dim=-1)  # [T, E]
        weights, experts = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        kernels = rowwise(x)
        for e in experts.unique().tolist():  # ascending
            token, slot = (experts == e).nonzero(as_tuple=True)
            h = self.linear(x[token], self.w13[e])
            if kernels is not None:
                h = kernels.silu_mul(h)
            else:
                gate, up = h.chunk(2, dim=-1)
                h = F.silu(gate) * up
            y = self.linear(h, self.w2[e]) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out
