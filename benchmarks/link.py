"""The measured link: pinned host <-> device copy bandwidth (or host memcpy on the CPU).

Every transfer number a benchmark reports is set against this, measured in the same run."""

from __future__ import annotations

import time

import torch

from .report import Spread


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_bandwidth(device: torch.device, direction: str, nbytes: int = 1 << 30,
                     repeats: int = 5) -> Spread:
    """Bytes/s of one large copy host->device (`"h2d"`) or device->host (`"d2h"`)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.fill_(1)
    dev.fill_(2)
    src, dst = (host, dev) if direction == "h2d" else (dev, host)
    samples = []
    for _ in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        samples.append(nbytes / (time.perf_counter() - t0))
    return Spread.of(samples[1:])  # the first copy pays for mapping and warm-up
