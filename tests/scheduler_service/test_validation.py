"""scheduler_service.validation: each bad GenerateRequest raises InvalidRequest saying what is wrong;
good ones get the documented defaults. The tokenizer is a pure fake: one token per character."""

from __future__ import annotations

import math
from typing import Any

import pytest

from common.block_hashing import ROOT, chain_root
from common.config import RequestLevelConfig
from common.errors import InvalidRequest
from common.keys import MAX_NAME_CHARS
from common.pb import generate_pb2 as pb
from common.sampling_defaults import SamplingDefaults
from scheduler_service.requests import NewRequest
from scheduler_service.tokenizer_source import ModelLimits
from scheduler_service.validation import validate

LIMITS = ModelLimits(model="m", max_model_len=128, vocab_size=1000)
CONFIG = RequestLevelConfig()
NOW = 1_700_000_000_000


def fake_tokenize(text: str) -> list[int]:
    """One id per character, always inside the vocabulary."""
    return [ord(c) % LIMITS.vocab_size for c in text]


def fake_encode_word(word: str) -> list[int]:
    """As ``fake_tokenize``, but a leading space joins the first character's token (id + 500), as
    tokenizers that mark word starts spell a word mid-text."""
    if word.startswith(" ") and len(word) > 1:
        return [500 + ord(word[1]) % 400, *fake_tokenize(word[2:])]
    return fake_tokenize(word)


def make(params: dict[str, Any] | None = None, **fields: Any) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(**({"prompt": "hello"} | fields))
    for key, value in (params or {}).items():
        if isinstance(value, list):
            getattr(msg.params, key).extend(value)
        elif isinstance(value, dict):
            getattr(msg.params, key).update(value)
        else:
            setattr(msg.params, key, value)
    return msg


def run(msg: pb.GenerateRequest, config: RequestLevelConfig = CONFIG, limits: ModelLimits = LIMITS) -> NewRequest:
    return validate(msg, fake_tokenize, limits, config, now_ms=NOW, encode_word=fake_encode_word)


BAD: dict[str, tuple[pb.GenerateRequest, str]] = {
    "empty prompt and no ids": (make(prompt=""), "prompt is empty"),
    "empty prompt and empty ids": (make(prompt="", prompt_token_ids=[]), "prompt is empty"),
    "token id equal to vocab size": (make(prompt="", prompt_token_ids=[1, 1000]), r"outside the vocabulary.*1000"),
    "token id far outside vocab": (make(prompt="", prompt_token_ids=[10**6]), "prompt_token_ids has token ids outside"),
    "prompt ids as long as the model": (make(prompt="", prompt_token_ids=[5] * 128), "max_model_len is 128"),
    "prompt text as long as the model": (make(prompt="x" * 128), "prompt has 128 tokens"),
    "prompt plus max_tokens too long": (make(prompt="x" * 100, params={"max_tokens": 29}), r"\+ max_tokens \(29\)"),
    "max_tokens alone too long": (make(params={"max_tokens": 10_000}), "exceeds max_model_len 128"),
    "negative temperature": (make(params={"temperature": -0.5}), "temperature"),
    "nan temperature": (make(params={"temperature": math.nan}), "temperature"),
    "infinite temperature": (make(params={"temperature": math.inf}), "temperature"),
    "top_p above one": (make(params={"top_p": 1.5}), "top_p"),
    "nan top_p": (make(params={"top_p": math.nan}), "top_p"),
    "negative top_p": (make(params={"top_p": -0.1}), "top_p"),
    "stream interval too coarse": (make(params={"stream_interval_tokens": 1025}), "stream_interval_tokens"),
    "too many stop strings": (make(params={"stop": [f"s{i}" for i in range(17)]}), "at most 16 stop strings"),
    "empty stop string": (make(params={"stop": ["ok", ""]}), "stop strings must have 1 to 256"),
    "too long stop string": (make(params={"stop": ["x" * 257]}), "stop strings must have 1 to 256"),
    "stop token id out of vocab": (make(params={"stop_token_ids": [3, 1000]}), "stop_token_ids has token ids outside"),
    "too many stop token ids": (make(params={"stop_token_ids": [1] * 65}), "at most 64 stop token ids"),
    "max_tokens 0 without prompt_logprobs": (make(params={"max_tokens": 0, "logprobs": 3}), "0 only with prompt"),
    "presence penalty above 2": (make(params={"presence_penalty": 2.5}), r"presence_penalty must lie in \[-2, 2\]"),
    "frequency penalty below -2": (make(params={"frequency_penalty": -3.0}), "frequency_penalty"),
    "nan frequency penalty": (make(params={"frequency_penalty": math.nan}), "frequency_penalty"),
    "repetition penalty 0": (make(params={"repetition_penalty": 0.0}), "repetition_penalty must be finite and > 0"),
    "negative repetition penalty": (make(params={"repetition_penalty": -1.0}), "repetition_penalty"),
    "min_tokens over max_tokens": (make(params={"max_tokens": 4, "min_tokens": 5}), r"min_tokens must lie in \[0, max"),
    "min_p above 1": (make(params={"min_p": 1.5}), r"min_p must lie in \[0, 1\]"),
    "logit bias out of vocab": (make(params={"logit_bias": {1000: 1.0}}), "logit_bias has token ids outside"),
    "logit bias above 100": (make(params={"logit_bias": {5: 101.0}}), r"logit_bias values must lie in \[-100, 100\]"),
    "too many logit biases": (make(params={"logit_bias": dict.fromkeys(range(1025), 1.0)}), "at most 1024 tokens"),
    "logprobs above 20": (make(params={"logprobs": 21}), r"logprobs must lie in \[0, 20\]"),
    "prompt logprobs above 20": (make(params={"prompt_logprobs": 50}), r"prompt_logprobs must lie in \[0, 20\]"),
    "priority 11": (make(priority=11), r"priority must lie in \[0, 10\], got 11"),
    "deadline in the past": (make(deadline_ms=NOW - 1), "is in the past"),
    "deadline right now": (make(deadline_ms=NOW), "is in the past"),
    "request id with a space": (make(request_id="has space"), "request_id must be 1-128 characters"),
    "request id with a slash": (make(request_id="a/b"), "request_id"),
    "request id with a brace": (make(request_id="{baton}"), "request_id"),
    "request id too long": (make(request_id="r" * 129), "request_id"),
    "request id with a colon": (make(request_id="abc:tokens"), "request_id"),
    "request id with a newline": (make(request_id="abc\n"), "request_id"),
    "request id with a star": (make(request_id="a*"), "request_id"),
    "request id naming a sample": (make(request_id="abc~1"), "request_id"),
    "more samples than allowed": (make(params={"n": 129}), r"n must lie in \[1, 128\]"),
    "tenant too long": (make(tenant="t" * (MAX_NAME_CHARS + 1)), "tenant must be 1-128 characters"),
    "tenant with a newline": (make(tenant="x\ny"), "tenant must be 1-128 characters"),
    "tenant with a colon": (make(tenant="a:b"), "tenant"),
    "tenant with a pipe": (make(tenant="a|b"), "tenant"),
    "tenant with a brace": (make(tenant="}x"), "tenant"),
    "cache salt too long": (make(cache_salt="s" * 257), "cache_salt has 257 characters; at most 256"),
    "allowed token out of vocab": (make(params={"allowed_token_ids": [3, 1000]}), "allowed_token_ids has token ids"),
    "more allowed tokens than the vocab": (make(params={"allowed_token_ids": [1] * 1001}), "at most the vocabulary"),
    "too many bad words": (make(params={"bad_words": ["w"] * 129}), "at most 128 bad words"),
    "empty bad word": (make(params={"bad_words": ["ok", ""]}), "bad words must have 1 to 256 characters"),
    "bad word of spaces": (make(params={"bad_words": ["  "]}), "not only spaces"),
    "too long bad word": (make(params={"bad_words": ["x" * 257]}), "bad words must have 1 to 256"),
    "truncate to 0 tokens": (make(params={"truncate_prompt_tokens": 0}), "truncate_prompt_tokens must be -1 or >= 1"),
    "truncate below -1": (make(params={"truncate_prompt_tokens": -2}), "truncate_prompt_tokens must be -1 or >= 1"),
}


@pytest.mark.parametrize(("msg", "message"), list(BAD.values()), ids=list(BAD))
def test_bad_request_raises_invalid_request_with_a_helpful_message(msg: pb.GenerateRequest, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        run(msg)


def test_invalid_request_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        run(make(prompt=""))


def test_too_long_prompt_text_raises_before_tokenizing() -> None:
    calls: list[str] = []

    def spy(text: str) -> list[int]:
        calls.append(text)
        return fake_tokenize(text)

    config = RequestLevelConfig(max_prompt_chars=50)
    with pytest.raises(InvalidRequest, match="prompt has 51 characters; at most 50"):
        validate(make(prompt="x" * 51), spy, LIMITS, config, now_ms=NOW)
    assert calls == []


def test_prompt_that_tokenizes_to_nothing_is_empty() -> None:
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        validate(make(prompt="   "), lambda _text: [], LIMITS, CONFIG, now_ms=NOW)


def test_too_many_stop_strings_follows_config() -> None:
    config = RequestLevelConfig(max_stop_strings=2, max_stop_string_chars=4)
    with pytest.raises(InvalidRequest, match="at most 2 stop strings"):
        run(make(params={"stop": ["a", "b", "c"]}), config)
    with pytest.raises(InvalidRequest, match="1 to 4 characters"):
        run(make(params={"stop": ["abcde"]}), config)
    assert run(make(params={"stop": ["a", "abcd"]}), config).params.stop == ("a", "abcd")


def test_n_counts_samples_within_the_given_limit() -> None:
    assert run(make()).n == 1  # unset means one
    assert run(make(params={"n": 1})).n == 1
    assert run(make(params={"n": 128, "seed": 2**64 - 128})).n == 128
    with pytest.raises(InvalidRequest, match=r"\[1, 8\]"):  # the frontend passes the batch size's bound
        validate(make(params={"n": 9}), fake_tokenize, LIMITS, CONFIG, now_ms=NOW, max_samples=8)
    with pytest.raises(InvalidRequest, match=r"\[1, 2\]"):
        run(make(params={"n": 3}), RequestLevelConfig(max_samples=2))


def test_request_id_with_trailing_newline_is_rejected() -> None:
    with pytest.raises(InvalidRequest, match="request_id"):
        run(make(request_id="abc\n"))


def test_defaults_for_a_minimal_request() -> None:
    req = run(make(prompt="hello"))
    assert req.prompt_ids == tuple(fake_tokenize("hello"))
    assert req.priority == 5
    assert req.tenant == "default"
    assert req.deadline_ms == 0
    assert req.arrival_ms == NOW
    params = req.params
    assert params.max_tokens == min(CONFIG.default_max_tokens, 128 - 5)
    assert params.temperature == 0.0
    assert params.top_p == 1.0
    assert params.top_k == 0
    assert params.seed is None
    assert params.stop == () and params.stop_token_ids == ()
    assert params.ignore_eos is False


def test_default_max_tokens_is_capped_by_the_room_left() -> None:
    assert run(make(prompt="x" * 100)).params.max_tokens == 28
    assert run(make(prompt="x" * 127)).params.max_tokens == 1


def test_default_max_tokens_uses_config_when_room_is_ample() -> None:
    limits = ModelLimits(model="m", max_model_len=4096, vocab_size=1000)
    assert run(make(prompt="hi"), limits=limits).params.max_tokens == 256
    config = RequestLevelConfig(default_max_tokens=7)
    assert run(make(prompt="hi"), config=config, limits=limits).params.max_tokens == 7


def test_fill_context_lets_an_unset_max_tokens_run_to_the_context_end() -> None:
    limits = ModelLimits(model="m", max_model_len=4096, vocab_size=1000)
    assert run(make(prompt="hi", params={"fill_context": True}), limits=limits).params.max_tokens == 4094
    asked = run(make(prompt="hi", params={"fill_context": True, "max_tokens": 9}), limits=limits)
    assert asked.params.max_tokens == 9  # an explicit max_tokens wins


def test_the_model_max_new_tokens_caps_only_an_unset_max_tokens() -> None:
    """As vLLM's server applies a generation_config's max_new_tokens."""
    limits = ModelLimits(
        model="m", max_model_len=4096, vocab_size=1000, sampling_defaults=SamplingDefaults(max_tokens=50)
    )
    assert run(make(prompt="hi"), limits=limits).params.max_tokens == 50
    assert run(make(prompt="hi", params={"fill_context": True}), limits=limits).params.max_tokens == 50
    assert run(make(prompt="hi", params={"max_tokens": 300}), limits=limits).params.max_tokens == 300
    config = RequestLevelConfig(default_max_tokens=7)
    assert run(make(prompt="hi"), config=config, limits=limits).params.max_tokens == 7


def test_prompt_plus_max_tokens_equal_to_max_model_len_is_accepted() -> None:
    assert run(make(prompt="x" * 100, params={"max_tokens": 28})).params.max_tokens == 28


def test_server_assigns_a_request_id_when_empty() -> None:
    first, second = run(make()), run(make())
    assert first.request_id and second.request_id
    assert first.request_id != second.request_id
    assert len(first.request_id) <= 128


def test_client_request_id_is_kept() -> None:
    assert run(make(request_id="Client-1.2_x@y-z")).request_id == "Client-1.2_x@y-z"
    assert run(make(request_id="r" * 128)).request_id == "r" * 128


def test_explicit_priorities_are_kept_including_zero() -> None:
    assert run(make(priority=0)).priority == 0
    assert run(make(priority=10)).priority == 10


def test_default_priority_comes_from_config() -> None:
    assert run(make(), RequestLevelConfig(default_priority=2)).priority == 2


def test_a_cache_salt_is_kept() -> None:
    assert run(make()).cache_salt == ""
    assert run(make(cache_salt="s" * 256)).cache_salt == "s" * 256


def test_per_tenant_prefix_caches_give_each_tenant_a_root_of_its_own() -> None:
    config = RequestLevelConfig(prefix_cache_per_tenant=True)
    roots = {
        (tenant, salt): chain_root(run(make(tenant=tenant, cache_salt=salt), config).cache_salt)
        for tenant in ("", "default", "acme", "globex")
        for salt in ("", "s")
    }
    assert roots[("", "")] == roots[("default", "")]  # no tenant is the default tenant
    assert len(set(roots.values())) == 6 and ROOT not in roots.values()
    assert chain_root(run(make(tenant="acme", cache_salt="s"), config).cache_salt) == roots[("acme", "s")]


def test_tenant_and_future_deadline_are_kept() -> None:
    req = run(make(tenant="t" * MAX_NAME_CHARS, deadline_ms=NOW + 1))
    assert req.tenant == "t" * MAX_NAME_CHARS
    assert req.deadline_ms == NOW + 1


def test_prompt_token_ids_are_used_when_prompt_is_empty() -> None:
    req = run(make(prompt="", prompt_token_ids=[0, 5, 999]))
    assert req.prompt_ids == (0, 5, 999)


def test_sampling_params_are_carried_over() -> None:
    req = run(
        make(
            params={
                "max_tokens": 10,
                "temperature": 0.5,
                "top_p": 0.25,
                "top_k": 999,
                "seed": 42,
                "stop": ["\n", "END"],
                "stop_token_ids": [0, 999],
                "ignore_eos": True,
                "stream_interval_tokens": 8,
            }
        )
    )
    p = req.params
    assert p.stream_interval_tokens == 8
    assert type(p).from_json(p.to_json()) == p, "it travels in the request record's params JSON"
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (10, 0.5, 0.25, 999, 42)
    assert p.stop == ("\n", "END")
    assert p.stop_token_ids == (0, 999)
    assert p.ignore_eos is True


def test_zero_top_p_means_one_and_seed_zero_is_kept() -> None:
    p = run(make(params={"top_p": 0.0, "seed": 0})).params
    assert p.top_p == 1.0
    assert p.seed == 0


def chat_request(**fields: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")]), **fields)


def test_a_chat_takes_its_ids_from_render_chat_and_the_prompts_checks() -> None:
    rendered: list[pb.Chat] = []

    def render(chat: pb.Chat) -> list[int]:
        rendered.append(chat)
        return [1, 7, 7, 2]

    req = validate(chat_request(), fake_tokenize, LIMITS, CONFIG, now_ms=NOW, render_chat=render)
    assert req.prompt_ids == (1, 7, 7, 2) and req.params.max_tokens == 128 - 4
    assert [m.content for m in rendered[0].messages] == ["hi"]
    with pytest.raises(InvalidRequest, match="max_model_len is 128"):
        validate(chat_request(), fake_tokenize, LIMITS, CONFIG, now_ms=NOW, render_chat=lambda _chat: [5] * 128)
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        validate(chat_request(), fake_tokenize, LIMITS, CONFIG, now_ms=NOW, render_chat=lambda _chat: [])


def test_a_chat_with_token_ids_or_nowhere_to_render_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="chat or prompt_token_ids, not both"):
        validate(
            chat_request(prompt_token_ids=[1]), fake_tokenize, LIMITS, CONFIG, now_ms=NOW, render_chat=lambda _chat: [1]
        )
    with pytest.raises(InvalidRequest, match="no chat input"):
        run(chat_request())


def test_setting_prompt_clears_chat_as_one_input() -> None:
    msg = chat_request()
    msg.prompt = "hello"  # the oneof: the last input set is the one sent
    assert msg.WhichOneof("input") == "prompt" and not msg.HasField("chat")
    assert run(msg).prompt_ids == tuple(fake_tokenize("hello"))


def test_sampling_controls_and_logprobs_are_carried_over() -> None:
    params = {
        "max_tokens": 10,
        "presence_penalty": -1.5,
        "frequency_penalty": 2.0,
        "repetition_penalty": 1.25,
        "min_tokens": 10,
        "min_p": 0.5,
        "logit_bias": {999: -100.0, 0: 100.0, 7: 0.5},
        "include_stop_str_in_output": True,
        "logprobs": 0,
        "prompt_logprobs": 20,
    }
    p = run(make(params=params)).params
    assert type(p).from_json(p.to_json()) == p, "it travels in the request record's params JSON"
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (-1.5, 2.0, 1.25)
    assert (p.min_tokens, p.min_p, p.include_stop_str_in_output) == (10, 0.5, True)
    assert p.logit_bias == ((0, 100.0), (7, 0.5), (999, -100.0))
    assert (p.logprobs, p.prompt_logprobs) == (0, 20)


def test_unset_controls_are_off() -> None:
    p = run(make()).params
    assert p.repetition_penalty == 1.0 and not p.adjusts_logits and p.min_p == 0.0
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens and not p.allowed_token_ids and not p.bad_words_token_ids


def test_vocabulary_controls_are_carried_over() -> None:
    params = {"skip_special_tokens": False, "allowed_token_ids": [7, 3, 7], "bad_words": ["ab", " cd", "x y"]}
    p = run(make(params=params)).params
    assert type(p).from_json(p.to_json()) == p, "it travels in the request record's params JSON"
    assert not p.skip_special_tokens and p.allowed_token_ids == (3, 7)
    # Each word as it is and with a leading space, where that is a new first token in as many tokens.
    a, b, c, d, x, y, space = (ord(ch) for ch in "abcdxy ")
    assert p.bad_words_token_ids == ((a, b), (500 + a, b), (c, d), (500 + c, d), (x, space, y), (500 + x, space, y))


def test_bad_words_need_a_word_encoder() -> None:
    msg = make(params={"bad_words": ["ab"]})
    with pytest.raises(InvalidRequest, match="takes no bad_words"):
        validate(msg, fake_tokenize, LIMITS, CONFIG, now_ms=NOW)


def test_bad_words_past_the_vocabulary_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="bad_words has token ids outside"):
        run(make(params={"bad_words": ["\u03a9"]}), limits=ModelLimits(model="m", max_model_len=128, vocab_size=900))


@pytest.mark.parametrize(("length", "truncate", "kept"), [(200, 5, 5), (200, 1, 1), (200, -1, 127), (50, 100, 50)])
def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(length: int, truncate: int, kept: int) -> None:
    prompt = "".join(chr(97 + i % 26) for i in range(length))
    req = run(make(prompt=prompt, params={"truncate_prompt_tokens": truncate, "max_tokens": 1}))
    assert req.prompt_ids == tuple(fake_tokenize(prompt))[-kept:]


def test_a_truncated_prompt_leaves_room_for_the_output() -> None:
    req = run(make(prompt="x" * 300, params={"truncate_prompt_tokens": 100, "max_tokens": 28}))
    assert len(req.prompt_ids) == 100 and req.params.max_tokens == 28


def test_max_tokens_zero_scores_the_prompt() -> None:
    p = run(make(params={"max_tokens": 0, "prompt_logprobs": 1})).params
    assert p.max_tokens == 0 and p.prompt_logprobs == 1


def test_only_a_request_that_fills_the_context_unasked_is_open_ended() -> None:
    assert run(make(prompt="hi", params={"fill_context": True})).open_ended
    assert not run(make(prompt="hi", params={"fill_context": True, "max_tokens": 9})).open_ended
    assert not run(make(prompt="hi")).open_ended


def test_a_top_k_of_the_whole_vocabulary_or_more_is_off() -> None:
    # As vLLM reads it: every token stays, so no filter (it was refused past the vocabulary).
    assert run(make(params={"top_k": 10**6})).params.top_k == 0
    assert run(make(params={"top_k": 1000})).params.top_k == 0  # the vocabulary's size
    assert run(make(params={"top_k": 999})).params.top_k == 999
