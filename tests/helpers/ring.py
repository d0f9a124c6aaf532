"""The host pool against the device pool on the CPU transport: pools of one shape, a step of
random q, k, v through every layer, random schedules, a run compared bit for bit, and a transport
that checks the ring's event protocol as it is issued."""

import random

import torch

from worker.attention import choose_attention
from worker.batch import build_meta
from worker.kv.device_pool import KVPool
from worker.kv.host_pool import HostKVPool
from worker.kv.transport import CpuTransport
from worker.step import PagedStep

H, KVH, D, P = 4, 2, 16, 4
LAYERS = 5


def pools(depth: int, exact: bool = False, delay_ms: float = 0.0, bridge: int | None = None,
          n_pages: int = 64, shape: tuple[int, int, int, int] = (LAYERS, P, KVH, D),
          budget_mib: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32,
          transport=None, slot_layers: int | None = 1) -> tuple[KVPool, HostKVPool]:
    """A device pool and a host pool of the same shape; the host one on the CPU transport with
    `delay_ms` unless given another."""
    layers, page, kvh, d = shape
    extra = {} if bridge is None else {"bridge_bytes": bridge}
    attention = choose_attention(exact, device, d)
    on_device = KVPool(layers, n_pages, page, kvh, d, dtype, device, attention)
    host = HostKVPool(layers, n_pages, page, kvh, d, dtype, device, attention, depth=depth,
                      ring_budget_mib=budget_mib, slot_layers=slot_layers,
                      transport=transport or CpuTransport(delay_ms), **extra)
    return on_device, host


def run_step(pool, chunk, tables, seed: int, heads: int = H,
             device: str = "cpu") -> list[torch.Tensor]:
    """chunk: [(seq, start, n)]. Every layer attends random q, k, v (the same for every pool,
    by `seed`); returns each layer's output."""
    ids = [i for i, _, _ in chunk]
    meta = build_meta([s for _, s, _ in chunk], [n for _, _, n in chunk],
                      [tables[i] for i in ids], [True] * len(ids), pool.page_size, device)
    g = torch.Generator().manual_seed(seed)
    t, (kvh, d), dtype = len(meta.positions), pool.k.shape[-2:], pool.k.dtype
    step = PagedStep(pool)
    step.fill(pool.begin_step(meta, ids))
    outs = []
    for i, layer in enumerate(pool.layers):
        q, k, v = (torch.randn(t, h, d, generator=g).to(device, dtype) for h in (heads, kvh, kvh))
        layer.enter()
        outs.append(step.attend(i, q, k, v))
        layer.leave(*step.new_rows[i])
    pool.end_step()
    return outs


def random_schedule(rng: random.Random, n_pages: int, page: int = P):
    """Sequences of random lengths on randomly placed pages: prefill in uneven chunks (several
    sequences per step), then decode steps of all of them together."""
    free = list(range(n_pages))
    rng.shuffle(free)
    lens = [rng.randint(3, 30) for _ in range(3)]
    decode = 4
    tables = {i: [free.pop() for _ in range(-(-(n + decode) // page))] for i, n in enumerate(lens)}
    steps, done = [], [0] * len(lens)
    while any(d < n for d, n in zip(done, lens)):
        chunk = []
        for i, n in enumerate(lens):
            if done[i] < n:
                m = min(n - done[i], rng.randint(1, 12))
                chunk.append((i, done[i], m))
                done[i] += m
        steps.append(chunk)
    for s in range(decode):
        steps.append([(i, n + s, 1) for i, n in enumerate(lens)])
    return tables, steps


def assert_same_run(on_device, host, tables, steps, device: str = "cpu") -> None:
    for seed, chunk in enumerate(steps):
        a = run_step(on_device, chunk, tables, seed, device=device)
        b = run_step(host, chunk, tables, seed, device=device)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"step {seed}"
    host.settle()
    assert torch.equal(on_device.k.cpu(), host.k) and torch.equal(on_device.v.cpu(), host.v)


class CheckedTransport(CpuTransport):
    """Checks the ring's event protocol as it is issued. A slot goes filled -> read -> released
    -> filled ...: a fill waits for the slot's release event and needs every read of the slot
    released (a fill nobody read, a discarded prime, may be filled over); a read needs a fill;
    while a step's own deliveries run, no more than `depth` fills are unread; a step's primes
    for the next fill every slot. A fence (the slots moved: every release recorded again after
    all the compute so far) releases every slot."""

    def __init__(self, delay_ms: float = 0.0):
        super().__init__(delay_ms)
        self.ring = None
        self.syncs = self.host_waits = 0
        self.log: list[str] = []  # "wait" (compute side, for a slot) and "host" (host blocks)

    def _slot(self, ev, kind: str) -> int | None:
        events = getattr(self.ring, kind)
        return next((s for s, e in enumerate(events) if e is ev), None)

    def start(self, ring) -> None:
        self.ring = ring
        self.state = ["released"] * len(ring.release)
        self.reads = 0
        self.fences = 0
        prime, fence, acquire = ring.prime, ring._fence, ring.acquire

        def priming():
            self.priming = True
            prime()
            self.priming = False

        def fencing():
            self.fencing = True
            fence()
            self.fencing = False
            self.state = ["released"] * len(ring.release)
            self.reads = 0  # the step's first read is a group's first again
            self.fences += 1
        def acquiring(layer):
            if not ring.ahead:  # the compute side copies into the buffer, where the slots lie
                self.state = ["read"] * len(ring.release)
            return acquire(layer)
        self.priming = self.fencing = False
        ring.prime, ring._fence, ring.acquire = priming, fencing, acquiring

    def copy(self, pairs, after=(), then=None):
        (release,) = after
        s = self._slot(release, "release")
        assert s is not None, "every delivery waits for its slot's release"
        assert self.state[s] in ("released", "filled"), f"slot {s} refilled while read"
        assert then is self.ring.ready[s]
        self.state[s] = "filled"
        ahead = self.state.count("filled")
        limit = self.ring.n_slots if self.priming or self.primed_unread() else self.ring.depth
        assert ahead <= limit, f"{ahead} layers in flight, depth {self.ring.depth}"
        super().copy(pairs, after, then)

    def primed_unread(self) -> bool:
        """Whether fills made by the last primes (used or discarded) may still be unread: until
        a step's first n_slots layers are read, every slot has been filled again since."""
        return self.reads % self.ring.n_groups < self.ring.n_slots

    def wait(self, ev):
        s = self._slot(ev, "ready")
        assert s is not None, "the compute side waits only on ready events"
        assert self.state[s] == "filled", f"slot {s} read without a fill"
        self.state[s] = "read"
        self.reads += 1
        self.log.append("wait")
        super().wait(ev)

    def record(self, ev):
        s = self._slot(ev, "release")
        if s is not None and not self.fencing:
            assert self.state[s] == "read", f"slot {s} released before it was read"
            self.state[s] = "released"
        super().record(ev)

    def host_wait(self, ev):
        self.host_waits += 1
        self.log.append("host")
        super().host_wait(ev)

    def synchronize(self):
        self.syncs += 1
        super().synchronize()
