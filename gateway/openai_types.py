"""OpenAI request bodies in, ``baton.v1`` messages out; Baton's answers back in OpenAI's shapes.

Only what Baton can honour is accepted: vLLM's extensions that Baton does not serve
(``_UNSUPPORTED``), and tools on completions, are a 400 rather than a silently different answer.
Unknown fields are ignored, as OpenAI clients send ones that do not matter here. vLLM's
``add_special_tokens`` goes to a text prompt (default true) or a chat (default false), and
``return_tokens_as_token_ids`` names logprobs' tokens ``token_id:N`` (``openai_logprobs``).

Sampling: ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` (token id -> bias) map to
Baton's ``SamplingParams`` fields of the same names. Log probabilities (see ``openai_logprobs``):
completions' ``logprobs`` (0-20 alternatives) and ``echo`` (the prompt before the text, and with
``logprobs`` the prompt tokens' log probabilities first, the first one ``null``; ``max_tokens`` 0
then scores the prompt without generating); chat's ``logprobs`` and ``top_logprobs`` (0-20); and
vLLM's ``prompt_logprobs`` (0-20; with a stream only 0, which answers nothing, as in vLLM), in
vLLM's shape. They are the model's raw distribution, before penalties, bias and temperature
(vLLM's default).

Several choices (``n``): Baton's ``SamplingParams.n``, so the choices are samples of one prompt
sharing its KV (with ``seed``, choice i samples with seed + i). ``choices[i].index`` is the
sample's; a stream interleaves the choices' chunks as their tokens come, each choice ends with its
own finish reason, and the usage counts the prompt once and every choice's tokens.

Several prompts (a completion's ``prompt`` as a list of strings or of token-id lists): a Baton
request per prompt (``Parsed.requests``, prompt i > 0 named ``ID.i``), prompt i's sample k at
``choices[i * n + k]``, the usage the prompts' added up.

Structured output (``response_format``, and vLLM's ``structured_outputs`` and ``guided_*``
fields): see ``openai_structured``.

Extensions beyond OpenAI's schema (send them with the client's ``extra_body``): ``top_k``,
``ignore_eos``, ``stop_token_ids``, and vLLM's ``repetition_penalty``, ``min_tokens``, ``min_p``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``allowed_token_ids``, ``bad_words`` and
``truncate_prompt_tokens``, which map to Baton's ``SamplingParams`` fields of the same names, and
vLLM's ``cache_salt``, the request's (``GenerateRequest.cache_salt``). A truncated prompt is
echoed as Baton decodes the tokens it kept.

Headers: ``x-baton-priority`` (0-10), ``x-baton-tenant`` (wins over the body's ``user``, itself
mapped to a tenant by ``tenant_of_user``; with client auth on, the API key sets the tenant instead,
see ``gateway.auth``) and
``x-baton-request-id`` (Baton's request id, an idempotency key: a repeat gets 409). A response's
``id`` is ``cmpl-`` or ``chatcmpl-`` plus Baton's request id, for GetRequest and Cancel, or, as
vLLM's, plus the body's ``request_id``, which only names the response.

Chat: the messages go to Baton as they are (a ``baton.v1.Chat``; text content parts are joined by
newlines, as vLLM joins them),
and the scheduler renders them with the model's own chat template, so ``usage.prompt_tokens``
counts the tokens the template produced. A model without a template answers 400. vLLM's
``add_generation_prompt``, ``continue_final_message``, ``chat_template`` and
``chat_template_kwargs`` go with them (``chat_options``), and so do ``tools``, earlier tool calls and
their results; ``tool_choice`` is ``openai_tools``'s.

``model`` names the served model (its path or hub id, as ``/v1/models`` lists it); another name is
404 ``model_not_found``. Left out, it means the served model, as in vLLM.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import xxhash

from common.keys import MAX_NAME_CHARS, is_safe_name
from common.logprobs import MAX_LOGPROBS
from common.pb import generate_pb2 as pb
from common.stop_reason import read_stop_reason
from gateway.errors import BadRequest
from gateway.openai_logprobs import vllm_prompt_logprobs
from gateway.openai_structured import structured_output
from gateway.openai_tools import AUTO, ToolCalling, chat_messages, parse_tools
from gateway.reasoning import Reasoning

PRIORITY_HEADER = "x-baton-priority"
TENANT_HEADER = "x-baton-tenant"
REQUEST_ID_HEADER = "x-baton-request-id"

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's is the context's room
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # vLLM's values
# The most prompts one completion request may list: each is a Baton request of its own.
MAX_PROMPTS = 1024

FINISH_REASON: dict[int, str] = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    # vLLM's name for an output ended by a cancel (OpenAI has none).
    pb.FINISH_REASON_CANCELLED: "abort",
}

# Field -> values that mean "not asked for"; anything else is refused with a 400. vLLM's own
# extensions are here where serving them would need what Baton does not do: beam search (and its
# length penalty), server-side logits processors, vLLM's scheduling priority (Baton's is the
# x-baton-priority header, on its own scale), grammar forms xgrammar is not
# given here (a whitespace pattern, structural tags), truncating a prompt's end, the log
# probabilities of chosen token ids, a budget of thinking tokens, and repetition detection.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "logits_processors": (None, []),
    "priority": (None, 0),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "guided_whitespace_pattern": (None,),
    "structural_tag": (None,),
    "truncation_side": (None, "left"),  # Baton's truncate_prompt_tokens keeps the prompt's end
    "logprob_token_ids": (None,),
    "thinking_token_budget": (None, -1),
    "repetition_detection": (None,),
    # vLLM takes no backend per request either; Baton's one is xgrammar.
    "guided_decoding_backend": (None, "auto", "xgrammar"),
}


@dataclass(frozen=True)
class Parsed:
    """One OpenAI request, as the Baton request to send and how to answer it."""

    request: pb.GenerateRequest
    model: str  # as the body names it; empty: the served model
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage, and no choices
    echo: bool = False  # completions: the prompt goes before the text (and its logprobs first); chat: see echo_text
    echo_top: int = 0  # completions' echo: the alternatives each prompt position shows (its logprobs)
    echo_text: str = ""  # chat's echo: the assistant's last message, which the answer goes after
    logprobs: bool = False  # the answer carries a ``logprobs`` object
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"
    tools: ToolCalling | None = None  # chat: what the request asked of its tools (``openai_tools``)
    # Chat, vLLM's include_reasoning: false leaves the thinking out of the answer.
    include_reasoning: bool = True
    token_ids: bool = False  # vLLM's return_token_ids: the prompt's and each choice's token ids
    # stream_options.continuous_usage_stats (vLLM's), with include_usage: every chunk says the usage so far.
    continuous_usage: bool = False
    # Completions with a list of prompts: every prompt (text, or token ids), the first of them also
    # in ``request``; empty: ``request``'s prompt alone.
    prompts: tuple[str | tuple[int, ...], ...] = ()
    # vLLM's prompt_logprobs: the prompt's log probabilities with this many alternatives, in vLLM's
    # shape (``openai_logprobs.vllm_prompt_logprobs``): each choice's (completions) or the
    # response's (chat). None: not asked for.
    prompt_logprobs: int | None = None
    # vLLM's body request_id: the response's id is made from it, as vLLM's is, and nothing else. It is
    # not Baton's request id, an idempotency key (x-baton-request-id), as vLLM serves a repeated or
    # any string there; empty: the response is named by Baton's request id.
    label: str = ""

    def requests(self) -> list[pb.GenerateRequest]:
        """One Baton request per prompt: ``request`` as headers, auth and defaults left it, with
        each prompt in turn; prompt i > 0 is named ``ID.i``, where ``ID`` names prompt 0."""
        if len(self.prompts) < 2:
            return [self.request]
        base = self.request.request_id
        if len(base) + 1 + len(str(len(self.prompts) - 1)) > MAX_NAME_CHARS:
            raise BadRequest(f"the request id is too long to name {len(self.prompts)} prompts' requests")
        out = [self.request]
        for i, prompt in enumerate(self.prompts[1:], start=1):
            request = pb.GenerateRequest()
            request.CopyFrom(self.request)
            request.ClearField("prompt")
            request.ClearField("prompt_token_ids")
            if isinstance(prompt, str):
                request.prompt = prompt
            else:
                request.prompt_token_ids[:] = prompt
                if self.echo and not request.params.HasField("prompt_logprobs"):
                    request.params.prompt_logprobs = 0  # its tokens' texts, to echo (``parse_completion``)
            request.request_id = f"{base}.{i}"
            out.append(request)
        return out


def _number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{name} must be a number", param=name)
    return _float(value, name)


def _float(value: int | float, name: str) -> float:
    """``value`` as a float; an integer too large for one (JSON allows any) is a 400, not an OverflowError."""
    try:
        return float(value)
    except OverflowError:
        raise BadRequest(f"{name} is out of range", param=name) from None


def _int(body: Mapping[str, Any], name: str, minimum: int, maximum: int = 2**32 - 1) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 100.0 is 100, as vLLM's pydantic models read it
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise BadRequest(f"{name} must be an integer in [{minimum}, {maximum}]", param=name)
    return value


def _bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false", param=name)
    return value


def _token_ids(value: Any, name: str, allow_empty: bool = False) -> list[int] | None:
    """``value`` as token ids when it is a list of non-negative ints (empty only with ``allow_empty``), else None."""
    if (
        isinstance(value, list)
        and (value or allow_empty)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        if any(not 0 <= t < 2**32 for t in value):
            raise BadRequest(f"{name} holds token ids out of range", param=name)
        return list(value)
    return None


def _stops(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise BadRequest("stop must be a string or a list of strings", param="stop")


def refuse_unsupported(body: Mapping[str, Any], unsupported: Mapping[str, tuple[Any, ...]] = _UNSUPPORTED) -> None:
    """A 400 for a field of ``unsupported`` that ``body`` sets to anything but its neutral values."""
    for name, neutral in unsupported.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) for v in neutral):
            raise BadRequest(f"{name}={body[name]!r} is not supported by this server", param=name)


def _logit_bias(body: Mapping[str, Any]) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token ids (as JSON object keys, so strings) to numbers. Baton checks the ranges."""
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise BadRequest("logit_bias must map token ids to numbers", param="logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) < 2**32):
            raise BadRequest(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BadRequest("logit_bias values must be numbers", param="logit_bias")
        out[int(key)] = _float(value, "logit_bias")
    return out


def _penalties(body: Mapping[str, Any], params: pb.SamplingParams) -> None:
    """OpenAI's penalties and bias, and vLLM's extensions; Baton checks the values."""
    for name in ("presence_penalty", "frequency_penalty", "min_p"):
        value = _number(body, name)
        if value is not None:
            setattr(params, name, value)
    repetition = _number(body, "repetition_penalty")
    if repetition is not None:
        params.repetition_penalty = repetition
    min_tokens = _int(body, "min_tokens", 0)
    if min_tokens is not None:
        params.min_tokens = min_tokens
    params.logit_bias.update(_logit_bias(body))
    params.include_stop_str_in_output = _bool(body, "include_stop_str_in_output")


def _vocabulary_controls(body: Mapping[str, Any], params: pb.SamplingParams) -> None:
    """vLLM's controls over which tokens may come and how they read; Baton checks the values."""
    if body.get("skip_special_tokens") is not None:
        params.skip_special_tokens = _bool(body, "skip_special_tokens")
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        ids = _token_ids(allowed, "allowed_token_ids")
        if ids is None:
            raise BadRequest("allowed_token_ids must be a non-empty list of token ids", param="allowed_token_ids")
        params.allowed_token_ids.extend(ids)
    bad_words = body.get("bad_words")
    if bad_words is not None:
        if not isinstance(bad_words, list) or not all(isinstance(w, str) for w in bad_words):
            raise BadRequest("bad_words must be a list of strings", param="bad_words")
        params.bad_words.extend(bad_words)
    truncate = _int(body, "truncate_prompt_tokens", -1, 2**31 - 1)
    if truncate is not None:
        params.truncate_prompt_tokens = truncate


def _sampling(body: Mapping[str, Any], default_max_tokens: int | None, min_max_tokens: int = 1) -> pb.SamplingParams:
    """``default_max_tokens``: where the body sets no max_tokens; None lets the output fill the context."""
    params = pb.SamplingParams(stop=_stops(body), ignore_eos=_bool(body, "ignore_eos"))
    _penalties(body, params)
    _vocabulary_controls(body, params)
    # The chat API's newer name wins over the deprecated one, as in OpenAI's API and vLLM.
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", min_max_tokens)
    if max_tokens is None and "max_tokens" not in body:
        # Only an absent max_tokens takes the default: an explicit null is the room left in the
        # context, as vLLM reads a completion's.
        max_tokens = default_max_tokens
    if max_tokens is None:
        params.fill_context = True  # the scheduler caps it by the model's max_new_tokens, as vLLM does
    else:
        params.max_tokens = max_tokens
    temperature = _number(body, "temperature")
    # OpenAI's default temperature is 1; Baton's proto default (0) means greedy.
    params.temperature = 1.0 if temperature is None else temperature
    top_p = _number(body, "top_p")
    if top_p is not None:
        # Baton's proto reads 0 as "unset" (1): an explicit 0 would silently switch the filter off.
        if not 0 < top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1], got {top_p}", param="top_p")
        params.top_p = top_p
    top_k = _int(body, "top_k", -1)
    if top_k is not None:
        params.top_k = max(top_k, 0)  # vLLM's -1, like 0, means every token
    seed = _int(body, "seed", -(2**63), 2**64 - 1)
    if seed is not None and seed != -1:  # vLLM's -1 is no seed at all
        params.seed = seed % 2**64  # vLLM takes any int64; a negative one as its two's complement
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        ids = _token_ids(stop_ids, "stop_token_ids", allow_empty=True)
        if ids is None:
            raise BadRequest("stop_token_ids must be a list of token ids", param="stop_token_ids")
        params.stop_token_ids.extend(ids)
    return params


def _parsed(
    body: Mapping[str, Any], request: pb.GenerateRequest, default_max_tokens: int | None, min_max_tokens: int = 1
) -> Parsed:
    refuse_unsupported(body)
    model = body.get("model") or ""  # null, as absent: the served model
    if not isinstance(model, str):
        raise BadRequest("model must be a string", param="model")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("user must be a string", param="user")
    label = body.get("request_id")  # vLLM's: it names the response, not Baton's request (see Parsed.label)
    if label is not None and (not isinstance(label, str) or not label):
        raise BadRequest("request_id must be a non-empty string", param="request_id")
    salt = body.get("cache_salt")
    if salt is not None:
        # As vLLM: a salt given must salt something (Baton checks its length).
        if not isinstance(salt, str) or not salt:
            raise BadRequest("cache_salt must be a non-empty string", param="cache_salt")
        request.cache_salt = salt
    stream = _bool(body, "stream")
    request.params.CopyFrom(_sampling(body, default_max_tokens, min_max_tokens))
    if (structured := structured_output(body)) is not None:
        request.params.structured_output.CopyFrom(structured)
    request.params.n = _int(body, "n", 1) or 1  # its upper bound is Baton's (request_level.max_samples)
    request.tenant = tenant_of_user(user or "")
    tokens_as_ids = _bool(body, "return_tokens_as_token_ids")
    request.return_prompt_token_ids = token_ids = _bool(body, "return_token_ids")
    include_usage, continuous_usage = _stream_options(body, stream)
    prompt_logprobs = _int(body, "prompt_logprobs", 0, MAX_LOGPROBS)
    if prompt_logprobs is not None and stream:  # as vLLM answers: they come with a whole response only
        if prompt_logprobs > 0:
            raise BadRequest("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
        prompt_logprobs = None  # 0, which vLLM takes with a stream and answers nothing for
    return Parsed(
        request,
        model,
        stream,
        include_usage,
        tokens_as_ids=tokens_as_ids,
        continuous_usage=continuous_usage,
        token_ids=token_ids,
        prompt_logprobs=prompt_logprobs,
        label=label or "",
    )


def _asking_prompt_logprobs(parsed: Parsed) -> None:
    """Baton computes one set of prompt log probabilities: as wide as vLLM's ``prompt_logprobs``
    and completions' echo (``logprobs`` alternatives) ask, each answer then taking its own."""
    if parsed.prompt_logprobs is None:
        return
    params = parsed.request.params
    echoed = params.prompt_logprobs if params.HasField("prompt_logprobs") else 0
    params.prompt_logprobs = max(echoed, parsed.prompt_logprobs)


def tenant_of_user(user: str) -> str:
    """The tenant OpenAI's ``user`` names: itself where it is a valid tenant name, else a name derived
    from it (any string is a valid ``user``, while tenants become parts of Redis keys), so each end
    user still counts as one tenant for fairness."""
    if not user or is_safe_name(user):
        return user
    return "user-" + xxhash.xxh3_64_hexdigest(user.encode("utf-8", "surrogatepass"))


def _stream_options(body: Mapping[str, Any], stream: bool) -> tuple[bool, bool]:
    """``include_usage`` (true unless set false, as vLLM reads it), and vLLM's
    ``continuous_usage_stats`` (which needs it, as in vLLM)."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", param="stream_options")
    if not stream:
        if options:  # as OpenAI and vLLM answer (an empty object asks for nothing)
            raise BadRequest("stream_options is only allowed when stream is true", param="stream_options")
        return False, False
    # vLLM's default, where OpenAI's is false: a client that sends stream_options at all (only
    # continuous_usage_stats, say) gets the usage unless it says otherwise.
    include = _bool(options, "include_usage", default=True)
    return include, include and _bool(options, "continuous_usage_stats")


def _prompts(value: Any) -> list[str | tuple[int, ...]]:
    """A completion's ``prompt``: a string, token ids, or a list of either (a batch of prompts)."""
    if isinstance(value, str):
        return [value]
    if (ids := _token_ids(value, "prompt")) is not None:
        return [tuple(ids)]
    if isinstance(value, list) and value and len(value) <= MAX_PROMPTS:
        prompts: list[str | tuple[int, ...]] = []
        for item in value:
            if isinstance(item, str):
                prompts.append(item)
            elif (ids := _token_ids(item, "prompt")) is not None:
                prompts.append(tuple(ids))
            else:
                break
        else:
            return prompts
    raise BadRequest(
        f"prompt must be a string, a list of token ids, or a list of up to {MAX_PROMPTS} of either", param="prompt"
    )


# Tools belong to conversations: a completion has no template to list them.
_COMPLETION_UNSUPPORTED: dict[str, tuple[Any, ...]] = {"tools": (None, []), "tool_choice": (None, "none")}


def parse_completion(body: Mapping[str, Any]) -> Parsed:
    refuse_unsupported(body, _COMPLETION_UNSUPPORTED)
    prompts = _prompts(body.get("prompt"))
    request = pb.GenerateRequest()
    if isinstance(prompts[0], str):
        request.prompt = prompts[0]
    else:
        request.prompt_token_ids.extend(prompts[0])
    if isinstance(prompts[0], str) and body.get("add_special_tokens") is not None:
        request.add_special_tokens = _bool(body, "add_special_tokens")  # token ids are taken as they are
    echo = _bool(body, "echo")
    parsed = _parsed(body, request, COMPLETION_DEFAULT_MAX_TOKENS, 0 if echo else 1)
    params = parsed.request.params
    logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
    if logprobs is not None:
        params.logprobs = logprobs
    truncated = params.HasField("truncate_prompt_tokens")
    if echo and (logprobs is not None or not request.prompt or params.max_tokens == 0 or truncated):
        # The prompt's logprobs; or, for a prompt of ids or a truncated one, its tokens' texts to
        # echo; or a prompt to score (max_tokens 0), which needs them: Baton computes the prompt
        # whatever it is asked.
        params.prompt_logprobs = logprobs or 0
    _asking_prompt_logprobs(parsed)
    prompt_list = tuple(prompts) if len(prompts) > 1 else ()
    return replace(parsed, echo=echo, logprobs=logprobs is not None, echo_top=logprobs or 0, prompts=prompt_list)


def _content(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if content is None:  # an assistant turn that only called tools
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise BadRequest("only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "\n".join(parts)  # as vLLM joins text parts
    raise BadRequest("message content must be a string or a list of text parts", param="messages")


def chat_input(messages: Any) -> pb.Chat:
    """The conversation as Baton takes it, tool calls and results included. Which roles a model
    accepts is Baton's to judge, with its template."""
    chat = pb.Chat()
    chat_messages(messages, chat, _content)
    return chat


def chat_options(body: Mapping[str, Any], chat: pb.Chat) -> None:
    """vLLM's options for rendering a conversation: ``add_generation_prompt`` (default true),
    ``continue_final_message``, ``chat_template`` (Baton takes it where the operator trusts clients
    with templates), ``chat_template_kwargs`` (an object of template variables),
    ``add_special_tokens`` (default false: the template's tokens alone), ``documents`` (for a
    template that cites them) and ``reasoning_effort`` (a template variable)."""
    template = body.get("chat_template")
    if template is not None:
        if not isinstance(template, str):
            raise BadRequest("chat_template must be a string", param="chat_template")
        chat.chat_template = template
    generation = body.get("add_generation_prompt")
    if generation is not None:
        chat.add_generation_prompt = _bool(body, "add_generation_prompt")
    chat.continue_final_message = _bool(body, "continue_final_message")
    chat.add_special_tokens = _bool(body, "add_special_tokens")  # vLLM's default for a chat: false
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
            raise BadRequest("documents must be a list of objects", param="documents")
        if documents:
            chat.documents = json.dumps(documents, ensure_ascii=False)
    variables = body.get("chat_template_kwargs")
    if variables is None:
        variables = {}
    if not isinstance(variables, dict):
        raise BadRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise BadRequest(
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}", param="reasoning_effort"
            )
        # As vLLM: the template reads the effort, and a template that asks whether to think at all
        # is told so, unless the request's own template variables say: by the name Qwen3's and
        # most templates read, and by the one DeepSeek V3.1's and Kimi K2's read (either name the
        # request sets speaks for both).
        thinks = variables.get("enable_thinking", variables.get("thinking", effort != "none"))
        variables = {"enable_thinking": thinks, "thinking": thinks, **variables, "reasoning_effort": effort}
    if variables:
        chat.chat_template_kwargs = json.dumps(variables, ensure_ascii=False)


def parse_chat(body: Mapping[str, Any], tool_call_parser: str = "") -> Parsed:
    """``tool_call_parser``: the tool-call syntax "auto" tool choice reads (``openai_tools``)."""
    request = pb.GenerateRequest(chat=chat_input(body.get("messages")))
    chat_options(body, request.chat)
    calling, request.chat.tools, forced = parse_tools(body, tool_call_parser)
    parsed = _parsed(body, request, None)  # as OpenAI's and vLLM's chat: the room left in the context
    params = parsed.request.params
    if calling is not None and calling.mode == AUTO and not params.HasField("skip_special_tokens"):
        params.skip_special_tokens = False  # the calls' tags may be special tokens: the parser reads them
    if forced is not None:
        if parsed.request.params.HasField("structured_output"):
            raise BadRequest(
                "a forced tool call already fixes the output's form: drop response_format", param="tool_choice"
            )
        parsed.request.params.structured_output.CopyFrom(forced)
    parsed = replace(parsed, tools=calling, include_reasoning=_bool(body, "include_reasoning", default=True))
    if _bool(body, "echo"):
        # vLLM's chat echo: an answer that continues the assistant's last message starts with it.
        last = request.chat.messages[-1]
        parsed = replace(parsed, echo=True, echo_text=last.content if last.role == "assistant" else "")
    logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top and not logprobs:
        raise BadRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
    if logprobs:
        parsed.request.params.logprobs = top or 0
    _asking_prompt_logprobs(parsed)
    return replace(parsed, logprobs=logprobs)


def apply_model_defaults(params: pb.SamplingParams, body: Mapping[str, Any], defaults: pb.SamplingDefaults) -> None:
    """The served model's recommended sampling settings (its generation_config, see
    ``common.sampling_defaults``) for what ``body`` leaves out, as vLLM's server applies them. Its
    max_new_tokens is the scheduler's to apply: it caps a max_tokens left unset, and only where
    the prompt's length is known."""
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if body.get(name) is None and defaults.HasField(name):
            setattr(params, name, getattr(defaults, name))


def apply_headers(request: pb.GenerateRequest, headers: Mapping[str, str]) -> None:
    """Baton's own headers; they win over the body, as a proxy in front may set them per API key."""
    if (priority := headers.get(PRIORITY_HEADER)) is not None:
        if not re.fullmatch(r"[0-9]{1,9}", priority.strip()):
            raise BadRequest(f"{PRIORITY_HEADER} must be an integer from 0 to 10")
        request.priority = int(priority)  # the upper bound is Baton's (max_priority), so Baton checks it
    if tenant := headers.get(TENANT_HEADER):
        request.tenant = tenant
    # The gateway names every request, so the OpenAI `id` can point at Baton's record from the start.
    request.request_id = headers.get(REQUEST_ID_HEADER) or request.request_id or uuid.uuid4().hex


def usage_dict(usage: pb.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        # As OpenAI reports it: the prompt tokens served from the prefix cache.
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class RunningUsage:
    """vLLM's ``continuous_usage_stats``: each chunk of a choice carries its usage so far, its
    prompt's tokens (a stream's first message of each sample says them) and its own output's."""

    def __init__(self, prompt_tokens: Sequence[int]) -> None:
        self.prompt_tokens = list(prompt_tokens)
        self.generated: dict[int, int] = {}

    def add(self, prompt: int, index: int, tokens: int) -> dict[str, Any]:
        """Choice ``index`` (of prompt ``prompt``) generated ``tokens`` more; its usage so far."""
        self.generated[index] = self.generated.get(index, 0) + tokens
        return self.of(prompt, index)

    def of(self, prompt: int, index: int) -> dict[str, Any]:
        completion = self.generated.get(index, 0)
        prompt_tokens = self.prompt_tokens[prompt]
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }


def samples_usage(usages: Sequence[pb.Usage]) -> pb.Usage:
    """A request's usage from its samples': the prompt once (they share it), every sample's output.
    Its cached tokens are the fewest any sample found: the later samples read the blocks that
    sample 0 computed, and the prompt counts once."""
    return pb.Usage(
        prompt_tokens=usages[0].prompt_tokens if usages else 0,
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=min((u.cached_tokens for u in usages), default=0),
    )


def prompts_usage(per_prompt: Sequence[Sequence[pb.Usage]]) -> pb.Usage:
    """The usage of a request with several prompts, each with its samples' usages: the prompts'
    usages (``samples_usage``) added up."""
    usages = [samples_usage(samples) for samples in per_prompt]
    return pb.Usage(
        prompt_tokens=sum(u.prompt_tokens for u in usages),
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=sum(u.cached_tokens for u in usages),
    )


# One choice's text and logprobs object from its prompt's index and its whole output
# (``openai_logprobs.ChoiceLogprobs.shape``).
Shape = Callable[[int, pb.CompleteResponse], tuple[str, dict[str, Any] | None]]


@dataclass(frozen=True)
class Reply:
    """Builds the response objects of one request, whole or as stream chunks."""

    chat: bool
    request_id: str
    model: str
    created: int
    # With stream_options.include_usage, OpenAI gives every chunk a usage field: null but in the last.
    include_usage: bool = False
    tools: ToolCalling | None = None  # chat: the answer's message may be tool calls
    reasoning: Reasoning | None = None  # chat: the thinking is split from the answer
    token_ids: bool = False  # vLLM's return_token_ids
    include_reasoning: bool = True  # the thinking goes out in ``reasoning`` (else it is dropped)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: alternatives per position; None: none

    @classmethod
    def for_request(cls, chat: bool, parsed: Parsed, model: str, reasoning: Reasoning | None = None) -> Reply:
        """``model``: the name to answer with (the request's, or the served model's when it named
        none); ``reasoning``: the gateway's reasoning parser, which chat answers go through."""
        created = int(time.time())
        thinking = reasoning if chat else None
        return cls(
            chat,
            parsed.label or parsed.request.request_id,
            model,
            created,
            parsed.include_usage,
            parsed.tools,
            thinking,
            parsed.token_ids,
            parsed.include_reasoning,
            parsed.prompt_logprobs,
        )

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def whole(
        self, outs: pb.CompleteResponse | Sequence[pb.CompleteResponse], shape: Shape | None = None
    ) -> dict[str, Any]:
        """The whole response to one prompt's output or several prompts' (in order): a choice per
        sample (``out.samples``; ``out`` itself when it has none), prompt i's sample k at index
        i * n + k as OpenAI numbers them, each choice's text and logprobs object as ``shape`` gives
        them (default: its text, none)."""
        per_prompt = [list(out.samples) or [out] for out in ([outs] if isinstance(outs, pb.CompleteResponse) else outs)]
        choices = [
            self._whole_choice(
                i * len(samples) + sample.sample_index, sample, *(shape(i, sample) if shape else (sample.text, None))
            )
            for i, samples in enumerate(per_prompt)
            for sample in samples
        ]
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        if self.chat and self.token_ids:  # vLLM's place for a chat's: the response's
            body["prompt_token_ids"] = list(per_prompt[0][0].prompt_token_ids)
        if self.prompt_logprobs is not None:  # vLLM's places: a chat response's, each completion choice's
            scored = [self._prompt_logprobs(samples) for samples in per_prompt]
            if self.chat:
                body["prompt_logprobs"] = scored[0]
            else:
                for choice in choices:
                    choice["prompt_logprobs"] = scored[choice["index"] // len(per_prompt[0])]
        body["usage"] = usage_dict(prompts_usage([[sample.usage for sample in samples] for samples in per_prompt]))
        return body

    def _prompt_logprobs(self, samples: Sequence[pb.CompleteResponse]) -> list[dict[str, Any] | None]:
        """A prompt's log probabilities in vLLM's shape, from whichever of its samples carries them
        (each computes its prompt whole; they agree)."""
        positions = next((s.prompt_logprobs for s in samples if s.prompt_logprobs), samples[0].prompt_logprobs)
        return vllm_prompt_logprobs(positions, self.prompt_logprobs or 0)

    def _whole_choice(
        self, index: int, sample: pb.CompleteResponse, text: str, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        finish = FINISH_REASON.get(sample.finish_reason)
        choice: dict[str, Any] = {
            "index": index,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": read_stop_reason(sample),
        }
        if self.token_ids:
            choice["token_ids"] = list(sample.token_ids)
        if not self.chat:
            choice["text"] = text
            if self.token_ids:  # vLLM's place for a completion's: each choice's
                choice["prompt_token_ids"] = list(sample.prompt_token_ids)
            return choice
        thought = answer = None
        if self.reasoning is not None:
            thought, answer = self.reasoning.split(
                text,
                keep_calls=self.tools is not None and self.tools.mode == AUTO,
                cut_short=sample.finish_reason == pb.FINISH_REASON_LENGTH,
            )
            text = answer or ""
        if self.tools is not None:
            choice["message"], choice["finish_reason"] = self.tools.whole_message(text, finish)
        else:
            choice["message"] = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            message = choice["message"]
            if self.include_reasoning:
                message["reasoning_content"] = message["reasoning"] = thought  # vLLM's older name, and its newer
            if answer is None and message["content"] == "":
                message["content"] = None  # all thinking, no answer
        return choice

    def chunk(
        self,
        text: str | None,
        finish_reason: int = 0,
        role: bool = False,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
        tool_calls: dict[str, Any] | None = None,
        finish: str | None = None,
        usage: dict[str, Any] | None = None,
        reasoning: str | None = None,
        ids: pb.GenerateResponse | None = None,
        stopped_by: pb.GenerateResponse | None = None,
    ) -> dict[str, Any]:
        """One stream chunk of choice ``index``; for chat, ``text=None`` is an empty delta (the
        finishing chunk), and ``tool_calls`` a delta of calls (``openai_tools.ToolCallStream``).
        ``finish`` names a finish reason in place of ``finish_reason``'s; ``usage`` is the usage so
        far, under vLLM's ``continuous_usage_stats``; ``reasoning`` a chat's thinking (``reasoning``);
        ``ids`` the message whose token ids (and prompt's, on a sample's first) the chunk carries,
        under vLLM's ``return_token_ids``; a finishing chunk says the ``stop_reason`` of the
        message it finishes (``stopped_by``), as vLLM's."""
        choice: dict[str, Any] = {
            "index": index,
            "logprobs": logprobs,
            "finish_reason": finish or FINISH_REASON.get(finish_reason),
        }
        if choice["finish_reason"] is not None:
            choice["stop_reason"] = read_stop_reason(stopped_by) if stopped_by is not None else None
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls is not None:
                delta.update(tool_calls)
            if reasoning is not None:
                delta["reasoning_content"] = delta["reasoning"] = reasoning
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if ids is not None and self.token_ids:
            choice["token_ids"] = list(ids.token_ids)
            if ids.prompt_token_ids:
                (out if self.chat else choice)["prompt_token_ids"] = list(ids.prompt_token_ids)
        if self.include_usage:
            out["usage"] = usage
        return out

    def usage_chunk(self, usage: pb.Usage) -> dict[str, Any]:
        """OpenAI's last chunk under ``stream_options.include_usage``: no choices, only usage."""
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        out["usage"] = usage_dict(usage)
        return out
