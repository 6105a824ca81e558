"""The Starlette app: OpenAI's HTTP routes over one ``grpc.aio`` channel to a Baton scheduler.

Every generation request watches its HTTP connection: when the client goes away the gRPC call
is cancelled, and Baton cancels a request whose client abandoned its call, freeing its KV blocks.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from common.grpc_metadata import accepted
from common.keys import sample_id
from common.pb import generate_pb2 as pb
from common.pb import generate_pb2_grpc
from common.tracing import client_interceptors
from gateway.anthropic_messages import MessageEvents, message_of
from gateway.anthropic_messages import chat_body as anthropic_chat_body
from gateway.anthropic_messages import count_body as anthropic_count_body
from gateway.anthropic_messages import error_body as anthropic_error
from gateway.auth import Caller, ClientAuth
from gateway.choice_stream import ChoiceStream
from gateway.cors import OPEN_TO_ANY_ORIGIN, CorsPolicy
from gateway.errors import BadRequest, GatewayError, ModelNotFound, from_rpc_error
from gateway.followed_call import FollowedCall, FollowedComplete, StreamCall
from gateway.metrics import GatewayMetrics, HttpMetrics
from gateway.openai_logprobs import ChoiceLogprobs
from gateway.openai_responses import ResponseEvents, chat_body, response_of, responses_error
from gateway.openai_tokenize import parse_detokenize, parse_tokenize, tokenize_answer
from gateway.openai_tools import TOOL_CALL_PARSERS
from gateway.openai_types import (
    REQUEST_ID_HEADER,
    TENANT_HEADER,
    Parsed,
    Reply,
    RunningUsage,
    apply_headers,
    apply_model_defaults,
    parse_chat,
    parse_completion,
    prompts_usage,
)
from gateway.reasoning import Reasoning
from gateway.request_id_header import RequestIdHeader
from gateway.served_model import ServedModels

log = logging.getLogger(__name__)

_HEALTH_TIMEOUT_S = 3.0
_INFO_TIMEOUT_S = 10.0
_DONE = b"data: [DONE]\n\n"
_CLIENT_CLOSED = 499  # nginx's convention; nobody reads it, the client is gone


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _sse_stream(chunks: AsyncIterator[dict[str, Any] | None]) -> AsyncIterator[bytes]:
    """A chat or completions stream as server-sent events, closed by OpenAI's [DONE]."""
    async for chunk in chunks:
        yield _DONE if chunk is None else _sse(chunk)


class _EventEncoder(Protocol):
    """Another API's stream events of a chat stream (``ResponseEvents``, ``MessageEvents``)."""

    def feed(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]: ...

    def end(self) -> list[dict[str, Any]]: ...


async def _typed_events(chunks: AsyncIterator[dict[str, Any] | None], encoder: _EventEncoder) -> AsyncIterator[bytes]:
    """A chat stream as another API's typed events (``event:`` and ``data:`` lines), as OpenAI's
    Responses API and Anthropic's Messages API send them: no [DONE]."""
    async for chunk in chunks:
        for event in encoder.end() if chunk is None else encoder.feed(chunk):
            yield b"event: " + event["type"].encode() + b"\n" + _sse(event)


@dataclass(frozen=True)
class _Generation:
    """An OpenAI request as Baton's requests (one per prompt), and how to answer it."""

    parsed: Parsed
    requests: list[pb.GenerateRequest]
    reply: Reply
    headers: dict[str, str]


# A body larger than this is refused (413) before it is read whole: it cannot be a prompt the
# scheduler accepts (``request_level.max_prompt_chars``, 1 M characters by default) and would only
# hold memory.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


async def _read_body(request: Request, limit: int) -> bytes:
    too_large = GatewayError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:  # a chunked body states no length: count as it comes
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


# JSON may escape half of a UTF-16 surrogate pair on its own, which no Unicode string holds (protobuf
# refuses it). Only a body with such an escape is checked in full.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def _json_body(request: Request, limit: int) -> dict[str, Any]:
    raw = await _read_body(request, limit)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deep
        raise BadRequest("the request body must be a JSON object") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw) and not _is_unicode(body):
        raise BadRequest("the request body holds a lone surrogate escape (\\ud800-\\udfff), which is not text")
    return body


def _is_unicode(body: dict[str, Any]) -> bool:
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, RecursionError):
        return False
    return True


async def _cancel_on_disconnect(request: Request, calls: Sequence[FollowedComplete | StreamCall]) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or the end of the response).
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for call in calls:
        call.cancel()


async def _messages(calls: Sequence[StreamCall], firsts: Sequence[Any]) -> AsyncGenerator[tuple[int, Any], None]:
    """Each call's messages as (the call's index, the message), the ``firsts`` already read; a
    call's end is ``grpc.aio.EOF``. One call is read in place; several are read side by side, each
    message passed on as it arrives, and a call's error is raised here."""
    if len(calls) == 1:
        message = firsts[0]
        while True:
            yield 0, message
            if message is grpc.aio.EOF:
                return
            message = await calls[0].read()
    arrived: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, call: StreamCall) -> None:
        try:
            while (message := await call.read()) is not grpc.aio.EOF:
                arrived.put_nowait((i, message))
        except grpc.aio.AioRpcError as exc:
            arrived.put_nowait((i, exc))
            return
        arrived.put_nowait((i, grpc.aio.EOF))

    for i, first in enumerate(firsts):
        arrived.put_nowait((i, first))
    pumps = [asyncio.create_task(pump(i, call)) for i, call in enumerate(calls) if firsts[i] is not grpc.aio.EOF]
    try:
        while True:
            i, message = await arrived.get()
            if isinstance(message, grpc.aio.AioRpcError):
                raise message
            yield i, message
    finally:
        for task in pumps:
            task.cancel()


def _client_gone(watcher: asyncio.Task[None]) -> bool:
    """Whether a CancelledError came from the watcher cancelling the gRPC call, not from this task's cancellation."""
    task = asyncio.current_task()
    return watcher.done() and not watcher.cancelled() and (task is None or task.cancelling() == 0)


class Gateway:
    """The route handlers, sharing one channel to ``target`` (a scheduler, or a balancer in front of several).

    Every route but ``/health``, ``/version`` and ``/metrics`` identifies its caller first
    (``ClientAuth``) and makes its calls to the scheduler with the caller's own credential.
    """

    def __init__(
        self,
        target: str,
        tracing: bool = False,
        auth: ClientAuth | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        model_aliases: Sequence[str] = (),
        tool_call_parser: str = "",
        reasoning_parser: str = "",
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """``credentials``: TLS (or mTLS) to the scheduler; None dials it in plaintext."""
        if max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        if tool_call_parser and tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"unknown tool-call parser {tool_call_parser!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}"
            )
        if tool_call_parser == "openai" and reasoning_parser != "openai_gptoss":
            # gpt-oss's calls are harmony messages, which only that reasoning parser splits out.
            raise ValueError(
                "the openai tool-call parser reads gpt-oss's harmony output: it needs the openai_gptoss "
                "reasoning parser beside it (--reasoning-parser openai_gptoss)"
            )
        self.tool_call_parser = tool_call_parser
        self.reasoning = Reasoning(reasoning_parser) if reasoning_parser else None
        self.target = target
        self.credentials = credentials
        self.tracing = tracing
        self.auth = auth or ClientAuth()
        self.max_body_bytes = max_body_bytes
        self.served = ServedModels(self._model_info, model_aliases)
        self._channel: grpc.aio.Channel | None = None

    @property
    def channel(self) -> grpc.aio.Channel:
        # Made on first use: a grpc.aio channel belongs to the event loop it was made in, the server's.
        if self._channel is None:
            interceptors = client_interceptors(self.tracing)
            if self.credentials is None:
                self._channel = grpc.aio.insecure_channel(self.target, interceptors=interceptors)
            else:
                self._channel = grpc.aio.secure_channel(self.target, self.credentials, interceptors=interceptors)
        return self._channel

    @property
    def stub(self) -> generate_pb2_grpc.GenerationStub:
        return generate_pb2_grpc.GenerationStub(self.channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        yield
        await self.close()

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, served as the chat request it amounts to (``openai_responses``)."""
        caller = self.auth.caller(request.headers)
        body, echo = chat_body(await _json_body(request, self.max_body_bytes))
        try:
            return await self._answer(
                request,
                caller,
                body,
                chat=True,
                whole_as=lambda whole: response_of(whole, echo),
                stream_as=lambda chunks: _typed_events(chunks, ResponseEvents(echo)),
            )
        except GatewayError as error:
            raise responses_error(error) from error

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API, served as the chat request it amounts to
        (``anthropic_messages``); its errors in Anthropic's shape."""
        try:
            caller = self.auth.caller(request.headers)
            body = anthropic_chat_body(await _json_body(request, self.max_body_bytes))
            return await self._answer(
                request,
                caller,
                body,
                chat=True,
                whole_as=message_of,
                stream_as=lambda chunks: _typed_events(chunks, MessageEvents()),
            )
        except GatewayError as error:
            return JSONResponse(anthropic_error(error), status_code=error.status, headers=error.headers)

    async def count_message_tokens(self, request: Request) -> Response:
        """Anthropic's ``/v1/messages/count_tokens``: the tokens of the prompt a Messages request
        would have, as ``/tokenize`` renders it."""
        try:
            caller = self.auth.caller(request.headers)
            model, call = parse_tokenize(anthropic_count_body(await _json_body(request, self.max_body_bytes)))
            out = await self._tokenizer_call(self.stub.Tokenize, call, model, caller)
        except GatewayError as error:
            return JSONResponse(anthropic_error(error), status_code=error.status, headers=error.headers)
        return JSONResponse({"input_tokens": len(out.token_ids)})

    async def _generate(self, request: Request, chat: bool) -> Response:
        caller = self.auth.caller(request.headers)  # before the body: an unknown caller learns nothing
        body = await _json_body(request, self.max_body_bytes)
        return await self._answer(request, caller, body, chat)

    async def _answer(
        self,
        request: Request,
        caller: Caller,
        body: Mapping[str, Any],
        chat: bool,
        whole_as: Callable[[dict[str, Any]], dict[str, Any]] = lambda whole: whole,
        stream_as: Callable[[AsyncIterator[dict[str, Any] | None]], AsyncIterator[bytes]] = _sse_stream,
    ) -> Response:
        """The answer to an OpenAI request's ``body``: a whole one in the shape ``whole_as`` gives
        it, a stream encoded by ``stream_as`` (OpenAI's server-sent chunks by default)."""
        generation = await self._prepare(request, caller, body, chat)
        if not generation.parsed.stream:
            whole = await self._whole(request, caller, generation)
            return whole if isinstance(whole, Response) else JSONResponse(whole_as(whole), headers=generation.headers)
        chunks = await self._open_stream(request, caller, generation)
        if isinstance(chunks, Response):
            return chunks
        return StreamingResponse(stream_as(chunks), media_type="text/event-stream", headers=generation.headers)

    async def _prepare(self, request: Request, caller: Caller, body: Mapping[str, Any], chat: bool) -> _Generation:
        """The Baton requests of an OpenAI request's ``body``, and how to answer it."""
        parsed = parse_chat(body, self.tool_call_parser) if chat else parse_completion(body)
        reasoning = None
        if chat and self.reasoning is not None:
            reasoning = self.reasoning.for_request(json.loads(parsed.request.chat.chat_template_kwargs or "{}"))
            reasoning.prepare(parsed.request.params)
        apply_headers(parsed.request, request.headers)
        self.auth.scope(parsed.request, caller, request.headers.get(TENANT_HEADER, ""))
        model = await self.served.resolve(parsed.model, caller.metadata)
        if (served := self.served.latest) is not None:
            apply_model_defaults(parsed.request.params, body, served.sampling_defaults)
        requests = parsed.requests()  # one per prompt: a completion may list several
        reply = Reply.for_request(chat, parsed, model, reasoning)
        # Baton's id, for GetRequest and Cancel: the body's request_id only names the response.
        baton_id = parsed.request.request_id
        log.debug("request %s: %s, stream=%s", baton_id, request.url.path, parsed.stream)
        return _Generation(parsed, requests, reply, {REQUEST_ID_HEADER: baton_id})

    async def _whole(self, request: Request, caller: Caller, generation: _Generation) -> dict[str, Any] | Response:
        """The whole answer's body; a Response where the client left before it."""
        parsed, requests, reply = generation.parsed, generation.requests, generation.reply
        calls = [FollowedComplete(self.stub, r, caller.metadata) for r in requests]
        watcher = asyncio.create_task(_cancel_on_disconnect(request, calls))
        try:
            outs = list(await asyncio.gather(*calls))
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        except asyncio.CancelledError:
            if _client_gone(watcher):
                log.info("request %s: client disconnected; cancelled", reply.request_id)
                return Response(status_code=_CLIENT_CLOSED)
            raise
        finally:
            watcher.cancel()
            for call in calls:  # a no-op for those that ended; the others' requests are cancelled
                call.cancel()
        failed = [s for out in outs for s in (out.samples or [out]) if s.finish_reason == pb.FINISH_REASON_ERROR]
        if failed:
            raise GatewayError(500, await self._failure(caller, failed[0].request_id), code="generation_failed")
        return reply.whole(outs, lambda i, sample: _choice_logprobs(reply, parsed, requests[i]).shape(sample))

    async def _open_stream(
        self, request: Request, caller: Caller, generation: _Generation
    ) -> AsyncIterator[dict[str, Any] | None] | Response:
        """The stream's chunks (``_chunks``) once Baton has accepted its requests; a refusal is
        raised as its HTTP error, and a Response is returned where the client left before that."""
        reply, requests = generation.reply, generation.requests
        # Each followed to another scheduler replica should its own go away mid-stream.
        calls: list[StreamCall] = [
            FollowedCall(self.stub, r, caller.metadata)
            if r.params.n <= 1
            else self.stub.Generate(r, metadata=caller.metadata)
            for r in requests
        ]
        watcher = asyncio.create_task(_cancel_on_disconnect(request, calls))
        try:
            # Baton's headers come once it has accepted a request, before its first token: the
            # answer starts then, as vLLM's does, while a refused request (bad input, full queue),
            # which ends without them, gets its HTTP status instead of a 200 with an error event.
            headers = await asyncio.gather(*(call.initial_metadata() for call in calls))
            firsts = None
            if not all(accepted(h) for h in headers):  # refused: reading raises its error
                firsts = list(await asyncio.gather(*(call.read() for call in calls)))
        except grpc.aio.AioRpcError as exc:
            watcher.cancel()
            for call in calls:
                call.cancel()
            raise from_rpc_error(exc) from None
        except asyncio.CancelledError:
            gone = _client_gone(watcher)
            watcher.cancel()
            for call in calls:
                call.cancel()
            if gone:
                log.info("request %s: client disconnected while queued; cancelled", reply.request_id)
                return Response(status_code=_CLIENT_CLOSED)
            raise
        return self._chunks(calls, firsts, watcher, caller, generation)

    async def _chunks(
        self,
        calls: list[StreamCall],
        firsts: list[Any] | None,
        watcher: asyncio.Task[None],
        caller: Caller,
        generation: _Generation,
    ) -> AsyncIterator[dict[str, Any] | None]:
        """Each chunk of the stream (or an error body, which ends it), then None where the stream
        ended without its client leaving. ``firsts``: each call's first message, where already read."""
        parsed, requests, reply = generation.parsed, generation.requests, generation.reply
        n = max(1, parsed.request.params.n)
        # Each finished choice's usage, by prompt and sample; the stream ends when every choice has one.
        usages: dict[tuple[int, int], pb.Usage] = {}
        choices: dict[int, ChoiceStream] = {}  # each choice's chunks, message by message
        messages: AsyncGenerator[tuple[int, Any], None] | None = None
        try:
            if firsts is None:
                firsts = list(await asyncio.gather(*(call.read() for call in calls)))
            running = RunningUsage([first.usage.prompt_tokens for first in firsts]) if parsed.continuous_usage else None
            messages = _messages(calls, firsts)
            if reply.chat:
                for index in range(n):  # a chat has one prompt
                    usage = running.of(0, index) if running else None
                    yield reply.chunk("", role=True, index=index, usage=usage)
            async for prompt, message in messages:
                if message is grpc.aio.EOF:
                    if all((prompt, k) in usages for k in range(n)):
                        continue  # this prompt's stream ended after its last choice: others go on
                    yield GatewayError(502, "Baton's stream ended without a finish reason").body()
                    break
                reason, sample = message.finish_reason, message.sample_index
                if reason == pb.FINISH_REASON_ERROR:
                    failed = sample_id(requests[prompt].request_id, sample)
                    failure = GatewayError(500, await self._failure(caller, failed), code="generation_failed")
                    yield failure.body()
                    break
                index = prompt * n + sample  # OpenAI's numbering of a batch's choices
                choice = choices.get(index)
                if choice is None:
                    shape = _choice_logprobs(reply, parsed, requests[prompt])
                    choice = choices[index] = ChoiceStream(reply, index, shape)
                usage = running.add(prompt, index, len(message.token_ids)) if running else None
                for chunk in choice.chunks(message, usage):
                    yield chunk
                if reason:
                    usages[prompt, sample] = message.usage
                if len(usages) == n * len(calls):
                    if parsed.include_usage:
                        per_prompt = [[usages[p, k] for k in range(n)] for p in range(len(calls))]
                        yield reply.usage_chunk(prompts_usage(per_prompt))
                    break
        except grpc.aio.AioRpcError as exc:
            yield from_rpc_error(exc).body()
        except asyncio.CancelledError:
            if not _client_gone(watcher):
                raise
            log.info("request %s: client disconnected mid-stream; cancelled", reply.request_id)
            return
        finally:
            if messages is not None:
                await messages.aclose()
            watcher.cancel()
            for call in calls:  # a no-op for a call that ended; otherwise Baton cancels the request
                call.cancel()
        yield None

    async def _failure(self, caller: Caller, request_id: str) -> str:
        """Baton's recorded reason for a failed request, best effort."""
        fallback = f"request {request_id} failed inside Baton"
        try:
            status = await self.stub.GetRequest(
                pb.GetRequestRequest(request_id=request_id), timeout=_INFO_TIMEOUT_S, metadata=caller.metadata
            )
        except grpc.aio.AioRpcError:
            return fallback
        return f"{fallback}: {status.error}" if status.error else fallback

    async def _model_info(self, metadata: tuple[tuple[str, str], ...]) -> pb.ModelInfoResponse:
        return await self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=_INFO_TIMEOUT_S, metadata=metadata)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize``: a prompt's or a conversation's token ids, as Baton would prompt with them."""
        caller = self.auth.caller(request.headers)
        model, call = parse_tokenize(await _json_body(request, self.max_body_bytes))
        out = await self._tokenizer_call(self.stub.Tokenize, call, model, caller)
        return JSONResponse(tokenize_answer(out, call.return_token_strs))

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``/detokenize``: the text of token ids."""
        caller = self.auth.caller(request.headers)
        model, call = parse_detokenize(await _json_body(request, self.max_body_bytes))
        out = await self._tokenizer_call(self.stub.Detokenize, call, model, caller)
        return JSONResponse({"prompt": out.text})

    async def _tokenizer_call(self, rpc: Any, call: Any, model: str, caller: Caller) -> Any:
        """``rpc(call)`` for ``caller``, once ``model`` names the served model (empty: it does)."""
        await self.served.resolve(model, caller.metadata)
        try:
            return await rpc(call, timeout=_INFO_TIMEOUT_S, metadata=caller.metadata)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    async def models(self, request: Request) -> Response:
        # Behind auth as in OpenAI's API, where listing models needs a key too.
        served = await self.served.current(self.auth.caller(request.headers).metadata)
        return JSONResponse({"object": "list", "data": [served.card(name) for name in served.names]})

    async def model(self, request: Request) -> Response:
        served = await self.served.current(self.auth.caller(request.headers).metadata)
        name = request.path_params["model"]
        if name not in served.names:
            raise ModelNotFound(name)
        return JSONResponse(served.card(name))

    async def health(self, request: Request) -> Response:
        """Open to all, as probes carry no key; the scheduler's health service is open too."""
        check = health_pb2_grpc.HealthStub(self.channel).Check
        try:
            answer = await check(health_pb2.HealthCheckRequest(), timeout=_HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return JSONResponse({"status": "UNREACHABLE", "target": self.target, "detail": exc.code().name}, 503)
        serving = answer.status == health_pb2.HealthCheckResponse.SERVING
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
        return JSONResponse({"status": status, "target": self.target}, status_code=200 if serving else 503)


def _choice_logprobs(reply: Reply, parsed: Parsed, request: pb.GenerateRequest) -> ChoiceLogprobs:
    # A truncated prompt is echoed as Baton decodes what it kept, not as the request gave it.
    prompt = "" if request.params.HasField("truncate_prompt_tokens") else request.prompt
    if reply.chat:
        prompt = parsed.echo_text
    return ChoiceLogprobs(reply.chat, parsed.echo, parsed.logprobs, prompt, parsed.tokens_as_ids, parsed.echo_top)


async def _version(request: Request) -> Response:
    """vLLM's ``/version``: Baton's, open to all as ``/health`` is."""
    return JSONResponse({"version": importlib.metadata.version("baton")})


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return GatewayError(exc.status_code, exc.detail, code=None).response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return GatewayError(500, "internal error in the gateway", code="internal").response()


def create_app(
    target: str,
    tracing: bool = False,
    auth_tokens: Mapping[str, str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    model_aliases: Sequence[str] = (),
    tool_call_parser: str = "",
    reasoning_parser: str = "",
    cors: CorsPolicy = OPEN_TO_ANY_ORIGIN,
    credentials: grpc.ChannelCredentials | None = None,
) -> Starlette:
    """The gateway's ASGI app, forwarding to the Baton scheduler at ``target`` (``HOST:PORT``).

    With ``tracing``, each call to the scheduler carries the trace context (OpenTelemetry). With
    ``auth_tokens`` (bearer token -> tenant, as the scheduler's ``auth_tokens_file``), every route
    but ``/health``, ``/version`` and ``/metrics`` needs one of those tokens (see ``gateway.auth``). A
    body over ``max_body_bytes`` is answered 413. A request's ``model`` must name the served model, as the
    executors registered it or as one of ``model_aliases``. ``tool_call_parser`` (one of
    ``openai_tools.TOOL_CALL_PARSERS``) serves tool_choice "auto", reading the calls in the model's
    syntax; empty, "auto" is refused. ``reasoning_parser`` (``reasoning.REASONING_PARSERS``) splits chat
    answers' thinking from them (``reasoning``). ``cors``: which web pages may call it (``gateway.cors``).
    ``credentials``: TLS (or mTLS) to the scheduler; None dials it in plaintext.
    """
    gateway = Gateway(
        target,
        tracing,
        ClientAuth(auth_tokens),
        max_body_bytes,
        model_aliases,
        tool_call_parser,
        reasoning_parser,
        credentials,
    )
    routes = [
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
        Route("/v1/responses", gateway.responses, methods=["POST"]),
        Route("/v1/messages", gateway.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", gateway.count_message_tokens, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/v1/models/{model:path}", gateway.model, methods=["GET"]),
        Route("/tokenize", gateway.tokenize, methods=["POST"]),
        Route("/detokenize", gateway.detokenize, methods=["POST"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/version", _version, methods=["GET"]),
    ]
    metrics = GatewayMetrics(routes)
    routes.append(Route("/metrics", metrics.endpoint, methods=["GET"]))
    handlers = {GatewayError: _gateway_error, HTTPException: _http_error, Exception: _unexpected}
    app = Starlette(
        routes=routes,
        exception_handlers=handlers,
        lifespan=gateway.lifespan,
        middleware=[cors.middleware(), Middleware(HttpMetrics, metrics=metrics), Middleware(RequestIdHeader)],
    )
    app.state.gateway = gateway
    return app
