"""Each token's text, decoded alone: how log probabilities name their tokens to clients.

As vLLM's ``decoded_token``: ``tokenizer.decode([id])`` with special tokens kept. A token that is
part of a character decodes to U+FFFD. Texts are cached by id (at most one per vocabulary entry),
since a request asking for alternatives names many tokens per position, and the same ones often.
"""

from __future__ import annotations

from collections.abc import Iterable


class TokenTexts:
    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self._decode = tokenizer.decode  # type: ignore[attr-defined]
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._decode([token_id], skip_special_tokens=False)
        return text

    def many(self, token_ids: Iterable[int]) -> list[str]:
        return [self(t) for t in token_ids]

    def joined(self, token_ids: Iterable[int]) -> str:
        """The tokens decoded together, special tokens kept: a character split across tokens whole."""
        return str(self._decode(list(token_ids), skip_special_tokens=False))
