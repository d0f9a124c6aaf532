"""What every worker of a cluster is built from (`WorkerConfig`, carried in ASSIGN), the domains
of its knobs, and what the engine core derives from them (`steps_ahead`)."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

DTYPES = ("auto", "float32", "bfloat16", "float16")
MAX_PAGES = 1 << 24  # KV pages or park slots of one pool
KV_MODES = ("device", "host")
OVERLAP = ("auto", "on", "off")
MAX_BUSY_POLL = 3600.0  # seconds
# Steps the engine core plans ahead of the one a worker that is the whole pipeline runs
# (worker/overlap.py): beside it, this many more are in flight.
STEPS_AHEAD = 2


def steps_ahead(overlap: str, device: str, kv: str) -> int:
    """How many steps the engine core keeps in flight beside the one a worker that is the whole
    pipeline runs (`--overlap`: auto is on for a CUDA device): `STEPS_AHEAD` on a CUDA device
    with device KV; one on a CPU, whose steps are synchronous, and with host KV, whose staging
    ring was measured with one; 0 without overlap."""
    cuda = str(device).startswith("cuda")
    if overlap == "off" or (overlap == "auto" and not cuda):
        return 0
    return STEPS_AHEAD if cuda and kv == "device" else 1


class WorkerConfig(msgspec.Struct, forbid_unknown_fields=True):
    """What every worker of a cluster is built from, carried whole from the CLI (one flag per
    field, of the same name: `coordinator/cli.py`) through the coordinator's config and ASSIGN
    to the worker's composition root (`worker/build.py`). A new worker knob is a field here and
    its flag there. The coordinator reads the ones it shares (pages, batch rows, exact, busy
    polling)."""

    model: Annotated[str, Meta(max_length=4096)] = "smollm2-135m"
    dtype: Annotated[str, Meta(max_length=32)] = "auto"
    kv: Annotated[str, Meta(max_length=16)] = "device"  # where the KV pages live: device, host
    pipeline_depth: Annotated[int, Meta(ge=0, le=64)] = 1  # staging ring slots delivered ahead
    ring_budget_mib: Annotated[int, Meta(ge=0, le=1 << 31)] = 512  # ring's device memory; 0: no cap
    exact: bool = False
    cuda_graphs: bool = True  # CUDA steps replayed from graphs (worker/cuda_graphs.py)
    overlap: Annotated[str, Meta(max_length=8)] = "auto"  # steps enqueued ahead (auto: on for CUDA)
    # seconds a process polls in a loop after a message before it sleeps (None: auto, 1 s on
    # CUDA, else 0; protocol/busy_poll.py), each worker by its own device; the engine core and
    # the frontends follow it too, auto by the devices the workers report
    busy_poll: Annotated[float, Meta(ge=0.0, le=MAX_BUSY_POLL)] | None = None
    page_size: Annotated[int, Meta(ge=1, le=4096)] = 16
    kv_pages: Annotated[int, Meta(ge=1, le=1 << 31)] = 1024
    park_pages: Annotated[int, Meta(ge=0, le=1 << 31)] | None = None  # park slots; None: kv_pages
    max_batch_seqs: Annotated[int, Meta(ge=1, le=1 << 20)] = 64
    max_batch_tokens: Annotated[int, Meta(ge=1, le=1 << 24)] = 512  # graphs are captured up to it
    transport_delay_ms: Annotated[float, Meta(ge=0.0, le=10_000.0)] = 0.0  # tests: copies delayed

    def __post_init__(self) -> None:
        if self.park_pages is None:
            self.park_pages = self.kv_pages

    def validate(self) -> None:
        """ValueError naming the flag of the first knob that is out of its domain."""
        for flag, value, domain in [("--dtype", self.dtype, DTYPES), ("--kv", self.kv, KV_MODES),
                                    ("--overlap", self.overlap, OVERLAP)]:
            if value not in domain:
                raise ValueError(f"{flag} must be one of {', '.join(domain)}, not {value!r}")
        for flag, value, lo in [("--pipeline-depth", self.pipeline_depth, 0),
                                ("--ring-budget-mib", self.ring_budget_mib, 0),
                                ("--page-size", self.page_size, 1),
                                ("--kv-pages", self.kv_pages, 1),
                                ("--park-pages", self.park_pages, 0),
                                ("--max-batch-seqs", self.max_batch_seqs, 1),
                                ("--max-batch-tokens", self.max_batch_tokens, 1)]:
            if value < lo:
                raise ValueError(f"{flag} must be at least {lo}, not {value}")
        if self.busy_poll is not None and not 0 <= self.busy_poll <= MAX_BUSY_POLL:
            raise ValueError(f"--busy-poll must be auto or 0 to {MAX_BUSY_POLL:g} seconds, not "
                             f"{self.busy_poll}")
        if self.page_size > 4096:
            raise ValueError(f"--page-size must be at most 4096, not {self.page_size}")
        for flag, value in [("--kv-pages", self.kv_pages), ("--park-pages", self.park_pages)]:
            if value > MAX_PAGES:
                raise ValueError(f"{flag} must be at most {MAX_PAGES} (the coordinator keeps "
                                 f"about 50 bytes of bookkeeping a page), not {value}")
