"""Several samples of one prompt (``SamplingParams.n``): their requests, when the later ones may
run and where, and the one stream a client reads them from.

A request with n > 1 is n requests in Redis, queued together by one script: sample 0 under the
request's id (its record keeps ``n``), sample k under ``ID~k`` (``common.keys.sample_id``; no
client can choose such an id). Each is scheduled, preempted, migrated, finished and expired as
any request is, so every mechanism that keeps one request safe keeps each sample safe.

They share the prompt's KV blocks through the executors' prefix caches: admission holds the later
samples back until sample 0's first token is recorded (its prefill is done, and its executor has
named the prompt's full blocks), then places them on sample 0's executor whenever it has room,
where each one's admission finds those blocks cached and computes only the prompt's last,
partial block. A later sample so waits one prefill for its first token; the fleet computes the
prompt once rather than n times. Should sample 0 end or vanish before its first token, its
siblings are released anyway (they then run on their own, as separate requests would).

Sampling: with a seed, sample k uses seed + k (as vLLM does; modulo 2^64, as a negative seed sent
to the OpenAI API arrives in two's complement), so the samples differ and the request is
reproducible; without one, each sample's generator is seeded from fresh randomness. Greedy samples
are identical.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import replace

from common.errors import InvalidRequest
from common.keys import sample_id
from common.lifecycle import FinishReason, RequestState
from common.sampling_params import SEED_MAX
from scheduler_service.requests import NewRequest, TokenEvent

# A sample's record field naming its request's sample count (sample 0's only).
SAMPLES_FIELD = "n"
# A later sample's record field, "1" when it neither waits for sample 0 nor follows it: it asks for
# its prompt's log probabilities, so it computes the whole prompt itself whatever is cached.
ALONE_FIELD = "alone"
_PLACED = (RequestState.ASSIGNED.name, RequestState.RUNNING.name, RequestState.FINISHED.name)
_LIVE_BEFORE_OUTPUT = (RequestState.QUEUED.name, RequestState.ASSIGNED.name, RequestState.RUNNING.name)


def check_samples(n: int, limit: int) -> int:
    """The request's sample count (proto3's 0 means 1); InvalidRequest past ``limit``."""
    n = n or 1
    if n > limit:
        raise InvalidRequest(f"n must lie in [1, {limit}] (request_level.max_samples and the batch size), got {n}")
    return n


def sample_requests(req: NewRequest) -> list[NewRequest]:
    """The request's samples, sample 0 first: each its own id and, with a seed, seed + k."""
    out = [req]
    for k in range(1, req.n):
        seed = req.params.seed
        params = req.params if seed is None else replace(req.params, seed=(seed + k) & SEED_MAX)
        out.append(replace(req, request_id=sample_id(req.request_id, k), params=params, n=1))
    return out


def samples_of(record: dict[str, str]) -> int:
    """How many samples the request a record belongs to has (1 for a later sample's own record)."""
    raw = record.get(SAMPLES_FIELD, "")
    return int(raw) if raw.isdigit() and int(raw) > 1 else 1


def may_place(first_state: str | None, first_generated: int) -> bool:
    """Whether a later sample may be placed, given its sample 0's state (None: its record is gone)
    and output so far: once sample 0's prefill is done, or once it can no longer do it."""
    return first_state not in _LIVE_BEFORE_OUTPUT or first_generated > 0


def affinity(first_state: str | None, first_executor: str) -> str:
    """The executor a released later sample should go to: where sample 0 runs or ran, which caches
    the prompt's blocks ("" when it holds none: re-queued, cancelled, failed)."""
    return first_executor if first_state in _PLACED else ""


async def merged_events(
    follow: Callable[[str], AsyncIterator[TokenEvent]], request_id: str, n: int, buffer: int = 64
) -> AsyncGenerator[tuple[int, TokenEvent], None]:
    """Each sample's events as ``follow(sample id)`` gives them, tagged with the sample's index,
    in the order they arrive, until every sample has finished. A follower's error ends the merge
    with that error. The buffer is bounded, so a slow reader holds the followers back (their
    tokens wait in Redis) rather than growing it. Readers close it (``contextlib.aclosing``) when
    they stop early, which stops the followers at once."""
    if n == 1:
        async for event in follow(request_id):
            yield 0, event
        return
    merged: asyncio.Queue[tuple[int, TokenEvent] | BaseException] = asyncio.Queue(buffer)

    async def pump(index: int) -> None:
        try:
            async for event in follow(sample_id(request_id, index)):
                await merged.put((index, event))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the reader re-raises it
            await merged.put(exc)

    tasks = [asyncio.create_task(pump(k), name=f"samples-{request_id}-{k}") for k in range(n)]
    try:
        unfinished = n
        while unfinished:
            item = await merged.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item[1].finish_reason is not FinishReason.NONE:
                unfinished -= 1
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
