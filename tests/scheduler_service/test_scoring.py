"""How a request is scored at enqueue: its expected output in particular."""

from __future__ import annotations

from common.config import BatonConfig
from common.sampling_params import SamplingParams
from scheduler_service.estimator import estimator_key
from scheduler_service.requests import NewRequest
from scheduler_service.scoring import RequestScorer

CONFIG = BatonConfig()


def _request(max_tokens: int, open_ended: bool) -> NewRequest:
    params = SamplingParams(max_tokens=max_tokens)
    return NewRequest("r", (1, 2, 3), params, 5, "default", 0, 0, open_ended=open_ended)


def test_an_open_ended_request_is_expected_to_write_what_a_default_one_may() -> None:
    """A chat without max_tokens may fill the context (fill_context), but its score, fairness
    charge and placement weight expect a default request's output until the estimator knows the
    tenant's: not the context's whole room."""
    scorer = RequestScorer(CONFIG)
    default = CONFIG.scheduler.request_level.default_max_tokens
    assert scorer.score(_request(30_000, open_ended=True)).expected_output == default
    assert scorer.score(_request(30_000, open_ended=False)).expected_output == 30_000  # asked for: the bound
    assert scorer.score(_request(100, open_ended=True)).expected_output == 100  # a context with less room


def test_an_open_ended_request_is_expected_to_write_what_its_kind_wrote_once_the_estimator_knows() -> None:
    scorer = RequestScorer(CONFIG)
    key = estimator_key("default", 3)
    scorer.update([], {f"{key}:n": "50", f"{key}:mean": "2000", f"{key}:err": "10"})
    assert scorer.score(_request(30_000, open_ended=True)).expected_output == 2000  # not the default's cap
    assert scorer.score(_request(1_000, open_ended=True)).expected_output == 1000  # the context's room still bounds it
