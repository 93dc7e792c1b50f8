"""Engine metrics in Prometheus form (vLLM's names with the `jaxinfer:` prefix), label `model_name`.

Each `EngineMetrics` owns its own `CollectorRegistry` (several engines in one test process must not
collide); the server exposes `prometheus_client.generate_latest(engine.metrics.registry)`.
`REGISTRY` is the registry of the process's default engine: an engine built without one passed
uses a fresh registry, so pass `REGISTRY` explicitly to publish there.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from jaxinfer.spec_decode.metrics import SpecDecodeMetrics

REGISTRY = CollectorRegistry()
# EngineStats' host phases of a step: before it reaches the device, then after.
STEP_PHASES = ("schedule", "build", "launch", "wait", "process")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                          0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        label = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(name, doc, label, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, label, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, label, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("jaxinfer:num_requests_running", "Requests running")
        self.num_requests_waiting = gauge("jaxinfer:num_requests_waiting", "Requests waiting")
        self.kv_cache_usage_perc = gauge("jaxinfer:kv_cache_usage_perc",
                                         "Fraction of KV-cache blocks held by requests (0..1)")
        self.kv_cache_used_blocks = gauge("jaxinfer:kv_cache_used_blocks",
                                          "KV-cache blocks held by requests (0 when idle: none leaked)")
        self.kv_cache_total_blocks = gauge("jaxinfer:kv_cache_total_blocks", "KV-cache blocks in the pool")
        self.weight_bytes = gauge("jaxinfer:weight_bytes",
                                  "Bytes of model weights one device holds (quantized: 8-bit values "
                                  "plus their scales)")
        self.prefix_cache_queries = counter("jaxinfer:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("jaxinfer:prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache")
        self.num_preemptions = counter("jaxinfer:num_preemptions", "Preemptions (by recompute)")
        self.prompt_tokens = counter("jaxinfer:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("jaxinfer:generation_tokens", "Generated tokens")
        self._success = Counter("jaxinfer:request_success", "Finished requests by reason",
                                ["model_name", "finished_reason"], registry=r)
        self.time_to_first_token = histogram("jaxinfer:time_to_first_token_seconds",
                                             "Time to first token", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("jaxinfer:inter_token_latency_seconds",
                                             "Time between tokens of a request",
                                             _TOKEN_LATENCY_BUCKETS)
        self.e2e_request_latency = histogram("jaxinfer:e2e_request_latency_seconds",
                                             "Arrival to finish", _LATENCY_BUCKETS)
        self.request_queue_time = histogram("jaxinfer:request_queue_time_seconds",
                                            "Arrival to first scheduled", _LATENCY_BUCKETS)
        self.kv_cache_bytes = gauge("jaxinfer:kv_cache_bytes",
                                    "Bytes of the KV-cache pool over all devices (1 per element "
                                    "with an fp8 cache)")
        self._cache_info = Gauge("jaxinfer:cache_config_info", "KV-cache settings (value 1)",
                                 ["model_name", "block_size", "cache_dtype", "num_blocks"],
                                 registry=r)
        self.compiled_buckets = gauge("jaxinfer:compiled_buckets",
                                      "Step buckets compiled and in use (the rest compiling)")
        self.total_buckets = gauge("jaxinfer:total_buckets", "Step buckets of the engine")
        self._prefix_seen = (0, 0)
        self._stats_of: Callable[[], EngineStats | None] | None = None
        self._spec_decode: SpecDecodeMetrics | None = None
        self._host_kv: HostKVMetrics | None = None

    def spec_decode(self, num_speculative_tokens: int) -> SpecDecodeMetrics:
        """Speculative decoding's counters: one set per registry, made by the first engine that
        speculates (an engine rebuilt on the same metrics keeps counting on them)."""
        if self._spec_decode is None:
            self._spec_decode = SpecDecodeMetrics(self.registry, self.model_name,
                                                  num_speculative_tokens)
        return self._spec_decode

    def host_kv(self) -> HostKVMetrics:
        """The host KV tier's metrics (--kv-offload): one set per registry, like spec_decode's."""
        if self._host_kv is None:
            self._host_kv = HostKVMetrics(self.model_name, self.registry)
        return self._host_kv

    def set_cache_config(self, block_size: int, cache_dtype: str, num_blocks: int,
                         bytes_per_block: int) -> None:
        self._cache_info.labels(self.model_name, str(block_size), cache_dtype, str(num_blocks)).set(1)
        self.kv_cache_bytes.set(num_blocks * bytes_per_block)

    def track_compiler(self, compiler) -> None:
        """Read the runner's BucketCompiler at every scrape (it advances between steps)."""
        self.compiled_buckets.set_function(lambda: compiler.num_ready)
        self.total_buckets.set_function(lambda: compiler.num_units)

    def track_stats(self, stats_of: Callable[[], "EngineStats | None"]) -> None:
        """Export the step loop's host timing as counters: steps dispatched and processed, and
        the host seconds of each phase. `stats_of()` is read at every scrape (benchmarks replace
        an engine's EngineStats; None: no engine now). An engine rebuilt on these metrics takes
        the export over."""
        if self._stats_of is None:
            self.registry.register(_StepPhases(self))
        self._stats_of = stats_of

    def step_phase_families(self) -> list:
        s = self._stats_of()
        if s is None:
            return []
        steps = CounterMetricFamily("jaxinfer:engine_steps", "Engine steps by stage: dispatched to "
                                    "the device, processed (their tokens taken)",
                                    labels=["model_name", "stage"])
        steps.add_metric([self.model_name, "dispatched"], s.steps)
        steps.add_metric([self.model_name, "processed"], s.processed)
        seconds = CounterMetricFamily(
            "jaxinfer:engine_step_host_seconds", "Host seconds of the step loop by phase: schedule, "
            "build and launch before a step reaches the device; wait (blocked on its tokens) and "
            "process (its outputs) after", labels=["model_name", "phase"])
        for phase in STEP_PHASES:
            seconds.add_metric([self.model_name, phase], getattr(s, f"{phase}_s"))
        return [steps, seconds]

    def request_success(self, finished_reason: str) -> None:
        self._success.labels(self.model_name, finished_reason).inc()

    def update_prefix_cache(self, queries: int, hits: int) -> None:
        """Feed the manager's monotonic counters; only the increase since the last call is added."""
        q0, h0 = self._prefix_seen
        if queries > q0:
            self.prefix_cache_queries.inc(queries - q0)
        if hits > h0:
            self.prefix_cache_hits.inc(hits - h0)
        self._prefix_seen = (queries, hits)


class _StepPhases:
    """A registry's view of EngineMetrics.step_phase_families (a custom collector)."""

    def __init__(self, metrics: EngineMetrics):
        self.metrics = metrics

    def collect(self):
        return self.metrics.step_phase_families()


def observe_many(histogram, amount: float, count: int) -> None:
    """`count` observations of `amount` in one update (a step's tokens mostly share one
    inter-token gap; prometheus_client's `observe` takes one at a time, and its buckets are
    cumulative only when exposed, so one bucket gets the whole count)."""
    if count == 1:
        histogram.observe(amount)
        return
    histogram._raise_if_not_observable()
    histogram._sum.inc(amount * count)
    for i, bound in enumerate(histogram._upper_bounds):
        if amount <= bound:
            histogram._buckets[i].inc(count)
            break


class EngineStats:
    """Host-side timing of the step loop (for benchmarks and the device-idle gap), summed over
    steps. `host_s` (schedule + build + launch) is the host work before a step reaches the device;
    the wait for a step's tokens and the output processing after them follow the next dispatch
    when the steps overlap."""

    def __init__(self):
        self.steps = 0
        self.host_s = 0.0          # schedule + build + launch, summed
        self.schedule_s = 0.0      # Scheduler.schedule
        self.build_s = 0.0         # the step's host arrays and block copies
        self.launch_s = 0.0        # the executables' calls (jax dispatch, kernel launches)
        self.wait_s = 0.0          # blocked on a step's sampled tokens (device -> host)
        self.process_s = 0.0       # output processing and the scheduler's update, after the wait
        self.processed = 0         # steps processed
        self.idle_dispatches = 0   # overlapped dispatches that found the previous step finished
        self.sync_gaps = 0         # steps dispatched after waiting for the previous one's tokens
        self.sync_gap_s = 0.0      # ... and the device idle time between the two, summed

    def record_dispatch(self, start: float, scheduled: float, built: float | None,
                        dispatched: float) -> None:
        """One dispatched step's host phases (perf_counter times; `built` None: not split)."""
        built = scheduled if built is None else built
        self.steps += 1
        self.host_s += dispatched - start
        self.schedule_s += scheduled - start
        self.build_s += built - scheduled
        self.launch_s += dispatched - built

    def record_process(self, seconds: float, wait_s: float) -> None:
        self.processed += 1
        self.wait_s += wait_s
        self.process_s += seconds - wait_s

    def breakdown_ms(self) -> dict[str, float]:
        """Milliseconds per step of each host phase."""
        per = 1e3 / max(self.steps, 1)
        per_processed = 1e3 / max(self.processed, 1)
        return dict(schedule=round(self.schedule_s * per, 3), build=round(self.build_s * per, 3),
                    launch=round(self.launch_s * per, 3),
                    wait=round(self.wait_s * per_processed, 3),
                    process=round(self.process_s * per_processed, 3))

    @property
    def host_ms_per_step(self) -> float:
        return 1e3 * self.host_s / max(self.steps, 1)

    @property
    def sync_gap_ms(self) -> float:
        return 1e3 * self.sync_gap_s / max(self.sync_gaps, 1)


_TRANSFER_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


class KVTransferMetrics:
    """A disaggregated engine's KV hand-over (jaxinfer/disagg): bytes and time of the prefill ->
    decode block transfers, blocks the decode side already held, and the queue depth per role."""

    def __init__(self, model_name: str, registry: CollectorRegistry):
        label = ["model_name"]
        r = self.registry = registry
        self.transfer_bytes = Counter("jaxinfer:kv_transfer_bytes", "KV bytes moved prefill -> decode",
                                      label, registry=r).labels(model_name)
        self.transfers = Counter("jaxinfer:kv_transfers", "Requests whose KV moved prefill -> decode",
                                 label, registry=r).labels(model_name)
        self.blocks_skipped = Counter("jaxinfer:kv_transfer_blocks_skipped",
                                      "Prompt blocks not moved: the decode side's prefix cache "
                                      "held them", label, registry=r).labels(model_name)
        self.transfer_seconds = Histogram(
            "jaxinfer:kv_transfer_seconds", "Gather dispatched to copy seen landed (host poll)",
            label, buckets=_TRANSFER_BUCKETS, registry=r).labels(model_name)
        queue = Gauge("jaxinfer:queue_depth", "Sequences waiting per stage: prefill (to be "
                      "scheduled), transfer (waiting for decode room or in flight), decode (to be "
                      "scheduled)", ["model_name", "stage"], registry=r)
        self.queue_depth = {s: queue.labels(model_name, s) for s in ("prefill", "transfer", "decode")}


class HostKVMetrics:
    """The host KV tier (--kv-offload): prefix tokens served from host, bytes copied each way,
    the host -> device copies' time, host blocks in use. `update` feeds monotonic totals."""

    _FIELDS = ("hit_tokens", "bytes_to_host", "bytes_to_device")

    def __init__(self, model_name: str, registry: CollectorRegistry):
        label, r = ["model_name"], registry
        self.hit_tokens = Counter("jaxinfer:kv_host_hit_tokens", "Prompt tokens whose KV came back "
                                  "from the host tier", label, registry=r).labels(model_name)
        self.bytes_to_host = Counter("jaxinfer:kv_host_offload_bytes", "KV bytes copied device -> "
                                     "host (evicted prefix blocks)", label,
                                     registry=r).labels(model_name)
        self.bytes_to_device = Counter("jaxinfer:kv_host_load_bytes", "KV bytes copied host -> "
                                       "device (host prefix hits)", label,
                                       registry=r).labels(model_name)
        self.load_seconds = Histogram(
            "jaxinfer:kv_host_load_seconds", "A step's host -> device copies, dispatch to done "
            "(the compute queued ahead of them included)", label, buckets=_TRANSFER_BUCKETS,
            registry=r).labels(model_name)
        self.used_blocks = Gauge("jaxinfer:kv_host_used_blocks", "Host tier blocks holding KV",
                                 label, registry=r).labels(model_name)
        self._seen = dict.fromkeys(self._FIELDS, 0)

    def update(self, used_blocks: int, **totals: int) -> None:
        self.used_blocks.set(used_blocks)
        for name, total in totals.items():
            if total > self._seen[name]:
                getattr(self, name).inc(total - self._seen[name])
            self._seen[name] = total
