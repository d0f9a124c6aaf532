"""The worker's composition root: from a `WorkerConfig` and its place in the pipeline, the model
stage, the KV pool, the park store, the step graphs and the runner over them. Nothing else in
the worker reads the config; nothing here touches a socket."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from protocol.busy_poll import busy_seconds
from protocol.messages import ModelInfo
from protocol.worker_config import WorkerConfig, steps_ahead

from .attention import choose_attention
from .cuda_graphs import StepGraphs
from .exact import apply_exact
from .kv.device_pool import KVPool
from .kv.host_pool import HostKVPool
from .kv.park_store import ParkStore
from .kv.transport import make_transport
from .loaders import ModelSource, check_split, resolve
from .metrics import WorkerMetrics
from .runner import ModelRunner

log = logging.getLogger("siding.worker")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def layer_range(n_layers: int, n_workers: int, rank: int) -> tuple[int, int]:
    """Even split; the first n_layers % n_workers ranks take one extra layer."""
    base, extra = divmod(n_layers, n_workers)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    if name not in TORCH_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of auto, {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


@dataclass
class BuiltWorker:
    source: ModelSource
    layers: tuple[int, int]  # [start, end) of the model's layers
    dtype: torch.dtype
    runner: ModelRunner
    steps_ahead: int  # plans taken ahead of the steps before them (worker/overlap.py)
    kv_bytes_per_page: int
    busy_seconds: float  # how long it polls in a loop after a message (protocol/busy_poll.py)


def build(config: WorkerConfig, rank: int, n_workers: int, device: str,
          metrics: WorkerMetrics, layers: tuple[int, int] | None = None) -> BuiltWorker:
    """Load rank `rank`'s layers (an even share of `n_workers`, unless `layers` says) on
    `device`, with everything that serves them."""
    c = config
    source = resolve(c.model)
    args = source.args
    check_split(source.name, args.n_layers, n_workers)
    start, end = layers or layer_range(args.n_layers, n_workers, rank)
    dtype = resolve_dtype(c.dtype, device)
    page_bytes = 2 * (end - start) * c.page_size * args.n_kv_heads * args.head_dim * (
        dtype.itemsize)
    check_memory(c, page_bytes, device)
    stage = source.load_stage(start, end, dtype, device)
    if c.exact:
        apply_exact(stage, device)
    shape = (end - start, c.kv_pages, c.page_size, args.n_kv_heads, args.head_dim)
    attention = choose_attention(c.exact, device, args.head_dim)
    if c.kv == "host":
        pool = HostKVPool(*shape, dtype, device, attention, depth=c.pipeline_depth,
                          ring_budget_mib=c.ring_budget_mib, metrics=metrics,
                          transport=make_transport(device, c.transport_delay_ms))
    else:
        pool = KVPool(*shape, dtype, device, attention)
    park = ParkStore(pool, c.park_pages)
    graphs = None
    if c.cuda_graphs and torch.device(device).type == "cuda":
        try:
            graphs = StepGraphs(stage, pool, device, max_rows=c.max_batch_tokens)
        except ValueError as e:
            log.warning("steps run eagerly: %s", e)
        else:
            graphs.prepare()  # no request of up to PREPARED_ROWS rows pays for a capture
    runner = ModelRunner(stage, pool, park, device, graphs)
    return BuiltWorker(source, (start, end), dtype, runner,
                       steps_ahead(c.overlap, device, c.kv), pool.bytes_per_page,
                       busy_seconds(c.busy_poll, [device]))


def check_memory(c: WorkerConfig, page_bytes: int, device: str) -> None:
    """Refuse, naming the flag, a pool or park store larger than the memory free for it."""
    cuda = torch.device(device).type == "cuda"
    pool, park = c.kv_pages * page_bytes, c.park_pages * page_bytes
    needs = [("--kv-pages", c.kv_pages, pool, "device" if cuda and c.kv == "device" else "host")]
    if cuda:  # pinned, so taken whole at once; on a CPU the park store is touched as it fills
        needs.append(("--park-pages", c.park_pages, park, "host"))
    free = {"device": torch.cuda.mem_get_info(device)[0] if cuda else None,
            "host": _host_available()}
    for flag, n, size, where in needs:
        if free[where] is None:
            continue
        if size > free[where]:
            raise ValueError(
                f"{flag} {n}: {n} pages of {page_bytes} bytes need {_gib(size)} of "
                f"{'device memory on ' + device if where == 'device' else 'host memory'}, "
                f"and {_gib(free[where])} is free; give fewer pages")
        free[where] -= size


def _host_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none: no check)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) << 10 for line in f
                        if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def model_info(source: ModelSource) -> ModelInfo:
    """What the coordinator's frontends need of the model (rank 0 sends it in READY)."""
    args, tok = source.args, source.tokenizer
    return ModelInfo(
        name=source.name, n_layers=args.n_layers, vocab_size=args.vocab_size,
        max_context=args.max_context, tokenizer_json=tok.tokenizer_json,
        chat_template=tok.chat_template, bos_id=tok.bos_id, add_bos=tok.add_bos,
        eos_ids=list(tok.eos_ids),
    )
