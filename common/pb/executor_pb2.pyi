from . import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExecSampling(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "min_p", "logit_bias", "include_stop_str_in_output", "logprobs", "prompt_logprobs", "keep_special_tokens", "allowed_token_ids", "bad_words", "structured_output")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KEEP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    include_stop_str_in_output: bool
    logprobs: int
    prompt_logprobs: int
    keep_special_tokens: bool
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenIds]
    structured_output: _generate_pb2.StructuredOutput
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., include_stop_str_in_output: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., keep_special_tokens: _Optional[bool] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., structured_output: _Optional[_Union[_generate_pb2.StructuredOutput, _Mapping]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling", "rank", "traceparent", "stream_interval_tokens", "stream_interval_ms", "prefix_root")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ROOT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: ExecSampling
    rank: float
    traceparent: str
    stream_interval_tokens: int
    stream_interval_ms: int
    prefix_root: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[ExecSampling, _Mapping]] = ..., rank: _Optional[float] = ..., traceparent: _Optional[str] = ..., stream_interval_tokens: _Optional[int] = ..., stream_interval_ms: _Optional[int] = ..., prefix_root: _Optional[int] = ...) -> None: ...

class PrefillGrant(_message.Message):
    __slots__ = ("request_id", "num_tokens", "expected_cached")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CACHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    expected_cached: int
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., expected_cached: _Optional[int] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("seq", "iteration", "admit", "abort", "preempt", "prefill", "token_budget")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    seq: int
    iteration: int
    admit: _containers.RepeatedCompositeFieldContainer[AdmitRequest]
    abort: _containers.RepeatedScalarFieldContainer[str]
    preempt: _containers.RepeatedScalarFieldContainer[str]
    prefill: _containers.RepeatedCompositeFieldContainer[PrefillGrant]
    token_budget: int
    def __init__(self, seq: _Optional[int] = ..., iteration: _Optional[int] = ..., admit: _Optional[_Iterable[_Union[AdmitRequest, _Mapping]]] = ..., abort: _Optional[_Iterable[str]] = ..., preempt: _Optional[_Iterable[str]] = ..., prefill: _Optional[_Iterable[_Union[PrefillGrant, _Mapping]]] = ..., token_budget: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs", "num_top", "top_token_ids", "top_logprobs", "ranks")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    num_top: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., num_top: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "index", "logprobs", "prompt_logprobs", "cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    index: int
    logprobs: TokenLogprobs
    prompt_logprobs: TokenLogprobs
    cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class FinishedRequest(_message.Message):
    __slots__ = ("request_id", "finish_reason", "text", "error", "stop_string", "stop_token_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    finish_reason: int
    text: str
    error: str
    stop_string: str
    stop_token_id: int
    def __init__(self, request_id: _Optional[str] = ..., finish_reason: _Optional[int] = ..., text: _Optional[str] = ..., error: _Optional[str] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("num_running", "kv_blocks_used", "kv_blocks_total", "step_time_ns", "num_tokens", "source", "utilization_pct", "memory_used_bytes", "memory_total_bytes", "power_watts", "pending_prefill_tokens", "prefix_cache_queries", "prefix_cache_hits")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PCT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    POWER_WATTS_FIELD_NUMBER: _ClassVar[int]
    PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    step_time_ns: int
    num_tokens: int
    source: str
    utilization_pct: float
    memory_used_bytes: int
    memory_total_bytes: int
    power_watts: float
    pending_prefill_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    def __init__(self, num_running: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., step_time_ns: _Optional[int] = ..., num_tokens: _Optional[int] = ..., source: _Optional[str] = ..., utilization_pct: _Optional[float] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., power_watts: _Optional[float] = ..., pending_prefill_tokens: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ...) -> None: ...

class KvCacheEvents(_message.Message):
    __slots__ = ("cleared", "stored", "removed")
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    cleared: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, cleared: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("iteration", "plan_seq", "tokens", "finished", "preempted", "load", "rejected", "kv_events")
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    PLAN_SEQ_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    plan_seq: int
    tokens: _containers.RepeatedCompositeFieldContainer[TokenDelta]
    finished: _containers.RepeatedCompositeFieldContainer[FinishedRequest]
    preempted: _containers.RepeatedScalarFieldContainer[str]
    load: Load
    rejected: _containers.RepeatedCompositeFieldContainer[FinishedRequest]
    kv_events: KvCacheEvents
    def __init__(self, iteration: _Optional[int] = ..., plan_seq: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[TokenDelta, _Mapping]]] = ..., finished: _Optional[_Iterable[_Union[FinishedRequest, _Mapping]]] = ..., preempted: _Optional[_Iterable[str]] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., rejected: _Optional[_Iterable[_Union[FinishedRequest, _Mapping]]] = ..., kv_events: _Optional[_Union[KvCacheEvents, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("executor_id", "model", "max_model_len", "kv_blocks_total", "block_size", "dtype", "device", "max_batch_size", "token_budget", "eos_token_ids", "vocab_size", "prefix_caching", "backend", "kv_window_tokens")
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    executor_id: str
    model: str
    max_model_len: int
    kv_blocks_total: int
    block_size: int
    dtype: str
    device: str
    max_batch_size: int
    token_budget: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    vocab_size: int
    prefix_caching: bool
    backend: str
    kv_window_tokens: int
    def __init__(self, executor_id: _Optional[str] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., max_batch_size: _Optional[int] = ..., token_budget: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., vocab_size: _Optional[int] = ..., prefix_caching: _Optional[bool] = ..., backend: _Optional[str] = ..., kv_window_tokens: _Optional[int] = ...) -> None: ...
