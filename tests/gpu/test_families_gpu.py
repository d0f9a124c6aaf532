"""Qwen3 and a mixture of experts on CUDA: a Qwen3 stage's prefill logits close to the same
weights' on the CPU in float32 (the step graphs capture its layers); an MoE layer's rows keep
their bits alone and beside 63 others in exact mode (bfloat16, the Triton matmul), and the step
graphs refuse MoE layers with the reason. Skipped without a GPU."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from worker.batch import build_meta  # noqa: E402
from worker.build import build_runner, load_stage, make_pool  # noqa: E402
from worker.step import run_eagerly  # noqa: E402

DEV = "cuda"


def prefill_logits(spec: str, device: str) -> torch.Tensor:
    stage = load_stage(spec, torch.float32, device)
    pool = make_pool(stage, 8, 16, device)
    meta = build_meta([0], [40], [list(range(8))], [True], 16, device)
    with torch.inference_mode():
        x = run_eagerly(stage, pool, meta, torch.arange(3, 43, device=device))
        return stage.logits(x).cpu()


@pytest.mark.parametrize("spec", ["synthetic:qwen3-tiny", "synthetic:moe-tiny"])
def test_a_stage_on_cuda_gives_the_cpus_logits(spec):
    torch.testing.assert_close(prefill_logits(spec, DEV), prefill_logits(spec, "cpu"),
                               rtol=1e-3, atol=1e-3)


def test_a_moe_layers_rows_keep_their_bits_beside_others_in_exact_mode():
    pytest.importorskip("triton")
    moe = load_stage("synthetic:moe-tiny", torch.bfloat16, DEV, exact=True).layers[0]
    x = torch.randn(64, moe.feed_forward.router.in_features,
                    generator=torch.Generator().manual_seed(0)).to(DEV, torch.bfloat16)
    with torch.inference_mode():
        crowd = moe.feed_forward(x)
        assert all(torch.equal(moe.feed_forward(x[i:i + 1])[0], crowd[i]) for i in range(64))


def test_the_step_graphs_capture_qwen3_and_refuse_moe_layers():
    pytest.importorskip("triton")
    dense = load_stage("synthetic:qwen3-tiny", torch.bfloat16, DEV)
    assert build_runner(dense, make_pool(dense, 64, 16, DEV), DEV, graphs=True).graphs
    moe = load_stage("synthetic:moe-tiny", torch.bfloat16, DEV)
    refused = []
    runner = build_runner(moe, make_pool(moe, 64, 16, DEV), DEV, graphs=True,
                          refused=refused.append)
    assert runner.graphs is None and "SparseMoE" in str(refused[0])
