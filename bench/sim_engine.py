"""The SIMULATED executor's engine rules, for scheduler benchmarks only (``bench/sim_executor.py``).

Pure bookkeeping, no model and no server: plans apply at the next iteration boundary (admit,
abort, preempt, prefill grants, token budget); every running decode gets one token per step and
prefill gets what the budget leaves; a request that finishes its prefill emits its first token in
that step; the batch and the KV blocks are bounded, and a full batch rejects. Tokens are made-up
ids and never EOS. Not a stand-in for the real engine in any test.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.lifecycle import FinishReason
from common.pb import executor_pb2 as pb


@dataclass(frozen=True)
class SimConfig:
    """What a simulated executor claims to be, and how long its steps take."""

    step_s: float = 0.025
    max_batch_size: int = 32
    token_budget: int = 512
    kv_blocks_total: int = 8192
    block_size: int = 16
    max_model_len: int = 4096
    vocab_size: int = 8192
    heartbeat_ms: int = 500
    timeout_ms: int = 3000

    def __post_init__(self) -> None:
        if self.step_s <= 0:
            raise ValueError(f"step_s must be positive, got {self.step_s}")
        if self.max_batch_size < 1 or self.token_budget < 2:
            raise ValueError("max_batch_size must be >= 1 and token_budget >= 2")


@dataclass
class SimRequest:
    request_id: str
    num_tokens: int  # prompt + already generated (all to prefill)
    generated: int  # output tokens so far (resumed ones count)
    max_tokens: int
    rank: float
    computed: int = 0

    @property
    def decoding(self) -> bool:
        return self.computed >= self.num_tokens

    def blocks(self, block_size: int) -> int:
        return -(-(self.computed + 1) // block_size)


@dataclass
class SimStats:
    """Counters one executor keeps; the benchmark reads them."""

    steps: int = 0  # steps with work
    tokens: int = 0  # tokens emitted
    reports: int = 0  # StepReports handed to gRPC
    plans: int = 0  # Plans received
    admitted: int = 0
    rejected: int = 0
    finished: int = 0
    busy_s: float = 0.0  # time spent in steps with work
    plan_latency_s: list[float] = field(default_factory=list)  # report k sent -> plan for k+1 received


class SimEngine:
    """The engine's bookkeeping with a stopwatch for a model. Pure; no gRPC."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.running: dict[str, SimRequest] = {}
        self.iteration = 0
        self.plan_seq = 0
        self.token_budget = config.token_budget
        self._grants: dict[str, int] = {}
        self._finished: list[pb.FinishedRequest] = []
        self._preempted: list[str] = []
        self._rejected: list[pb.FinishedRequest] = []
        self._reported_seq = 0

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    @property
    def has_news(self) -> bool:
        return bool(self._finished or self._preempted or self._rejected) or self.plan_seq != self._reported_seq

    def apply(self, plan: pb.Plan) -> None:
        for request_id in plan.abort:
            if self.running.pop(request_id, None) is not None:
                self._finished.append(pb.FinishedRequest(request_id=request_id, finish_reason=FinishReason.CANCELLED))
        for request_id in plan.preempt:
            if self.running.pop(request_id, None) is not None:
                self._preempted.append(request_id)
        for admit in plan.admit:
            self._admit(admit)
        self._grants = {g.request_id: g.num_tokens for g in plan.prefill}
        if plan.token_budget > 0:
            self.token_budget = plan.token_budget
        self.plan_seq = plan.seq

    def abort_all(self) -> None:
        self.running.clear()

    def _admit(self, admit: pb.AdmitRequest) -> None:
        self.running.pop(admit.request_id, None)  # a re-admission restarts it
        total = len(admit.prompt_token_ids) + len(admit.output_token_ids)
        blocks = -(-(total + 1) // self.config.block_size)
        if total >= self.config.max_model_len or blocks > self.config.kv_blocks_total:
            error = f"{total} tokens do not fit"
            self._finished.append(pb.FinishedRequest(request_id=admit.request_id, finish_reason=4, error=error))
            return
        if len(self.running) >= min(self.config.max_batch_size, self.token_budget - 1):
            self._rejected.append(pb.FinishedRequest(request_id=admit.request_id, error="batch full"))
            return
        max_tokens = max(1, admit.sampling.max_tokens)
        req = SimRequest(admit.request_id, total, len(admit.output_token_ids), max_tokens, admit.rank)
        self.running[admit.request_id] = req
        if req.generated >= max_tokens:
            self._finish(req)

    def _finish(self, req: SimRequest) -> None:
        self.running.pop(req.request_id, None)
        self._finished.append(pb.FinishedRequest(request_id=req.request_id, finish_reason=FinishReason.LENGTH))

    def _kv_used(self) -> int:
        return sum(r.blocks(self.config.block_size) for r in self.running.values())

    def step(self, elapsed_ns: int) -> pb.StepReport:
        """One iteration's bookkeeping: decodes first, then prefill chunks within the budget."""
        budget = self.token_budget
        ordered = sorted(self.running.values(), key=lambda r: r.rank)
        while self._kv_used() > self.config.kv_blocks_total and ordered:  # out of blocks: preempt the least important
            victim = ordered.pop()
            del self.running[victim.request_id]
            self._preempted.append(victim.request_id)
        completing: list[SimRequest] = []
        num_tokens = 0
        for req in ordered:
            if req.decoding:
                req.computed += 1
                completing.append(req)
                budget -= 1
                num_tokens += 1
        for req in ordered:
            if req.decoding or budget <= 0:
                continue
            size = min(req.num_tokens - req.computed, budget, self._grants.get(req.request_id, budget))
            req.computed += size
            budget -= size
            num_tokens += size
            if req.decoding:
                completing.append(req)
        self._grants = {}
        deltas = []
        for req in completing:
            token = (hash(req.request_id) + req.generated) % self.config.vocab_size
            deltas.append(
                pb.TokenDelta(request_id=req.request_id, token_ids=[token], text=f" t{token}", index=req.generated)
            )
            req.generated += 1
            req.num_tokens += 1
            if req.generated >= req.max_tokens:
                self._finish(req)
        self.iteration += 1
        return self._report(deltas, num_tokens, elapsed_ns)

    def drain(self) -> pb.StepReport:
        return self._report([], 0, 0)

    def _report(self, deltas: list[pb.TokenDelta], num_tokens: int, elapsed_ns: int) -> pb.StepReport:
        report = pb.StepReport(
            iteration=self.iteration,
            plan_seq=self.plan_seq,
            tokens=deltas,
            finished=self._finished,
            preempted=self._preempted,
            rejected=self._rejected,
            load=pb.Load(
                num_running=len(self.running),
                kv_blocks_used=self._kv_used(),
                kv_blocks_total=self.config.kv_blocks_total,
                step_time_ns=elapsed_ns,
                num_tokens=num_tokens,
                source="sim",
                pending_prefill_tokens=sum(r.num_tokens - r.computed for r in self.running.values() if not r.decoding),
            ),
        )
        self._finished, self._preempted, self._rejected = [], [], []
        self._reported_seq = self.plan_seq
        return report
