"""A step's small host-to-device uploads (positions, page tables, token ids) without a copy engine.

A CUDA device moves host memory with its copy engines, and an engine serves the copies of every
stream in the order they became ready. With host KV, a staging ring's deliveries (megabytes a
layer) stand there ready whenever the compute stream finishes a step, and the next step's few
hundred bytes of metadata, copied on the compute stream, wait until they have all landed: on an
H200 with llama-1b at 4k keys and depth 4, 0.6-0.8 ms a step with the compute stream idle
(docs/kv-pipelining.md).

So an upload is written into pinned host memory and read from there by a kernel on the current
stream, through the device's mapping of that memory (its address is the same on both sides, as
unified addressing gives every pinned allocation): a few hundred bytes over the link, no copy
engine. The pinned buffers are a ring; each is written again only once the kernel that read it
last has run (an event, normally long complete).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cuda_driver

SLOTS = 8  # uploads in flight before the host waits for the oldest: two or three steps' worth
MIN_ELEMENTS = 1 << 10


class _Mapped:
    """A pinned host buffer as a CUDA array, for `torch.as_tensor`."""

    def __init__(self, host: torch.Tensor):
        self.__cuda_array_interface__ = {"shape": (host.numel(),), "typestr": "<i8",
                                         "data": (host.data_ptr(), False), "version": 3}


@dataclass
class _Slot:
    host: torch.Tensor  # pinned int64
    mapped: torch.Tensor  # the same memory, as a CUDA tensor
    read: cuda_driver.Event  # recorded after the kernel that read it last


class Uploads:
    """int64 uploads to one CUDA device through a ring of pinned, mapped buffers."""

    def __init__(self, device: torch.device):
        self.device = device
        self.slots: list[_Slot | None] = [None] * SLOTS
        self.next = 0

    def __call__(self, flat: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """flat: a host int64 tensor -> the same on the device (enqueued on the current
        stream; the host does not wait for it), in `out` where given (int64, flat's size)."""
        n = flat.numel()
        if not n:
            return torch.empty(0, dtype=torch.int64, device=self.device) if out is None else out
        i, self.next = self.next, (self.next + 1) % SLOTS
        slot = self.slots[i]
        if slot is not None:
            slot.read.synchronize()
        if slot is None or slot.host.numel() < n:
            slot = self.slots[i] = self._slot(max(MIN_ELEMENTS, 1 << (n - 1).bit_length()))
        slot.host[:n].copy_(flat)
        if out is None:
            out = torch.empty(n, dtype=torch.int64, device=self.device)
        # an elementwise kernel, not `copy_`: a copy between CUDA tensors is a copy engine's
        torch.add(slot.mapped[:n], 0, out=out)
        slot.read.record(torch.cuda.current_stream(self.device).cuda_stream)
        return out

    def _slot(self, size: int) -> _Slot:
        # not inference tensors, whatever mode the first upload runs in: the later ones write
        # into them in any mode
        with torch.inference_mode(False):
            host = torch.empty(size, dtype=torch.int64, pin_memory=True)
            mapped = torch.as_tensor(_Mapped(host), device=self.device)
        return _Slot(host, mapped, cuda_driver.Event())


_uploads: dict[torch.device, Uploads] = {}


def upload(flat: torch.Tensor, device: torch.device, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """flat (host int64) on CUDA device `device` (in `out` where given), through its
    `Uploads`."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    u = _uploads.get(device)
    if u is None:
        u = _uploads[device] = Uploads(device)
    return u(flat, out)
