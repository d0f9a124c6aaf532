"""ModelRunner: turns a StepPlan into tensors, runs this worker's layers, samples on the last."""

from __future__ import annotations

import time

import torch

from protocol.errors import ProtocolError
from protocol.messages import SeqPlan, Step
from protocol.sampling import SamplingParams

from .batch import BatchMeta, build_meta, device_ints
from .cuda_graphs import Head, StepGraphs
from .kv.park_store import ParkStore
from .kv.pool import Pool
from .model import StageModel
from .sampler import sample_tokens
from .step import PagedStep, run_eagerly


class SequenceFault(ProtocolError):
    """A plan that is wrong about one sequence; the coordinator fails only that one."""

    def __init__(self, seq_id: int, message: str):
        super().__init__(f"sequence {seq_id}: {message}")
        self.seq_id = seq_id


class ModelRunner:
    def __init__(self, stage: StageModel, pool: Pool, park: ParkStore,
                 device: torch.device | str, graphs: StepGraphs | None = None):
        """graphs: replays steps of up to MAX_ROWS rows (worker/cuda_graphs.py); None runs every
        step eagerly."""
        self.stage = stage
        self.graphs = graphs
        self.pool = pool
        self.park = park
        self.device = torch.device(device)
        self.first = stage.embed is not None
        self.last = stage.output is not None
        self.tables: dict[int, list[int]] = {}
        self.sampling: dict[int, SamplingParams] = {}
        self.eager = PagedStep(pool)  # what a step that no graph replays runs over
        self.park_seconds = 0.0  # of the last applied plan
        self.head: Head | None = None  # the last forward's, where a graph replay computed it
        # each sequence's last drawn token, on the device: (the step's tokens, its place there),
        # the input of a row planned before the coordinator knew it (`SeqPlan.after`)
        self.drawn: dict[int, tuple[torch.Tensor, int]] = {}

    def apply(self, plan: Step) -> BatchMeta:
        """Apply the plan's deltas (free, park, restore, copies, pages) and build the step's
        metadata. Raises SequenceFault naming the sequence a bad delta is about."""
        if plan.park or plan.restore or plan.copies:
            self.pool.settle()  # a host pool's last rows reach its pages before they are touched
        for seq_id in plan.free:
            self.tables.pop(seq_id, None)
            self.sampling.pop(seq_id, None)
            self.drawn.pop(seq_id, None)
            self.park.drop(seq_id)
        t0 = time.perf_counter()
        for m in plan.park:
            self.tables.pop(m.id, None)
            self._fault(m.id, self.park.park, m.id, m.pages, m.slots)
        for m in plan.restore:
            if any(not 0 <= p < self.pool.n_pages for p in m.kept):
                raise SequenceFault(m.id, "page id out of range")
            self._fault(m.id, self.park.restore, m.id, m.slots, m.pages)
            self.tables[m.id] = list(m.kept) + list(m.pages)
        self.park_seconds = time.perf_counter() - t0 if plan.park or plan.restore else 0.0
        for c in plan.copies:
            if not (0 <= c.src < self.pool.n_pages and 0 <= c.dst < self.pool.n_pages):
                raise ProtocolError(f"page copy {c.src} -> {c.dst} out of range")
            self.pool.k[:, c.dst] = self.pool.k[:, c.src]
            self.pool.v[:, c.dst] = self.pool.v[:, c.src]
        for s in plan.seqs:
            table = self.add_pages(s)
            if s.sampling is not None:
                self.sampling[s.id] = s.sampling
            if len(table) * self.pool.page_size < s.start + s.n:
                raise SequenceFault(s.id, "positions past its pages")
            if s.after and (s.n != 1 or s.id not in self.drawn or not self.first):
                raise SequenceFault(s.id, "a row on a token this worker did not draw")
        if self.first and len(plan.token_ids) != sum(s.n for s in plan.seqs):
            raise ProtocolError("token_ids do not match the plan's row count")
        return build_meta(
            [s.start for s in plan.seqs], [s.n for s in plan.seqs],
            [self.tables[s.id] for s in plan.seqs], [s.sample for s in plan.seqs],
            self.pool.page_size, self.device,
        )

    def add_pages(self, s: SeqPlan) -> list[int]:
        """Sequence `s`'s pages, with those the plan adds: its page table."""
        if any(not 0 <= p < self.pool.n_pages for p in s.pages_add):
            raise SequenceFault(s.id, "page id out of range")
        table = self.tables.setdefault(s.id, [])
        table.extend(s.pages_add)
        return table

    @staticmethod
    def _fault(seq_id: int, fn, *args) -> None:
        try:
            fn(*args)
        except ProtocolError as e:
            raise SequenceFault(seq_id, e.message.removeprefix(f"sequence {seq_id}: ")) from None

    @torch.inference_mode()
    def forward(self, plan: Step, meta: BatchMeta, hidden: torch.Tensor | None,
                tokens: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [T, dim] from the previous stage (None on the first). tokens: the first
        stage's input ids already on the device (the last step's `greedy`), in place of the
        plan's. Returns [T, dim]."""
        self.head = None
        if not plan.seqs:  # a step that only parks or restores
            return torch.empty(0, self.stage.args.dim, device=self.device)
        if not self.first:
            inputs = hidden
        elif tokens is not None:
            inputs = tokens
        else:
            inputs = self._inputs(plan)
        layer_meta = self.pool.begin_step(meta, [s.id for s in plan.seqs])
        if self.graphs is not None and self.graphs.bucket_rows(meta.n_rows) is not None:
            out = self.graphs.forward(inputs, layer_meta)
            self.head = self.graphs.head
        else:
            out = run_eagerly(self.stage, self.pool, layer_meta, inputs, self.eager)
        self.pool.end_step()
        return out

    def _inputs(self, plan: Step) -> torch.Tensor:
        """The plan's input ids on the device, with the tokens drawn last for its rows planned
        `after` them in place of their placeholders."""
        rows, picks, drawn, bases = [], [], [], {}
        row = 0
        for s in plan.seqs:
            if s.after:
                tokens, k = self.drawn[s.id]
                if id(tokens) not in bases:  # the steps they come from, one after another
                    bases[id(tokens)] = sum(t.numel() for t in drawn)
                    drawn.append(tokens)
                rows.append(row)
                picks.append(bases[id(tokens)] + k)
            row += s.n
        if not rows:
            (inputs,) = device_ints([plan.token_ids], self.device)
            return inputs
        inputs, rows_t, picks_t = device_ints([plan.token_ids, rows, picks], self.device)
        inputs[rows_t] = (drawn[0] if len(drawn) == 1 else torch.cat(drawn))[picks_t]
        return inputs

    @torch.inference_mode()
    def draw(self, plan: Step, meta: BatchMeta, hidden: torch.Tensor) -> torch.Tensor:
        """The tokens of the plan's sequences that sample, left on the device (the next step can
        be enqueued on them before the host reads them): [N] int64."""
        sampled = [s for s in plan.seqs if s.sample]
        head, self.head = self.head, None
        if not sampled:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        params = [self.sampling.get(s.id, SamplingParams()) for s in sampled]
        positions = [s.start + s.n for s in sampled]
        if head is not None:  # the replay's: the sampled rows' logits, in their order
            tokens = self.graphs.draws.tokens(head.greedy, params, positions)
        else:
            tokens = sample_tokens(self._logits(meta, hidden), params, positions)
        for k, s in enumerate(sampled):
            self.drawn[s.id] = (tokens, k)
        return tokens

    def sample(self, plan: Step, meta: BatchMeta, hidden: torch.Tensor) -> tuple[list, list]:
        """Sampled (sequence ids, tokens) for the plan's sequences that sample, read on the
        host."""
        return [s.id for s in plan.seqs if s.sample], self.draw(plan, meta, hidden).tolist()

    def _logits(self, meta: BatchMeta, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] of the rows that sample."""
        return self.stage.logits(hidden[meta.sample_rows])
