import random

import torch
import torch.nn.functional as F

from worker.attention import choose_attention
from worker.batch import build_meta
from worker.kv.device_pool import KVPool
from worker.step import PagedStep


def dense_reference(q, k, v, n_ctx):
    """q: [n, H, D] for the last n of n_ctx positions; k, v: [n_ctx, KVH, D]."""
    n = q.shape[0]
    mask = torch.arange(n_ctx)[None, :] <= torch.arange(n_ctx - n, n_ctx)[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, enable_gqa=True)
    return o.transpose(0, 1)


def run_sequences(pool, seqs, tables, steps):
    """Feed each sequence's K/V through the pool in `steps` chunks; return the last outputs."""
    outs = {}
    for chunk in steps:
        starts = [s for _, s, _ in chunk]
        counts = [n for _, _, n in chunk]
        ids = [i for i, _, _ in chunk]
        meta = build_meta(starts, counts, [tables[i] for i in ids], [True] * len(ids),
                          pool.page_size, "cpu")
        q = torch.cat([seqs[i][0][s:s + n] for i, s, n in chunk])
        k = torch.cat([seqs[i][1][s:s + n] for i, s, n in chunk])
        v = torch.cat([seqs[i][2][s:s + n] for i, s, n in chunk])
        step = PagedStep(pool)
        step.fill(meta)
        o = step.attend(0, q, k, v)
        for b, i in enumerate(ids):
            outs[i] = o[meta.query_starts[b]:meta.query_starts[b + 1]]
    return outs


def test_paged_attention_matches_dense_for_any_page_placement():
    torch.manual_seed(0)
    rng = random.Random(0)
    H, KVH, D, page = 6, 2, 16, 4
    lens = [13, 5, 21]
    seqs = {i: (torch.randn(n, H, D), torch.randn(n, KVH, D), torch.randn(n, KVH, D))
            for i, n in enumerate(lens)}
    pool = KVPool(1, 32, page, KVH, D, torch.float32, "cpu", choose_attention(False, "cpu", D))
    free = list(range(32))
    rng.shuffle(free)
    tables = {i: [free.pop() for _ in range(-(-n // page))] for i, n in enumerate(lens)}
    # prefill in uneven chunks, then one decode row each (batched decode path)
    steps = [[(0, 0, 7), (1, 0, 5)], [(0, 7, 5), (2, 0, 20)], [(0, 12, 1), (2, 20, 1)]]
    outs = run_sequences(pool, seqs, tables, steps)
    for i, (s, n) in {0: (12, 1), 1: (0, 5), 2: (20, 1)}.items():
        q, k, v = seqs[i]
        ref = dense_reference(q[s:s + n], k[:s + n], v[:s + n], s + n)
        torch.testing.assert_close(outs[i], ref, rtol=1e-5, atol=1e-5)


def test_moving_pages_does_not_change_the_result():
    torch.manual_seed(1)
    H, KVH, D, page, n = 4, 2, 8, 4, 11
    seq = {0: (torch.randn(n, H, D), torch.randn(n, KVH, D), torch.randn(n, KVH, D))}
    attention = choose_attention(False, "cpu", D)
    a = run_sequences(KVPool(1, 8, page, KVH, D, torch.float32, "cpu", attention), seq,
                      {0: [0, 1, 2]}, [[(0, 0, n)]])
    b = run_sequences(KVPool(1, 8, page, KVH, D, torch.float32, "cpu", attention), seq,
                      {0: [7, 3, 5]}, [[(0, 0, n)]])
    assert torch.equal(a[0], b[0])
