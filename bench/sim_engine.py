"""The SIMULATED executor's engine, for scheduler benchmarks only (``bench/sim_executor.py``).

No model and no server: the engine's own rules with made-up tokens. Plans apply at the next
iteration boundary (admit, abort, preempt, prefill grants, token budget). Which requests the batch
takes (``executor_service.batch_admission``), how a step's token budget splits between decodes and
prefill chunks and who is preempted when KV blocks run out (``executor_service.step_scheduler``),
and the block accounting itself (``executor_service.block_allocator``) are the engine's code, run
on ``SimRequest``; a request that finishes its prefill emits its first token in that step. Tokens
are made-up ids and never EOS. Not a stand-in for the real engine in any test.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.lifecycle import FinishReason
from common.pb import executor_pb2 as pb
from executor_service.batch_admission import Admission, judge_admission
from executor_service.block_allocator import BlockAllocator
from executor_service.step_scheduler import StepScheduler


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


@dataclass(eq=False)
class SimRequest:
    """One running request: counts of tokens and the blocks they hold, no token ids
    (an ``executor_service.schedulable.SchedulableSequence``)."""

    request_id: str
    prompt_len: int
    generated: int  # output tokens so far (a resumed request is admitted with some: it prefills them too)
    max_tokens: int
    rank: float
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose (imaginary) K/V are in the cache

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.generated

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def final_len(self) -> int:
        return self.prompt_len + self.max_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_computed > 0 and self.num_uncomputed == 1


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
        self.allocator = BlockAllocator(config.kv_blocks_total, config.block_size)
        self.step_scheduler: StepScheduler[SimRequest] = StepScheduler(self.allocator, self._drop)
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
            if (req := self.running.get(request_id)) is not None:
                self._drop(req)
                self._finished.append(pb.FinishedRequest(request_id=request_id, finish_reason=FinishReason.CANCELLED))
        for request_id in plan.preempt:
            if (req := self.running.get(request_id)) is not None:
                self._drop(req)
                self._preempted.append(request_id)
        for admit in plan.admit:
            self._admit(admit)
        self._grants = {g.request_id: g.num_tokens for g in plan.prefill}
        if plan.token_budget > 0:
            self.token_budget = plan.token_budget
        self.plan_seq = plan.seq

    def abort_all(self) -> None:
        for req in list(self.running.values()):
            self._drop(req)

    def _admit(self, admit: pb.AdmitRequest) -> None:
        if (previous := self.running.get(admit.request_id)) is not None:
            self._drop(previous)  # a re-admission restarts it
        total = len(admit.prompt_token_ids) + len(admit.output_token_ids)
        verdict = judge_admission(
            total,
            len(self.running),
            max_model_len=self.config.max_model_len,
            max_batch_size=self.config.max_batch_size,
            token_budget=self.token_budget,
            kv=self.allocator,
        )
        if verdict is Admission.TOO_LONG:
            error = f"{total} tokens do not fit"
            self._finished.append(
                pb.FinishedRequest(request_id=admit.request_id, finish_reason=FinishReason.ERROR, error=error)
            )
            return
        if verdict is Admission.BATCH_FULL:
            self._rejected.append(pb.FinishedRequest(request_id=admit.request_id, error="batch full"))
            return
        max_tokens = max(1, admit.sampling.max_tokens)
        prompt_len, generated = len(admit.prompt_token_ids), len(admit.output_token_ids)
        req = SimRequest(admit.request_id, prompt_len, generated, max_tokens, admit.rank)
        self.running[admit.request_id] = req
        if req.generated >= max_tokens:
            self._finish(req)

    def _drop(self, req: SimRequest) -> None:
        self.allocator.release(req.block_table)
        req.num_computed = 0
        self.running.pop(req.request_id, None)

    def _finish(self, req: SimRequest) -> None:
        self._drop(req)
        self._finished.append(pb.FinishedRequest(request_id=req.request_id, finish_reason=FinishReason.LENGTH))

    def step(self, elapsed_ns: int) -> pb.StepReport:
        """One iteration: the engine's step rule, then a made-up token for every sequence it completed."""
        ordered = sorted(self.running.values(), key=lambda r: r.rank)
        plan = self.step_scheduler.schedule(ordered, self.token_budget, self._grants)
        self._grants = {}
        self._preempted.extend(r.request_id for r in plan.preempted)
        completing = [c.seq for c in plan.chunks if c.completes]
        for chunk in plan.chunks:
            chunk.seq.num_computed += chunk.num_tokens
        deltas = []
        for req in completing:
            token = (hash(req.request_id) + req.generated) % self.config.vocab_size
            deltas.append(
                pb.TokenDelta(request_id=req.request_id, token_ids=[token], text=f" t{token}", index=req.generated)
            )
            req.generated += 1
            if req.generated >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
                self._finish(req)
        self.iteration += 1
        return self._report(deltas, plan.num_tokens, elapsed_ns)

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
                kv_blocks_used=self.allocator.num_used,
                kv_blocks_total=self.config.kv_blocks_total,
                step_time_ns=elapsed_ns,
                num_tokens=num_tokens,
                source="sim",
                pending_prefill_tokens=sum(r.num_uncomputed for r in self.running.values() if not r.is_decoding),
            ),
        )
        self._finished, self._preempted, self._rejected = [], [], []
        self._reported_seq = self.plan_seq
        return report
