"""scheduler_service.link_state: what a linked request still weighs on its executor."""

from __future__ import annotations

from scheduler_service.link_state import LinkedRequest


def linked(generated: int, expected_output: int = 100, prompt_len: int = 40) -> LinkedRequest:
    return LinkedRequest("r", prompt_len, generated, 0, 0, None, expected_output=expected_output)


def test_outstanding_tokens_count_the_prompt_until_the_first_token() -> None:
    assert linked(generated=0).outstanding_tokens == 100 + 40
    assert linked(generated=1).outstanding_tokens == 99
    assert linked(generated=60).outstanding_tokens == 40


def test_a_request_past_its_expected_output_still_weighs_a_token() -> None:
    # The estimator guessed short; the request is still running, so it is not free work.
    assert linked(generated=150).outstanding_tokens == 1
