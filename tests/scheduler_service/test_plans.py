"""scheduler_service.plans: prefill grants count only the tokens that will be computed."""

from __future__ import annotations

from common.pb import executor_pb2 as pb
from scheduler_service.plans import prefill_grants


def admit(request_id: str, prompt: int, output: int = 0) -> pb.AdmitRequest:
    return pb.AdmitRequest(request_id=request_id, prompt_token_ids=[1] * prompt, output_token_ids=[2] * output)


def granted(grants: list[pb.PrefillGrant]) -> dict[str, int]:
    return {g.request_id: g.num_tokens for g in grants}


def test_grants_in_plan_order_until_the_budget_runs_out() -> None:
    admits = [admit("a", 100), admit("b", 100, 20), admit("c", 100)]
    assert granted(prefill_grants(admits, 250, 512)) == {"a": 100, "b": 120, "c": 30}
    assert granted(prefill_grants(admits, 250, 64)) == {"a": 64, "b": 64, "c": 64}


def test_an_expected_cache_hit_is_neither_granted_nor_spent() -> None:
    admits = [admit("hit", 1_000), admit("miss", 100)]
    assert granted(prefill_grants(admits, 300, 512, {"hit": 960})) == {"hit": 40, "miss": 100}
    sent = prefill_grants(admits, 300, 512, {"hit": 960})
    assert [g.expected_cached for g in sent] == [960, 0]  # the executor computes what it lost of it
    # Without the hit, the first request would take the whole budget.
    assert granted(prefill_grants(admits, 300, 512)) == {"hit": 300}


def test_a_whole_prompt_cached_still_computes_one_token() -> None:
    assert granted(prefill_grants([admit("all", 64, 3)], 100, 512, {"all": 500})) == {"all": 1}
