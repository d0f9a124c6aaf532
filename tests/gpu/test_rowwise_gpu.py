"""The one-launch row-wise kernels (worker/kernels/rowwise_triton.py) against the eager steps
they replace, on CUDA: the same bits where the eager path's roundings are reproduced (RoPE, the
residual add and RMSNorm), within rounding for SiLU (Triton's exp is not torch's). Skipped
without a GPU."""

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from worker.kernels import rowwise_triton  # noqa: E402
from worker.model import ModelArgs, build_stage  # noqa: E402
from worker.rope import Rope, apply_rope  # noqa: E402

DEV = "cuda"


def draw(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEV, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 64), (9, 3, 64), (32, 8, 128)])
def test_rope_gives_the_eager_rotation_bit_for_bit(dtype, heads, kv_heads, head_dim):
    t = 37
    qkv = draw(t, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    rope = Rope(head_dim, 500000.0, None, 8192).to(DEV)
    cos, sin = rope(torch.randint(0, 8192, (t,), device=DEV), dtype)
    q, k, v = rowwise_triton.rope_qk(qkv, cos, sin, heads, kv_heads, head_dim)
    q0, k0, v0 = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    assert torch.equal(q, apply_rope(q0.view(t, heads, head_dim), cos, sin))
    assert torch.equal(k, apply_rope(k0.view(t, kv_heads, head_dim), cos, sin))
    assert torch.equal(v, v0.view(t, kv_heads, head_dim))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_add_gives_the_eager_sum_and_the_norm_kernels_bits(dtype):
    x, y = draw(300, 2048, dtype=dtype), draw(300, 2048, dtype=dtype, seed=1)
    w = draw(2048, dtype=dtype, seed=2)
    total, normed = rowwise_triton.add_rms_norm(x, y, w, 1e-5)
    h = x + y
    assert torch.equal(total, h)
    # the norm's sum of squares is reduced in another order than torch's `mean`
    assert torch.equal(normed, rowwise_triton.rms_norm(h, w, 1e-5))
    hf = h.float()
    eager = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    torch.testing.assert_close(normed, eager, rtol=2e-2, atol=2e-2)


def test_silu_mul_matches_eager_within_rounding_and_keeps_a_rows_bits_alone():
    x = draw(300, 2 * 8192, dtype=torch.bfloat16)
    gate, up = x.chunk(2, dim=-1)
    out = rowwise_triton.silu_mul(x)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-2, atol=1e-2)
    assert torch.equal(rowwise_triton.silu_mul(x[7:8]), out[7:8])


class Given:
    """A step whose attention returns `attn` [T, H, D], keeping the q, k, v it was given."""

    def __init__(self, attn: torch.Tensor):
        self.attn, self.qkv = attn, ()

    def attend(self, layer: int, q, k, v) -> torch.Tensor:
        self.qkv = (q, k, v)
        return self.attn


def test_a_stage_on_cuda_gives_the_eager_modules_hidden_states():
    """The whole layer with the kernels (the modules choose them on CUDA) against the same
    layer's modules on the CPU in float32: the kernels compute the same function."""
    a = ModelArgs(n_layers=2, dim=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
                  vocab_size=512, rope_theta=10000.0, rms_eps=1e-5, max_context=1024)
    g = torch.Generator().manual_seed(3)
    shapes = {"attention_norm.weight": (a.dim,),
              "attention.wqkv.weight": (a.q_dim + 2 * a.kv_dim, a.dim),
              "attention.wo.weight": (a.dim, a.q_dim), "ffn_norm.weight": (a.dim,),
              "feed_forward.w13.weight": (2 * a.ffn_dim, a.dim),
              "feed_forward.w2.weight": (a.dim, a.ffn_dim)}
    tensors = {f"layers.{i}.{k}": torch.randn(*s, generator=g) * 0.05
               for i in range(2) for k, s in shapes.items()}
    cpu = build_stage(a, 0, 2, {"embed.weight": torch.randn(a.vocab_size, a.dim, generator=g),
                                "norm.weight": torch.ones(a.dim),
                                "output.weight": torch.randn(a.vocab_size, a.dim, generator=g),
                                **tensors})
    gpu = build_stage(a, 0, 2, {k: v.to(DEV) for k, v in cpu.state_dict().items()
                                if k not in ("rope.cos", "rope.sin")})
    x = torch.randn(50, a.dim, generator=g)
    pos = torch.arange(50)
    cos, sin = cpu.rope(pos, torch.float32)
    gcos, gsin = gpu.rope(pos.to(DEV), torch.float32)
    for cl, gl in zip(cpu.layers, gpu.layers, strict=True):
        attn = torch.randn(50, a.n_heads, a.head_dim, generator=g)
        c, gs = Given(attn), Given(attn.to(DEV))
        out, gout = cl(x, cos, sin, c, 0), gl(x.to(DEV), gcos, gsin, gs, 0)
        for ours, ref in zip(gs.qkv, c.qkv, strict=True):
            torch.testing.assert_close(ours.cpu(), ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gout.cpu(), out, rtol=1e-4, atol=1e-4)
