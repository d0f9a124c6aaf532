"""ModelRunner: turns a StepPlan into tensors, runs this worker's layers, samples on the last."""

from __future__ import annotations

import torch

from protocol.errors import ProtocolError
from protocol.messages import Step

from .batch import BatchMeta, build_meta
from .kv_pool import KVPool
from .model import StageModel
from .sampler import SamplingParams, sample


class ModelRunner:
    def __init__(self, stage: StageModel, pool: KVPool, device: torch.device | str):
        self.stage = stage
        self.pool = pool
        self.device = torch.device(device)
        self.first = stage.embed is not None
        self.last = stage.output is not None
        self.tables: dict[int, list[int]] = {}
        self.sampling: dict[int, SamplingParams] = {}

    def apply(self, plan: Step) -> BatchMeta:
        """Update page tables from the plan's deltas and build this step's metadata."""
        for seq_id in plan.free:
            self.tables.pop(seq_id, None)
            self.sampling.pop(seq_id, None)
        for s in plan.seqs:
            table = self.tables.setdefault(s.id, [])
            if any(not 0 <= p < self.pool.n_pages for p in s.pages_add):
                raise ProtocolError(f"sequence {s.id}: page id out of range")
            table.extend(s.pages_add)
            if s.sampling is not None:
                sp = s.sampling
                self.sampling[s.id] = SamplingParams(sp.temperature, sp.top_p, sp.top_k, sp.seed)
            if len(table) * self.pool.page_size < s.start + s.n:
                raise ProtocolError(f"sequence {s.id}: positions past its pages")
        if self.first and len(plan.token_ids) != sum(s.n for s in plan.seqs):
            raise ProtocolError("token_ids do not match the plan's row count")
        return build_meta(
            [s.start for s in plan.seqs], [s.n for s in plan.seqs],
            [self.tables[s.id] for s in plan.seqs], [s.sample for s in plan.seqs],
            self.pool.page_size, self.device,
        )

    @torch.inference_mode()
    def forward(self, plan: Step, meta: BatchMeta, hidden: torch.Tensor | None) -> torch.Tensor:
        """hidden: [T, dim] from the previous stage (None on the first). Returns [T, dim]."""
        if self.first:
            inputs = torch.tensor(plan.token_ids, dtype=torch.int64, device=self.device)
        else:
            inputs = hidden
        return self.stage(inputs, meta.positions, self.pool.layers, meta)

    @torch.inference_mode()
    def sample(self, plan: Step, meta: BatchMeta, hidden: torch.Tensor) -> tuple[list, list]:
        """Sampled (sequence ids, tokens) for the plan's sequences that sample."""
        sampled = [s for s in plan.seqs if s.sample]
        if not sampled:
            return [], []
        logits = self.stage.logits(hidden[meta.sample_rows]).float()
        params = [self.sampling.get(s.id, SamplingParams()) for s in sampled]
        tokens = sample(logits, params, [s.start + s.n for s in sampled])
        return [s.id for s in sampled], tokens
