"""Per-request timings and the figures ``vllm bench serve`` reports: TTFT, TPOT, ITL, E2E, throughput, goodput.

Definitions follow vLLM's benchmark so the two tables compare line by line:
- TTFT: send to the first chunk that carries a token;
- TPOT: (E2E - TTFT) / (output tokens - 1), per request with more than one token;
- ITL: the gaps between successive token-carrying chunks, over all requests;
- E2E: send to the last chunk;
- throughput: over the benchmark's duration, from the first send to the last finish;
- goodput: requests per second that met every SLO given (``ttft``, ``tpot``, ``e2el``, in ms).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestTiming:
    """What the client saw of one request; times are ``time.perf_counter()`` seconds."""

    prompt_len: int
    expected_len: int  # tokens asked for
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each token-carrying chunk
    output_len: int = 0  # tokens received
    error: str = ""  # empty when the request finished normally
    cached_len: int = 0  # prompt tokens the server read from its prefix cache (the final usage's)

    @property
    def ok(self) -> bool:
        return not self.error and self.output_len > 0

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.sent

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between closest ranks, as numpy's default."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency metric, in milliseconds."""

    mean: float
    std: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Distribution:
        ms = [s * 1000 for s in seconds]
        if not ms:
            return cls(math.nan, math.nan, math.nan, math.nan, math.nan)
        std = statistics.pstdev(ms) if len(ms) > 1 else 0.0
        return cls(statistics.fmean(ms), std, percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


@dataclass(frozen=True)
class Summary:
    """A benchmark run's figures."""

    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    cached_input_tokens: int  # of input_tokens, those read from a prefix cache instead of computed
    output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # generated tokens / s
    total_token_throughput: float  # (prompt + generated tokens of completed requests) / s
    request_goodput: float | None  # requests meeting every SLO / s; None without SLOs
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    short_requests: int  # completed with fewer tokens than asked

    def to_dict(self) -> dict[str, object]:
        """Flat keys named as in ``vllm bench serve --save-result`` (``mean_ttft_ms``, ``p99_itl_ms``...)."""
        out: dict[str, object] = {
            "completed": self.completed,
            "failed": self.failed,
            "duration": self.duration_s,
            "total_input_tokens": self.input_tokens,
            "total_cached_input_tokens": self.cached_input_tokens,
            "total_output_tokens": self.output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "short_requests": self.short_requests,
        }
        for name in ("ttft", "tpot", "itl", "e2el"):
            dist: Distribution = getattr(self, name)
            out |= {
                f"mean_{name}_ms": dist.mean,
                f"median_{name}_ms": dist.p50,
                f"std_{name}_ms": dist.std,
                f"p50_{name}_ms": dist.p50,
                f"p90_{name}_ms": dist.p90,
                f"p99_{name}_ms": dist.p99,
            }
        return out


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput takes METRIC:MS with METRIC one of {', '.join(GOODPUT_METRICS)}; got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: the SLO must not be negative")
    return slos


def _meets(timing: RequestTiming, slos: Mapping[str, float]) -> bool:
    values = {"ttft": timing.ttft, "tpot": timing.tpot or 0.0, "e2el": timing.e2el}
    return all(values[name] * 1000 <= limit for name, limit in slos.items())


def summarize(timings: Sequence[RequestTiming], duration_s: float, slos: Mapping[str, float] | None = None) -> Summary:
    done = [t for t in timings if t.ok]
    duration = max(duration_s, 1e-9)
    output_tokens = sum(t.output_len for t in done)
    input_tokens = sum(t.prompt_len for t in done)
    goodput = None if not slos else sum(_meets(t, slos) for t in done) / duration
    return Summary(
        completed=len(done),
        failed=len(timings) - len(done),
        duration_s=duration_s,
        input_tokens=input_tokens,
        cached_input_tokens=sum(t.cached_len for t in done),
        output_tokens=output_tokens,
        request_throughput=len(done) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        request_goodput=goodput,
        ttft=Distribution.of([t.ttft for t in done]),
        tpot=Distribution.of([tp for t in done if (tp := t.tpot) is not None]),
        itl=Distribution.of([gap for t in done for gap in t.itls]),
        e2el=Distribution.of([t.e2el for t in done]),
        short_requests=sum(t.output_len < t.expected_len for t in done),
    )
