"""The attention scratch every captured step of a worker shares (`worker.kernels.Scratch`)."""

import torch

from worker.kernels import Scratch, states_bytes


def test_views_of_later_graphs_share_one_buffer_and_a_larger_need_gets_a_larger_one():
    scratch = Scratch("cpu")
    small = scratch.views((2, 3), (2, 3), (2, 3, 4))
    assert [tuple(v.shape) for v in small] == [(2, 3), (2, 3), (2, 3, 4)]
    assert all(v.dtype == torch.float32 for v in small)
    # the views of one call do not overlap, and fill the front of the buffer in order
    starts = [v.data_ptr() for v in small]
    assert starts == sorted(starts) and starts[1] - starts[0] == 6 * 4
    same = scratch.views((4, 5))  # fits: the same memory
    assert same[0].data_ptr() == small[0].data_ptr()
    first = scratch.buffer
    large = scratch.views((100,), (3,))
    assert scratch.buffer is not first and scratch.buffer.numel() == 103
    assert large[0].data_ptr() == scratch.buffer.data_ptr()
    assert first.numel() == 36  # the earlier graphs' buffer is left as it was
    scratch.views((104,))  # just past it: at least twice, so growth stays geometric
    assert scratch.buffer.numel() == 206


def test_softmax_states_are_maxima_sums_and_outputs_of_the_bytes_counted_for_them():
    scratch = Scratch("cpu")
    m, l_sum, o = scratch.states((3, 4, 5), 8)
    assert (m.shape, l_sum.shape, o.shape) == ((3, 4, 5), (3, 4, 5), (3, 4, 5, 8))
    assert states_bytes((3, 4, 5), 8) == sum(t.numel() * t.element_size() for t in (m, l_sum, o))
