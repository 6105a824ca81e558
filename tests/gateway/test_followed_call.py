"""A gateway stream outlives the scheduler replica it reads from: stopped (a rolling update) or
killed, the replica's streams are followed on another with ``Resume``, and the client's stream
goes on with no gap, no repeat and no error."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis

from tests.gateway.serving import serve_gateway
from tests.process_stack import ProcessStack
from tests.stack import eventually

NO_EOS = {"ignore_eos": True}
REQUEST = "{baton}:req:%s"


@pytest.fixture
def processes(tmp_path: Path, tiny_model_dir: Path) -> Iterator[ProcessStack]:
    stack = ProcessStack(tmp_path, tiny_model_dir)
    stack.start_redis()
    yield stack
    stack.stop_all()


@pytest.mark.parametrize("how", ["stop", "kill"])
async def test_a_stream_goes_on_when_its_replica_goes_away(processes: ProcessStack, how: str) -> None:
    processes.start_executor("exec-a")
    first = processes.start_scheduler("sched-1")
    second = processes.start_scheduler("sched-2")
    # The channel's first address is the replica it reads from; the other takes over.
    target = f"ipv4:{first},{second}"
    client = redis.Redis.from_url(processes.redis_url, decode_responses=True)
    async with (
        serve_gateway(target) as base_url,
        openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as api,
    ):
        model = (await api.models.list()).data[0].id
        ask = {"model": model, "prompt": "Hello", "max_tokens": 600, "temperature": 0, "extra_body": NO_EOS}
        stream = await api.completions.create(stream=True, **ask)  # type: ignore[call-overload]
        pieces: list[str] = []
        finish = None
        async for chunk in stream:
            if not chunk.choices:
                continue
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
            if len(pieces) == 5:  # mid-stream: the replica goes
                if how == "stop":
                    assert await asyncio.to_thread(processes.stop, "sched-1") == 0
                else:
                    processes.kill("sched-1")
        assert finish == "length"
        request_id = stream.response.headers["x-baton-request-id"]
        await eventually(lambda: client.hget(REQUEST % request_id, "state") == "FINISHED", "the request to finish")
        whole = await api.completions.create(**ask)  # type: ignore[call-overload]
    assert "".join(pieces) == whole.choices[0].text
    assert whole.usage is not None and whole.usage.completion_tokens == 600


@pytest.mark.parametrize("how", ["stop", "kill"])
async def test_a_whole_answer_outlives_its_replica(processes: ProcessStack, how: str) -> None:
    """A Complete call cut mid-request is followed from the start on the other replica, and its
    answer assembled from that stream is the answer."""
    processes.start_executor("exec-a")
    first = processes.start_scheduler("sched-1")
    second = processes.start_scheduler("sched-2")
    client = redis.Redis.from_url(processes.redis_url, decode_responses=True)
    async with (
        serve_gateway(f"ipv4:{first},{second}") as base_url,
        openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as api,
    ):
        model = (await api.models.list()).data[0].id

        async def complete(request_id: str) -> openai.types.Completion:
            return await api.completions.create(
                model=model,
                prompt="Hello",
                max_tokens=600,
                temperature=0,
                extra_body=NO_EOS,
                extra_headers={"x-baton-request-id": request_id},
            )

        cut = asyncio.create_task(complete(f"whole-{how}"))
        await eventually(lambda: client.llen(f"{{baton}}:req:whole-{how}:tokens") >= 5, "the request to run")
        if how == "stop":
            assert await asyncio.to_thread(processes.stop, "sched-1") == 0
        else:
            processes.kill("sched-1")
        answer = await cut
        again = await complete(f"again-{how}")
    assert answer.choices[0].finish_reason == "length" and answer.usage is not None and again.usage is not None
    assert answer.usage.completion_tokens == 600 and answer.usage.prompt_tokens == again.usage.prompt_tokens
    assert answer.choices[0].text == again.choices[0].text


async def test_a_client_that_leaves_a_followed_stream_cancels_its_request(processes: ProcessStack) -> None:
    """Followed, the stream reads through Resume, whose cancel cancels nothing: the gateway cancels
    the request itself, as a Generate call's cancel would."""
    processes.start_executor("exec-a")
    first = processes.start_scheduler("sched-1")
    second = processes.start_scheduler("sched-2")
    client = redis.Redis.from_url(processes.redis_url, decode_responses=True)
    async with (
        serve_gateway(f"ipv4:{first},{second}") as base_url,
        openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as api,
    ):
        model = (await api.models.list()).data[0].id
        stream = await api.completions.create(
            model=model, prompt="Hello", max_tokens=3000, temperature=0, stream=True, extra_body=NO_EOS
        )
        request_id = stream.response.headers["x-baton-request-id"]
        read = 0
        async for _chunk in stream:
            read += 1
            if read == 5:
                assert await asyncio.to_thread(processes.stop, "sched-1") == 0
            if read == 15:  # well past the stop: read through Resume
                break
        await stream.close()
        await eventually(lambda: client.hget(REQUEST % request_id, "state") == "CANCELLED", "the request's cancel")
