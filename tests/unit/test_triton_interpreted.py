"""The CUDA kernels' logic on the CPU: each Triton kernel run by Triton's interpreter
(TRITON_INTERPRET=1) on CPU tensors in float32, against PyTorch. What a GPU adds (the bits of
bfloat16 products, speed) is `tests/gpu`'s; this catches a wrong index, mask, tile walk or merge
on a machine without one, where GPU time is scarce.

Each check runs in a process of its own: the interpreter is chosen when a kernel is decorated, so
it must be on before the kernel modules are imported, and off in a process that runs
`tests/gpu`. The interpreter runs a launch's programs one after another, so of the programs that
count themselves finished (`kernels.launch_counts`) the last in that order adds the results.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from exactness.invariance import PagedSequences, chunks_that_differ_from_rows

from worker.batch import build_meta
from worker.kernels import Scratch, launch_counts
from worker.rope import Rope, apply_rope

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
DT = torch.float32
HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 2, 16, 16
LENS = [150, 7, 40, 300]


def interpreted():
    """The kernel modules, their device queries answered for a CPU (an H100's SM count)."""
    from worker import kernels
    from worker.kernels import flash_triton, matmul_triton, paged_triton, rowwise_triton

    for module in (kernels, paged_triton, matmul_triton):
        module.sm_count = lambda device: 132
    return paged_triton, flash_triton, matmul_triton, rowwise_triton


def sequences() -> PagedSequences:
    return PagedSequences(LENS, HEADS, KV_HEADS, HEAD_DIM, PAGE, 0, DT, "cpu")


def assert_dense(attend, rows) -> None:
    seqs = sequences()
    for out, row in zip(seqs.attend(attend, rows), rows, strict=True):
        torch.testing.assert_close(out, seqs.dense(*row), rtol=1e-4, atol=1e-4)


# a step of prompt chunks (from the start and mid-sequence, across 64-key tiles, shorter and
# longer than a block) and decode rows
MIXED = [(0, 0, 150), (1, 6, 1), (2, 3, 37), (3, 255, 1), (3, 64, 3)]
DECODE = [(0, 149, 1), (1, 6, 1), (2, 39, 1), (3, 299, 1)]


def check_exact_attention() -> None:
    paged, *_ = interpreted()
    assert_dense(paged.paged_attention, MIXED)
    paged.MERGE_CHUNK = 2  # a spread row's states merged over several chunks
    assert_dense(paged.paged_attention, DECODE)  # few rows: their tiles spread, then merged
    # a chunk's rows are the rows attended one at a time, spread (the interpreter's float32
    # products are a row's own, as a GPU's tensor-core products are)
    seqs, chunks = sequences(), [range(0, 40), range(63, 66), range(125, 161)]
    assert chunks_that_differ_from_rows(paged.paged_attention, seqs, 3, chunks) == []
    # prompts' tiles grouped, as launches of GROUP_FROM_ROWS rows group them: the same bits
    plain = [seqs.attend(paged.paged_attention, [(3, c.start, len(c))])[0] for c in chunks]
    paged.GROUP_FROM_ROWS = 0
    assert_dense(paged.paged_attention, MIXED)
    grouped = [seqs.attend(paged.paged_attention, [(3, c.start, len(c))])[0] for c in chunks]
    assert all(torch.equal(a, b) for a, b in zip(plain, grouped, strict=True))
    assert not launch_counts(torch.device("cpu")).any()  # left at zero for the next launch


def check_default_attention() -> None:
    _, flash, *_ = interpreted()
    assert_dense(flash.paged_attention, MIXED)  # the flash kernel
    assert_dense(flash.paged_attention, DECODE)  # the split kernels and their combine
    # long splits: fewer splits than tiles, a combine over several chunks of them
    seqs = sequences()
    q = torch.cat([seqs.q[3][299:300], seqs.q[0][149:150]])
    meta = build_meta([299, 149], [1, 1], [seqs.tables[3], seqs.tables[0]], [True, True], PAGE,
                      "cpu")
    block_p = flash.decode_block(HEADS, KV_HEADS)
    blocks, tables = flash.paged.step_blocks(meta, block_p)
    for split in (64, 128, 256):
        out = torch.empty_like(q)
        scratch = Scratch("cpu").states((2, HEADS, -(-300 // split)), HEAD_DIM)
        flash.launch_decode(q, seqs.k_pool, seqs.v_pool, tables, flash.paged.zero_base("cpu"),
                            blocks, meta.positions, scratch, out, HEAD_DIM ** -0.5, split,
                            block_p)
        torch.testing.assert_close(out[:1], seqs.dense(3, 299, 1), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out[1:], seqs.dense(0, 149, 1), rtol=1e-4, atol=1e-4)


def check_write_rows() -> None:
    paged, *_ = interpreted()
    g = torch.Generator().manual_seed(0)
    k_pages, v_pages = torch.zeros(2, 7, 4, KV_HEADS, HEAD_DIM)  # page 6: the spare
    k, v = torch.randn(2, 5, KV_HEADS, HEAD_DIM, generator=g)
    pages, offsets = torch.tensor([0, 0, 3, 5, 2]), torch.tensor([0, 3, 1, 2, 3])
    # two rows carried, the rest of the step's rows padding on the spare page
    carry = torch.randn(2, 5, KV_HEADS, HEAD_DIM, generator=g)
    carry_pages, carry_offsets = torch.tensor([1, 4, 6, 6, 6]), torch.tensor([2, 0, 0, 0, 0])
    paged.write_rows(k_pages, v_pages, k, v, pages, offsets,
                     (carry, carry_pages, carry_offsets))
    want_k, want_v = torch.zeros_like(k_pages), torch.zeros_like(v_pages)
    want_k[pages, offsets], want_v[pages, offsets] = k, v
    want_k[carry_pages[:2], carry_offsets[:2]] = carry[0, :2]
    want_v[carry_pages[:2], carry_offsets[:2]] = carry[1, :2]
    assert torch.equal(k_pages[:6], want_k[:6]) and torch.equal(v_pages[:6], want_v[:6])


def check_exact_matmul() -> None:
    *_, matmul, _ = interpreted()
    g = torch.Generator().manual_seed(0)
    for k, n in [(576, 960), (1536, 100), (100, 37)]:  # split (spread, then summed) and not
        x, w = torch.randn(70, k, generator=g), torch.randn(n, k, generator=g) * k ** -0.5
        out = matmul.linear(x, w)
        torch.testing.assert_close(out, x @ w.T, rtol=1e-4, atol=1e-4)
        # a row keeps its bits in a launch of any size
        assert torch.equal(matmul.linear(x[5:6], w), out[5:6])
        assert torch.equal(matmul.linear(x[3:9], w), out[3:9])
    # 4,224 rows fill the GPU's SMs with row tiles, so each program sums its tile's three splits;
    # a launch of two rows spreads them and the last program adds them, one of 70 a second
    # kernel: the same bits
    x, w = torch.randn(4224, 1536, generator=g), torch.randn(100, 1536, generator=g) * 1536 ** -0.5
    out = matmul.linear(x, w)
    assert torch.equal(out[5:7], matmul.linear(x[5:7], w))
    assert torch.equal(out[:70], matmul.linear(x[:70], w))
    assert not launch_counts(torch.device("cpu")).any()  # left at zero for the next launch


def check_rowwise() -> None:
    *_, rowwise = interpreted()
    g = torch.Generator().manual_seed(0)
    x, y, w = torch.randn(9, 300, generator=g), torch.randn(9, 300, generator=g), \
        torch.randn(300, generator=g)
    eager = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(rowwise.rms_norm(x, w, 1e-5), eager, rtol=1e-5, atol=1e-5)
    total, normed = rowwise.add_rms_norm(x, y, w, 1e-5)
    assert torch.equal(total, x + y)
    torch.testing.assert_close(normed, rowwise.rms_norm(x + y, w, 1e-5), rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(9, 2 * 3000, generator=g)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(rowwise.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5,
                               atol=1e-5)
    t, heads, kv_heads, d = 11, 6, 2, 32
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    cos, sin = Rope(d, 10000.0, None, 1024)(torch.randint(0, 1024, (t,), generator=g), DT)
    q, k, v = rowwise.rope_qk(qkv, cos, sin, heads, kv_heads, d)
    q0, k0, v0 = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
    torch.testing.assert_close(q, apply_rope(q0.view(t, heads, d), cos, sin))
    torch.testing.assert_close(k, apply_rope(k0.view(t, kv_heads, d), cos, sin))
    assert torch.equal(v, v0.view(t, kv_heads, d))


CHECKS = {name[len("check_"):]: fn for name, fn in globals().items()
          if name.startswith("check_")}


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_kernel_logic_in_the_triton_interpreter(check):
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    run = subprocess.run([sys.executable, __file__, check], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert run.stdout.strip() == f"{check}: ok"


if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
    print(f"{sys.argv[1]}: ok")
