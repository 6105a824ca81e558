"""What the first message of each sample of a streamed request carries beyond its tokens, whether
it goes out on a ``Generate`` stream or as a ``GenerateBatch`` event: the prompt's size in its
usage (a streaming client's usage so far needs it) and, when the request asked, the prompt's ids."""

from __future__ import annotations

from collections.abc import Sequence

from common.pb import generate_pb2 as pb


class FirstMessages:
    def __init__(self, prompt_ids: Sequence[int], return_prompt_token_ids: bool) -> None:
        self._prompt_ids = prompt_ids
        self._return_ids = return_prompt_token_ids
        self._started: set[int] = set()  # the samples whose first message has gone

    def complete(self, response: pb.GenerateResponse, sample_index: int) -> pb.GenerateResponse:
        """``response`` of sample ``sample_index``, with what its first message carries if it is one."""
        if sample_index not in self._started:
            self._started.add(sample_index)
            response.usage.prompt_tokens = len(self._prompt_ids)
            if self._return_ids:
                response.prompt_token_ids.extend(self._prompt_ids)
        return response
