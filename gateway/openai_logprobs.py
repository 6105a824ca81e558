"""Baton's log probabilities (``PositionLogprobs``) in OpenAI's two shapes, and the prompt's in vLLM's.

Tokens are named by their text as Baton decodes them alone (vLLM's ``decoded_token``); a token
that holds part of a character shows as U+FFFD, and chat's ``bytes`` are that text's UTF-8 bytes,
not the token's raw bytes. Log probabilities are floored at -9999.0 as vLLM does (JSON has no
-infinity). The prompt's first token, which nothing predicts, has a ``null`` log probability and
``null`` alternatives, as in OpenAI's echo.

Completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, where each
``top_logprobs`` entry maps the most likely tokens' texts, and the chosen one's, to their log
probabilities ("up to logprobs + 1 elements", as OpenAI says), and ``text_offset`` is each token's
character offset in the choice's text, counted as vLLM does from the tokens' texts.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": None}``.

vLLM's ``prompt_logprobs``: per prompt position ``null`` (the first) or ``{token id: {"logprob",
"rank", "decoded_token"}}``, the prompt's token first with its rank (how many tokens are at least as
likely), then the most likely tokens ranked 1, 2, ... (the prompt's token among them keeps its place
and takes their entry), as vLLM builds them.

With vLLM's ``return_tokens_as_token_ids``, a token is named ``token_id:N`` instead of by its text
(so tokens whose texts collide, or hold part of a character, stay apart), in ``tokens``, the
alternatives' keys and chat's ``token`` and ``bytes``; offsets then count those names, as vLLM's do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from common.pb import generate_pb2 as pb

LOGPROB_FLOOR = -9999.0


def _value(entry: pb.TokenLogprob) -> float | None:
    return max(entry.logprob, LOGPROB_FLOOR) if entry.HasField("logprob") else None


def _name(entry: pb.TokenLogprob, as_token_ids: bool) -> str:
    return f"token_id:{entry.token_id}" if as_token_ids else entry.text


class CompletionLogprobs:
    """Builds the legacy ``logprobs`` objects of one choice, chunk by chunk (offsets run on)."""

    def __init__(self, as_token_ids: bool = False) -> None:
        self.offset = 0  # characters of the choice's text the tokens so far account for
        self.as_token_ids = as_token_ids

    def of(self, positions: Iterable[pb.PositionLogprobs]) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for position in positions:
            token = position.token
            name = _name(token, self.as_token_ids)
            value = _value(token)
            out["tokens"].append(name)
            out["token_logprobs"].append(value)
            if value is None:
                out["top_logprobs"].append(None)
            else:
                top = {_name(alt, self.as_token_ids): max(alt.logprob, LOGPROB_FLOOR) for alt in position.top}
                top.setdefault(name, value)
                out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(name)
        return out


def _vllm_entry(entry: pb.TokenLogprob, rank: int | None) -> dict[str, Any]:
    return {"logprob": max(entry.logprob, LOGPROB_FLOOR), "rank": rank, "decoded_token": entry.text}


def vllm_prompt_logprobs(positions: Iterable[pb.PositionLogprobs], num_top: int) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``, each position with ``num_top`` alternatives at most."""
    out: list[dict[str, Any] | None] = []
    for position in positions:
        token = position.token
        if not token.HasField("logprob"):
            out.append(None)
            continue
        entries = {str(token.token_id): _vllm_entry(token, token.rank if token.HasField("rank") else None)}
        for rank, alt in enumerate(position.top[:num_top], start=1):
            entries[str(alt.token_id)] = _vllm_entry(alt, rank)
        out.append(entries)
    return out


def _chat_entry(entry: pb.TokenLogprob, as_token_ids: bool) -> dict[str, Any]:
    name = _name(entry, as_token_ids)
    return {"token": name, "logprob": _value(entry), "bytes": list(name.encode("utf-8"))}


def chat_logprobs(positions: Iterable[pb.PositionLogprobs], as_token_ids: bool = False) -> dict[str, Any]:
    content = []
    for position in positions:
        entry = _chat_entry(position.token, as_token_ids)
        entry["top_logprobs"] = [_chat_entry(alt, as_token_ids) for alt in position.top]
        content.append(entry)
    return {"content": content, "refusal": None}


class ChoiceLogprobs:
    """One choice's text and ``logprobs`` object, message by message: the echoed prompt (``echo``)
    goes before the first message's text, and its log probabilities before the first message's.

    Messages are Baton's ``GenerateResponse`` stream, or one ``CompleteResponse`` for the whole
    answer: both carry ``text``, ``logprobs`` and ``prompt_logprobs``. The prompt's text is the one
    the request gave; a prompt given as token ids is echoed as Baton decodes its tokens together
    (``prompt_text``), as vLLM does. A completion's echoed prompt positions show ``echo_top``
    alternatives (its ``logprobs``), however many vLLM's ``prompt_logprobs`` had computed; a chat's
    echo is its assistant message's text alone (``prompt``)."""

    def __init__(
        self, chat: bool, echo: bool, logprobs: bool, prompt: str, as_token_ids: bool = False, echo_top: int = 0
    ) -> None:
        self.chat = chat
        self.echo = echo
        self.wanted = logprobs
        self.prompt = prompt
        self.as_token_ids = as_token_ids
        self.echo_top = echo_top
        self._completion = CompletionLogprobs(as_token_ids)
        self._first = True

    def shape(self, message: Any) -> tuple[str, dict[str, Any] | None]:
        """The message's text and logprobs object (None when the request did not ask for them)."""
        text, positions = message.text, list(message.logprobs)
        if self._first and self.echo and self.chat:
            text = self.prompt + text
        elif self._first and self.echo:
            prompt = [pb.PositionLogprobs(token=p.token, top=p.top[: self.echo_top]) for p in message.prompt_logprobs]
            text = (self.prompt or message.prompt_text) + text
            positions = prompt + positions
        self._first = False
        if not self.wanted:
            return text, None
        return text, chat_logprobs(positions, self.as_token_ids) if self.chat else self._completion.of(positions)
