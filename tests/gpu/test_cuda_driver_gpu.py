"""The CUDA calls the staging ring and the step graphs make (through CuPy): copies both ways
land the bytes, events order one stream after another and time it, a failed call raises with
the runtime's name for the error, and a transport refuses a copy it cannot make in one piece.
Skipped without a GPU."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from worker import cuda_driver as cuda  # noqa: E402
from worker.kv.transport import CudaTransport  # noqa: E402


def test_copies_land_the_bytes_both_ways():
    stream = torch.cuda.Stream()
    src = torch.randint(0, 1 << 30, (1 << 16,), dtype=torch.int32).pin_memory()
    dev = torch.zeros_like(src, device="cuda")
    back = torch.zeros_like(src).pin_memory()
    done = cuda.Event()
    h = stream.cuda_stream
    torch.cuda.synchronize()
    cuda.copy_async(dev.data_ptr(), src.data_ptr(), src.nbytes, h, False, True)
    cuda.copy_async(back.data_ptr(), dev.data_ptr(), dev.nbytes, h, True, False)
    done.record(h)
    done.synchronize()
    assert done.query()
    assert torch.equal(back, src)
    with pytest.raises(ValueError):
        cuda.copy_async(back.data_ptr(), src.data_ptr(), src.nbytes, h, True, True)


def test_a_stream_waits_for_an_event_recorded_on_another():
    """The compute stream is held up by a long kernel; a copy on the transfer stream that waits
    for an event recorded after that kernel sees its result, and the timing events measure
    the hold-up."""
    compute = torch.cuda.current_stream()
    transfer = torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    out = torch.empty(x.shape, dtype=x.dtype).pin_memory()
    ready = cuda.Event()
    start, end = cuda.Event(timing=True), cuda.Event(timing=True)
    start.record(compute.cuda_stream)
    torch.cuda._sleep(100_000_000)  # tens of milliseconds
    x.fill_(7.0)
    ready.record(compute.cuda_stream)
    end.record(compute.cuda_stream)
    cuda.wait_event(transfer.cuda_stream, ready)
    cuda.copy_async(out.data_ptr(), x.data_ptr(), x.nbytes, transfer.cuda_stream, True, False)
    transfer.synchronize()
    assert bool((out == 7.0).all())
    assert start.elapsed_ms(end) > 1.0


def test_a_failed_call_raises_with_the_runtimes_name():
    with pytest.raises(cuda.CudaError, match="CUDA call failed: cudaErrorInvalid"):
        cuda.launch_graph(0, torch.cuda.current_stream().cuda_stream)


def test_a_transport_refuses_a_copy_it_cannot_make_in_one_piece():
    t = CudaTransport("cuda")
    dst = torch.zeros(4, 4, device="cuda")
    src = torch.ones(4, 8).pin_memory()[:, :4]  # strided
    with pytest.raises(ValueError, match="contiguous"):
        t.copy([(dst, src)])
    t.copy([(dst, src.contiguous())])
    t.synchronize()
    assert bool((dst == 1).all())



def test_uploads_land_whole_however_many_are_in_flight():
    """Uploads through the pinned ring while the stream is held up: more of them than the ring
    has buffers, so a buffer is written again only once the kernel that read it has run."""
    from worker import uploads
    from worker.uploads import SLOTS, upload
    uploads._uploads.clear()
    with torch.inference_mode():  # buffers made here are written outside it below
        assert upload(torch.arange(5), torch.device("cuda")).tolist() == list(range(5))
    g = torch.Generator().manual_seed(0)
    sources = [torch.randint(-(1 << 62), 1 << 62, (n,), generator=g, dtype=torch.int64)
               for n in [1, 7, 300, 5000, 1, 2048] * SLOTS]
    torch.cuda._sleep(100_000_000)
    outs = [upload(s.clone(), torch.device("cuda")) for s in sources]
    assert all(torch.equal(o.cpu(), s) for o, s in zip(outs, sources, strict=True))
    assert upload(torch.empty(0, dtype=torch.int64), torch.device("cuda")).numel() == 0
