"""The scheduler's Prometheus metrics, named after vLLM's with a ``baton:`` prefix."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.lifecycle import FinishReason
from common.metrics import LATENCY_BUCKETS, REQUEST_LATENCY_BUCKETS
from common.pb import executor_pb2 as pb

# ``finished_reason`` as vLLM labels it (its dashboards filter on ``abort``).
_FINISHED_REASON = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",
    FinishReason.ERROR: "error",
}


@dataclass(frozen=True)
class _ExecutorChildren:
    """One executor's labelled series, kept so a step report costs no ``labels()`` lookups."""

    kv_usage: Gauge
    step_time: Histogram
    gpu_util: Gauge
    gpu_memory: Gauge
    gpu_power: Gauge


class SchedulerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.waiting = Gauge("baton:num_requests_waiting", "Requests in the pending queue", registry=r)
        self.waiting_by = Gauge(
            "baton:num_requests_waiting_by_class",
            "Queued requests by priority and tenant (sampled head of queue)",
            ["priority", "tenant"],
            registry=r,
        )
        self.running = Gauge("baton:num_requests_running", "Requests on executors this replica drives", registry=r)
        self.executors = Gauge("baton:executors_alive", "Executors this replica drives", registry=r)
        self.kv_usage = Gauge("baton:kv_cache_usage_perc", "KV cache usage, 0-1", ["executor"], registry=r)
        self.gpu_util = Gauge(
            "baton:gpu_utilization_perc", "GPU (or process CPU) utilisation", ["executor"], registry=r
        )
        self.gpu_memory = Gauge("baton:gpu_memory_used_bytes", "GPU (or process) memory used", ["executor"], registry=r)
        self.gpu_power = Gauge("baton:gpu_power_watts", "GPU power draw", ["executor"], registry=r)
        self.prompt_tokens = Counter("baton:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("baton:generation_tokens", "Generated tokens", registry=r)
        self.success = Counter(
            "baton:request_success",
            "Requests ended, however they ended (abort: cancelled)",
            ["finished_reason"],
            registry=r,
        )
        self.preemptions = Counter(
            "baton:num_preemptions",
            "Requests executors handed back for KV space (not scheduler preemptions)",
            registry=r,
        )
        self.migrations = Counter("baton:num_migrations", "Requests re-queued after losing their executor", registry=r)
        self.shed = Counter("baton:requests_shed", "Requests refused with RESOURCE_EXHAUSTED", ["priority"], registry=r)
        self.deadlines = Counter(
            "baton:deadline_requests", "Finished requests that had a deadline, by outcome", ["outcome"], registry=r
        )
        self.length_error = Gauge(
            "baton:output_length_estimate_error_tokens",
            "Output-length estimator: mean absolute error in tokens, weighted by samples",
            registry=r,
        )
        self.load_factor = Gauge("baton:load_factor", "Load factor 0-1 between the load_aware thresholds", registry=r)
        self.scheduler_preemptions = Counter(
            "baton:scheduler_preemptions", "Running requests preempted for more important waiting ones", registry=r
        )
        # Fleet-wide autoscaling signals (scheduler_service/fleet_signals.py): read from Redis, so
        # every replica exports the same values; aggregate with max(), not sum().
        self.oldest_waiting = Gauge(
            "baton:queue_oldest_waiting_seconds",
            "Age of the oldest queued request, by priority (over the head of the queue)",
            ["priority"],
            registry=r,
        )
        self.fleet_kv_usage = Gauge(
            "baton:fleet_kv_cache_usage_perc", "KV cache in use over all live executors, 0-1", registry=r
        )
        self.fleet_running = Gauge(
            "baton:fleet_num_requests_running", "Requests running on all live executors", registry=r
        )
        self.fleet_executors = Gauge("baton:fleet_executors", "Live executors (by heartbeat)", registry=r)
        self.aborted = Counter("baton:requests_aborted", "Requests aborted for their client", ["reason"], registry=r)
        self.malformed = Counter(
            "baton:requests_malformed",
            "Requests ended FAILED because their Redis state could not be read (RequestRecords.quarantine)",
            registry=r,
        )
        self.ttft = Histogram(
            "baton:time_to_first_token_seconds",
            "Arrival to first token, observed as it comes",
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "baton:inter_token_latency_seconds",
            "Time between a request's tokens (a chunk's gap shared by its tokens)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "baton:e2e_request_latency_seconds",
            "Arrival to finish, of requests that ran on an executor",
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "baton:request_queue_time_seconds",
            "Arrival to first placement, of requests that ran on an executor",
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.step_time = Histogram(
            "baton:step_time_seconds",
            "Executor iteration time, one step per report",
            ["executor"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.plan_latency = Histogram(
            "baton:plan_latency_seconds", "Time to make one admission plan", buckets=LATENCY_BUCKETS, registry=r
        )
        self._per_executor: dict[str, _ExecutorChildren] = {}

    def observe_load(self, executor_id: str, load: pb.Load) -> None:
        # Called once per step report: the labelled children are looked up once per executor.
        children = self._per_executor.get(executor_id)
        if children is None:
            children = self._per_executor[executor_id] = _ExecutorChildren(
                self.kv_usage.labels(executor_id),
                self.step_time.labels(executor_id),
                self.gpu_util.labels(executor_id),
                self.gpu_memory.labels(executor_id),
                self.gpu_power.labels(executor_id),
            )
        if load.kv_blocks_total:
            children.kv_usage.set(load.kv_blocks_used / load.kv_blocks_total)
        if load.step_time_ns:
            children.step_time.observe(load.step_time_ns / 1e9)
        children.gpu_util.set(load.utilization_pct)
        children.gpu_memory.set(load.memory_used_bytes)
        children.gpu_power.set(load.power_watts)

    def observe_finish(self, reason: FinishReason, usage: dict[str, float], e2e_s: float) -> None:
        """A request its executor ended (its time to first token was observed as it came)."""
        self.count_end(reason)
        self.prompt_tokens.inc(usage.get("prompt_tokens", 0))
        self.queue_time.observe(usage.get("queue_time_ms", 0.0) / 1000)
        self.e2e.observe(max(0.0, e2e_s))

    def count_end(self, reason: FinishReason) -> None:
        """A request ended: by its executor, or where none could (cancelled while queued, fitting
        no executor, past the migration limit, unreadable in Redis)."""
        self.success.labels(_FINISHED_REASON.get(reason, reason.name.lower())).inc()

    def forget_executor(self, executor_id: str) -> None:
        self._per_executor.pop(executor_id, None)
        for family in (self.kv_usage, self.step_time, self.gpu_util, self.gpu_memory, self.gpu_power):
            with contextlib.suppress(KeyError):
                family.remove(executor_id)
