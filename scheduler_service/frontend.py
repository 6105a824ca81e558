"""What the public API does, in plain Python: submit, follow a request's events, cancel, describe.

The gRPC servicer only converts protobuf at the edge; tests can drive this class directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from redis.exceptions import ResponseError

from common.block_hashing import BlockNaming
from common.config import BatonConfig
from common.errors import DataLoss, InvalidRequest, NotFound, Overloaded, PermissionDenied
from common.keys import MAX_NAME_CHARS, NAME_ALPHABET, is_request_id, sample_id, split_sample_id
from common.lifecycle import FinishReason, RequestState
from common.pb import generate_pb2 as pb
from common.redis_client import with_redis_retry
from common.sampling_params import SamplingParams
from common.security import current_principal, fleet_secret
from common.tracing import current_traceparent, tag_current_span
from scheduler_service.chat import Chat, chat_prompt_ids
from scheduler_service.dispatcher import Dispatcher
from scheduler_service.grammar_check import GrammarCheck
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.priority import shed_limit
from scheduler_service.prompt_prefix import prefix_fields
from scheduler_service.requests import NewRequest, TokenEvent, join_runs
from scheduler_service.samples import merged_events, sample_requests, samples_of
from scheduler_service.scoring import RequestScorer
from scheduler_service.store import Store
from scheduler_service.token_texts import TokenTexts
from scheduler_service.tokenizer_source import ModelLimits, TokenizerSource
from scheduler_service.validation import validate

log = logging.getLogger(__name__)

T = TypeVar("T")

_BLOCK_MS = 2000
_LONG_PROMPT_CHARS = 20_000


async def _off_the_loop_if(heavy: bool, work: Callable[[], T]) -> T:
    """``work()``, on a worker thread when ``heavy``: a huge prompt's tokenising keeps the event loop
    responsive there, and a small one costs less than a thread hop here."""
    return await asyncio.to_thread(work) if heavy else work()


@dataclass(frozen=True)
class RequestStatus:
    request_id: str
    state: RequestState
    executor_id: str
    tokens_generated: int
    queue_position: int | None
    finish_reason: FinishReason
    prompt_tokens: int
    error: str
    sample_index: int = 0  # which sample of its request this describes
    samples: tuple[RequestStatus, ...] = ()  # with n > 1 asked by the request's id: every sample's


def _expired(request_id: str, index: int) -> RequestStatus:
    """A sample whose record expired (it ended long enough ago): described as ended, no more."""
    return RequestStatus(request_id, RequestState.UNSPECIFIED, "", 0, None, FinishReason.NONE, 0, "", index)


class Frontend:
    def __init__(
        self,
        store: Store,
        dispatcher: Dispatcher,
        tokenizers: TokenizerSource,
        config: BatonConfig,
        scorer: RequestScorer,
        metrics: SchedulerMetrics,
    ) -> None:
        """``scorer``: the one the dispatcher feeds with the fleet's load and the length estimator."""
        self.store = store
        self.dispatcher = dispatcher
        self.tokenizers = tokenizers
        self.config = config
        self.scorer = scorer
        self.metrics = metrics
        self._texts: TokenTexts | None = None
        self.grammar_check = GrammarCheck()
        # Prompts are named as the fleet's executors name their blocks: keyed by the same secret.
        self.naming = BlockNaming.for_fleet(fleet_secret(config.security))

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        limit = self.config.scheduler.request_level.max_prompt_chars
        if len(text) > limit:  # the same limit as a prompt's, before any tokenising
            raise InvalidRequest(f"text has {len(text)} characters; at most {limit}")
        tokenizer, _ = await self.tokenizers.get()
        encode = functools.partial(tokenizer.encode, text, add_special_tokens=add_special_tokens)  # type: ignore[attr-defined]
        return list(await _off_the_loop_if(len(text) > _LONG_PROMPT_CHARS, encode))

    async def token_pieces(self, token_ids: list[int]) -> list[str]:
        """Each token's piece as the vocabulary spells it (``convert_ids_to_tokens``)."""
        tokenizer, _ = await self.tokenizers.get()
        return [str(piece) for piece in tokenizer.convert_ids_to_tokens(token_ids)]  # type: ignore[attr-defined]

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens' text included; ids past the vocabulary are refused."""
        limit = self.config.scheduler.request_level.max_prompt_chars
        if len(token_ids) > limit:
            raise InvalidRequest(f"{len(token_ids)} token ids; at most {limit}")
        tokenizer, _ = await self.tokenizers.get()
        vocab = len(tokenizer)  # type: ignore[arg-type]
        if token_ids and max(token_ids) >= vocab:
            raise InvalidRequest(f"token id {max(token_ids)} is past the vocabulary ({vocab} tokens)")
        decode = functools.partial(tokenizer.decode, token_ids)  # type: ignore[attr-defined]
        return str(await _off_the_loop_if(len(token_ids) > _LONG_PROMPT_CHARS, decode))

    async def tokenize_chat(self, chat: Chat) -> list[int]:
        """The conversation's prompt ids under the model's chat template, within the prompt's limits."""
        request_level = self.config.scheduler.request_level
        if chat.chars > request_level.max_prompt_chars:  # before any templating, as for a prompt
            limit = request_level.max_prompt_chars
            raise InvalidRequest(f"chat has {chat.chars} characters (roles, contents, template); at most {limit}")
        tokenizer, _ = await self.tokenizers.get()
        render = functools.partial(chat_prompt_ids, tokenizer, chat, request_level.allow_request_chat_template)
        return await _off_the_loop_if(chat.chars > _LONG_PROMPT_CHARS, render)

    async def token_texts(self) -> TokenTexts:
        """The tokenizer's texts of single tokens, for log probabilities."""
        tokenizer, _ = await self.tokenizers.get()
        if self._texts is None or self._texts.tokenizer is not tokenizer:
            self._texts = TokenTexts(tokenizer)
        return self._texts

    async def model_limits(self) -> ModelLimits:
        _, limits = await self.tokenizers.get()
        return limits

    async def submit(self, msg: pb.GenerateRequest) -> NewRequest:
        principal = current_principal.get()
        if principal is not None and not principal.is_admin:
            if msg.tenant and msg.tenant != principal.tenant:
                raise PermissionDenied(f"this token may not submit for tenant {msg.tenant!r}")
            msg.tenant = principal.tenant  # with auth on, the token decides the tenant
        tokenizer, limits = await self.tokenizers.get()
        if msg.WhichOneof("input") == "chat":
            prompt_ids = await self.tokenize_chat(Chat.from_pb(msg.chat))
        else:
            special = msg.add_special_tokens if msg.HasField("add_special_tokens") else True
            prompt_ids = await self.tokenize(msg.prompt, add_special_tokens=special) if msg.prompt else []
        request_level = self.config.scheduler.request_level
        # A request's samples share one executor's batch (see ``samples``).
        max_samples = min(request_level.max_samples, self.config.scheduler.batch_level.max_batch_size)
        req = validate(
            msg,
            lambda _text: prompt_ids,
            limits,
            request_level,
            render_chat=lambda _chat: prompt_ids,
            max_samples=max_samples,
            encode_word=lambda word: list(tokenizer.encode(word, add_special_tokens=False)),  # type: ignore[attr-defined]
        )
        if req.params.structured_output is not None:  # a bad schema is refused here, not by an executor
            await self.grammar_check.check(req.params.structured_output)
        scored = self.scorer.score(req)
        tag_current_span(req.request_id)
        limit = shed_limit(req.priority, request_level)
        if req.n > limit:  # each sample counts against the queue's limit: these would never fit
            raise InvalidRequest(f"n={req.n} samples exceed the queue's limit for priority {req.priority} ({limit})")
        # The prompt's block names, for placement where an executor caches its start. A request for
        # its prompt's log probabilities computes the whole prompt (no cache), so it names none: it
        # earns no credit for a cached prefix and draws no later request after its own.
        scored_prompt = req.params.prompt_logprobs is not None
        block_size = 0 if scored_prompt else limits.block_size
        fields = {**scored.fields, **prefix_fields(req.prompt_ids, block_size, req.cache_salt, self.naming)}
        samples, traceparent, submission = sample_requests(req), current_traceparent(), secrets.token_hex(8)
        forgets_tenants = request_level.forget_idle_tenants_s > 0
        try:
            # Rides out a Redis restart as every other call does: sent again, the same submission
            # finds its own record if the first attempt landed.
            await self._retrying(
                lambda: self.store.requests.enqueue_samples(
                    samples, scored.score, limit, traceparent, fields, submission, forgets_tenants
                ),
                f"queueing {req.request_id}",
            )
        except Overloaded as exc:
            self.metrics.shed.labels(str(req.priority)).inc()
            raise Overloaded(
                f"the queue holds {limit} or more requests, the limit for priority {req.priority}; retry later",
                request_level.retry_after_ms,
            ) from exc
        log.info(
            "request %s queued: %d prompt tokens, priority %d, tenant %s, expected output %d, %d samples",
            req.request_id,
            len(req.prompt_ids),
            req.priority,
            req.tenant,
            scored.expected_output,
            req.n,
        )
        self.dispatcher.work_queued()
        return req

    async def submit_or_abandon(self, msg: pb.GenerateRequest, abandon: Callable[[str], None]) -> NewRequest:
        """``submit``, for a caller that may be cancelled part way (a client that left, a deadline):
        the submit runs to its end regardless, and a request it queued goes to ``abandon`` at once
        instead of running for nobody. Cancelling the submit itself would not undo its enqueue,
        which may be in Redis already (its batch went out before the caller was cancelled)."""
        submitting = asyncio.ensure_future(self.submit(msg))
        try:
            return await asyncio.shield(submitting)
        except asyncio.CancelledError:
            submitting.add_done_callback(functools.partial(_abandon_if_queued, abandon))
            raise

    def sample_events(
        self, request_id: str, n: int, from_index: int = 0
    ) -> AsyncGenerator[tuple[int, TokenEvent], None]:
        """Every sample's events (``events`` of each), tagged with its index, until all have
        finished; with n = 1 the request's own."""
        return merged_events(lambda sample: self.events(sample, from_index), request_id, n)

    async def samples(self, request_id: str) -> int:
        """How many samples ``request_id`` names: its request's n for a request's own id, 1 for a
        later sample's (``ID~k``); NotFound or PermissionDenied as ``authorize``."""
        return samples_of(await self.authorize(request_id))

    async def events(self, request_id: str, from_index: int = 0) -> AsyncIterator[TokenEvent]:
        """The request's events from output index ``from_index`` on, ending with its finish event.

        Events carry their output index, so a replayed or duplicated entry (a retried write, a
        migration) is trimmed here and the client never sees a token twice or a gap.
        """
        next_index = from_index
        last_id = "0"
        what = f"reading {request_id}"
        while True:
            try:
                batch = await self._retrying(functools.partial(self._read_events, request_id, last_id), what)
            except ResponseError:
                if not await self.store.streams.is_malformed(request_id):
                    raise
                await self._end_malformed(request_id)
                continue  # the stream now holds the request's final event
            if not batch:
                record = await self._retrying(functools.partial(self.store.requests.get, request_id), what)
                if record is None:
                    raise NotFound(f"request {request_id} does not exist or has expired")
                lost = _lost_final_event(record)
                if lost is not None:
                    for event in await self._end_from_record(request_id, next_index, lost):
                        yield event
                    return
            ready: list[TokenEvent] = []
            for entry_id, event in batch:
                last_id = entry_id
                if event.index > next_index:
                    repair = await self._repair_gap(request_id, next_index, event.index)
                    if repair is not None:
                        next_index = event.index
                        ready.append(repair)
                end = event.index + len(event.token_ids)
                if end > next_index or event.finish_reason is not FinishReason.NONE:
                    if event.index < next_index:  # a replayed prefix: keep the new tail
                        skip = min(next_index - event.index, len(event.token_ids))
                        # (A final event behind a resume past the end says where the output ends.)
                        event = replace(event.after(skip), index=min(next_index, end))
                        if event.token_ids:  # its text was the whole event's: the tail's, decoded
                            event = replace(event, text=await self._decode(request_id, event.token_ids))
                    next_index = max(next_index, end)
                    ready.append(event)
                if event.finish_reason is not FinishReason.NONE:
                    break
            # Several entries arrive at once when this client fell behind (its previous message was
            # still being written): they go out as one message, the same tokens no later, one
            # message's cost instead of several on a busy replica.
            for event in join_runs(ready):
                yield event
                if event.finish_reason is not FinishReason.NONE:
                    return

    async def _end_from_record(self, request_id: str, start: int, reason: FinishReason) -> list[TokenEvent]:
        """The end of a request whose record ended without its final event reaching its stream (its
        writer died between the two): the tokens recorded since ``start``, then the final event,
        published too, so every other reader ends and the stream gets its TTL."""
        end = await self._retrying(lambda: self.store.requests.token_count(request_id), f"reading {request_id}")
        events = []
        if end > start and (repair := await self._repair_gap(request_id, start, end)) is not None:
            events.append(repair)
        recorded = await self._retrying(
            lambda: self.store.requests.final_event(request_id, reason), f"reading {request_id}"
        )
        final = replace(recorded, index=max(start, end))
        await self._retrying(lambda: self.store.streams.publish_final(request_id, final), f"ending {request_id}")
        log.warning("request %s ended without its final event; sent it from its record", request_id)
        return join_runs([*events, final])

    async def _end_malformed(self, request_id: str) -> None:
        """The request's output stream holds another type: end the request FAILED (its stream is
        replaced by one with the final event), or, if it had already ended, say the output is lost."""
        try:
            record = await self.store.requests.get(request_id)
            executor_id = record.get("executor", "") if record else ""
        except ResponseError:  # the record is malformed too
            executor_id = ""
        if not await self.store.requests.quarantine(request_id, "its output stream in Redis is malformed", executor_id):
            raise DataLoss(f"the output stream of request {request_id} is malformed in Redis")

    async def _repair_gap(self, request_id: str, start: int, end: int) -> TokenEvent | None:
        """Tokens recorded but never published (their writer died between the two steps).

        The request's token list is the source of truth, so the client still gets every token
        exactly once; the text is decoded here, as the executor's text for them was lost.
        """
        tokens = await self._retrying(
            lambda: self.store.requests.tokens_between(request_id, start, end), f"reading the tokens of {request_id}"
        )
        if len(tokens) != end - start:
            return None
        text = await self._decode(request_id, tokens)
        log.info("request %s: repaired a gap of %d tokens from its record", request_id, len(tokens))
        return TokenEvent(start, tokens, text)

    async def _decode(self, request_id: str, tokens: Sequence[int]) -> str:
        """The text of ``tokens`` decoded alone, as the request's ``skip_special_tokens`` says."""
        tokenizer, _ = await self.tokenizers.get()
        skip = await self._skips_special_tokens(request_id)
        return tokenizer.decode(list(tokens), skip_special_tokens=skip)  # type: ignore[attr-defined,no-any-return]

    async def _skips_special_tokens(self, request_id: str) -> bool:
        """The request's skip_special_tokens (True where its record is gone)."""
        record = await self._retrying(lambda: self.store.requests.get(request_id), f"reading {request_id}")
        try:
            return SamplingParams.from_json(record["params"]).skip_special_tokens if record else True
        except (KeyError, TypeError, ValueError):  # a malformed record: its gap reads as most requests' would
            return True

    async def _read_events(self, request_id: str, last_id: str) -> list[tuple[str, TokenEvent]]:
        return await self.store.streams.follow(request_id, last_id, _BLOCK_MS)

    async def _retrying(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """Every Redis call of a client's stream rides out an outage (up to ``redis_retry_s``). A
        stream written by this replica's own links gets no XREAD to fail on while Redis is down:
        its read just times out empty, and the existence check after it is then the first call
        to meet the outage."""
        return await with_redis_retry(call, self.config.distributed.redis_retry_s, what)

    async def authorize(self, request_id: str) -> dict[str, str]:
        """The request's record, if it exists and the caller's tenant owns it."""
        if not is_request_id(request_id):
            # Read as a key, "abc:tokens" would be request abc's token list: refused, not looked up.
            raise InvalidRequest(
                f"request_id must be 1-{MAX_NAME_CHARS} characters of {NAME_ALPHABET} (ID~k for a later sample)"
            )
        record = await self.store.requests.get(request_id)
        if record is None:
            raise NotFound(f"request {request_id} does not exist or has expired")
        principal = current_principal.get()
        if principal is not None and not principal.is_admin and record.get("tenant") != principal.tenant:
            raise PermissionDenied(f"request {request_id} belongs to another tenant")
        return record

    async def cancel(self, request_id: str) -> RequestState:
        """Cancel the request; with n > 1 every sample of it (the state returned is sample 0's, or,
        when sample 0 ended and expired while later ones go on, the first of those)."""
        try:
            record = await self.authorize(request_id)
        except NotFound:
            return await self._cancel_outliving_samples(request_id)
        n = samples_of(record)
        state = await self._cancel_one(request_id)
        for k in range(1, n):
            with contextlib.suppress(NotFound):  # it expired before sample 0: nothing left to cancel
                await self._cancel_one(sample_id(request_id, k))
        return state

    async def _cancel_outliving_samples(self, request_id: str) -> RequestState:
        """Cancel the later samples of a request whose sample 0 ended and expired (its record named
        their count) while they went on: a sample preempted or re-queued often can outlive it."""
        if split_sample_id(request_id)[1]:
            raise NotFound(f"request {request_id} does not exist or has expired")
        limit = self.config.scheduler.request_level.max_samples
        samples = [sample_id(request_id, k) for k in range(1, limit)]
        states = []
        for sample, exists in zip(samples, await self.store.requests.exist(samples), strict=True):
            if exists:
                await self.authorize(sample)
                with contextlib.suppress(NotFound):  # it expired meanwhile
                    states.append(await self._cancel_one(sample))
        if not states:
            raise NotFound(f"request {request_id} does not exist or has expired")
        return states[0]

    async def _cancel_one(self, request_id: str) -> RequestState:
        outcome = await self.store.requests.cancel(request_id)
        if outcome.state is None:
            raise NotFound(f"request {request_id} does not exist or has expired")
        if outcome.ended_here:
            # It was queued: end its stream here, as no executor will.
            event = await self.store.requests.final_event(request_id, FinishReason.CANCELLED)
            await self.store.streams.publish_final(request_id, event)
        elif outcome.state in (RequestState.ASSIGNED, RequestState.RUNNING):
            await self.dispatcher.request_abort(request_id, outcome.executor_id)
        return outcome.state

    async def status(self, request_id: str) -> RequestStatus:
        """The request's state; for a request's own id with n > 1, each sample's too (``samples``)."""
        record = await self.authorize(request_id)
        own = await self._status_of(request_id, record)
        n = samples_of(record)
        if n == 1:
            return own
        samples = [own]
        for k in range(1, n):
            sample = sample_id(request_id, k)
            sample_record = await self.store.requests.get(sample)
            if sample_record is None:  # expired before sample 0
                samples.append(_expired(sample, k))
            else:
                samples.append(await self._status_of(sample, sample_record))
        return replace(own, samples=tuple(samples))

    async def _status_of(self, request_id: str, record: dict[str, str]) -> RequestStatus:
        state = RequestState[record["state"]]
        position = await self.store.queue.position(request_id) if state is RequestState.QUEUED else None
        reason = record.get("finish_reason", "")
        return RequestStatus(
            request_id=request_id,
            state=state,
            executor_id=record.get("executor", ""),
            tokens_generated=_count(record.get("tokens_generated")),
            queue_position=position,
            finish_reason=FinishReason[reason] if reason else FinishReason.NONE,
            prompt_tokens=_count(record.get("prompt_len")),
            error=record.get("error", ""),
            sample_index=split_sample_id(request_id)[1],
        )

    async def alive_executors(self) -> int:
        return await self.dispatcher.alive_executors()


def _abandon_if_queued(abandon: Callable[[str], None], submitting: asyncio.Future[NewRequest]) -> None:
    if not submitting.cancelled() and submitting.exception() is None:
        abandon(submitting.result().request_id)


# How long after a request's record ended its final event may still be on its way to the stream:
# the writer that ends a record publishes the event right after, in the same task.
_FINAL_EVENT_GRACE_MS = 5_000


def _lost_final_event(record: dict[str, str]) -> FinishReason | None:
    """How the request ended, where its record ended long enough ago that its final event, not in
    its stream, was lost; None while it runs or its event may still come."""
    finished = record.get("finished_ms", "")
    state = RequestState.__members__.get(record.get("state", ""))
    if state is None or not state.is_terminal or not finished.isdigit():
        return None
    if time.time() * 1000 - int(finished) < _FINAL_EVENT_GRACE_MS:
        return None
    return FinishReason.__members__.get(record.get("finish_reason", ""), FinishReason.ERROR)


def _count(raw: str | None) -> int:
    """A count field of a record; 0 when absent or, in a malformed record, not a number."""
    return int(raw) if raw and raw.isdigit() else 0
