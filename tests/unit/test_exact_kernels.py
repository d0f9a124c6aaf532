"""Exact mode's CPU kernels: a row computed alone has the same bits as inside any launch."""

import pytest
import torch
import torch.nn.functional as F
from exactness.invariance import (
    ROW_COUNTS,
    PagedSequences,
    chunks_that_differ_from_rows,
    counts_where_row_differs,
    positions_where_row_differs,
    prompt_bits,
    prompt_kv_bits,
    split_chunks,
)

from worker.attention import choose_attention
from worker.exact import apply_exact
from worker.kernels import exact_cpu
from worker.loaders import resolve

# (K, N): the default model's wqkv, w13, w2 and head, and odd sizes
SHAPES = [(576, 960), (576, 3072), (1536, 576), (576, 49152), (100, 37), (256, 512)]


def weights(k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(512, k, generator=g), torch.randn(n, k, generator=g) * 0.05


@pytest.mark.parametrize("k,n", SHAPES)
def test_linear_row_alone_equals_row_in_a_launch_of_any_size(k, n):
    x, w = weights(k, n)
    counts = [*range(1, 10), 16, 17, 31, 64, 67] if n > 10_000 else ROW_COUNTS  # the head: costly
    assert counts_where_row_differs(lambda a: exact_cpu.linear(a, w), x, counts) == []


@pytest.mark.parametrize("k,n", SHAPES[:3])
def test_linear_row_keeps_its_bits_at_any_position_of_a_launch(k, n):
    x, w = weights(k, n, seed=1)
    for m in (5, 16, 67):
        assert positions_where_row_differs(lambda a: exact_cpu.linear(a, w), x, m) == []


def test_linear_with_bias_and_leading_dims_is_row_invariant():
    x, w = weights(96, 40)
    bias = torch.randn(40)
    alone = exact_cpu.linear(x[None, :1], w, bias)
    assert torch.equal(exact_cpu.linear(x[None, :33], w, bias)[:, :1], alone)
    torch.testing.assert_close(exact_cpu.linear(x, w, bias), F.linear(x, w, bias))


def test_linear_rows_do_not_depend_on_the_thread_count():
    # --workers N gives each worker cores / N threads
    x, w = weights(576, 960)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = exact_cpu.linear(x[:70], w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(exact_cpu.linear(x[:70], w), one)


def test_default_linear_does_differ_so_these_tests_can_see_a_difference():
    x, w = weights(576, 960)
    assert len(counts_where_row_differs(lambda a: F.linear(a, w), x)) > 60


def test_row_invariance_check_refuses_a_kernel_without_the_property(monkeypatch):
    monkeypatch.setattr(exact_cpu, "linear",  # one launch of whatever rows are given
                        lambda x, weight, bias=None: F.linear(x, weight, bias))
    with pytest.raises(ValueError, match="cannot be honoured"):
        exact_cpu.check_row_invariance(weights(576, 960)[1])


LENS = [300, 41, 7, 130]


def paged(seed: int, page: int = 16) -> PagedSequences:
    return PagedSequences(LENS, 9, 3, 64, page, seed, torch.float32, "cpu")


def test_attention_chunk_rows_equal_rows_attended_alone_across_split_boundaries():
    seqs = paged(0)
    chunks = split_chunks(exact_cpu.SPLIT, LENS[0])
    assert chunks_that_differ_from_rows(exact_cpu.paged_attention, seqs, 0, chunks) == []


def test_attention_does_not_depend_on_page_placement_or_page_size():
    rows = [(0, 250, 50), (1, 40, 1), (3, 0, 130)]
    ref = paged(0).attend(exact_cpu.paged_attention, rows)
    for seed, page in [(1, 16), (2, 4), (3, 1), (4, 64)]:
        out = paged(seed, page).attend(exact_cpu.paged_attention, rows)
        assert all(torch.equal(a, b) for a, b in zip(out, ref)), (seed, page)


def test_attention_decode_row_ignores_its_neighbours():
    seqs = paged(0)
    alone = seqs.attend(exact_cpu.paged_attention, [(1, 40, 1)])[0]
    for rows in ([(0, 299, 1), (1, 40, 1)], [(2, 6, 1), (1, 40, 1), (3, 129, 1)],
                 [(0, 200, 64), (1, 40, 1), (2, 0, 7)]):
        out = seqs.attend(exact_cpu.paged_attention, rows)
        assert torch.equal(out[rows.index((1, 40, 1))], alone), rows


def test_attention_matches_the_dense_reference():
    seqs = paged(0)
    out = seqs.attend(exact_cpu.paged_attention, [(0, 200, 100)])[0]
    torch.testing.assert_close(out, seqs.dense(0, 200, 100), rtol=1e-5, atol=1e-5)


def test_default_attention_does_differ_between_a_chunk_and_single_rows():
    seqs = paged(0)
    default = choose_attention(False, "cpu", 64)
    assert chunks_that_differ_from_rows(default, seqs, 0, [range(110, 150)]) != []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_stage_gives_a_prompt_the_same_bits_in_one_chunk_or_any_chunks(dtype):
    chunkings = [[1] * 40, [3, 17, 1, 19], [33, 7]]
    assert prompt_bits(True, chunkings, "cpu", dtype) == [True, True, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_prefill_leaves_the_same_kv_bits_in_its_pages_however_it_was_chunked(dtype):
    """What an exact-mode prefix cache hit relies on, checked on the KV itself."""
    chunkings = [[1] * 40, [3, 17, 1, 19], [16, 16, 8], [33, 7]]
    assert prompt_kv_bits(True, chunkings, "cpu", dtype) == [True] * 4


def test_default_stage_does_differ_row_by_row():
    # in float32; this CPU's default bfloat16 path happened to give equal bits here
    assert prompt_bits(False, [[1] * 40], "cpu", torch.float32) == [False]


def test_apply_exact_refuses_what_it_cannot_honour():
    stage = resolve("synthetic:tiny").load_stage(0, 1, torch.float64, "cpu")
    with pytest.raises(ValueError, match="float32, bfloat16 and float16"):
        apply_exact(stage, "cpu")
    with pytest.raises(ValueError, match="cpu and cuda"):
        apply_exact(resolve("synthetic:tiny").load_stage(0, 1, torch.float32, "cpu"), "mps")
