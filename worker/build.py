"""The worker's composition root: from a `WorkerConfig` and its place in the pipeline, the model
stage, the KV pool, the park store, the step graphs and the runner over them. Nothing else in
the worker reads the config; nothing here touches a socket. Tests and benchmarks compose the
same parts through `load_stage`, `make_pool` and `build_runner`, which `build` is made of."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from protocol.busy_poll import busy_seconds
from protocol.messages import ModelInfo
from protocol.worker_config import WorkerConfig, steps_ahead

from .attention import choose_attention
from .cuda_graphs import DEFAULT_ROWS, StepGraphs
from .exact import apply_exact
from .kv.device_pool import KVPool
from .kv.host_pool import HostKVPool
from .kv.park_store import ParkStore
from .kv.pool import Pool
from .kv.transport import make_transport
from .loaders import ModelSource, check_split, resolve
from .metrics import WorkerMetrics
from .model import StageModel
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
    stage = load_stage(source, dtype, device, layers=(start, end), exact=c.exact)
    pool = make_pool(stage, c.kv_pages, c.page_size, device, exact=c.exact, kv=c.kv,
                     depth=c.pipeline_depth, ring_budget_mib=c.ring_budget_mib,
                     delay_ms=c.transport_delay_ms, metrics=metrics)
    runner = build_runner(stage, pool, device, park_pages=c.park_pages,
                          graphs=c.cuda_graphs and torch.device(device).type == "cuda",
                          max_rows=c.max_batch_tokens,
                          refused=lambda e: log.warning("steps run eagerly: %s", e))
    if runner.graphs is not None:
        runner.graphs.prepare()  # no request of up to PREPARED_ROWS rows pays for a capture
    return BuiltWorker(source, (start, end), dtype, runner,
                       steps_ahead(c.overlap, device, c.kv), pool.bytes_per_page,
                       busy_seconds(c.busy_poll, [device]))


def load_stage(model: str | ModelSource, dtype: torch.dtype, device: str | torch.device, *,
               layers: tuple[int, int] | None = None, exact: bool = False) -> StageModel:
    """The model's layers [start, end) (None: all of them) in `dtype` on `device`; in exact
    mode (worker/exact.py) where `exact`. model: a `--model` spec or a resolved source."""
    source = resolve(model) if isinstance(model, str) else model
    start, end = layers or (0, source.args.n_layers)
    stage = source.load_stage(start, end, dtype, device)
    if exact:
        apply_exact(stage, device)
    return stage


def make_pool(stage: StageModel, n_pages: int, page_size: int, device: str | torch.device, *,
              exact: bool = False, kv: str = "device", depth: int = 1, ring_budget_mib: int = 0,
              slot_layers: int | None = None, delay_ms: float = 0.0,
              metrics: WorkerMetrics | None = None) -> KVPool | HostKVPool:
    """`n_pages` KV pages of `page_size` tokens for the stage's layers in its dtype, attended by
    exact or default mode's paged attention. kv "device": the pages on the device; "host": in
    host memory, delivered through a staging ring (depth, ring_budget_mib, slot_layers and
    metrics are the ring's; delay_ms, every copy's delay, is for tests)."""
    a = stage.args
    shape = (len(stage.layers), n_pages, page_size, a.n_kv_heads, a.head_dim)
    dtype = next(stage.parameters()).dtype
    attention = choose_attention(exact, device, a.head_dim)
    if kv == "host":
        return HostKVPool(*shape, dtype, device, attention, depth=depth,
                          ring_budget_mib=ring_budget_mib, metrics=metrics,
                          transport=make_transport(device, delay_ms), slot_layers=slot_layers)
    return KVPool(*shape, dtype, device, attention)


def build_runner(stage: StageModel, pool: Pool, device: str | torch.device, *,
                 park_pages: int = 1, graphs: bool = False, max_rows: int = DEFAULT_ROWS,
                 refused: Callable[[ValueError], None] | None = None) -> ModelRunner:
    """A runner of the stage over the pool, with a park store of `park_pages` slots. With
    `graphs`, steps of up to `max_rows` rows run in pieces (worker/cuda_graphs.py), captured on
    a CUDA device and eager elsewhere. Where the pieces cannot be built, their ValueError is
    raised, or, given `refused`, handed to it and steps run eagerly."""
    pieces = None
    if graphs:
        capture = torch.device(device).type == "cuda"
        try:
            pieces = StepGraphs(stage, pool, device, capture=capture, max_rows=max_rows)
        except ValueError as e:
            if refused is None:
                raise
            refused(e)
    return ModelRunner(stage, pool, ParkStore(pool, park_pages), device, pieces)


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
