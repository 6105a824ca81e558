"""A gateway answer outlives the scheduler replica it reads from: stopped (a rolling update) or
killed, the replica's requests are followed on another with ``Resume``, and the client's stream
goes on with no gap, no repeat and no error; a whole answer comes whole."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import openai
import pytest
import redis

from tests.gateway.serving import serve_gateway
from tests.process_stack import ProcessStack
from tests.stack import eventually

NO_EOS = {"ignore_eos": True}
REQUEST = "{baton}:req:%s"


@dataclass
class TwoReplicas:
    processes: ProcessStack
    api: openai.AsyncOpenAI  # the gateway's, over both replicas
    model: str
    redis: redis.Redis

    def state(self, request_id: str) -> str | None:
        return self.redis.hget(REQUEST % request_id, "state")  # type: ignore[return-value]

    async def lose_first(self, how: str) -> None:
        """The replica the gateway reads from goes away: stopped, or killed."""
        if how == "stop":
            assert await asyncio.to_thread(self.processes.stop, "sched-1") == 0
        else:
            self.processes.kill("sched-1")

    def completion(self, max_tokens: int, **extra: object) -> dict[str, object]:
        return {"model": self.model, "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0, **extra}


@contextlib.asynccontextmanager
async def two_replicas(processes: ProcessStack) -> AsyncIterator[TwoReplicas]:
    """An executor, two scheduler replicas and a gateway whose channel reads from the first, its
    first address, and reconnects to the other."""
    processes.start_executor("exec-a")
    first = processes.start_scheduler("sched-1")
    second = processes.start_scheduler("sched-2")
    client = redis.Redis.from_url(processes.redis_url, decode_responses=True)
    async with (
        serve_gateway(f"ipv4:{first},{second}") as base_url,
        openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as api,
    ):
        model = (await api.models.list()).data[0].id
        yield TwoReplicas(processes, api, model, client)
    client.close()


@pytest.mark.parametrize("how", ["stop", "kill"])
async def test_a_stream_and_a_whole_answer_outlive_their_replica(processes: ProcessStack, how: str) -> None:
    """Both under way when their replica goes: the stream goes on from where it was, the Complete
    call is followed from its start and its answer assembled from that stream; each equals the
    answer of a run nothing interrupted."""
    async with two_replicas(processes) as replicas:
        ask = replicas.completion(600, extra_body=NO_EOS)
        cut_whole = asyncio.create_task(
            replicas.api.completions.create(**ask, extra_headers={"x-baton-request-id": f"whole-{how}"})  # type: ignore[call-overload]
        )
        tokens = f"{{baton}}:req:whole-{how}:tokens"
        stream = await replicas.api.completions.create(stream=True, **ask)  # type: ignore[call-overload]
        pieces: list[str] = []
        finish = None
        async for chunk in stream:
            if not chunk.choices:
                continue
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
            if len(pieces) == 5:  # both mid-request
                await eventually(lambda: replicas.redis.llen(tokens) >= 5, "the whole answer to run")  # type: ignore[operator]
                await replicas.lose_first(how)
        assert finish == "length"
        request_id = stream.response.headers["x-baton-request-id"]
        await eventually(lambda: replicas.state(request_id) == "FINISHED", "the request to finish")
        whole = await cut_whole
        again = await replicas.api.completions.create(**ask)  # type: ignore[call-overload]
    assert "".join(pieces) == whole.choices[0].text == again.choices[0].text
    assert whole.choices[0].finish_reason == "length" and whole.usage is not None and again.usage is not None
    assert whole.usage.completion_tokens == 600 and whole.usage.prompt_tokens == again.usage.prompt_tokens


async def test_a_client_that_leaves_a_followed_stream_cancels_its_request(processes: ProcessStack) -> None:
    """Followed, the stream reads through Resume, whose cancel cancels nothing: the gateway cancels
    the request itself, as a Generate call's cancel would."""
    async with two_replicas(processes) as replicas:
        ask = replicas.completion(3000, extra_body=NO_EOS)
        stream = await replicas.api.completions.create(stream=True, **ask)  # type: ignore[call-overload]
        request_id = stream.response.headers["x-baton-request-id"]
        read = 0
        async for _chunk in stream:
            read += 1
            if read == 5:
                await replicas.lose_first("stop")
            if read == 15:  # well past the stop: read through Resume
                break
        await stream.close()
        await eventually(lambda: replicas.state(request_id) == "CANCELLED", "the request's cancel")
