"""The public Generation servicer: protobuf in and out, logic in Frontend."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from common.complete_response import complete_response
from common.grpc_metadata import REQUEST_ID_METADATA
from common.keys import split_sample_id
from common.lifecycle import FinishReason
from common.logprobs import Logprobs
from common.pb import generate_pb2 as pb
from common.pb import generate_pb2_grpc
from common.stop_reason import write_stop_reason
from scheduler_service.batch_stream import BatchStream
from scheduler_service.chat import Chat
from scheduler_service.first_messages import FirstMessages
from scheduler_service.frontend import Frontend, RequestStatus
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.requests import TokenEvent, parse_ids
from scheduler_service.samples import samples_of
from scheduler_service.token_texts import TokenTexts

log = logging.getLogger(__name__)


def response_pb(
    request_id: str, event: TokenEvent, sample_index: int = 0, texts: TokenTexts | None = None
) -> pb.GenerateResponse:
    """``texts`` names the tokens of an event's log probabilities (needed only when it has some)."""
    msg = pb.GenerateResponse(
        request_id=request_id,
        index=event.index,
        token_ids=event.token_ids,
        text=event.text,
        finish_reason=int(event.finish_reason),  # type: ignore[arg-type]
        sample_index=sample_index,
    )
    if event.finish_reason is not FinishReason.NONE:
        msg.usage.CopyFrom(usage_pb(event.usage))
    write_stop_reason(msg, event.stop_reason)
    if event.logprobs is not None or event.prompt_logprobs is not None:
        if texts is None:
            raise ValueError("an event with log probabilities needs the tokenizer's texts")
        if event.logprobs is not None:
            msg.logprobs.extend(positions_pb(event.logprobs, texts))
        if event.prompt_logprobs is not None:
            msg.prompt_logprobs.extend(positions_pb(event.prompt_logprobs, texts))
            msg.prompt_text = texts.joined(event.prompt_logprobs.token_ids)
    return msg


def positions_pb(logprobs: Logprobs, texts: TokenTexts) -> list[pb.PositionLogprobs]:
    """One message per position; the prompt's first token gets neither a logprob nor alternatives."""
    out = []
    for i, token in enumerate(logprobs.token_ids):
        if not logprobs.predicted(i):
            out.append(pb.PositionLogprobs(token=pb.TokenLogprob(token_id=token, text=texts(token))))
            continue
        top = [
            pb.TokenLogprob(token_id=t, logprob=x, text=texts(t), rank=place)
            for place, (t, x) in enumerate(logprobs.top(i), start=1)
        ]
        chosen = pb.TokenLogprob(token_id=token, logprob=logprobs.logprobs[i], text=texts(token))
        if logprobs.ranks[i]:  # 0: an executor that did not rank it
            chosen.rank = logprobs.ranks[i]
        out.append(pb.PositionLogprobs(token=chosen, top=top))
    return out


def usage_pb(usage: dict[str, float]) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        queue_time_ms=float(usage.get("queue_time_ms", 0.0)),
        ttft_ms=float(usage.get("ttft_ms", 0.0)),
        cached_tokens=int(usage.get("cached_tokens", 0)),
    )


def status_pb(status: RequestStatus) -> pb.GetRequestResponse:
    msg = pb.GetRequestResponse(
        request_id=status.request_id,
        state=int(status.state),  # type: ignore[arg-type]
        executor_id=status.executor_id,
        tokens_generated=status.tokens_generated,
        finish_reason=int(status.finish_reason),  # type: ignore[arg-type]
        prompt_tokens=status.prompt_tokens,
        error=status.error,
        sample_index=status.sample_index,
    )
    if status.queue_position is not None:
        msg.queue_position = status.queue_position
    msg.samples.extend(status_pb(sample) for sample in status.samples)
    return msg


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend, metrics: SchedulerMetrics) -> None:
        self._frontend = frontend
        self._metrics = metrics
        self._background: set[asyncio.Task[object]] = set()  # cancels outliving their handler
        self._stopping = False  # this replica is shutting down: a cut stream is not a client leaving

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        req = await self._frontend.submit_or_abandon(request, self._abandon)
        unfinished = req.n
        first = FirstMessages(req.prompt_ids, request.return_prompt_token_ids)
        try:
            # The response's headers say it was accepted, before its first token: a client (the
            # gateway) can start its own answer while the request waits in the queue. Inside the
            # try: a client that leaves as they go out still gets its request cancelled.
            await context.send_initial_metadata(((REQUEST_ID_METADATA, req.request_id),))
            async with contextlib.aclosing(self._frontend.sample_events(req.request_id, req.n)) as events:
                async for k, event in events:
                    unfinished -= event.finish_reason is not FinishReason.NONE
                    yield first.complete(await self._response(req.request_id, event, k), k)
        finally:
            if unfinished:  # the client went away or its deadline passed: free the executor's KV blocks
                self._abandon(req.request_id)

    async def GenerateBatch(
        self, request_iterator: AsyncIterator[pb.GenerateRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateBatchResponse]:
        stream = BatchStream(self._frontend, self._response, self._abandon)
        context.add_done_callback(lambda _call: stream.end())
        async with contextlib.aclosing(stream.run(request_iterator)) as messages:
            async for message in messages:
                yield message

    async def _response(self, request_id: str, event: TokenEvent, sample_index: int = 0) -> pb.GenerateResponse:
        has_logprobs = event.logprobs is not None or event.prompt_logprobs is not None
        texts = await self._frontend.token_texts() if has_logprobs else None
        return response_pb(request_id, event, sample_index, texts)

    def stop_serving(self) -> None:
        """This replica is stopping: the streams its shutdown cuts leave their requests running, for
        their clients to follow with ``Resume`` on another replica, as after a crash."""
        self._stopping = True

    def _abandon(self, request_id: str) -> None:
        """Cancel a request its client left unfinished, without holding up the handler's exit."""
        if self._stopping:
            log.info("request %s left running as this replica stops; its client can resume it elsewhere", request_id)
            return
        log.info("request %s abandoned by its client; cancelling", request_id)
        self._metrics.aborted.labels("client_gone").inc()
        task = asyncio.ensure_future(self._frontend.cancel(request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def Resume(
        self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        record = await self._frontend.authorize(request.request_id)  # NOT_FOUND before the stream starts
        n = samples_of(record)
        # A later sample's own id follows that sample alone; its index is in the id.
        offset = split_sample_id(request.request_id)[1]
        # Replayed from the start, each sample's first message is whole, as a Generate call's is.
        first = (
            FirstMessages(parse_ids(record.get("prompt_ids")), request.return_prompt_token_ids)
            if request.from_index == 0
            else None
        )
        async with contextlib.aclosing(
            self._frontend.sample_events(request.request_id, n, request.from_index)
        ) as events:
            async for k, event in events:
                response = await self._response(request.request_id, event, offset + k)
                yield first.complete(response, offset + k) if first is not None else response

    async def Complete(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.CompleteResponse:
        chunks = [chunk async for chunk in self.Generate(request, context)]
        return complete_response(chunks[0].request_id if chunks else request.request_id, chunks)

    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext) -> pb.CancelResponse:
        state = await self._frontend.cancel(request.request_id)
        self._metrics.aborted.labels("cancelled").inc()
        return pb.CancelResponse(state=int(state))  # type: ignore[arg-type]

    async def GetRequest(
        self, request: pb.GetRequestRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetRequestResponse:
        return status_pb(await self._frontend.status(request.request_id))

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        limits = await self._frontend.model_limits()
        executors = await self._frontend.alive_executors()
        return pb.ModelInfoResponse(
            model=limits.model,
            max_model_len=limits.max_model_len,
            executors=executors,
            sampling_defaults=limits.sampling_defaults.to_pb(),
        )

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        if request.WhichOneof("input") == "chat":
            ids = await self._frontend.tokenize_chat(Chat.from_pb(request.chat))
        else:
            special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = await self._frontend.tokenize(request.text, add_special_tokens=special)
        pieces = await self._frontend.token_pieces(ids) if request.return_token_strs else []
        limits = await self._frontend.model_limits()
        return pb.TokenizeResponse(token_ids=ids, token_strs=pieces, max_model_len=limits.max_model_len)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        return pb.DetokenizeResponse(text=await self._frontend.detokenize(list(request.token_ids)))
