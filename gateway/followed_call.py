"""A request's ``Generate`` stream that outlives the scheduler replica serving it.

A replica that stops (a rolling update: its shutdown cuts the streams it has not finished) or dies
leaves its requests running, driven by another replica; a client follows one there with
``Resume`` from the output index it has reached (``docs/deployment.md``). ``FollowedCall`` does
that for the gateway, whose own clients could not: when a stream Baton accepted ends with the
status of a server that went away, it asks the same channel (which reconnects to a live replica,
through the address's other endpoints or a balancer in front of them) whether Baton holds the
request, then opens ``Resume`` there and goes on reading, so the HTTP stream sees no gap and no
repeat. It tries for ``FOLLOW_WINDOW_S``, then passes on the error as before.
``FollowedComplete`` does the same for a whole answer: a ``Complete`` call cut so is followed
from the start, once a live replica says Baton holds the request, and its answer assembled from
the stream as ``Complete`` assembles it.

A call of several samples is not followed: ``Resume`` follows sample 0 only together with every
other sample, from one index, while each sample has reached its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Generator
from typing import Any, Protocol, cast

import grpc

from common.complete_response import complete_response
from common.grpc_metadata import REQUEST_ID_METADATA
from common.pb import generate_pb2 as pb
from common.pb import generate_pb2_grpc

log = logging.getLogger(__name__)

# How long a stream may go without a live replica before its error reaches the client: a replica
# taking over a dead one's executors waits for the lease to lapse (seconds), a restart longer.
FOLLOW_WINDOW_S = 30.0
# What a stream cut by a replica going away ends with: UNAVAILABLE (a shutdown, a lost
# connection), CANCELLED, INTERNAL or UNKNOWN where the connection dropped mid-frame.
_SERVER_GONE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
)
_FIRST_RETRY_S, _LONGEST_RETRY_S = 0.1, 2.0
_HELD_TIMEOUT_S = 10.0  # for a replica to connect and say whether it holds a cut Complete's request


async def held(
    stub: generate_pb2_grpc.GenerationStub, request_id: str, metadata: tuple[tuple[str, str], ...], timeout_s: float
) -> bool:
    """Whether a live replica holds ``request_id`` (a call cut before its request was queued leaves
    none), asked within ``timeout_s`` of whichever replica the channel reaches next, which may take a
    moment to connect; False where none answers in time."""
    ask = pb.GetRequestRequest(request_id=request_id)
    try:
        await stub.GetRequest(ask, metadata=metadata, timeout=timeout_s, wait_for_ready=True)
    except grpc.aio.AioRpcError:
        return False
    return True


class StreamCall(Protocol):
    """What the gateway reads a stream through: a ``grpc.aio`` stream call, or a ``FollowedCall``."""

    async def initial_metadata(self) -> Any: ...

    async def read(self) -> Any: ...

    def cancel(self) -> bool: ...


class FollowedCall:
    """``stub.Generate(request)``, read as a ``grpc.aio`` stream call is (``initial_metadata``,
    ``read``, ``cancel``), followed with ``Resume`` once accepted."""

    def __init__(
        self,
        stub: generate_pb2_grpc.GenerationStub,
        request: pb.GenerateRequest,
        metadata: tuple[tuple[str, str], ...],
        accepted: bool = False,
    ) -> None:
        """``accepted``: Baton holds the request, whose own call went away before it answered:
        it is followed from its start at once (a ``Complete``'s)."""
        self._stub, self._metadata = stub, metadata
        self._asks_prompt_ids = request.return_prompt_token_ids
        self._request_id = ""  # Baton's id for it, once accepted: what Resume follows
        self._next_index = 0  # the output index of the next token the reader has not had
        self._first_read = False  # a first message, with what only a first carries, was read
        self._ended = False  # its final message was read
        self._following = False  # the current call is a Resume, whose cancel cancels nothing
        self._cancels: set[asyncio.Task[Any]] = set()
        if accepted:
            self._request_id = request.request_id
            self._call: Any = self._resume()
        else:
            self._call = stub.Generate(request, metadata=metadata)

    async def initial_metadata(self) -> Any:
        headers = await self._call.initial_metadata()
        self._request_id = next((str(v) for k, v in headers or () if k == REQUEST_ID_METADATA), "")
        return headers

    async def read(self) -> Any:
        lost_since: float | None = None  # when the last replica went away, while none answers
        delay = _FIRST_RETRY_S
        while True:
            try:
                message = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                if not self._request_id or exc.code() not in _SERVER_GONE:
                    raise
                now = time.monotonic()
                lost_since = now if lost_since is None else lost_since
                if self._following:  # the last try failed too: wait before the next
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, _LONGEST_RETRY_S)
                left = FOLLOW_WINDOW_S - (time.monotonic() - lost_since)
                if left <= 0 or not await held(self._stub, self._request_id, self._metadata, left):
                    raise
                log.info(
                    "request %s: its replica went away (%s); following it from token %d",
                    self._request_id,
                    exc.code().name,
                    self._next_index,
                )
                self._call = self._resume()
                continue
            if message is not grpc.aio.EOF:
                self._next_index = message.index + len(message.token_ids)
                self._first_read = True
                self._ended = self._ended or bool(message.finish_reason)
            return message

    def _resume(self) -> Any:
        """A Resume call from where the reader is; from the start, its first message whole."""
        resume = pb.ResumeRequest(
            request_id=self._request_id,
            from_index=self._next_index,
            return_prompt_token_ids=self._asks_prompt_ids and not self._first_read,
        )
        self._following = True
        return self._stub.Resume(resume, metadata=self._metadata)

    def cancel(self) -> bool:
        """Stop reading; an unfinished request is cancelled, as a ``Generate`` call's cancel does."""
        cancelled = bool(self._call.cancel())
        if self._following and not self._ended and self._request_id:
            # A Resume call only reads: its cancel leaves the request running for nobody.
            task = asyncio.ensure_future(self._cancel_request())
            self._cancels.add(task)
            task.add_done_callback(self._cancels.discard)
            self._ended = True
        return cancelled

    async def _cancel_request(self) -> None:
        try:
            await self._stub.Cancel(pb.CancelRequest(request_id=self._request_id), metadata=self._metadata, timeout=10)
        except grpc.aio.AioRpcError as exc:
            log.warning("request %s: its cancel failed (%s); it runs on unread", self._request_id, exc.code().name)


class FollowedComplete:
    """``stub.Complete(request)``, awaited and cancelled as that call is, followed from its start
    where its replica went away before answering and a live one holds the request."""

    def __init__(
        self, stub: generate_pb2_grpc.GenerationStub, request: pb.GenerateRequest, metadata: tuple[tuple[str, str], ...]
    ) -> None:
        self._stub, self._request, self._metadata = stub, request, metadata
        self._call: Any = stub.Complete(request, metadata=metadata)
        self._followed: FollowedCall | None = None
        self._cancelled = False

    def __await__(self) -> Generator[Any, None, pb.CompleteResponse]:
        return self._answer().__await__()

    async def _answer(self) -> pb.CompleteResponse:
        try:
            return cast(pb.CompleteResponse, await self._call)
        except grpc.aio.AioRpcError as exc:
            request_id = self._request.request_id
            if exc.code() not in _SERVER_GONE or self._request.params.n > 1:
                raise
            if not await held(self._stub, request_id, self._metadata, _HELD_TIMEOUT_S):
                raise
            log.info("request %s: its replica went away (%s); following it", request_id, exc.code().name)
            followed = self._followed = FollowedCall(self._stub, self._request, self._metadata, accepted=True)
            if self._cancelled:  # the client left while a replica was sought
                followed.cancel()
                raise asyncio.CancelledError from None
            chunks = []
            while (message := await followed.read()) is not grpc.aio.EOF:
                chunks.append(message)
            return complete_response(self._request.request_id, chunks)

    def cancel(self) -> bool:
        """Cancel the request, as a ``Complete`` call's cancel does."""
        self._cancelled = True
        return self._followed.cancel() if self._followed is not None else bool(self._call.cancel())
