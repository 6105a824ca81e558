"""Request parsing, response shaping and error mapping, without a server."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import grpc
import pytest

from common.keys import is_safe_name
from common.pb import generate_pb2 as pb
from gateway.errors import BadRequest, from_rpc_error
from gateway.openai_logprobs import ChoiceLogprobs, CompletionLogprobs, chat_logprobs, vllm_prompt_logprobs
from gateway.openai_types import (
    Reply,
    RunningUsage,
    apply_headers,
    chat_input,
    parse_chat,
    parse_completion,
    tenant_of_user,
)


def test_completion_defaults_follow_openai() -> None:
    parsed = parse_completion({"model": "m", "prompt": "Hi"})
    params = parsed.request.params
    assert parsed.request.prompt == "Hi"
    assert (params.max_tokens, params.temperature, params.ignore_eos) == (16, 1.0, False)
    assert not params.HasField("seed")
    assert (parsed.stream, parsed.include_usage, parsed.model) == (False, False, "m")


def test_completion_fields_map_to_sampling_params() -> None:
    body: dict[str, Any] = {
        "prompt": [[1, 2, 3]],
        "max_tokens": 7,
        "temperature": 0,
        "top_p": 0.5,
        "seed": 0,
        "stop": "\n",
        "user": "team-a",
        "stream": True,
        "stream_options": {"include_usage": True},
        "top_k": 4,
        "ignore_eos": True,
        "stop_token_ids": [2],
        "n": 1,
        "logprobs": None,
        "presence_penalty": 0,
        "response_format": {"type": "text"},
        "frequency_penalty": -0.5,
        "logit_bias": {"7": -100, "12": 2.5},
        "repetition_penalty": 1.25,
        "min_tokens": 3,
        "min_p": 0.125,
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "allowed_token_ids": [4, 9],
        "bad_words": ["no", " never"],
        "truncate_prompt_tokens": -1,
    }
    parsed = parse_completion(body)
    request = parsed.request
    assert list(request.prompt_token_ids) == [1, 2, 3] and request.prompt == ""
    assert request.params.max_tokens == 7 and request.params.temperature == 0
    assert request.params.top_p == pytest.approx(0.5) and request.params.top_k == 4
    assert request.params.HasField("seed") and request.params.seed == 0
    assert list(request.params.stop) == ["\n"] and list(request.params.stop_token_ids) == [2]
    assert request.params.ignore_eos and request.tenant == "team-a"
    assert parsed.stream and parsed.include_usage
    params = request.params
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, -0.5, 1.25)
    assert (params.min_tokens, params.min_p, params.include_stop_str_in_output) == (3, 0.125, True)
    assert dict(params.logit_bias) == {7: -100.0, 12: 2.5}
    assert params.HasField("skip_special_tokens") and not params.skip_special_tokens
    assert list(params.allowed_token_ids) == [4, 9] and list(params.bad_words) == ["no", " never"]
    assert params.truncate_prompt_tokens == -1
    assert not params.HasField("logprobs") and not params.HasField("prompt_logprobs") and not parsed.logprobs
    assert request.params.n == 1


def test_add_special_tokens_reaches_a_text_prompt_or_a_chat() -> None:
    assert not parse_completion({"prompt": "a"}).request.HasField("add_special_tokens")
    bare = parse_completion({"prompt": "a", "add_special_tokens": False}).request
    assert bare.HasField("add_special_tokens") and not bare.add_special_tokens
    ids = parse_completion({"prompt": [1, 2], "add_special_tokens": False}).request
    assert not ids.HasField("add_special_tokens")  # token ids are taken as they are
    messages = [{"role": "user", "content": "hi"}]
    assert not parse_chat({"messages": messages}).request.chat.add_special_tokens
    assert parse_chat({"messages": messages, "add_special_tokens": True}).request.chat.add_special_tokens


def test_chat_echo_goes_before_a_continued_assistant_message() -> None:
    continued = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}]
    parsed = parse_chat({"messages": continued, "echo": True})
    assert parsed.echo and parsed.echo_text == "Well,"
    assert parse_chat({"messages": continued[:1], "echo": True}).echo_text == ""  # nothing of the assistant's
    assert parse_chat({"messages": continued, "modalities": ["text"]}).echo_text == ""


def test_vllm_request_fields_reach_baton() -> None:
    messages = [{"role": "user", "content": "hi"}]
    documents = [{"title": "Mill", "text": "The wheel stopped."}]
    chat = parse_chat({"messages": messages, "documents": documents, "request_id": "mine 1"})
    assert json.loads(chat.request.chat.documents) == documents
    # vLLM's request_id names the response, any string and as often as a client likes: it is not
    # Baton's request id, which is an idempotency key (the header's, else a new one).
    parsed = parse_completion({"prompt": "a", "request_id": "mine/2", "model": None})
    apply_headers(parsed.request, {})
    assert parsed.label == "mine/2" and parsed.request.request_id not in ("", "mine/2")
    assert Reply.for_request(False, parsed, "m").id == "cmpl-mine/2"
    apply_headers(parsed.request, {"x-baton-request-id": "header"})
    assert parsed.request.request_id == "header"
    assert Reply.for_request(True, replace(parsed, label=""), "m").id == "chatcmpl-header"
    for bad in ({"documents": "text"}, {"documents": ["text"]}):
        with pytest.raises(BadRequest, match="documents"):
            parse_chat({"messages": messages, **bad})


def test_unset_controls_stay_unset() -> None:
    params = parse_completion({"prompt": "a"}).request.params
    assert not params.HasField("repetition_penalty") and not params.logit_bias and params.min_tokens == 0
    assert not params.HasField("skip_special_tokens") and not params.HasField("truncate_prompt_tokens")
    assert not params.allowed_token_ids and not params.bad_words


@pytest.mark.parametrize(
    "body,logprobs,prompt_logprobs",
    [
        ({"prompt": "a", "logprobs": 3}, 3, None),
        ({"prompt": "a", "logprobs": 0, "echo": True}, 0, 0),
        ({"prompt": "a", "logprobs": 5, "echo": True, "max_tokens": 0}, 5, 5),
        ({"prompt": "a", "echo": True}, None, None),  # the prompt's text is the request's own
        ({"prompt": [1, 2], "echo": True}, None, 0),  # its tokens' texts are needed to echo it
        ({"prompt": "a", "echo": True, "max_tokens": 0}, None, 0),  # scoring the prompt
        ({"prompt": "a", "echo": True, "truncate_prompt_tokens": 1}, None, 0),  # echoes what was kept
    ],
)
def test_completion_logprobs_and_echo(body: dict[str, Any], logprobs: int | None, prompt_logprobs: int | None) -> None:
    parsed = parse_completion(body)
    params = parsed.request.params
    assert (params.logprobs if params.HasField("logprobs") else None) == logprobs
    assert (params.prompt_logprobs if params.HasField("prompt_logprobs") else None) == prompt_logprobs
    assert parsed.echo == body["echo"] if "echo" in body else not parsed.echo
    assert parsed.logprobs == (logprobs is not None)


def test_chat_logprobs() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    parsed = parse_chat({"messages": messages, "logprobs": True, "top_logprobs": 4})
    assert parsed.logprobs and parsed.request.params.logprobs == 4 and not parsed.echo
    assert parse_chat({"messages": messages, "logprobs": True}).request.params.logprobs == 0
    assert not parse_chat({"messages": messages, "logprobs": False}).request.params.HasField("logprobs")
    for bad in (
        {"top_logprobs": 2},
        {"logprobs": True, "top_logprobs": 21},
        {"logprobs": 1},
        {"modalities": ["audio"]},
    ):
        with pytest.raises(BadRequest):
            parse_chat({"messages": messages, **bad})


def _position(token: int, text: str, logprob: float | None, *top: tuple[int, str, float]) -> pb.PositionLogprobs:
    chosen = pb.TokenLogprob(token_id=token, text=text)
    if logprob is not None:
        chosen.logprob = logprob
    return pb.PositionLogprobs(token=chosen, top=[pb.TokenLogprob(token_id=t, text=x, logprob=v) for t, x, v in top])


def test_logprob_shapes() -> None:
    first = _position(1, "<s>", None)
    hello = _position(5, "Hello", -1.5, (6, " Hi", -0.5), (5, "Hello", -1.5))
    there = _position(7, " there", -0.25, (7, " there", -0.25))
    snowman = _position(9, "☃", float("-inf"), (7, " there", -0.25))
    assert CompletionLogprobs().of([first, hello, there]) == {
        "tokens": ["<s>", "Hello", " there"],
        "token_logprobs": [None, -1.5, -0.25],
        "top_logprobs": [None, {" Hi": -0.5, "Hello": -1.5}, {" there": -0.25}],
        "text_offset": [0, 3, 8],
    }
    chat = chat_logprobs([there, snowman])
    assert chat["refusal"] is None and chat["content"][0] == {
        "token": " there",
        "logprob": -0.25,
        "bytes": [32, 116, 104, 101, 114, 101],
        "top_logprobs": [{"token": " there", "logprob": -0.25, "bytes": [32, 116, 104, 101, 114, 101]}],
    }
    assert chat["content"][1]["logprob"] == -9999.0 and chat["content"][1]["bytes"] == [226, 152, 131]
    # Not asked: chosen token only (logprobs=0) still shows in top_logprobs, as OpenAI's "up to logprobs + 1".
    assert CompletionLogprobs().of([_position(5, "Hello", -1.5)])["top_logprobs"] == [{"Hello": -1.5}]


def test_tokens_named_by_their_ids_as_vllm_names_them() -> None:
    hello = _position(5, "Hello", -1.5, (6, " Hi", -0.5), (5, "Hello", -1.5))
    snowman = _position(12, "\ufffd", -2.0)
    assert CompletionLogprobs(as_token_ids=True).of([hello, snowman]) == {
        "tokens": ["token_id:5", "token_id:12"],
        "token_logprobs": [-1.5, -2.0],
        "top_logprobs": [{"token_id:6": -0.5, "token_id:5": -1.5}, {"token_id:12": -2.0}],
        "text_offset": [0, 10],
    }
    entry = chat_logprobs([hello], as_token_ids=True)["content"][0]
    assert entry["token"] == "token_id:5" and entry["bytes"] == list(b"token_id:5")
    assert [alt["token"] for alt in entry["top_logprobs"]] == ["token_id:6", "token_id:5"]
    assert parse_completion({"prompt": "a", "return_tokens_as_token_ids": True}).tokens_as_ids
    assert not parse_chat({"messages": [{"role": "user", "content": "Hi"}]}).tokens_as_ids


def test_echo_goes_before_the_first_message_only() -> None:
    first = pb.GenerateResponse(text="!", token_ids=[8], logprobs=[_position(8, "!", -2.0)])
    first.prompt_logprobs.extend([_position(1, "<s>", None), _position(5, "Hi", -3.0)])
    first.prompt_text = "<s>Hi"  # the prompt's ids decoded together (a prompt of ids is echoed as this)
    second = pb.GenerateResponse(text="?", token_ids=[9], logprobs=[_position(9, "?", -1.0)])
    choice = ChoiceLogprobs(chat=False, echo=True, logprobs=True, prompt="Hi")
    text, logprobs = choice.shape(first)
    assert text == "Hi!" and logprobs is not None and logprobs["tokens"] == ["<s>", "Hi", "!"]
    text, logprobs = choice.shape(second)
    assert text == "?" and logprobs is not None and logprobs["text_offset"] == [6]
    ids_prompt = ChoiceLogprobs(chat=False, echo=True, logprobs=False, prompt="")
    assert ids_prompt.shape(first) == ("<s>Hi!", None)
    assert ChoiceLogprobs(chat=True, echo=False, logprobs=True, prompt="Hi").shape(second)[1] == chat_logprobs(
        second.logprobs
    )


def test_n_asks_baton_for_samples() -> None:
    assert parse_completion({"prompt": "a", "n": 3}).request.params.n == 3
    chat = parse_chat({"messages": [{"role": "user", "content": "Hi"}], "n": 4, "seed": 7})
    assert chat.request.params.n == 4 and chat.request.params.seed == 7
    assert parse_completion({"prompt": "a", "n": None}).request.params.n == 1
    # The upper bound is Baton's (request_level.max_samples): it answers INVALID_ARGUMENT, a 400.
    assert parse_completion({"prompt": "a", "n": 100_000}).request.params.n == 100_000


def test_cache_salt_goes_to_baton() -> None:
    assert parse_completion({"prompt": "a", "cache_salt": "s3cret"}).request.cache_salt == "s3cret"
    assert parse_completion({"prompt": "a", "cache_salt": None}).request.cache_salt == ""


def test_a_null_max_tokens_is_the_room_left_in_the_context() -> None:
    # As vLLM reads a completion's: only an absent max_tokens means OpenAI's 16.
    assert parse_completion({"prompt": "a"}).request.params.max_tokens == 16
    params = parse_completion({"prompt": "a", "max_tokens": None}).request.params
    assert params.fill_context and params.max_tokens == 0


def test_chat_defaults_to_batons_max_tokens() -> None:
    parsed = parse_chat({"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 3})
    assert parsed.request.params.max_tokens == 3
    assert parse_chat({"messages": [{"role": "user", "content": "Hi"}]}).request.params.max_tokens == 0


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "a", "n": 0}, "n"),
        ({"prompt": "a", "n": 1.5}, "n"),
        ({"prompt": "a", "best_of": 3}, "best_of"),
        ({"prompt": "a", "echo": "yes"}, "echo"),
        ({"prompt": "a", "logprobs": 21}, "logprobs"),
        ({"prompt": "a", "logprobs": True}, "logprobs"),
        ({"prompt": "a", "frequency_penalty": "high"}, "frequency_penalty"),
        ({"prompt": "a", "repetition_penalty": None, "min_tokens": -1}, "min_tokens"),
        ({"prompt": "a", "logit_bias": {"five": 1}}, "logit_bias"),
        ({"prompt": "a", "logit_bias": {"5": "1"}}, "logit_bias"),
        ({"prompt": "a", "logit_bias": [5, 1]}, "logit_bias"),
        ({"prompt": "a", "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
        ({"prompt": "a", "response_format": {"type": "structural_tag"}}, "response_format"),
        ({"prompt": ["a", 5]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": ["a"] * 1025}, "prompt"),
        ({"prompt": [[1], [2, -1]]}, "prompt"),
        ({"prompt": [1, -1]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "max_tokens": True}, "max_tokens"),
        ({"prompt": "a", "temperature": "hot"}, "temperature"),
        ({"prompt": "a", "seed": -(2**63) - 1}, "seed"),
        ({"prompt": "a", "top_p": 0}, "top_p"),
        ({"prompt": "a", "top_p": 1.5}, "top_p"),
        ({"prompt": "a", "top_k": -2}, "top_k"),
        ({"prompt": "a", "temperature": 10**400}, "temperature"),
        ({"prompt": "a", "min_p": -(10**400)}, "min_p"),
        ({"prompt": "a", "logit_bias": {"5": 10**400}}, "logit_bias"),
        ({"prompt": "a", "logit_bias": {"\u00b2": 1}}, "logit_bias"),  # a digit, but not an ASCII one
        ({"prompt": "a", "stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"prompt": "a", "stop": [1]}, "stop"),
        ({"prompt": "a", "stream": "yes"}, "stream"),
        ({"prompt": "a", "user": 5}, "user"),
        ({"prompt": "a", "cache_salt": ""}, "cache_salt"),
        ({"prompt": "a", "cache_salt": 7}, "cache_salt"),
        ({"prompt": "a", "use_beam_search": True}, "use_beam_search"),
        ({"prompt": "a", "length_penalty": 0.5}, "length_penalty"),
        ({"prompt": "a", "logits_processors": ["x"]}, "logits_processors"),
        ({"prompt": "a", "priority": 3}, "priority"),
        ({"prompt": "a", "return_tokens_as_token_ids": 1}, "return_tokens_as_token_ids"),
        ({"prompt": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"prompt": "a", "structural_tag": "{}"}, "structural_tag"),
        ({"prompt": "a", "return_token_ids": "yes"}, "return_token_ids"),
        ({"prompt": "a", "request_id": ""}, "request_id"),
        ({"prompt": "a", "request_id": 5}, "request_id"),
        ({"prompt": "a", "skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"prompt": "a", "allowed_token_ids": []}, "allowed_token_ids"),
        ({"prompt": "a", "allowed_token_ids": [1, -1]}, "allowed_token_ids"),
        ({"prompt": "a", "allowed_token_ids": "5"}, "allowed_token_ids"),
        ({"prompt": "a", "bad_words": "word"}, "bad_words"),
        ({"prompt": "a", "bad_words": [3]}, "bad_words"),
        ({"prompt": "a", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"prompt": "a", "truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens"),
        ({"prompt": "a", "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": "a", "truncation_side": "right"}, "truncation_side"),
        ({"prompt": "a", "logprob_token_ids": [1]}, "logprob_token_ids"),
        ({"prompt": "a", "thinking_token_budget": 64}, "thinking_token_budget"),
        ({"prompt": "a", "repetition_detection": {}}, "repetition_detection"),
    ],
)
def test_completion_rejects(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as err:
        parse_completion(body)
    assert err.value.param == param and err.value.status == 400


def test_a_list_of_prompts_is_a_request_per_prompt() -> None:
    parsed = parse_completion({"prompt": ["one", [5, 6], "three"], "n": 2, "max_tokens": 3})
    parsed.request.request_id, parsed.request.tenant = "abc", "t"  # as headers and auth set them
    requests = parsed.requests()
    assert [r.request_id for r in requests] == ["abc", "abc.1", "abc.2"]
    assert [(r.prompt, list(r.prompt_token_ids)) for r in requests] == [("one", []), ("", [5, 6]), ("three", [])]
    assert all(r.params.n == 2 and r.params.max_tokens == 3 and r.tenant == "t" for r in requests)
    assert requests[0] is parsed.request
    echoed = parse_completion({"prompt": ["one", [5, 6]], "echo": True})
    echoed.request.request_id = "e"
    assert [r.params.HasField("prompt_logprobs") for r in echoed.requests()] == [False, True]  # ids' texts, to echo
    for single in ("one", ["one"], [5, 6], [[5, 6]]):  # one prompt, in any of its forms
        one = parse_completion({"prompt": single})
        assert one.prompts == () and one.requests() == [one.request]
    long = parse_completion({"prompt": ["a"] * 11})
    long.request.request_id = "x" * 126
    with pytest.raises(BadRequest, match="too long"):
        long.requests()


def test_chat_messages_go_to_baton_as_they_are() -> None:
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    parsed = parse_chat({"model": "m", "messages": messages})
    assert parsed.request.WhichOneof("input") == "chat" and not parsed.request.prompt_token_ids
    chat = parsed.request.chat
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be terse."),
        ("user", "Hi \nthere"),  # text parts joined by newlines, as vLLM joins them
        ("assistant", ""),
    ]
    assert not chat.HasField("add_generation_prompt") and not chat.chat_template  # Baton's defaults
    assert not chat.continue_final_message and not chat.chat_template_kwargs
    options = {"add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"é": [1]}}
    continued = parse_chat({"messages": messages, **options}).request.chat
    assert continued.HasField("add_generation_prompt") and not continued.add_generation_prompt
    assert continued.continue_final_message and json.loads(continued.chat_template_kwargs) == {"é": [1]}
    assert not parse_chat({"messages": messages, "chat_template_kwargs": {}}).request.chat.chat_template_kwargs
    for name, value in (("chat_template_kwargs", [1]), ("continue_final_message", "yes"), ("add_generation_prompt", 1)):
        with pytest.raises(BadRequest, match=name):
            parse_chat({"messages": messages, name: value})
    # Which roles count is the scheduler's call (with the model's template), not the gateway's.
    assert chat_input([{"role": "wizard", "content": "x"}]).messages[0].role == "wizard"
    for bad in (
        [],
        None,
        "Hi",
        [{"content": "x"}],
        [{"role": 3, "content": "x"}],
        [{"role": "user", "content": [{"type": "image_url"}]}],
        [{"role": "user", "content": 5}],
    ):
        with pytest.raises(BadRequest) as err:
            chat_input(bad)
        assert err.value.param == "messages"


@pytest.mark.parametrize(
    "body",
    [
        {"stream_options": {"include_usage": True}},  # only with stream (an empty object is fine)
        {"stream": True, "stream_options": "usage"},
        {"stream": True, "stream_options": {"include_usage": "yes"}},
    ],
)
def test_stream_options_refusals(body: dict[str, Any]) -> None:
    with pytest.raises(BadRequest):
        parse_completion({"prompt": "a", **body})


def test_include_usage_is_read_from_stream_options() -> None:
    assert not parse_completion({"prompt": "a", "stream_options": {}}).include_usage  # vLLM accepts it too
    chat = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
    # vLLM's default (OpenAI's is false): stream_options at all asks for the usage, unless it says not.
    assert parse_chat({**chat, "stream_options": {}}).include_usage
    assert not parse_completion({"prompt": "a", "stream": True, "stream_options": None}).include_usage
    assert parse_completion({"prompt": "a", "stream": True, "stream_options": {"include_usage": True}}).include_usage
    both = {"include_usage": True, "continuous_usage_stats": True}
    assert parse_completion({"prompt": "a", "stream": True, "stream_options": both}).continuous_usage
    alone = {"continuous_usage_stats": True}  # include_usage true by default, as in vLLM
    assert parse_completion({"prompt": "a", "stream": True, "stream_options": alone}).continuous_usage
    off = {"include_usage": False, "continuous_usage_stats": True}  # it needs include_usage, as in vLLM
    assert not parse_completion({"prompt": "a", "stream": True, "stream_options": off}).continuous_usage
    assert not parse_completion({"prompt": "a", "stream": True, "stream_options": off}).include_usage


def test_running_usage_counts_each_choices_output() -> None:
    running = RunningUsage([5, 7])
    assert running.of(0, 0) == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
    running.add(0, 0, 2)
    assert running.add(1, 3, 1) == {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}
    assert running.add(0, 0, 1)["completion_tokens"] == 3


def test_headers_override_body() -> None:
    request = pb.GenerateRequest(tenant="from-user")
    apply_headers(request, {"x-baton-priority": "7", "x-baton-tenant": "acme", "x-baton-request-id": "r1"})
    assert (request.priority, request.tenant, request.request_id) == (7, "acme", "r1")
    request = pb.GenerateRequest(tenant="from-user")
    apply_headers(request, {})
    assert not request.HasField("priority") and request.tenant == "from-user" and len(request.request_id) == 32
    for bad in ("-1", "1.5", "high", "99999999999"):
        with pytest.raises(BadRequest):
            apply_headers(pb.GenerateRequest(), {"x-baton-priority": bad})


def test_reply_shapes() -> None:
    usage = pb.Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1)
    text = Reply(chat=False, request_id="r", model="m", created=1)
    whole = pb.CompleteResponse(text="ab", finish_reason=pb.FINISH_REASON_LENGTH, usage=usage)
    assert text.whole(whole) == {
        "id": "cmpl-r",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "logprobs": None, "finish_reason": "length", "stop_reason": None, "text": "ab"}],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "total_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 1},
        },
    }
    chat = Reply(chat=True, request_id="r", model="m", created=1)
    whole.finish_reason = pb.FINISH_REASON_STOP
    assert chat.whole(whole)["choices"][0]["message"] == {
        "role": "assistant",
        "content": "ab",
    }
    assert chat.chunk("", role=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finishing = chat.chunk(None, pb.FINISH_REASON_CANCELLED)["choices"][0]
    assert finishing["delta"] == {} and finishing["finish_reason"] == "abort"  # vLLM's name for it
    assert chat.usage_chunk(usage)["choices"] == [] and chat.usage_chunk(usage)["object"] == "chat.completion.chunk"
    assert "usage" not in chat.chunk("a")
    counted = Reply(chat=True, request_id="r", model="m", created=1, include_usage=True)
    assert counted.chunk("a")["usage"] is None and counted.usage_chunk(usage)["usage"]["total_tokens"] == 5


def test_reply_has_a_choice_per_sample_and_counts_the_prompt_once() -> None:
    samples = [
        pb.CompleteResponse(
            request_id="r" if k == 0 else f"r~{k}",
            sample_index=k,
            text=f"s{k}",
            finish_reason=pb.FINISH_REASON_STOP if k == 1 else pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=3, completion_tokens=k + 1, cached_tokens=2 if k else 0),
        )
        for k in range(3)
    ]
    out = pb.CompleteResponse()
    out.CopyFrom(samples[0])
    out.samples.extend(samples)
    body = Reply(chat=True, request_id="r", model="m", created=1).whole(out)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "s0", "length"),
        (1, "s1", "stop"),
        (2, "s2", "length"),
    ]
    # The prompt once, and as cached as the sample that computed it found it.
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 6,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    text = Reply(chat=False, request_id="r", model="m", created=1)
    assert text.chunk("x", index=2)["choices"][0] == {"index": 2, "logprobs": None, "finish_reason": None, "text": "x"}


@pytest.mark.parametrize(
    "code,status",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.ALREADY_EXISTS, 409),
        (grpc.StatusCode.FAILED_PRECONDITION, 400),
        (grpc.StatusCode.INTERNAL, 500),
        (grpc.StatusCode.UNKNOWN, 500),
    ],
)
def test_grpc_codes_map_to_http(code: grpc.StatusCode, status: int) -> None:
    exc = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="why")
    error = from_rpc_error(exc)
    assert error.status == status
    body = error.body()["error"]
    assert body["message"] == "why" and body["code"] == code.name.lower() and body["type"]


def test_vllm_spellings_of_defaults_are_accepted() -> None:
    """Values vLLM's clients send for "no restriction" or "the default", which a stricter reading refused."""
    params = parse_completion({"prompt": "a", "top_k": -1, "stop_token_ids": [], "seed": -1}).request.params
    assert params.top_k == 0 and not params.stop_token_ids
    assert not params.HasField("seed")  # vLLM's -1: no seed, each request sampled afresh
    # Any other int64 seeds, as in vLLM; a negative one as its two's complement.
    assert parse_completion({"prompt": "a", "seed": -2}).request.params.seed == 2**64 - 2
    assert parse_completion({"prompt": "a", "top_p": 1e-9}).request.params.top_p == pytest.approx(1e-9)


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    """OpenAI deprecates ``max_tokens`` for chat; vLLM takes ``max_completion_tokens`` first."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "max_completion_tokens": 2}
    assert parse_chat(body).request.params.max_tokens == 2
    assert parse_chat({**body, "max_tokens": 0}).request.params.max_tokens == 2  # the deprecated one unread


@pytest.mark.parametrize("user", ["user 42", "a+b@example.com", "x" * 300, "名前", "id:7"])
def test_any_openai_user_names_a_tenant(user: str) -> None:
    """OpenAI's ``user`` is any string; a tenant becomes part of Redis keys. A user that is no valid
    tenant name gets one derived from it: the same user, the same tenant, whatever else it sends."""
    tenant = parse_completion({"prompt": "a", "user": user}).request.tenant
    assert is_safe_name(tenant) and tenant.startswith("user-")
    assert tenant == tenant_of_user(user) != tenant_of_user(user + "!")
    assert parse_completion({"prompt": "a", "user": "acme.team-1"}).request.tenant == "acme.team-1"


def test_an_integral_float_is_an_integer_and_the_neutral_values_of_refused_fields_pass() -> None:
    """As vLLM's pydantic models read them."""
    body = {"prompt": "a", "max_tokens": 5.0, "truncation_side": "left", "thinking_token_budget": -1}
    assert parse_completion(body).request.params.max_tokens == 5


def test_prompt_logprobs_ask_as_wide_as_the_echo_and_vllms_field_together() -> None:
    asked = parse_completion({"prompt": "a", "prompt_logprobs": 3})
    assert asked.prompt_logprobs == 3 and asked.request.params.prompt_logprobs == 3
    echoed = parse_completion({"prompt": "a", "echo": True, "logprobs": 5, "prompt_logprobs": 2})
    assert echoed.request.params.prompt_logprobs == 5 and (echoed.echo_top, echoed.prompt_logprobs) == (5, 2)
    chat = parse_chat({"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 0})
    assert chat.prompt_logprobs == 0 and chat.request.params.prompt_logprobs == 0
    for bad in ({"prompt_logprobs": -1}, {"prompt_logprobs": 21}, {"prompt_logprobs": 1, "stream": True}):
        with pytest.raises(BadRequest):
            parse_completion({"prompt": "a", **bad})
    streamed = parse_completion({"prompt": "a", "prompt_logprobs": 0, "stream": True})  # vLLM takes it, sends none
    assert streamed.prompt_logprobs is None and not streamed.request.params.HasField("prompt_logprobs")


def test_vllm_prompt_logprobs_put_the_prompts_token_first() -> None:
    def entry(token: int, logprob: float, rank: int | None = None) -> pb.TokenLogprob:
        out = pb.TokenLogprob(token_id=token, logprob=logprob, text=f"t{token}")
        if rank is not None:
            out.rank = rank
        return out

    positions = [
        pb.PositionLogprobs(token=pb.TokenLogprob(token_id=1, text="t1")),  # nothing predicts it
        pb.PositionLogprobs(token=entry(7, -3.0, 4), top=[entry(2, -0.5, 1), entry(3, -1.0, 2)]),
        pb.PositionLogprobs(token=entry(3, -1.0, 2), top=[entry(2, -0.5, 1), entry(3, -1.0, 2)]),
        pb.PositionLogprobs(token=entry(5, float("-inf"), 9)),
    ]
    none, outside, inside, floored = vllm_prompt_logprobs(positions, 2)
    assert none is None and outside is not None and inside is not None and floored is not None
    assert list(outside) == ["7", "2", "3"] and outside["7"] == {"logprob": -3.0, "rank": 4, "decoded_token": "t7"}
    assert [e["rank"] for e in outside.values()] == [4, 1, 2]
    assert list(inside) == ["3", "2"] and inside["3"]["rank"] == 2  # among the top: one entry, in its place
    assert floored["5"]["logprob"] == -9999.0  # JSON has no -infinity
    assert list(vllm_prompt_logprobs(positions[1:2], 1)[0] or {}) == ["7", "2"]


def test_a_structured_output_backend_other_than_batons_is_refused() -> None:
    assert parse_completion({"prompt": "a", "guided_decoding_backend": "xgrammar"}).request.prompt == "a"
    with pytest.raises(BadRequest, match="guided_decoding_backend"):
        parse_completion({"prompt": "a", "guided_decoding_backend": "outlines"})
