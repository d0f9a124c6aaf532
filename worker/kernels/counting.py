"""What the Triton kernels share to let the last of an output's programs add their partial
results in the same launch (`launch_counts` holds the counts). Imported on CUDA only, with the
kernels that use it."""

import triton
import triton.language as tl


@triton.jit
def last_to_finish(count_ptr, n):
    # Whether this program is the last of the n that count themselves at count_ptr (a
    # `launch_counts` slot, zero before the launch): their stores are then visible to it (each
    # program's threads stored before its barrier, its atomic releases them at the GPU's scope,
    # the last one's acquires them), and it sets the count back to zero for the next launch (the
    # others have counted)
    tl.debug_barrier()
    last = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == n - 1
    if last:
        tl.store(count_ptr, 0)
    return last
