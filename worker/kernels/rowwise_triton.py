"""The model's elementwise and per-row steps as one Triton launch each, for CUDA in every mode.

Eager PyTorch runs RoPE as some fourteen kernels a layer, SiLU-and-multiply as three and the
residual add beside RMSNorm as two; at decode sizes each launch costs more than its work (an
H200 decode step of `synthetic:llama-1b` at batch 1 spent 0.4 ms of its 1.6 ms of kernels in
them). Each kernel here is one program per row (a row's bits depend on that row alone, as exact
mode needs) and rounds where the eager path rounds: every intermediate the eager path stores in
the activations' dtype is rounded to it here too, so a kernel gives the eager path's bits.

- `rms_norm`: `worker.model.RMSNorm`'s arithmetic; one fixed reduction tree (torch's CUDA
  reduction picks its thread layout from the tensor's shape).
- `add_rms_norm`: the residual add, and RMSNorm of its result.
- `rope_qk`: q and k of a fused qkv projection rotated (`worker.rope.apply_rope`), in one pass.
- `silu_mul`: SiLU of the gate half times the up half of a fused gate/up projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import FUSION


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    # as RMSNorm: normalised in float32, cast to the activations' dtype, then times the weight
    h = _rounded(x * tl.rsqrt(tl.sum(x * x, axis=0) / N + eps), out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., dim] -> [..., dim], `worker.model.RMSNorm`'s arithmetic, one row per program."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0),
                                           rows.shape[1], eps,
                                           BLOCK=triton.next_power_of_2(rows.shape[1]), **FUSION)
    return out.reshape(x.shape)


@triton.jit
def _add_rms_norm_kernel(x_ptr, y_ptr, w_ptr, sum_ptr, out_ptr, stride_x, stride_y, N, eps,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    s = _rounded(x + y, sum_ptr.dtype.element_ty)  # the sum is stored before the norm
    tl.store(sum_ptr + row * N + cols, s.to(sum_ptr.dtype.element_ty), mask=mask)
    h = _rounded(s * tl.rsqrt(tl.sum(s * s, axis=0) / N + eps), out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y: [T, dim] -> (x + y, RMSNorm(x + y)), each [T, dim] in x's dtype."""
    t, n = x.shape
    if x.stride(1) != 1 or y.stride(1) != 1:
        x, y = x.contiguous(), y.contiguous()
    total = torch.empty(t, n, dtype=x.dtype, device=x.device)
    out = torch.empty_like(total)
    if t:
        _add_rms_norm_kernel[(t,)](x, y, weight, total, out, x.stride(0), y.stride(0), n, eps,
                                   BLOCK=triton.next_power_of_2(n), **FUSION)
    return total, out


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """float32 x rounded to `dtype` (to nearest even) and back: what a product the eager path
    stores in the activations' dtype holds. Through the conversion instruction itself, which
    the compiler cannot fold away as it can a `.to(dtype).to(tl.float32)` pair (measured: the
    eager bits were lost that way)."""
    if dtype == tl.bfloat16:
        y = tl.inline_asm_elementwise("cvt.rn.bf16.f32 $0, $1;", "=h,r", [x],
                                      dtype=tl.bfloat16, is_pure=True, pack=1)
    elif dtype == tl.float16:
        y = tl.inline_asm_elementwise("cvt.rn.f16.f32 $0, $1;", "=h,r", [x],
                                      dtype=tl.float16, is_pure=True, pack=1)
    else:
        y = x
    return y.to(tl.float32)


@triton.jit
def _rope_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, stride_x, stride_c,
                 H: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr,
                 HEADS: tl.constexpr):
    # One row: its H query heads and KVH key heads (the first H + KVH heads of the row), each
    # [x1 | x2] -> [x1 cos - x2 sin | x2 cos + x1 sin], every product rounded to the dtype first
    # as the eager path stores it
    t = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, HEADS)[:, None]
    j = tl.arange(0, HALF)[None, :]
    mask = head < H + KVH
    src = qkv_ptr + t * stride_x + head * (2 * HALF) + j
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    c = tl.load(cos_ptr + t * stride_c + j).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_c + j).to(tl.float32)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    a, b = _rounded(x1 * c, dt), _rounded(x2 * s, dt)
    e, f = _rounded(x2 * c, dt), _rounded(x1 * s, dt)
    o1, o2 = (a - b).to(dt), (e + f).to(dt)
    is_q = head < H
    q_dst = q_ptr + t * (H * 2 * HALF) + head * (2 * HALF) + j
    tl.store(q_dst, o1, mask=is_q)
    tl.store(q_dst + HALF, o2, mask=is_q)
    is_k = mask & (head >= H)
    k_dst = k_ptr + t * (KVH * 2 * HALF) + (head - H) * (2 * HALF) + j
    tl.store(k_dst, o1, mask=is_k)
    tl.store(k_dst + HALF, o2, mask=is_k)


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
            head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv: [T, (heads + 2 kv_heads) * head_dim], a fused projection's output; cos, sin:
    [T, 1, head_dim / 2] (`worker.rope.Rope`) -> q [T, heads, D] and k [T, kv_heads, D] rotated
    (new tensors) and v [T, kv_heads, D] (a view of qkv). head_dim a power of two."""
    t = qkv.shape[0]
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    q = torch.empty(t, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(t, kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    cos, sin = cos.reshape(t, -1), sin.reshape(t, -1)
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    if t:
        _rope_kernel[(t,)](qkv, cos, sin, q, k, qkv.stride(0), cos.stride(0), H=heads,
                           KVH=kv_heads, HALF=head_dim // 2,
                           HEADS=triton.next_power_of_2(heads + kv_heads), **FUSION)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(t, kv_heads, head_dim)
    return q, k, v


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + F + cols, mask=mask, other=0.0)
    dt = g.dtype
    g = g.to(tl.float32)
    silu = _rounded(g / (1.0 + tl.exp(-g)), dt)  # F.silu's result, stored
    tl.store(out_ptr + row * F + cols, (silu * u.to(tl.float32)).to(dt), mask=mask)


SILU_BLOCK = 2048


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2F], gate columns then up columns -> silu(gate) * up: [T, F]."""
    t, f2 = x.shape
    f = f2 // 2
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(t, f, dtype=x.dtype, device=x.device)
    if t:
        _silu_mul_kernel[(t, triton.cdiv(f, SILU_BLOCK))](x, out, x.stride(0), f,
                                                           BLOCK=SILU_BLOCK, **FUSION)
    return out
