"""How exact attention cuts a sequence's rows into blocks (`paged_triton.block_spans`)."""

import pytest

from worker.kernels.paged_triton import block_spans


@pytest.mark.parametrize("lo,hi", [(0, 1), (5, 6), (0, 4), (3, 7), (0, 5), (10, 26), (0, 33),
                                   (7, 300)])
def test_blocks_cover_the_rows_once_in_order_at_the_sizes_of_their_kind(lo, hi):
    spans = block_spans(lo, hi, 4, 16)
    rows = [r for first, n in spans for r in range(first, first + n)]
    assert rows == list(range(lo, hi))
    size = 4 if hi - lo <= 4 else 16  # a prompt's blocks are the larger
    assert all(n == size for _, n in spans[:-1]) and 0 < spans[-1][1] <= size


def test_a_decode_row_is_a_block_of_its_own_and_a_prompt_groups_its_tiles():
    assert block_spans(9, 10, 4, 16) == [(9, 1)]
    assert block_spans(0, 40, 4, 16) == [(0, 16), (16, 16), (32, 8)]
    assert block_spans(0, 40, 4, 4) == [(r, 4) for r in range(0, 40, 4)]
