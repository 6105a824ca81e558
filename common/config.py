"""Baton's configuration: one YAML file, overridable by ``BATON_*`` env vars, loaded into frozen dataclasses.

Env overrides name a key by its path with double underscores, e.g.
``BATON_SCHEDULER__BATCH_LEVEL__MAX_BATCH_SIZE=32`` or ``BATON_EXECUTOR__DTYPE=bfloat16``.
Values are parsed as YAML scalars. An unknown key, in the file or the environment, is an error.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class RequestLevelConfig:
    """Per-request admission and priority knobs."""

    default_priority: int = 5
    max_priority: int = 10
    # Aging: each priority level is worth this much queue time, so a low-priority request
    # overtakes newer high-priority ones after at most (10 * credit) ms: no starvation.
    priority_credit_ms: float = 1000.0
    default_max_tokens: int = 256
    max_pending_requests: int = 10000
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_prompt_chars: int = 1_000_000

    def __post_init__(self) -> None:
        if not 0 <= self.default_priority <= self.max_priority:
            raise ValueError("request_level.default_priority must lie in [0, max_priority]")
        if not (math.isfinite(self.priority_credit_ms) and self.priority_credit_ms >= 0):
            raise ValueError("request_level.priority_credit_ms must be a finite number >= 0")
        if self.default_max_tokens < 1 or self.max_pending_requests < 1:
            raise ValueError("request_level.default_max_tokens and max_pending_requests must be >= 1")


@dataclass(frozen=True)
class BatchLevelConfig:
    """How many requests share one executor batch."""

    max_batch_size: int = 64
    min_batch_size: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_batch_size <= self.max_batch_size:
            raise ValueError("batch_level needs 1 <= min_batch_size <= max_batch_size")


@dataclass(frozen=True)
class TokenLevelConfig:
    """Tokens per iteration: decodes plus chunked prefill."""

    token_budget: int = 512
    max_prefill_chunk: int = 512

    def __post_init__(self) -> None:
        if self.token_budget < 1 or self.max_prefill_chunk < 1:
            raise ValueError("token_level.token_budget and max_prefill_chunk must be >= 1")


@dataclass(frozen=True)
class LoadAwareConfig:
    """Load thresholds (fraction of KV cache in use) between which the scheduler adapts."""

    low_load_threshold: float = 0.3
    high_load_threshold: float = 0.85

    def __post_init__(self) -> None:
        if not 0.0 <= self.low_load_threshold <= self.high_load_threshold <= 1.0:
            raise ValueError("load_aware needs 0 <= low_load_threshold <= high_load_threshold <= 1")


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

    def __post_init__(self) -> None:
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
    # The address other services dial; empty means this host's name and the bound port.
    advertise_address: str = ""
    executor_id: str = ""  # empty: a random id
    dtype: str = "float32"
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    block_size: int = 16
    kv_cache_memory_mb: int = 512
    max_batch_size: int = 256
    token_budget: int = 512
    # Worker threads torch may use; 0 keeps torch's default.
    torch_threads: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"executor.dtype must be float32, float16 or bfloat16, not {self.dtype}")
        if self.block_size < 1 or self.kv_cache_memory_mb < 1:
            raise ValueError("executor.block_size and kv_cache_memory_mb must be >= 1")
        if self.max_batch_size < 1 or self.token_budget < 1:
            raise ValueError("executor.max_batch_size and token_budget must be >= 1")


@dataclass(frozen=True)
class SecurityConfig:
    """TLS on gRPC ports (public and scheduler <-> executor) and bearer-token auth on the public API.

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

    def __post_init__(self) -> None:
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


def _build(cls: type, data: Mapping[str, Any], path: str) -> Any:
    if not isinstance(data, Mapping):
        raise ValueError(f"config section {path or '<root>'} must be a mapping")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise ValueError(f"unknown config key {path}{key!s}; known: {', '.join(sorted(known))}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(typing.cast(type, hint), value or {}, f"{path}{key}.")
        else:
            kwargs[key] = _coerce(hint, value, f"{path}{key}")
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, path: str) -> Any:
    base = hint
    if isinstance(hint, types.UnionType):
        base = next(a for a in typing.get_args(hint) if a is not type(None))
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        raise ValueError(f"config key {path} must be {base.__name__}, got {value!r}")
    return value


def _set_path(tree: dict[str, Any], parts: list[str], value: Any) -> None:
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"env override names a value, not a section: {'.'.join(parts)}")
        node = child
    node[parts[-1]] = value


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Turn ``BATON_A__B=value`` variables into a nested mapping."""
    tree: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith("BATON_") or "__" not in name:
            continue
        parts = [p.lower() for p in name[len("BATON_") :].split("__")]
        _set_path(tree, parts, yaml.safe_load(raw) if raw != "" else "")
    return tree


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> BatonConfig:
    """Load the YAML file (if any), apply env overrides, and validate."""
    data: dict[str, Any] = {}
    if path:
        loaded = yaml.safe_load(Path(path).read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
        data = loaded or {}
    data = _merge(data, env_overrides(os.environ if environ is None else environ))
    return typing.cast(BatonConfig, _build(BatonConfig, data, ""))


def with_overrides(config: BatonConfig, **sections: Mapping[str, Any]) -> BatonConfig:
    """Return a copy with some keys replaced, e.g. from CLI flags: ``with_overrides(c, executor={"model": d})``."""
    data = dataclasses.asdict(config)
    cleaned = {k: {kk: vv for kk, vv in v.items() if vv is not None} for k, v in sections.items()}
    return typing.cast(BatonConfig, _build(BatonConfig, _merge(data, cleaned), ""))
