"""The executor's Prometheus metrics: its own view of the batch, the KV cache and the device."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.metrics import LATENCY_BUCKETS
from executor_service.engine_io import StepOutput
from executor_service.load_metrics import DeviceLoad


class ExecutorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("baton:executor_num_running", "Sequences in the batch", registry=r)
        self.kv_usage = Gauge("baton:kv_cache_usage_perc", "KV cache usage, 0-1", registry=r)
        self.step_time = Histogram(
            "baton:executor_step_time_seconds", "Iteration time", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tokens = Counter("baton:executor_tokens", "Tokens computed (prefill + decode)", registry=r)
        self.preemptions = Counter("baton:executor_preemptions", "Sequences preempted for KV space", registry=r)
        self.prefix_queries = Counter(
            "baton:prefix_cache_queries", "Prompt tokens of new requests looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter(
            "baton:prefix_cache_hits", "Prompt tokens of new requests found in the prefix cache", registry=r
        )
        # The step outputs carry running totals; the counters advance by the difference.
        self._prefix_seen = (0, 0)
        self.gpu_util = Gauge("baton:gpu_utilization_perc", "GPU (or process CPU) utilisation", registry=r)
        self.gpu_memory = Gauge("baton:gpu_memory_used_bytes", "GPU (or process) memory used", registry=r)
        self.gpu_power = Gauge("baton:gpu_power_watts", "GPU power draw", registry=r)
        self.backend = Gauge(
            "baton:executor_backend", "The forward-pass backend running the model (1)", ["backend"], registry=r
        )

    def observe_step(self, out: StepOutput) -> None:
        """Every step, on the engine thread (prometheus_client's metrics are thread-safe)."""
        self.running.set(out.num_running)
        if out.kv_blocks_total:
            self.kv_usage.set(out.kv_blocks_used / out.kv_blocks_total)
        if out.num_tokens:
            self.step_time.observe(out.step_time_ns / 1e9)
            self.tokens.inc(out.num_tokens)
        self.preemptions.inc(len(out.preempted))
        queries, hits = self._prefix_seen
        if out.prefix_cache_queries != queries or out.prefix_cache_hits != hits:
            self.prefix_queries.inc(max(0, out.prefix_cache_queries - queries))
            self.prefix_hits.inc(max(0, out.prefix_cache_hits - hits))
            self._prefix_seen = (out.prefix_cache_queries, out.prefix_cache_hits)

    def observe_device(self, device: DeviceLoad) -> None:
        """With each step report, off the engine thread: a sample may read NVML or /proc."""
        self.gpu_util.set(device.utilization_pct)
        self.gpu_memory.set(device.memory_used_bytes)
        self.gpu_power.set(device.power_watts)
