"""Scores each new request at enqueue from what the fleet knows now: the length estimator, the
executors' load and step times, the tenant's weight. The arithmetic lives in pure modules
(``priority``, ``fair_share``, ``estimator``); this class only gathers their inputs.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from common.config import BatonConfig
from scheduler_service.estimator import LengthStats, estimator_key, predict_output
from scheduler_service.fair_share import admission_cost
from scheduler_service.priority import ScoreInputs, load_factor, queue_score
from scheduler_service.requests import NewRequest


@dataclass(frozen=True)
class FleetLoad:
    """The fleet's load as executors last reported it (their heartbeats in Redis)."""

    kv_usage: float = 0.0  # mean fraction of KV blocks in use
    step_ms: float = 0.0  # mean iteration time; 0 when unknown
    load: float = 0.0  # what the thresholds compare: KV use, or step time against its target

    @classmethod
    def from_reports(cls, reports: Iterable[Mapping[str, float]], target_step_ms: float) -> FleetLoad:
        usages, steps = [], []
        for report in reports:
            total = report.get("kv_blocks_total", 0)
            if total:
                usages.append(report.get("kv_blocks_used", 0) / total)
            if report.get("step_time_ms"):
                steps.append(float(report["step_time_ms"]))
        kv = sum(usages) / len(usages) if usages else 0.0
        step = sum(steps) / len(steps) if steps else 0.0
        load = max(kv, step / target_step_ms if target_step_ms else 0.0)
        return cls(kv, step, min(1.0, load))


@dataclass(frozen=True)
class Scored:
    score: float
    expected_output: int
    fields: dict[str, str]  # stored on the request: fairness charge and estimator bookkeeping


class RequestScorer:
    def __init__(self, config: BatonConfig) -> None:
        self.config = config
        self.fleet = FleetLoad()
        self.estimates: dict[str, LengthStats] = {}
        self.refreshed = 0.0

    @property
    def load_factor(self) -> float:
        return load_factor(self.fleet.load, self.config.scheduler.load_aware)

    def update(self, executor_loads: Iterable[str | None], estimator_fields: Mapping[str, str]) -> None:
        """Take fresh inputs: executors' heartbeat load JSON and the estimator hash."""
        reports = [json.loads(raw) for raw in executor_loads if raw]
        self.fleet = FleetLoad.from_reports(reports, self.config.scheduler.load_aware.target_step_ms)
        keys = {name.rsplit(":", 1)[0] for name in estimator_fields}
        self.estimates = {}
        for key in keys:
            stats = LengthStats.from_fields(
                estimator_fields.get(f"{key}:n"),
                estimator_fields.get(f"{key}:mean"),
                estimator_fields.get(f"{key}:err"),
            )
            if stats is not None:
                self.estimates[key] = stats
        self.refreshed = time.monotonic()

    def mean_abs_error(self) -> float:
        """The estimator's mean absolute error in tokens, weighted by each key's samples."""
        samples = sum(s.samples for s in self.estimates.values())
        if not samples:
            return 0.0
        return sum(s.abs_error * s.samples for s in self.estimates.values()) / samples

    def predict(self, tenant: str, prompt_tokens: int, max_tokens: int, open_ended: bool = False) -> int:
        """Expected output tokens. An open-ended request's bound is the context's room: until the
        estimator knows its kind, it is expected to write what a request that set no length may."""
        rl = self.config.scheduler.request_level
        stats = self.estimates.get(estimator_key(tenant, prompt_tokens))
        if open_ended and (stats is None or stats.samples < rl.estimator_min_samples):
            return min(max_tokens, rl.default_max_tokens)
        return predict_output(max_tokens, stats, rl.estimator_min_samples)

    def score(self, req: NewRequest) -> Scored:
        rl = self.config.scheduler.request_level
        prompt = len(req.prompt_ids)
        expected = self.predict(req.tenant, prompt, req.params.max_tokens, req.open_ended)
        step_ms = self.fleet.step_ms
        prefill_steps = math.ceil(prompt / self.config.scheduler.token_level.max_prefill_chunk)
        inputs = ScoreInputs(
            arrival_ms=req.arrival_ms,
            priority=req.priority,
            need_tokens=prompt + expected,
            deadline_ms=req.deadline_ms,
            ttft_target_ms=float(req.ttft_target_ms),
            service_ms=(prefill_steps + expected) * step_ms,
            prefill_ms=prefill_steps * step_ms,
        )
        score = queue_score(inputs, rl, self.config.scheduler.load_aware, self.fleet.load)
        weight = rl.tenant_weight(req.tenant)
        cost = admission_cost(
            prompt, expected, weight, rl.fairness_prompt_token_weight, rl.fairness_output_token_weight
        )
        fields = {
            "est_out": str(expected),
            "est_key": estimator_key(req.tenant, prompt),
            "fair_cost": repr(max(cost, 1e-9)),
            "fair_out_w": repr(rl.fairness_output_token_weight / weight),
            "ttft_target_ms": str(req.ttft_target_ms),
        }
        return Scored(score, expected, fields)
