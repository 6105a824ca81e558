"""The continuous-batching engine: apply plans, then schedule -> run -> sample -> postprocess.

Single-threaded by design: the engine thread owns every Sequence and the KV cache, so nothing
here takes a lock. Plans arrive as ``PlanUpdate`` deltas and apply between iterations.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import xxhash

from common.block_hashing import UNKEYED, BlockNaming
from common.lifecycle import FinishReason
from common.logprobs import NO_LOGPROBS, Logprobs
from common.sampling_params import SamplingParams
from executor_service import prompt_logprobs
from executor_service.backends.base import DecodeRead
from executor_service.batch_admission import Admission, judge_admission
from executor_service.block_allocator import BlockAllocator
from executor_service.cpu_threads import ThreadGovernor
from executor_service.detokenizer import IncrementalDetokenizer
from executor_service.engine_io import (
    NO_KV_EVENTS,
    AdmitSpec,
    FinishOut,
    KvCacheEvents,
    PlanUpdate,
    StepOutput,
    TokenOut,
)
from executor_service.grammar_cache import GrammarCache
from executor_service.grammar_masks import GrammarBroken, GrammarMasks, OutputGrammar, OutputMatcher, resume_matcher
from executor_service.model_runner import ModelRunner
from executor_service.prefix_cache import PrefixCache
from executor_service.sampling import Sampled, Sampler, make_generator
from executor_service.sequence import Sequence
from executor_service.step_scheduler import ScheduledChunk, StepPlan, StepScheduler

log = logging.getLogger(__name__)

NOTHING_TO_SAMPLE = (
    "no token may be sampled: the structured output's grammar accepts none here (no string completes "
    "it), or allowed_token_ids and bad_words, with the grammar or min_tokens, exclude every token"
)


@dataclass(frozen=True)
class EngineLimits:
    max_model_len: int
    max_batch_size: int
    token_budget: int
    eos_token_ids: frozenset[int]
    # The tokenizer's own end-of-sequence token: the one stop token a finish does not name (as vLLM).
    eos_token_id: int | None = None


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        allocator: BlockAllocator,
        tokenizer: object,
        limits: EngineLimits,
        threads: ThreadGovernor | None = None,
        grammars: GrammarCache | None = None,
        overlap: bool = False,
        naming: BlockNaming = UNKEYED,
    ) -> None:
        """``grammars``: compiles structured outputs' grammars (None: such requests end with an error);
        ``overlap``: launch each decode step before reading the last one's tokens (see ``step``), where
        the runner feeds decodes from its device-side rows; ``naming``: how the fleet names cached
        blocks (keyed by its secret)."""
        self.runner = runner
        self.allocator = allocator
        self.tokenizer = tokenizer
        self.limits = limits
        self.token_budget = limits.token_budget
        self.sampler = Sampler(limits.eos_token_ids)
        self.threads = threads  # None: torch's thread count is fixed (configured, or a GPU)
        self.prefix_cache = PrefixCache(allocator, naming)
        # The model's sliding window; where every layer has it (``releasing``), the blocks it has passed
        # are released, checked per chunk only then.
        self.window = runner.window
        self.releasing = self.window if self.window is not None and self.window.every_layer else None
        # Where every layer is windowed, a chunk's blocks come on top of its window's: a plan's budget
        # past what the pool holds beside a whole window would leave a request of max_model_len
        # tokens (which ``servable_length`` let through for the configured budget) without room.
        self._most_chunk = (
            self.releasing.most_chunk(allocator.num_blocks, allocator.block_size, limits.max_model_len)
            if self.releasing is not None
            else None
        )
        self.step_scheduler: StepScheduler[Sequence] = StepScheduler(allocator, self._drop)
        self.running: dict[str, Sequence] = {}
        # Step bookkeeping kept between steps, so a step costs no pass over the running set it can skip:
        # the running sequences in rank order (None: re-sort, after a sequence joined or left), and
        # those not decoding yet (whose uncomputed tokens are the pending prefill).
        self._by_rank: list[Sequence] | None = None
        self._prefilling: set[Sequence] = set()
        self.iteration = 0
        self.plan_seq = 0
        self._grants: dict[str, int] = {}
        self._finished: list[FinishOut] = []
        self._preempted: list[str] = []
        self._rejected: list[FinishOut] = []
        self._reported_seq = 0
        self.grammars = grammars
        self.grammar_masks = GrammarMasks(grammars.vocab_size) if grammars is not None else None
        embeddings = runner.model.get_input_embeddings()  # type: ignore[operator]
        self._embedding_rows = int(embeddings.num_embeddings)
        # Running sequences that need more of a step than a greedy argmax and their token's text: sampling,
        # logprobs, adjusted logits, a grammar, prompt scoring. While there are none (a common batch), the
        # step skips the passes over every row that ask each one.
        self._special: set[Sequence] = set()
        self.overlap = overlap and runner.decode_read is not DecodeRead.IN_PLACE
        self._pending: _PendingStep | None = None  # the launched step whose tokens are not read yet
        self._drops = 0  # sequences dropped so far: a pending step whose count still matches lost none
        # Admissions waiting for their structured output's grammar to compile, in arrival order.
        self._compiling: dict[str, tuple[AdmitSpec, Future[OutputGrammar]]] = {}
        # The token ids of texts constraints wait for (``StructuredOutput.starts_after``), by text.
        self._waited: dict[str, tuple[int, ...]] = {}

    @property
    def has_work(self) -> bool:
        # A compile still running is no work: the worker idles on its inbox meanwhile, then admits.
        if self.running or self._pending is not None:
            return True
        return any(future.done() for _, future in self._compiling.values())

    @property
    def has_news(self) -> bool:
        """Something to report even without a step: aborts, rejections, or a plan not yet acknowledged."""
        return bool(self._finished or self._preempted or self._rejected) or self.plan_seq != self._reported_seq

    # ---- plans -------------------------------------------------------------------------
    def apply(self, plan: PlanUpdate) -> None:
        if plan.abort_all:
            for active in list(self.running.values()):
                self._drop(active)
            self._compiling.clear()
            return
        for request_id in plan.abort:
            seq = self.running.get(request_id)
            if seq is not None:
                self._drop(seq)
                self._finished.append(FinishOut(request_id, FinishReason.CANCELLED, seq.detokenizer.flush()))
            elif self._compiling.pop(request_id, None) is not None:
                self._finished.append(FinishOut(request_id, FinishReason.CANCELLED))
        for request_id in plan.preempt:
            seq = self.running.get(request_id)
            if seq is not None:
                self._drop(seq)
                self._preempted.append(request_id)
            elif self._compiling.pop(request_id, None) is not None:
                self._preempted.append(request_id)
        self._finished.extend(plan.refused)
        if plan.token_budget > 0:  # before the admits, which are judged by the chunks it allows
            self.token_budget = min(plan.token_budget, self._most_chunk or plan.token_budget)
        for spec in plan.admit:
            self._admit(spec)
        self._grants.update(plan.grants)  # plans applied at one boundary: each keeps its grants
        for request_id, expected in plan.expected_cached.items():
            seq = self.running.get(request_id)
            if seq is not None and request_id in self._grants and seq.num_cached < expected:
                # Blocks the scheduler's index still named were evicted: the grant covers them too.
                self._grants[request_id] += expected - seq.num_cached
        self.plan_seq = plan.seq  # the newest applied; each stream numbers its own plans

    def _admit(self, spec: AdmitSpec) -> None:
        previous = self.running.get(spec.request_id)
        if previous is not None:
            # The scheduler re-admitted it (with the tokens Redis recorded): its word wins over
            # whatever this executor computed since, which no client has seen.
            log.info("request %s re-admitted; restarting it from %d tokens", spec.request_id, len(spec.output_ids))
            self._drop(previous)
        self._compiling.pop(spec.request_id, None)  # a re-admission replaces one still waiting
        structured = spec.params.structured_output
        if structured is None:
            self._join(spec, None)
        elif self.grammars is None:
            error = "this executor serves no structured output"
            self._finished.append(FinishOut(spec.request_id, FinishReason.ERROR, error=error))
        else:
            future = self.grammars.get(structured.grammar)
            if future.done():
                self._join(spec, future)
            else:  # joins once compiled (``_admit_compiled``): the engine thread never waits for a compile
                self._compiling[spec.request_id] = (spec, future)

    def _admit_compiled(self) -> None:
        """Admit the requests whose grammars have compiled since the last step."""
        for request_id, (spec, future) in list(self._compiling.items()):
            if future.done():
                del self._compiling[request_id]
                self._join(spec, future)

    def _join(self, spec: AdmitSpec, grammar: Future[OutputGrammar] | None) -> None:
        """Add the request to the batch (``grammar``: its structured output's, compiled)."""
        if grammar is not None and grammar.exception() is not None:
            # The scheduler checked the constraint; only a compile that fails here lands on this path.
            error = str(grammar.exception())
            self._finished.append(FinishOut(spec.request_id, FinishReason.ERROR, error=error))
            return
        total = len(spec.prompt_ids) + len(spec.output_ids)
        if (unservable := self._unservable(spec, total)) is not None:
            self._finished.append(FinishOut(spec.request_id, FinishReason.ERROR, error=unservable))
            return
        if spec.output_ids and (total >= self.limits.max_model_len or len(spec.output_ids) >= spec.params.max_tokens):
            # A resumed request already complete: it ends as it would have, whatever room is left.
            self._finished.append(FinishOut(spec.request_id, FinishReason.LENGTH))
            return
        verdict = judge_admission(
            total,
            len(self.running),
            max_model_len=self.limits.max_model_len,
            max_batch_size=self.limits.max_batch_size,
            token_budget=self.token_budget,
            kv=self.allocator,
            window=self.window,
        )
        if verdict is Admission.TOO_LONG:
            error = f"{total} tokens do not fit (max_model_len {self.limits.max_model_len}, KV blocks)"
            self._finished.append(FinishOut(spec.request_id, FinishReason.ERROR, error=error))
            return
        if verdict is Admission.BATCH_FULL:
            self._rejected.append(FinishOut(spec.request_id, FinishReason.NONE, error="batch full"))
            return
        params = spec.params
        detok = IncrementalDetokenizer(
            self.tokenizer,
            spec.prompt_ids,
            params.stop,
            output_token_ids=list(spec.output_ids),
            min_tokens=params.min_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )
        seq = Sequence(
            request_id=spec.request_id,
            prompt_ids=list(spec.prompt_ids),
            output_ids=list(spec.output_ids),
            params=spec.params,
            rank=spec.rank,
            generator=None if spec.params.temperature == 0 else make_generator(spec.params.seed, self.runner.device),
            detokenizer=detok,
            stop_token_ids=frozenset(params.stop_token_ids).union(
                () if params.ignore_eos else self.limits.eos_token_ids
            ),
            max_output=min(params.max_tokens, self.limits.max_model_len - len(spec.prompt_ids)),
            prefix_root=spec.prefix_root,
        )
        self.running[spec.request_id] = seq
        self._by_rank = None
        self._prefilling.add(seq)
        if not _plain(params):
            self._special.add(seq)
        begins = self._constraint_begins(spec) if grammar is not None else None
        if grammar is not None and begins is None:  # it waits for its text (a reasoning model's end of thinking)
            seq.grammar_waits = (grammar.result(), self._waited_ids(spec.params))
        elif grammar is not None:
            try:
                seq.grammar = resume_matcher(grammar.result(), spec.output_ids[begins:])
            except GrammarBroken as exc:
                self._finish(seq, FinishReason.ERROR, "", str(exc))
                return
            if seq.grammar.is_terminated():  # its output was already complete
                self._finish(seq, FinishReason.STOP, "")
                return
        if params.prompt_logprobs is not None and not spec.output_ids:
            # Its prompt's log probabilities need every prompt position's logits: no prefix cache.
            seq.prompt_logprobs = NO_LOGPROBS
        else:
            self.prefix_cache.match(seq)
            if self.releasing is not None:  # cached blocks its window has already passed
                self.releasing.release_passed(seq, self.allocator)

    def _unservable(self, spec: AdmitSpec, total: int) -> str | None:
        """Why the model cannot take this sequence at all, for that request alone: nothing to continue,
        or ids past its embeddings (the scheduler checks them against the tokenizer; a model whose
        table is smaller would fail the whole step, and the engine thread with it)."""
        if total == 0:
            return "an empty prompt has nothing to continue"
        for ids in (spec.prompt_ids, spec.output_ids):  # no joined copy of a long prompt
            if ids and (min(ids) < 0 or max(ids) >= self._embedding_rows):
                return f"token ids outside the model's vocabulary (size {self._embedding_rows})"
        return None

    def _waited_ids(self, params: SamplingParams, reopening: bool = False) -> tuple[int, ...]:
        """The token ids of the text a constraint waits for (``reopening``: of the text that opens
        what it closes), as the tokenizer writes it alone."""
        structured = params.structured_output
        text = "" if structured is None else structured.reopened_by if reopening else structured.starts_after
        if not text:
            return ()
        ids = self._waited.get(text)
        if ids is None:
            ids = self._waited[text] = tuple(self.tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]
        return ids

    def _constraint_begins(self, spec: AdmitSpec) -> int | None:
        """Where in the output a structured output's constraint begins, as it began when the output
        was written (a resumed request replays its output through the grammar from there): 0
        without ``starts_after`` or with its text already in the prompt (a template that switched
        the thinking off) and not reopened after it there (``reopened_by``: earlier turns closed
        their thinking, this one's is open), else right after the text's first occurrence in the
        output, where the waiting ended (a constrained answer may write the text again); None while
        the output has not written it."""
        waited = self._waited_ids(spec.params)
        if not waited:
            return 0
        closed = _last_end(spec.prompt_ids, waited)
        if closed is not None:
            reopening = self._waited_ids(spec.params, reopening=True)
            opened = _last_end(spec.prompt_ids, reopening) if reopening else None
            if opened is None or opened < closed:
                return 0
        return _first_end(spec.output_ids, waited)

    def _drop(self, seq: Sequence) -> None:
        self.allocator.release(seq.block_table, seq.block_names)
        seq.reset_cache()
        self.runner.release(seq)
        self.running.pop(seq.request_id, None)
        self.sampler.release(seq.request_id)
        self._by_rank = None
        self._prefilling.discard(seq)
        self._special.discard(seq)
        self._drops += 1

    # ---- one iteration -----------------------------------------------------------------
    def step(self) -> StepOutput:
        """One iteration: plan the step, launch it, and report tokens.

        With ``overlap``, a step of plain decodes is launched before the last step's tokens are read
        (its inputs are already in the runner's decode rows, on the device): the host reads, detokenises
        and reports step N-1 while the device computes step N, and the report of step N carries step N-1's
        tokens. A request that finished at step N-1 (a stop token or string) has then computed one more
        token, which is dropped, as vLLM's asynchronous scheduling does; one that reaches its length limit
        is not scheduled again. A step that reads tokens on the host (a prompt's chunk, a grammar, a
        penalty, log probabilities) first reads the last step's, so it sees every token.
        """
        started = time.perf_counter_ns()
        self._admit_compiled()
        settled: list[TokenOut] = []
        if self._pending is not None and (self._special or self._prefilling):
            settled = self._settle()
        ranked = self._ranked()
        if self._pending is not None and self.allocator.num_free < len(ranked) and self._short_of_blocks(ranked):
            # A decode would preempt someone for a block: read the pending tokens first, so that a request
            # they end frees its blocks instead of being handed back as preempted.
            settled = _merged(settled, self._settle())
            ranked = self._ranked()
        if self._pending is not None:  # those at their length limit end when the pending tokens are read
            ranked = [s for s in ranked if len(s.output_ids) + s.num_pending < s.max_output]
        # Only prefills share blocks or wait for them: a step of decodes alone skips the rule.
        sharing = self.prefix_cache.sharing() if self._prefilling else None
        plan = self.step_scheduler.schedule(
            ranked, self.token_budget, self._grants, sharing.may_compute if sharing is not None else None
        )
        self._grants = {}
        self._preempted.extend(s.request_id for s in plan.preempted)
        if plan.chunks:
            tokens = _merged(settled, self._compute(plan))
        else:
            tokens = _merged(settled, self._settle()) if self._pending is not None else settled
        self.iteration += 1
        return self._output(tokens, plan.num_tokens, time.perf_counter_ns() - started)

    def _short_of_blocks(self, ranked: list[Sequence]) -> bool:
        """Whether this step's decodes that cross into a new block need more blocks than are free."""
        block_size = self.allocator.block_size
        crossing = sum(1 for s in ranked if len(s.block_table) * block_size < s.num_tokens)
        return crossing > self.allocator.num_free

    def _ranked(self) -> list[Sequence]:
        """The running sequences, most important first; sorted again only after the set changed."""
        if self._by_rank is None:
            self._by_rank = sorted(self.running.values(), key=lambda s: s.rank)
        return self._by_rank

    def _compute(self, plan: StepPlan[Sequence]) -> list[TokenOut]:
        """Run the plan's chunks, sample, and postprocess the completed sequences' tokens.

        The order keeps the host off the device's critical path where the device is asynchronous
        (CUDA): forward, sampling and the write of the sampled tokens into the decode rows are
        queued first, then the bookkeeping that needs no token runs while the device computes,
        and the one device-to-host copy of the step (the tokens, for postprocessing) comes last.
        """
        chunks = plan.chunks
        decodes = plan.num_decodes  # the first chunks, each a one-token decode that completes
        completing = [c.seq for c in chunks[:decodes]]
        if decodes < len(chunks):
            completing += [c.seq for c in chunks[decodes:] if c.completes]
        prefills = chunks[decodes:]
        scoring = any(c.seq.prompt_logprobs is not None for c in prefills)
        leading = [prompt_logprobs.rows_wanted(c) for c in chunks] if scoring else None
        logits = self._forward(chunks, leading, plan.num_tokens)
        if leading is not None:
            prompt_logprobs.gather(chunks, leading, logits[len(completing) :])
        sampled = None
        if completing:
            rows = logits[: len(completing)]
            if not self._special:
                sampled = self.sampler.sample_greedy(rows)
            else:
                rows = rows.float()  # adjusted and sampled in float32 (a copy unless they are already)
                generators = [None if s.generator is None else self._generator_for(s) for s in completing]
                stuck: list[int] = []  # rows whose grammar accepts nothing
                if self.grammar_masks is not None and any(s.grammar is not None for s in completing):
                    stuck = self.grammar_masks.apply(rows, [s.grammar for s in completing])  # in place
                sampled = self.sampler.sample(rows, completing, generators, stuck)
            self.runner.commit(sampled.on_device)
            sampled.copy_to_host()
        # The last step's tokens, read while this one computes (overlap): this step's inputs among them,
        # which naming a filled block below hashes.
        drops = self._drops
        settled = self._settle() if self._pending is not None else []
        naming, block_size = self.prefix_cache.enabled, self.allocator.block_size
        releasing = self.releasing
        for chunk in chunks:
            seq = chunk.seq
            if drops != self._drops and self.running.get(seq.request_id) is not seq:
                continue  # it finished when its last token was read: this step's token is dropped
            seq.num_computed += chunk.num_tokens
            if naming and seq.num_computed >= (seq.num_named + 1) * block_size:  # a block filled: name it
                self.prefix_cache.name_computed(seq)
            if releasing is not None:  # after naming: a named block stays cached, as a finished request's do
                releasing.release_passed(seq, self.allocator)
        if self._prefilling:
            self._prefilling.difference_update(completing)  # decoding from now on, or about to finish
        if sampled is None:
            return settled
        if self.overlap and not self._special and not self._prefilling:
            # The next step can launch before these tokens are read: they are read then (``_settle``).
            self._pending = _PendingStep(completing, sampled, drops)  # as launched: before the read above
            for seq in completing:
                seq.num_pending = 1
            return settled
        return _merged(settled, self._emit(completing, sampled))

    def _settle(self) -> list[TokenOut]:
        """Read and postprocess the pending step's tokens, but those of sequences that left since."""
        pending = self._pending
        if pending is None:
            return []
        self._pending = None
        seqs, tokens = pending.seqs, pending.sampled.tokens
        if pending.drops != self._drops:
            kept = [i for i, seq in enumerate(seqs) if self.running.get(seq.request_id) is seq]
            seqs, tokens = [seqs[i] for i in kept], [tokens[i] for i in kept]
        for seq in seqs:
            seq.num_pending = 0
        return self._postprocess(seqs, tokens, [None] * len(seqs))

    def _forward(self, chunks: Seq[ScheduledChunk[Sequence]], leading: Seq[int] | None, tokens: int) -> torch.Tensor:
        if self.threads is None:
            return self._run(chunks, leading)
        self.threads.before_step(tokens)
        started = time.perf_counter()
        logits = self._run(chunks, leading)
        self.threads.after_step(time.perf_counter() - started, tokens)
        return logits

    def _run(self, chunks: Seq[ScheduledChunk[Sequence]], leading: Seq[int] | None) -> torch.Tensor:
        # Only prompt-logprob steps pass ``leading``; other steps call ``run(chunks)``, the runner's common form.
        return self.runner.run(chunks) if leading is None else self.runner.run(chunks, leading)

    def _emit(self, seqs: list[Sequence], sampled: Sampled) -> list[TokenOut]:
        """Each completed sequence's new token (the step's one copy of them to the host happens
        here). A request that only scores its prompt (max_tokens 0) ends instead, its sampled
        token unused, and so does one left with nothing to sample, with an error."""
        tokens, logprobs = sampled.tokens, sampled.logprobs
        if not self._special or not (sampled.dead or any(s.params.max_tokens == 0 for s in seqs)):
            return self._postprocess(seqs, tokens, logprobs)
        out: list[TokenOut] = []
        keep: list[int] = []
        dead = set(sampled.dead)
        for i, seq in enumerate(seqs):
            if seq.params.max_tokens == 0:
                scored = prompt_logprobs.take(seq)
                out.append(TokenOut(seq.request_id, (), "", 0, prompt_logprobs=scored, num_cached=seq.num_cached))
                self._finish(seq, FinishReason.LENGTH, "")
            elif i in dead:
                self._finish(seq, FinishReason.ERROR, seq.detokenizer.flush(), NOTHING_TO_SAMPLE)
            else:
                keep.append(i)
        kept = [seqs[i] for i in keep]
        return out + self._postprocess(kept, [tokens[i] for i in keep], [logprobs[i] for i in keep])

    @staticmethod
    def _generator_for(seq: Sequence) -> torch.Generator | None:
        """Seeded requests reseed per position, so a resumed request samples what it would have. The
        seed and the position are hashed together, all 64 bits of each: distinct seeds give
        independent draws (a linear mix kept 63 bits, so seeds 2**63 apart drew the same)."""
        generator, seed = seq.generator, seq.params.seed
        if generator is not None and seed is not None:
            key = (seed % 2**64).to_bytes(8, "little") + len(seq.output_ids).to_bytes(8, "little")
            generator.manual_seed(xxhash.xxh3_64_intdigest(key))
        return generator

    def drain(self) -> StepOutput:
        """Report news (aborts, rejections) without running a step."""
        return self._output([], 0, 0)

    def _postprocess(
        self, seqs: Seq[Sequence], tokens: list[int], token_logprobs: list[Logprobs | None]
    ) -> list[TokenOut]:
        """Each sequence's new token: its text, its output, and whether it ends here.

        Per token of every running request, on the engine thread between steps: kept to plain reads of
        what admission prepared (``Sequence.stop_token_ids``, ``max_output``), with the rare cases (a
        structured output's matcher, the prompt's log probabilities) off the common path.
        """
        out: list[TokenOut] = []
        for seq, token, logprobs in zip(seqs, tokens, token_logprobs, strict=True):
            first = None
            if seq.grammar is not None or seq.prompt_logprobs is not None:
                first = prompt_logprobs.take(seq)  # the prompt's, with the request's first token (if asked)
                if seq.grammar is not None and not seq.grammar.accept_token(token):
                    # The mask allows only accepted tokens, so this is a fault: end this request alone.
                    error = f"sampled token {token} breaks the structured output's grammar"
                    self._finish(seq, FinishReason.ERROR, seq.detokenizer.flush(), error)
                    continue
            output = seq.output_ids
            output.append(token)
            count = len(output)
            if seq.grammar_waits is not None:  # free text until the constraint's text is written
                compiled, waited = seq.grammar_waits
                if tuple(output[-len(waited) :]) == waited:
                    seq.grammar, seq.grammar_waits = OutputMatcher(compiled), None
            # Before min_tokens, stop tokens were masked (logits_processing).
            stop_token = count > seq.params.min_tokens and token in seq.stop_token_ids
            detokenizer = seq.detokenizer
            # As in vLLM, a stop token's own text is left out unless the request asks for it.
            text = "" if stop_token and not seq.params.include_stop_str_in_output else detokenizer.push_token(token)
            cached = None
            if not seq.cached_reported:  # the admission's first output says what its prefill skipped
                seq.cached_reported = True
                cached = seq.num_cached
            out.append(TokenOut(seq.request_id, (token,), text, count - 1, logprobs, first, cached))
            if stop_token or (seq.grammar is not None and seq.grammar.is_terminated()):
                # A terminated grammar took a stop token (EOS), the only one its mask then allowed:
                # ignore_eos cannot keep it going. A stop token is named before a stop string its own
                # text completes (kept with include_stop_str_in_output), as vLLM checks them.
                named = stop_token and token != self.limits.eos_token_id
                self._finish(seq, FinishReason.STOP, detokenizer.flush(), stop_reason=token if named else None)
            elif detokenizer.stopped:  # the detokenizer already waits for min_tokens
                self._finish(seq, FinishReason.STOP, "", stop_reason=detokenizer.matched_stop)
            elif count >= seq.max_output:
                self._finish(seq, FinishReason.LENGTH, detokenizer.flush())
        return out

    def _finish(
        self, seq: Sequence, reason: FinishReason, text: str, error: str = "", stop_reason: str | int | None = None
    ) -> None:
        self._drop(seq)
        self._finished.append(FinishOut(seq.request_id, reason, text, error, stop_reason))

    def _kv_events(self) -> KvCacheEvents:
        stored, removed = self.allocator.drain_changes()
        return KvCacheEvents(stored=stored, removed=removed) if stored or removed else NO_KV_EVENTS

    def _output(self, tokens: list[TokenOut], num_tokens: int, elapsed_ns: int) -> StepOutput:
        out = StepOutput(
            iteration=self.iteration,
            plan_seq=self.plan_seq,
            tokens=tuple(tokens),
            finished=tuple(self._finished),
            preempted=tuple(self._preempted),
            rejected=tuple(self._rejected),
            num_tokens=num_tokens,
            step_time_ns=elapsed_ns,
            num_running=len(self.running),
            kv_blocks_used=self.allocator.num_used,
            kv_blocks_total=self.allocator.num_blocks,
            pending_prefill_tokens=sum(s.num_uncomputed for s in self._prefilling if not s.is_decoding),
            kv_events=self._kv_events(),
            prefix_cache_queries=self.prefix_cache.queries,
            prefix_cache_hits=self.prefix_cache.hits,
        )
        self._finished, self._preempted, self._rejected = [], [], []
        self._reported_seq = self.plan_seq
        return out


def _ends(ids: list[int] | tuple[int, ...], part: tuple[int, ...]) -> Iterator[int]:
    """The indexes just past each occurrence of ``part`` in ``ids``, in order. The scan for
    ``part``'s first token runs in C (``index``): a long prompt costs the engine thread, which every
    request in the batch waits on, next to nothing."""
    start = -1
    while True:
        try:
            start = ids.index(part[0], start + 1)
        except ValueError:
            return
        if tuple(ids[start : start + len(part)]) == part:
            yield start + len(part)


def _first_end(ids: list[int] | tuple[int, ...], part: tuple[int, ...]) -> int | None:
    """The index just past the first occurrence of ``part`` in ``ids``; None where it does not occur."""
    return next(_ends(ids, part), None)


def _last_end(ids: list[int] | tuple[int, ...], part: tuple[int, ...]) -> int | None:
    """The index just past the last occurrence of ``part`` in ``ids``; None where it does not occur."""
    return max(_ends(ids, part), default=None)  # they come in order


def _plain(params: SamplingParams) -> bool:
    """Whether a request asks nothing of a step but a greedy argmax and its token's text (``Engine._special``)."""
    return (
        params.greedy
        and params.logprobs is None
        and params.prompt_logprobs is None
        and not params.adjusts_logits
        and params.structured_output is None
        and params.max_tokens > 0
    )


@dataclass(frozen=True)
class _PendingStep:
    """A launched step whose tokens are not read yet (``Engine.step``, overlap)."""

    seqs: list[Sequence]  # its completing sequences, in sampling order
    sampled: Sampled
    drops: int  # ``Engine._drops`` at its launch: unchanged when it is read, none of ``seqs`` left


def _merged(earlier: list[TokenOut], later: list[TokenOut]) -> list[TokenOut]:
    """Two consecutive steps' tokens as one report's: a request's tokens joined into one output."""
    if not earlier or not later:
        return earlier or later
    by_request = {out.request_id: out for out in earlier}
    for out in later:
        before = by_request.get(out.request_id)
        by_request[out.request_id] = out if before is None else before.then(out)
    return list(by_request.values())
