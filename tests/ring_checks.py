"""A CPU transport that checks the staging ring's event protocol as the ring issues it."""

from worker.transport import CpuTransport


class CheckedTransport(CpuTransport):
    """Events are per layer; slots are where a layer lands this step. A slot goes filled -> read
    -> released -> filled ...: a fill waits for the release of the layer that read the slot last
    and needs that read released (a fill nobody read, a discarded prime, may be filled over); a
    read needs a fill (the layer reading it may wait again); while a step's own deliveries run,
    no more than `depth` fills are unread; a step's primes for the next fill every slot.

    timed: what `timed_step` answers, in turn (a timed ring step runs its waits eagerly)."""

    def __init__(self, delay_ms: float = 0.0, timed: tuple[bool, ...] = (False,)):
        super().__init__(delay_ms)
        self.ring = None
        self.syncs = self.host_waits = 0
        self.timed = timed
        self.steps = 0

    def start(self, ring) -> None:
        self.ring = ring
        self.state = ["released"] * ring.n_slots
        self.reader: list[int | None] = [None] * ring.n_slots  # the layer that read it last
        self.reads = 0
        prime = ring.prime

        def priming(*args, **kwargs):
            self.priming = True
            prime(*args, **kwargs)
            self.priming = False
        self.priming = False
        ring.prime = priming

    @staticmethod
    def _index(ev, events) -> int | None:
        return next((i for i, e in enumerate(events) if e is ev), None)

    def _slot(self, layer: int) -> int:
        return (self.ring.base + layer) % self.ring.n_slots

    def timed_step(self) -> bool:
        self.steps += 1
        return self.timed[(self.steps - 1) % len(self.timed)]

    def copy(self, pairs, after=None, then=None):
        ring = self.ring
        if self._index(then, ring.ready) is not None:
            s = (pairs[0][0].data_ptr() - ring.buf.data_ptr()) // (ring.n * ring.page_bytes)
            r = self.reader[s]
            assert r is None or after is ring.release[r], \
                "a refill must wait for the release of the layer that read the slot last"
            assert self.state[s] in ("released", "filled"), f"slot {s} refilled while read"
            self.state[s] = "filled"
            ahead = self.state.count("filled")
            limit = ring.n_slots if self.priming or self.primed_unread() else ring.depth
            assert ahead <= limit, f"{ahead} layers in flight, depth {ring.depth}"
        super().copy(pairs, after, then)

    def primed_unread(self) -> bool:
        """Whether fills made by the last primes (used or discarded) may still be unread: until
        a step's first n_slots layers are read, every slot has been filled again since."""
        return self.reads % self.ring.n_layers < self.ring.n_slots

    def wait(self, ev):
        layer = self._index(ev, self.ring.ready)
        assert layer is not None, "the compute side waits only on ready events"
        s = self._slot(layer)
        again = self.state[s] == "read" and self.reader[s] == layer  # a primed layer's patch
        assert self.state[s] == "filled" or again, f"slot {s} read without a fill"
        self.state[s] = "read"
        self.reader[s] = layer
        self.reads += not again
        super().wait(ev)

    def record(self, ev):
        layer = self._index(ev, self.ring.release)
        if layer is not None:
            s = self._slot(layer)
            assert self.state[s] == "read" and self.reader[s] == layer, \
                f"slot {s} released before layer {layer} read it"
            self.state[s] = "released"
        super().record(ev)

    def host_wait(self, ev):
        self.host_waits += 1
        super().host_wait(ev)

    def synchronize(self):
        self.syncs += 1
        super().synchronize()
