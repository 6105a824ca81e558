"""Baton's configuration schema: frozen dataclasses, one per section, each validating its own values.

``common.config_loading`` fills them from the YAML file and ``BATON_*`` environment overrides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from common.keys import MAX_SAMPLES_BOUND, check_name


@dataclass(frozen=True)
class RequestLevelConfig:
    """Per-request admission and the adaptive priority score (see docs/scheduling.md)."""

    default_priority: int = 5
    max_priority: int = 10
    # Aging: each priority level is worth this much queue time, so a low-priority request
    # overtakes newer high-priority ones of its tenant after at most (10 * credit) ms: no starvation.
    priority_credit_ms: float = 1000.0
    # Urgency: a request with a deadline counts as having arrived at (deadline - expected service
    # time - this margin) when that is earlier than its arrival. So deadlines within this horizon
    # pull a request ahead of work that arrived up to (margin - slack) before it; farther ones
    # change nothing.
    urgency_margin_ms: float = 30000.0
    # Applied when a request names no TTFT target of its own; 0: none.
    default_ttft_target_ms: float = 0.0
    # Resource need: queue time each token of (prompt + expected output) costs, so very large
    # requests yield a little to small ones (0 turns it off).
    resource_ms_per_token: float = 0.1
    default_max_tokens: int = 256
    max_pending_requests: int = 10000
    # Shedding order: priority 0 is refused once the queue is (1 - reserve) full, max_priority
    # only when it is full, linearly between: room stays for important work.
    shed_reserve_fraction: float = 0.2
    # Retry-after hint sent with RESOURCE_EXHAUSTED.
    retry_after_ms: int = 1000
    # Tenant fairness: equal-weight tenants get equal token throughput under saturation.
    default_tenant_weight: float = 1.0
    tenant_weights: dict[str, float] = field(default_factory=dict)
    # Most requests a tenant may have running at once across the fleet; absent: no cap.
    tenant_max_running: dict[str, int] = field(default_factory=dict)
    # Virtual token counter charges: a prompt token is cheaper than a generated one.
    fairness_prompt_token_weight: float = 0.25
    fairness_output_token_weight: float = 1.0
    # Across tenants, one priority level of a tenant's next request is worth this many counter
    # tokens: important work goes first, yet no tenant gets more than 10 levels' worth ahead.
    fairness_priority_credit_tokens: float = 64.0
    # Preemption: a waiting request may evict running work this many priority levels below it
    # when no executor has room; 0 disables. A request preempted max_preemptions times is safe.
    preempt_priority_gap: int = 3
    max_preemptions: int = 2
    # Output-length estimator: running mean per (tenant, prompt-length bucket) after this many samples.
    estimator_min_samples: int = 4
    estimator_alpha: float = 0.2
    # A tenant with nothing queued or running for this long loses its fairness counter and its
    # length estimates (it comes back as a new tenant would): Redis holds no state for every
    # tenant name ever sent. 0 keeps them for good.
    forget_idle_tenants_s: int = 86_400
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    # Words a request may ban (bad_words), each at most max_stop_string_chars long: the scheduler
    # tokenises them at submit, and the executor indexes them once per request.
    max_bad_words: int = 128
    max_prompt_chars: int = 1_000_000  # text prompts, conversations and Tokenize, checked before tokenising
    # Whether a conversation may bring its own Jinja chat template (used in place of the model's).
    # Off by default: even sandboxed, a template can build gigabytes or loop for minutes in the
    # scheduler, so only clients the operator trusts should send one.
    allow_request_chat_template: bool = False
    # One GenerateBatch stream: requests beyond this many unfinished ones get RESOURCE_EXHAUSTED
    # events of their own (nothing is queued for them); and once this many events wait for a slow
    # reader, the stream's requests stop reading their token streams until it catches up (the
    # tokens wait in Redis, so memory stays bounded).
    max_batch_stream_requests: int = 1024
    batch_stream_outbox_events: int = 4096
    # Most samples one request may ask for (SamplingParams.n); the batch size bounds it too, as its
    # samples share one executor.
    max_samples: int = 128
    # Each tenant's requests share cached prompt blocks only with the same tenant's, as if each
    # carried its tenant as a cache salt: no tenant can tell by timing what another sent. Off, as
    # in vLLM, tenants share what they have in common (a system prompt) unless a request salts it.
    prefix_cache_per_tenant: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.default_priority <= self.max_priority:
            raise ValueError("request_level.default_priority must lie in [0, max_priority]")
        for name in ("priority_credit_ms", "urgency_margin_ms", "default_ttft_target_ms", "resource_ms_per_token"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"request_level.{name} must be a finite number >= 0")
        if self.max_prompt_chars < 1 or self.max_batch_stream_requests < 1 or self.batch_stream_outbox_events < 1:
            raise ValueError(
                "request_level.max_prompt_chars, max_batch_stream_requests and batch_stream_outbox_events must be >= 1"
            )
        if not 1 <= self.max_samples < MAX_SAMPLES_BOUND:
            raise ValueError(f"request_level.max_samples must lie in [1, {MAX_SAMPLES_BOUND})")
        if self.default_max_tokens < 1 or self.max_pending_requests < 1:
            raise ValueError("request_level.default_max_tokens and max_pending_requests must be >= 1")
        if not 0.0 <= self.shed_reserve_fraction < 1.0 or self.retry_after_ms < 0:
            raise ValueError("request_level needs 0 <= shed_reserve_fraction < 1 and retry_after_ms >= 0")
        for tenant in (*self.tenant_weights, *self.tenant_max_running):
            check_name(tenant, "a tenant named in request_level")
        weights = [self.default_tenant_weight, *self.tenant_weights.values()]
        if not all(math.isfinite(w) and w > 0 for w in weights):
            raise ValueError("request_level tenant weights must be finite numbers > 0")
        if any(cap < 1 for cap in self.tenant_max_running.values()):
            raise ValueError("request_level.tenant_max_running caps must be >= 1")
        if (
            min(
                self.fairness_prompt_token_weight,
                self.fairness_output_token_weight,
                self.fairness_priority_credit_tokens,
            )
            < 0
        ):
            raise ValueError("request_level fairness token weights must be >= 0")
        if self.preempt_priority_gap < 0 or self.max_preemptions < 0:
            raise ValueError("request_level.preempt_priority_gap and max_preemptions must be >= 0")
        if self.estimator_min_samples < 1 or not 0 < self.estimator_alpha <= 1:
            raise ValueError("request_level needs estimator_min_samples >= 1 and 0 < estimator_alpha <= 1")
        if self.forget_idle_tenants_s < 0:
            raise ValueError("request_level.forget_idle_tenants_s must be >= 0 (0: never)")

    def tenant_weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, self.default_tenant_weight)


@dataclass(frozen=True)
class BatchLevelConfig:
    """How many requests share one executor batch, and which ones."""

    # vLLM's default too. The executor's KV room, checked at every placement, is the real bound:
    # a 64 cap left a wide workload (200 requests of up to 512 + 200 tokens) queueing behind
    # free KV, at 0.78x the throughput of 256 (docs/performance.md).
    max_batch_size: int = 256
    min_batch_size: int = 1
    # At low load an idle executor waits up to this long for min_batch_size requests; 0: never waits.
    batch_timeout_ms: float = 0.0
    # Length-aware merging may reorder queued requests whose scores lie within this window of the
    # head's, to join a batch whose lengths they fit; 0 keeps strict queue order.
    merge_window_ms: float = 500.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_batch_size <= self.max_batch_size:
            raise ValueError("batch_level needs 1 <= min_batch_size <= max_batch_size")
        if self.batch_timeout_ms < 0 or self.merge_window_ms < 0:
            raise ValueError("batch_level.batch_timeout_ms and merge_window_ms must be >= 0")


@dataclass(frozen=True)
class TokenLevelConfig:
    """Tokens per iteration: decodes plus chunked prefill."""

    # Room for a full batch's decodes plus a few prompts' prefill in one step (vLLM-CPU's is 4096):
    # a 512 budget spread a burst of prompts over many steps, doubling time to first token.
    token_budget: int = 2048
    max_prefill_chunk: int = 2048

    def __post_init__(self) -> None:
        if self.token_budget < 1 or self.max_prefill_chunk < 1:
            raise ValueError("token_level.token_budget and max_prefill_chunk must be >= 1")


@dataclass(frozen=True)
class LoadAwareConfig:
    """How the scheduler adapts to load, measured as the executors' mean KV cache use (0-1) or,
    when higher, their mean step time over ``target_step_ms``. Below ``low_load_threshold`` nothing
    changes; above ``high_load_threshold`` each adjustment is at full strength; linearly between."""

    low_load_threshold: float = 0.3
    high_load_threshold: float = 0.85
    # Step time that counts as full load; 0: judge by KV use alone.
    target_step_ms: float = 0.0
    # Under full load, deadline margins grow by this factor (urgency counts more) ...
    urgency_load_boost: float = 1.0
    # ... the resource-need penalty grows by this factor (very large requests yield) ...
    resource_load_boost: float = 2.0
    # ... new admissions shrink to this fraction of the free batch slots and KV blocks ...
    min_admission_fraction: float = 0.5
    # ... and the prefill token budget shrinks to this fraction, which protects running decodes.
    min_token_budget_fraction: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.low_load_threshold <= self.high_load_threshold <= 1.0:
            raise ValueError("load_aware needs 0 <= low_load_threshold <= high_load_threshold <= 1")
        if self.target_step_ms < 0 or self.urgency_load_boost < 0 or self.resource_load_boost < 0:
            raise ValueError("load_aware.target_step_ms, urgency_load_boost and resource_load_boost must be >= 0")
        for name in ("min_admission_fraction", "min_token_budget_fraction"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"load_aware.{name} must lie in (0, 1]")


@dataclass(frozen=True)
class DistributedConfig:
    """Redis, leases and heartbeats."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "baton"
    lease_ttl_ms: int = 3000
    heartbeat_interval_ms: int = 500
    executor_timeout_ms: int = 3000
    discovery_interval_ms: int = 250
    request_ttl_s: int = 3600
    # How long readers and writers ride out a Redis outage (retrying with backoff) before giving up.
    redis_retry_s: float = 30.0
    # A request whose executor died is re-queued at most this many times, then fails.
    max_migrations: int = 3
    # Token-stream batching (vLLM's stream_interval): a request's tokens reach its client (and
    # Redis) once this many have gathered, or once the oldest has waited stream_interval_ms (0: no
    # time limit). 1 streams every step's tokens at once. A first and a final event always go at
    # once. Sent to the executor with each admission; it holds the tokens (token_batching.py).
    stream_interval_tokens: int = 1
    stream_interval_ms: int = 0

    def __post_init__(self) -> None:
        if self.stream_interval_tokens < 1 or self.stream_interval_ms < 0:
            raise ValueError("distributed needs stream_interval_tokens >= 1 and stream_interval_ms >= 0")
        if self.heartbeat_interval_ms <= 0 or self.lease_ttl_ms <= self.heartbeat_interval_ms:
            raise ValueError("distributed needs 0 < heartbeat_interval_ms < lease_ttl_ms")
        if self.request_ttl_s < 1:
            raise ValueError("distributed.request_ttl_s must be >= 1")
        if self.redis_retry_s < 0 or self.max_migrations < 0:
            raise ValueError("distributed.redis_retry_s and max_migrations must be >= 0")


@dataclass(frozen=True)
class MonitoringConfig:
    """Logging and Prometheus."""

    log_level: str = "INFO"
    metrics_port: int = 0  # the scheduler's Prometheus /metrics port; 0 disables it
    executor_metrics_port: int = 0  # the executor's; separate so both can share one config file
    tracing: bool = False  # OpenTelemetry spans across gateway -> scheduler -> executor
    otlp_endpoint: str = ""  # where spans go (needs opentelemetry-exporter-otlp); empty: no exporter

    def __post_init__(self) -> None:
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"monitoring.log_level is not a level: {self.log_level}")


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler service."""

    host: str = "0.0.0.0"
    port: int = 50051
    # Where the scheduler finds the tokenizer; empty means the model path executors register.
    tokenizer: str = ""
    max_message_bytes: int = 16 * 1024 * 1024
    request_level: RequestLevelConfig = field(default_factory=RequestLevelConfig)
    batch_level: BatchLevelConfig = field(default_factory=BatchLevelConfig)
    token_level: TokenLevelConfig = field(default_factory=TokenLevelConfig)
    load_aware: LoadAwareConfig = field(default_factory=LoadAwareConfig)

    def __post_init__(self) -> None:
        # Every running request decodes one token per step; the budget must leave room for prefill.
        if self.token_level.token_budget <= self.batch_level.max_batch_size:
            raise ValueError("scheduler.token_level.token_budget must exceed batch_level.max_batch_size")


@dataclass(frozen=True)
class ExecutorConfig:
    """The executor service."""

    model: str = ""
    host: str = "0.0.0.0"
    port: int = 0  # 0 picks a free port
    # The address other services dial; empty means this host's own (common/netaddr.py: POD_IP, else
    # its first non-loopback IP, else its name) and the bound port.
    advertise_address: str = ""
    executor_id: str = ""  # empty: a random id
    dtype: str = "float32"
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    block_size: int = 16
    kv_cache_memory_mb: int = 512
    max_batch_size: int = 256
    token_budget: int = 2048  # the step budget until the scheduler's first plan sets it
    # Worker threads torch may use. 0: on CPU chosen per step (executor_service/cpu_threads.py):
    # every core that other processes leave for a heavy step; for a light one all but one, left to
    # the rest of the stack, while other processes use it; on CUDA torch's default. A fixed N
    # turns that off.
    torch_threads: int = 0
    # Step reports: 1 sends one per step. N > 1 holds plain decode tokens for up to N steps or
    # report_max_wait_ms, merged into one report; finishes, preemptions, plan acknowledgements,
    # pending prefill and first tokens still go at once (executor_service/token_batching.py).
    # For CPU hosts where the scheduler shares the cores. A request whose client takes chunks
    # (a stream interval) holds its tokens for its chunks whatever N is.
    report_every_steps: int = 1
    report_max_wait_ms: float = 50.0
    # The forward-pass backend (executor_service/backends/): "auto" picks the fastest whose declared
    # support covers the model, device and dtype; a name (cpu_native, cpu_transformers, cuda, torch)
    # asks for that one, and the executor refuses to start if it cannot serve the model. "torch" is
    # the reference: transformers' forward and public torch ops only.
    backend: str = "auto"
    # Whether backends may use torch's private ops (oneDNN prepacked linears, the BRGeMM micro-kernel),
    # each only after its self-test at start (executor_service/guarded_ops.py). False: public ops only.
    torch_private_ops: bool = True
    # Automatic prefix caching: finished and preempted requests' full KV blocks stay cached by
    # the hash of their prefix (common/block_hashing.py), and a request whose prompt starts the
    # same way starts from them instead of recomputing them. Cached blocks count as free and are
    # evicted least recently used first. False frees every block as soon as its request ends.
    prefix_caching: bool = True
    # On CUDA, decode-only steps of a backend with static shapes (the cuda backend) are captured as
    # CUDA graphs, one per batch bucket and table width, and replayed (executor_service/decode_graphs.py).
    # False runs the same padded steps eagerly. Ignored on the CPU, where nothing is captured.
    cuda_graphs: bool = True
    # Overlapped steps: a decode step is launched before the last step's tokens are read on the host,
    # so reading, detokenising and reporting them overlaps the device's work (Engine.step). "auto": where
    # the device computes asynchronously (CUDA); "on": on the CPU too, where it gains nothing (the host
    # computes the step itself); "off": each step's tokens are read before the next is planned.
    async_scheduling: str = "auto"
    # The nice value (0-19) of the executor's threads: above 0, the scheduler, Redis and the gateway
    # on the same host run first when they need the CPU, so a busy executor delays placing and
    # streaming requests less, at a cost in throughput when the host is saturated
    # (executor_service/cpu_priority.py). 0 leaves the priority the process started with.
    nice: int = 0

    def __post_init__(self) -> None:
        if self.executor_id:
            check_name(self.executor_id, "executor.executor_id")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"executor.dtype must be float32, float16 or bfloat16, not {self.dtype}")
        if self.block_size < 1 or self.kv_cache_memory_mb < 1:
            raise ValueError("executor.block_size and kv_cache_memory_mb must be >= 1")
        if self.max_batch_size < 1 or self.token_budget < 1:
            raise ValueError("executor.max_batch_size and token_budget must be >= 1")
        if self.report_every_steps < 1 or self.report_max_wait_ms < 0:
            raise ValueError("executor.report_every_steps must be >= 1 and report_max_wait_ms >= 0")
        if not self.backend:
            raise ValueError("executor.backend must be auto or a backend's name")
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ValueError(f"executor.async_scheduling must be auto, on or off, not {self.async_scheduling!r}")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"executor.nice must be 0-19, not {self.nice}")


def check_fleet_secret(secret: str, where: str) -> None:
    """The secret travels as gRPC metadata, which carries printable ASCII only."""
    if not secret or not all(0x21 <= ord(c) <= 0x7E for c in secret):
        raise ValueError(f"{where}: the fleet secret must be non-empty printable ASCII without spaces")


@dataclass(frozen=True)
class SecurityConfig:
    """TLS on gRPC ports (public and scheduler <-> executor), bearer-token auth on the public API and
    the fleet secret on executors' ports.

    Redis credentials and TLS go in ``distributed.redis_url`` (``redis://user:password@host``,
    ``rediss://`` for TLS, with ``?ssl_ca_certs=...``).
    """

    tls_cert: str = ""  # PEM certificate of this service's gRPC port; empty serves plaintext
    tls_key: str = ""  # its private key
    tls_ca: str = ""  # CA that signs peers: verifies executors' certs, and clients' when required
    require_client_cert: bool = False  # mTLS: callers must present a cert signed by tls_ca
    client_cert: str = ""  # the scheduler's own cert when it dials executors with mTLS
    client_key: str = ""
    auth_tokens_file: str = ""  # YAML mapping bearer token -> tenant ("*" = admin); empty disables auth
    # The fleet's shared secret: schedulers present it on every call to an executor, and executors
    # refuse any caller without it, so reaching an executor's port is not enough to drive it. Empty
    # (both) leaves executors open to whoever reaches them, as `baton dev` does on loopback.
    fleet_secret: str = ""
    fleet_secret_file: str = ""  # ... read from this file instead (a mounted Secret), so it stays out of configs

    def __post_init__(self) -> None:
        if self.fleet_secret and self.fleet_secret_file:
            raise ValueError("set security.fleet_secret or security.fleet_secret_file, not both")
        if self.fleet_secret:
            check_fleet_secret(self.fleet_secret, "security.fleet_secret")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("security.tls_cert and security.tls_key go together")
        if bool(self.client_cert) != bool(self.client_key):
            raise ValueError("security.client_cert and security.client_key go together")
        if self.require_client_cert and not (self.tls_cert and self.tls_ca):
            raise ValueError("security.require_client_cert needs tls_cert, tls_key and tls_ca")


@dataclass(frozen=True)
class BatonConfig:
    """The whole file."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
