"""Exact mode's CUDA kernels compiled for a Hopper GPU (sm_90: the H100 and H200) on a machine
without one: Triton's front end, its lowering and ptxas, for every variant a worker launches.
What the interpreter (`test_triton_interpreted.py`) cannot catch, a kernel that does not compile
for the GPU, fails here rather than on the first GPU that runs it; what the compiled kernel
computes is `tests/gpu`'s."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from worker.kernels import FUSION, matmul_triton, paged_triton  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def compiled(kernel, pointers: dict[str, str], constexprs: dict, **options) -> str:
    """The kernel's PTX for HOPPER: arguments not in `pointers` (a type each) nor in
    `constexprs` are 32-bit integers."""
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32")
                 for name in kernel.arg_names}
    built = triton.compile(ASTSource(kernel, signature, constexprs), target=HOPPER,
                           options=options)
    assert built.asm["cubin"], "ptxas made no binary"
    return built.asm["ptx"]


ATTENTION_POINTERS = {
    **{name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")},
    **{name: "*i64" for name in ("tables_ptr", "base_ptr", "blocks_ptr", "pos_ptr")},
    **{name: "*fp32" for name in ("m_ptr", "l_ptr", "o_ptr")},
    "counts_ptr": "*i32", "scale": "fp32",
}


@pytest.mark.parametrize("spread,grouped", [(False, False), (True, False), (False, True)],
                         ids=["walked", "spread", "grouped"])
def test_exact_attention_compiles_for_hopper(spread, grouped):
    # llama-1b's heads: 32 query heads over 8 KV heads of 64
    ptx = compiled(paged_triton._attention_kernel, ATTENTION_POINTERS,
                   dict(H=32, REP=4, REP_P2=4, BLOCK_P=paged_triton.block_rows(32, 8), D=64,
                        TILE=paged_triton.TILE, SPREAD=spread, GROUPED=grouped,
                        CHUNK=paged_triton.MERGE_CHUNK),
                   num_warps=paged_triton.WARPS, **paged_triton.NO_FUSION)
    # a spread launch's programs count themselves (one atomic); a walked one's do not
    assert ptx.count("atom.") == (1 if spread else 0)


@pytest.mark.parametrize("spread,sum_last", [(False, False), (True, False), (True, True)],
                         ids=["in-program", "sum-kernel", "last-program"])
def test_exact_matmul_compiles_for_hopper(spread, sum_last):
    block_n, warps, stages = matmul_triton.SMALL_LAUNCH
    ptx = compiled(matmul_triton._linear_kernel,
                   {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "parts_ptr": "*fp32",
                    "counts_ptr": "*i32"},
                   dict(SPLITS=4, SPREAD=spread, SUM_LAST=sum_last,
                        BLOCK_M=matmul_triton.BLOCK_M, BLOCK_N=block_n,
                        BLOCK_K=matmul_triton.BLOCK_K),
                   num_warps=warps, num_stages=stages, **FUSION)
    assert ptx.count("atom.") == (1 if sum_last else 0)
    if not sum_last and spread:
        compiled(matmul_triton._sum_splits_kernel, {"parts_ptr": "*fp32", "out_ptr": "*bf16"},
                 dict(SPLITS=4, BLOCK=1024), **FUSION)
