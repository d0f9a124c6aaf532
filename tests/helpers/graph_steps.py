"""Step-graph runs for the tests: a tiny synthetic model's runner on a device or host pool
(with or without graph pieces), a schedule of prompts, a mixed step and decode batches that pad
by different amounts, and every step's hidden rows and tokens."""

import torch

from protocol.messages import SeqPlan, Step
from protocol.sampling import SamplingParams
from worker.build import build_runner, load_stage, make_pool
from worker.runner import ModelRunner

PAGE = 4
PROMPTS = {1: 9, 2: 5, 3: 13, 4: 2, 5: 7}  # sequence id -> prompt length
# decode batches: 5 rows pad to 8, 3 to 4 (rows past them stale from the 5-row step), 1, 4, 2,
# then one batch twice (a host pool's second step takes its first layers primed)
DECODES = [[1, 2, 3, 4, 5], [2, 4, 5], [3], [1, 2, 3, 4], [5, 1], [1, 2, 3, 4, 5],
           [1, 2, 3, 4, 5]]
# sequence id -> how it samples, for `run(..., sampling=SAMPLING)`: one greedy, the others
# drawing with a temperature, top-k, top-p and both
SAMPLING = {1: SamplingParams(temperature=0.8, seed=1), 2: SamplingParams(),
            3: SamplingParams(temperature=1.2, top_k=20, seed=3),
            4: SamplingParams(temperature=1.0, top_p=0.9, seed=4),
            5: SamplingParams(temperature=0.7, top_k=5, top_p=0.8, seed=5)}


def schedule(prompts: dict[int, int] = PROMPTS) -> list[Step]:
    """Prompts of sequences 1-3, then (mixed) of 4 and 5 beside a decode row of 1, then DECODES;
    pages interleaved across sequences, so no table is a run."""
    pages = iter(range(pages_needed(prompts)))
    n_pages = {i: -(-(n + len(DECODES) + 1) // PAGE) for i, n in prompts.items()}
    tables = {i: [] for i in prompts}
    for k in range(max(n_pages.values())):
        for i in prompts:
            if k < n_pages[i]:
                tables[i].append(next(pages))
    steps = [Step(step=0, seqs=[SeqPlan(id=i, start=0, n=prompts[i], pages_add=tables[i],
                                        sample=True) for i in (1, 2, 3)]),
             # a mixed step: prompts beside a decode row, the first not sampling (as a chunk
             # that does not end its prompt), so the rows that sample are not the first rows
             Step(step=1, seqs=[SeqPlan(id=4, start=0, n=prompts[4], pages_add=tables[4],
                                        sample=False),
                                SeqPlan(id=5, start=0, n=prompts[5], pages_add=tables[5],
                                        sample=True),
                                SeqPlan(id=1, start=prompts[1], n=1, sample=True)])]
    pos = dict(prompts)
    pos[1] += 1
    for k, ids in enumerate(DECODES):
        steps.append(Step(step=2 + k, seqs=[SeqPlan(id=i, start=pos[i], n=1, sample=True)
                                             for i in ids]))
        for i in ids:
            pos[i] += 1
    return steps


def pages_needed(prompts: dict[int, int]) -> int:
    return sum(-(-(n + len(DECODES) + 1) // PAGE) for n in prompts.values())


def run(runner: ModelRunner, prompts: dict[int, int] = PROMPTS,
        sampling: dict[int, SamplingParams] | None = None) -> list[tuple[torch.Tensor, list[int]]]:
    """Hidden rows and sampled tokens of every step of `schedule(prompts)`; sampling: how each
    sequence samples (greedy where not given)."""
    runner.sampling.update(sampling or {})
    last = {i: 100 + i for i in prompts}
    out = []
    for plan in schedule(prompts):
        plan.token_ids = [(last[s.id] + j) % 500 for s in plan.seqs for j in range(s.n)]
        meta = runner.apply(plan)
        hidden = runner.forward(plan, meta, None)
        ids, tokens = runner.sample(plan, meta, hidden)
        last.update(zip(ids, tokens))
        out.append((hidden, tokens))
    return out


def runner(exact: bool, kv: str = "device", graphs: bool = True, device: str = "cpu",
           dtype: torch.dtype = torch.float32, n_pages: int = 64, depth: int = 1,
           slot_layers: int | None = 1) -> ModelRunner:
    """On a CUDA device the pieces are captured graphs and the host pool's copies go on a
    transfer stream; on the CPU the pieces run eagerly and copies go through the copy thread."""
    stage = load_stage("synthetic:tiny", dtype, device, exact=exact)
    pool = make_pool(stage, n_pages, PAGE, device, exact=exact, kv=kv, depth=depth,
                     slot_layers=slot_layers, delay_ms=0.5)
    return build_runner(stage, pool, device, park_pages=4, graphs=graphs)
