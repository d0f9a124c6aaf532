"""Every coordinator metric (docs/reference.md, "Metrics"), exported from one registry:
siding's names, and vLLM's names for the same figures (`VllmView`), which the dashboards and
autoscalers written for vLLM read."""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from protocol.errors import ErrorCode
from protocol.metrics_http import serve_exposition, serve_metrics

FINISH_REASONS = ("stop", "length", "abort")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56,
                   5.12, 10.24, 20.48, 60.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
# vLLM's bounds for the same histograms (vllm/v1/metrics/loggers.py), counted beside siding's
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class CoordinatorMetrics:
    def __init__(self) -> None:
        r = self.own = CollectorRegistry()  # siding's names; `registry` adds vLLM's
        self.requests_running = Gauge("siding_requests_running", "Sequences running", registry=r)
        self.requests_waiting = Gauge("siding_requests_waiting", "Sequences queued", registry=r)
        self.requests_parked = Gauge("siding_requests_parked", "Sequences parked", registry=r)
        self.kv_pages_used = Gauge("siding_kv_pages_used", "KV pages in use", registry=r)
        self.kv_pages_total = Gauge("siding_kv_pages_total", "KV pages in the pool", registry=r)
        self.park_pages_used = Gauge("siding_park_pages_used", "Park store pages in use",
                                     registry=r)
        self.preemptions = Counter("siding_preemptions", "Sequences preempted", ["action"],
                                   registry=r)
        self.restores = Counter("siding_restores", "Parked sequences restored", registry=r)
        self.ahead_rows = Counter("siding_ahead_rows",
                                  "Rows planned on a token still in flight: used, or dropped "
                                  "(their sequence had ended)", ["outcome"], registry=r)
        self.park_bytes = Counter("siding_park_bytes", "Bytes parked and restored",
                                  ["direction"], registry=r)
        self.park_seconds = CountedHistogram("siding_park_seconds",
                                             "Time of one park or restore", LATENCY_BUCKETS, r)
        self.request_preemptions = CountedHistogram(
            "siding_request_preemptions", "Preemptions per finished request",
            (0, 1, 2, 4, 8, 16, 32, 64), r)
        self.ttft = CountedHistogram("siding_time_to_first_token_seconds",
                                     "Time to first token", LATENCY_BUCKETS, r,
                                     also=VLLM_TTFT_BUCKETS)
        self.itl = CountedHistogram("siding_inter_token_latency_seconds",
                                    "Time between tokens", LATENCY_BUCKETS, r,
                                    also=VLLM_ITL_BUCKETS)
        self.e2e = CountedHistogram("siding_e2e_request_latency_seconds", "Request latency",
                                    REQUEST_BUCKETS, r, also=VLLM_REQUEST_BUCKETS)
        self.queue = CountedHistogram("siding_request_queue_seconds",
                                      "Time queued before first step", REQUEST_BUCKETS, r,
                                      also=VLLM_REQUEST_BUCKETS)
        self.prompt_tokens = Counter("siding_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("siding_generation_tokens", "Generated tokens",
                                         registry=r)
        self.requests = Counter("siding_requests", "Finished requests", ["finish_reason"],
                                registry=r)
        self.request_errors = Counter("siding_request_errors", "Failed requests", ["code"],
                                      registry=r)
        self.step_seconds = CountedHistogram("siding_step_seconds", "Step round trip",
                                             LATENCY_BUCKETS, r)
        self.workers_up = Gauge("siding_workers_up", "Workers alive and ready", registry=r)
        self.dropped_messages = Counter("siding_dropped_messages", "Malformed messages dropped",
                                        ["socket"], registry=r)
        self.rejected = Counter("siding_rejected_connections",
                                "Peers refused by CURVE authentication, by socket", ["socket"],
                                registry=r)
        for action in ("park", "recompute"):
            self.preemptions.labels(action=action)
        for direction in ("out", "in"):
            self.park_bytes.labels(direction=direction)
        self.ahead_used = self.ahead_rows.labels(outcome="used")
        self.ahead_dropped = self.ahead_rows.labels(outcome="dropped")
        for reason in FINISH_REASONS:
            self.requests.labels(finish_reason=reason)
        for code in ErrorCode:
            self.request_errors.labels(code=code.value)
        for socket in ("client", "frontend", "worker"):
            self.dropped_messages.labels(socket=socket)
        for socket in ("client", "worker"):
            self.rejected.labels(socket=socket)
        self.vllm = VllmView(self)
        self.registry = CollectorRegistry()  # what the endpoints export
        self.registry.register(self.own)
        self.registry.register(self.vllm)

    def watch_prefix_cache(self, cache) -> None:
        """Export the prefix cache's figures, read from it at each scrape."""
        self.own.register(PrefixCacheCollector(cache))
        self.vllm.prefix_cache = cache

    def serving(self, model_name: str) -> None:
        """The served model is known: vLLM's names are exported, labelled with it."""
        self.vllm.model_name = model_name

    def set_gauges(self, scheduler, workers_up: int) -> None:
        s = scheduler
        self.requests_running.set(len(s.running))
        self.requests_waiting.set(len(s.waiting))
        self.requests_parked.set(len(s.parked))
        self.kv_pages_used.set(s.allocator.n_used)
        self.park_pages_used.set(s.park_slots.n_used)
        self.workers_up.set(workers_up)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        serve_metrics(self.registry, port, addr)

    def serve_frontends(self, path: str) -> None:
        """The same exposition on a Unix socket, which the frontends serve on the HTTP API."""
        serve_exposition(self.registry, path)

    def figures(self) -> dict:
        """The numbers the metrics export, read back from them, for `siding status`: from one
        collection of siding's names (each lookup of a sample by name collects all of it again,
        and twenty of them held the loop for 10 ms; vLLM's names would double its time)."""
        samples: dict[str, float] = {}
        by_label: dict[str, dict[str, int]] = {}
        for family in self.own.collect():
            for sample in family.samples:
                if not sample.labels:
                    samples[sample.name] = sample.value
                elif sample.name.endswith("_total") and len(sample.labels) == 1:
                    (label,) = sample.labels.values()
                    by_label.setdefault(sample.name, {})[label] = int(sample.value)

        def value(name: str) -> int:
            return int(samples.get(name, 0))

        def mean(name: str) -> float | None:  # a histogram's, None before its first observation
            count = samples.get(name + "_count")
            return samples[name + "_sum"] / count if count else None

        return {
            "tokens": {"prompt": value("siding_prompt_tokens_total"),
                       "generated": value("siding_generation_tokens_total")},
            "finished": by_label.get("siding_requests_total", {}),
            "errors": by_label.get("siding_request_errors_total", {}),
            "preemptions": by_label.get("siding_preemptions_total", {}),
            "restores": value("siding_restores_total"),
            "dropped": by_label.get("siding_dropped_messages_total", {}),
            "park_pages_used": value("siding_park_pages_used"),
            "prefix_cache": {
                "queried_tokens": value("siding_prefix_cache_queries_total"),
                "hit_tokens": value("siding_prefix_cache_hits_total"),
                "cached_pages": value("siding_prefix_cache_pages"),
                "evictions": value("siding_prefix_cache_evictions_total"),
            },
            "latency_mean_seconds": {
                "queue": mean("siding_request_queue_seconds"),
                "ttft": mean("siding_time_to_first_token_seconds"),
                "itl": mean("siding_inter_token_latency_seconds"),
                "e2e": mean("siding_e2e_request_latency_seconds"),
                "step": mean("siding_step_seconds"),
            },
        }


class CountedHistogram:
    """A histogram of the engine core's loop, which alone observes it (a scrape reads a copy of
    the counts), exported as any other. It takes a value many times at once: a step's tokens
    share their time, and most of their streams the gap since their last token, so the
    inter-token latency is a few `observe(gap, count)` a step where prometheus_client's
    `Histogram` took an observation (a lock and a bucket scan) for each stream, 0.9 of the
    core's 5.5 us a token at 64 streams (`siding bench core-step`). And it is a few lines of
    code where a step ran through a dozen of prometheus_client's once each, cold.

    It counts against `buckets` and `also` together and exports `buckets`; `family` exports
    the same observations under another name with the bounds of `also` (vLLM's), exact because
    every bound is counted."""

    def __init__(self, name: str, documentation: str, buckets, registry: CollectorRegistry,
                 also=()):
        self.name, self.documentation, self.buckets = name, documentation, tuple(buckets)
        self.bounds = sorted({*buckets, *also})
        self.index = {b: i for i, b in enumerate(self.bounds)}
        self.counts = [0] * (len(self.bounds) + 1)  # the last: past every bound
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += count  # a bucket holds values <= its le
        self.sum += value * count

    def family(self, name: str, documentation: str, buckets, labels: dict[str, str] | None = None
               ) -> HistogramMetricFamily:
        counts, total = list(self.counts), self.sum
        cumulative = list(accumulate(counts))
        family = HistogramMetricFamily(name, documentation, labels=list(labels or ()))
        family.add_metric(list((labels or {}).values()), sum_value=total, buckets=[
            *((floatToGoString(b), cumulative[self.index[b]]) for b in buckets),
            ("+Inf", cumulative[-1])])
        return family

    def collect(self):
        yield self.family(self.name, self.documentation, self.buckets)


class PrefixCacheCollector:
    """The prefix cache's counters and gauge, as the cache (and its allocator) count them."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def collect(self):
        c = self.cache
        for name, doc, value in [
            ("siding_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
             c.queried),
            ("siding_prefix_cache_hits", "Prompt tokens found in the prefix cache", c.hit),
            ("siding_prefix_cache_evictions", "Cached pages reused for other KV",
             c.allocator.evictions),
        ]:
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily("siding_prefix_cache_pages", "Cached pages no sequence holds",
                                value=c.idle_pages)


class VllmView:
    """vLLM's metric names (vllm/v1/metrics/loggers.py) for the figures siding counts, read from
    siding's own metrics at each scrape: one observation, two names, no second count. Labelled
    `model_name` (the served model) and `engine` ("0": one engine core), as vLLM labels them;
    exported once the model is known (its workers are ready)."""

    def __init__(self, metrics: CoordinatorMetrics):
        self.m = metrics
        self.model_name: str | None = None
        self.prefix_cache = None

    def collect(self):
        if self.model_name is None:
            return
        m, labels = self.m, {"model_name": self.model_name, "engine": "0"}
        names, values = list(labels), list(labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    _value(m.requests_running))
        # a preempted sequence waits in vLLM's queue; siding keeps the parked ones apart
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    _value(m.requests_waiting) + _value(m.requests_parked))
        total = _value(m.kv_pages_total)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    _value(m.kv_pages_used) / total if total else 0.0)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      sum(_by_label(m.preemptions).values()))
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                      _value(m.prompt_tokens))
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      _value(m.generation_tokens))
        success = CounterMetricFamily("vllm:request_success",
                                      "Count of successfully processed requests.",
                                      labels=[*names, "finished_reason"])
        for reason, value in _by_label(m.requests).items():
            success.add_metric([*values, reason], value)
        yield success
        if self.prefix_cache is not None:
            yield counter("vllm:prefix_cache_queries",
                          "Prefix cache queries, in terms of number of queried tokens.",
                          self.prefix_cache.queried)
            yield counter("vllm:prefix_cache_hits",
                          "Prefix cache hits, in terms of number of cached tokens.",
                          self.prefix_cache.hit)
        for hist, name, doc, buckets in [
            (m.ttft, "vllm:time_to_first_token_seconds",
             "Histogram of time to first token in seconds.", VLLM_TTFT_BUCKETS),
            (m.itl, "vllm:inter_token_latency_seconds",
             "Histogram of inter-token latency in seconds.", VLLM_ITL_BUCKETS),
            # vLLM's name for the same figure before 0.11, which older dashboards still read
            (m.itl, "vllm:time_per_output_token_seconds",
             "Histogram of time per output token in seconds. "
             "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", VLLM_ITL_BUCKETS),
            (m.e2e, "vllm:e2e_request_latency_seconds",
             "Histogram of e2e request latency in seconds.", VLLM_REQUEST_BUCKETS),
            (m.queue, "vllm:request_queue_time_seconds",
             "Histogram of time spent in WAITING phase for request.", VLLM_REQUEST_BUCKETS),
        ]:
            yield hist.family(name, doc, buckets, labels)


def _value(metric) -> float:
    """An unlabelled counter's or gauge's value."""
    (family,) = metric.collect()
    return next(s.value for s in family.samples if not s.name.endswith("_created"))


def _by_label(counter) -> dict[str, float]:
    """A counter of one label: its value by label value."""
    (family,) = counter.collect()
    return {next(iter(s.labels.values())): s.value for s in family.samples
            if s.name.endswith("_total")}
