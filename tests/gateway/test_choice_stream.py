"""One streamed choice's chunks from Baton's messages, without a server."""

from __future__ import annotations

import json

import pytest

from common.pb import generate_pb2 as pb
from gateway.choice_stream import ChoiceStream
from gateway.errors import BadRequest
from gateway.openai_logprobs import ChoiceLogprobs
from gateway.openai_tools import AUTO, ToolCalling
from gateway.openai_types import Reply, parse_chat
from gateway.reasoning import Reasoning


def _stream(reply: Reply) -> ChoiceStream:
    return ChoiceStream(reply, 0, ChoiceLogprobs(reply.chat, False, False, ""))


def test_a_completions_choice_sends_text_and_its_finish_together() -> None:
    stream = _stream(Reply(chat=False, request_id="r", model="m", created=0))
    (chunk,) = stream.chunks(pb.GenerateResponse(text="Hi", token_ids=[5]), None)
    assert chunk["choices"][0]["text"] == "Hi" and chunk["choices"][0]["finish_reason"] is None
    finish = pb.GenerateResponse(text="!", finish_reason=pb.FINISH_REASON_STOP, stop_string="\n")
    (last,) = stream.chunks(finish, None)
    assert last["choices"][0] == {
        "index": 0,
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": "\n",
        "text": "!",
    }
    assert stream.chunks(pb.GenerateResponse(text="", token_ids=[7]), None) == []  # held-back text


def test_a_chat_choice_thinks_answers_and_calls_in_order() -> None:
    reply = Reply(
        chat=True,
        request_id="r",
        model="m",
        created=0,
        tools=ToolCalling(AUTO, parser="hermes"),
        reasoning=Reasoning("qwen3"),
    )
    stream = _stream(reply)
    deltas = []
    for text in ("<think>Hm", "m.</think>It is", ' 4.<tool_call>{"name": "clock"}</tool_call>'):
        deltas += [c["choices"][0]["delta"] for c in stream.chunks(pb.GenerateResponse(text=text), None)]
    last = stream.chunks(pb.GenerateResponse(finish_reason=pb.FINISH_REASON_STOP), {"completion_tokens": 3})
    assert [d.get("reasoning_content") for d in deltas if "reasoning_content" in d] == ["Hm", "m."]
    assert "".join(d.get("content") or "" for d in deltas) == "It is 4."
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == ["clock"]
    assert last[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_token_ids_go_out_even_with_their_text_held_back() -> None:
    reply = Reply(chat=True, request_id="r", model="m", created=0, token_ids=True)
    (chunk,) = _stream(reply).chunks(pb.GenerateResponse(text="", token_ids=[7], prompt_token_ids=[1, 2]), None)
    assert chunk["choices"][0]["token_ids"] == [7] and chunk["prompt_token_ids"] == [1, 2]


def test_include_reasoning_false_leaves_the_thinking_out() -> None:
    """vLLM's include_reasoning: the answer alone, streamed and whole."""
    parsed = parse_chat({"messages": [{"role": "user", "content": "2 + 2?"}], "include_reasoning": False})
    reply = Reply.for_request(True, parsed, "m", Reasoning("qwen3"))
    stream = _stream(reply)
    deltas = [
        c["choices"][0]["delta"]
        for text in ("<think>Hm.</think>", "It is 4.")
        for c in stream.chunks(pb.GenerateResponse(text=text), None)
    ]
    assert deltas == [{"content": "It is 4."}]
    (choice,) = reply.whole(
        pb.CompleteResponse(text="<think>Hm.</think>It is 4.", finish_reason=pb.FINISH_REASON_STOP)
    )["choices"]
    assert choice["message"] == {"role": "assistant", "content": "It is 4."}


def test_reasoning_effort_is_a_template_variable() -> None:
    """As vLLM passes it, telling a template that asks whether to think."""
    ask = {"messages": [{"role": "user", "content": "Hi"}]}
    low = parse_chat({**ask, "reasoning_effort": "low"}).request.chat
    assert json.loads(low.chat_template_kwargs) == {
        "reasoning_effort": "low",
        "enable_thinking": True,
        "thinking": True,
    }
    told = parse_chat({**ask, "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}})
    assert json.loads(told.request.chat.chat_template_kwargs) == {
        "reasoning_effort": "none",
        "enable_thinking": True,
        "thinking": True,
    }
    with pytest.raises(BadRequest):
        parse_chat({**ask, "reasoning_effort": "extreme"})


GPT_OSS_OUTPUT = (
    "<|channel|>analysis<|message|>Need the time.<|end|><|start|>assistant<|channel|>commentary<|message|>"
    "Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.clock <|constrain|>json<|message|>{}"
)


def _gpt_oss_reply() -> Reply:
    """A chat reply of gpt-oss, its harmony messages read by its reasoning and tool-call parsers."""
    return Reply(
        chat=True,
        request_id="r",
        model="m",
        created=0,
        tools=ToolCalling(AUTO, parser="openai"),
        reasoning=Reasoning("openai_gptoss"),
    )


def test_gpt_oss_harmony_thinks_answers_and_calls_streamed_and_whole() -> None:
    """gpt-oss's analysis channel is the thinking, its preamble the content, its message to
    functions.clock the call, streamed in pieces and read whole alike."""
    reply = _gpt_oss_reply()
    stream = _stream(reply)
    deltas = []
    for at in range(0, len(GPT_OSS_OUTPUT), 7):
        message = pb.GenerateResponse(text=GPT_OSS_OUTPUT[at : at + 7])
        deltas += [c["choices"][0]["delta"] for c in stream.chunks(message, None)]
    # The call ends with the output (its <|call|> is the stop token, which the text does not show).
    last = stream.chunks(pb.GenerateResponse(finish_reason=pb.FINISH_REASON_STOP), {"completion_tokens": 3})
    deltas += [c["choices"][0]["delta"] for c in last if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Need the time."
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    assert [(c["function"]["name"], c["function"]["arguments"]) for d in deltas for c in d.get("tool_calls", [])] == [
        ("clock", "{}")
    ]
    assert last[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = reply.whole(pb.CompleteResponse(text=GPT_OSS_OUTPUT, finish_reason=pb.FINISH_REASON_STOP))
    (choice,) = whole["choices"]
    assert choice["message"]["reasoning_content"] == "Need the time." and choice["message"]["content"] == "Checking."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["clock"]
    assert choice["finish_reason"] == "tool_calls"


def test_gpt_oss_call_cut_short_by_max_tokens_is_no_call() -> None:
    """A harmony call the token limit cut short ends with finish reason length and no call,
    streamed and whole alike (its arguments are unfinished)."""
    reply = _gpt_oss_reply()
    cut = GPT_OSS_OUTPUT[:-1] + '{"zone": "Europe/Os'
    stream = _stream(reply)
    chunks = stream.chunks(pb.GenerateResponse(text=cut), None)
    chunks += stream.chunks(pb.GenerateResponse(finish_reason=pb.FINISH_REASON_LENGTH), None)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    assert not any(d.get("tool_calls") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = reply.whole(pb.CompleteResponse(text=cut, finish_reason=pb.FINISH_REASON_LENGTH))
    (choice,) = whole["choices"]
    assert choice["message"]["content"] == "Checking." and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "length"
