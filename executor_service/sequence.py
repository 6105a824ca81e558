"""One request as the executor sees it: its tokens, its KV blocks, and how far it is computed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.block_hashing import ROOT
from common.logprobs import Logprobs
from common.sampling_params import SamplingParams
from executor_service.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from executor_service.grammar_masks import OutputGrammar, OutputMatcher


@dataclass(eq=False)
class Sequence:
    """Mutable per-request state, owned by the engine thread."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    # Lower rank is more important; the engine preempts the highest rank first.
    rank: float
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer
    # Its KV blocks, token t in block_table[t // block_size]. Blocks a sliding window has passed are
    # released, their entries the allocator's placeholder (sliding_window.py), so positions still index it.
    block_table: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache. The newest sampled token is not computed until the
    # next step feeds it back, so a decoding sequence has exactly one uncomputed token.
    num_computed: int = 0
    # Prefix-cache names (common/block_hashing.py) of its first full blocks, as far as hashed,
    # and how many of its blocks carry their name in the allocator (or were taken by it).
    block_names: list[int] = field(default_factory=list)
    num_named: int = 0
    # The name its first block chains from: ROOT, or its cache salt's.
    prefix_root: int = ROOT
    # Tokens of this admission taken from the prefix cache rather than computed, and whether its
    # first output (which reports them: the usage's cached tokens) has gone out. Hits happen only
    # while it prefills, so the count is final by its first output.
    num_cached: int = 0
    cached_reported: bool = False
    # The prompt's log probabilities gathered so far, chunk by chunk, while the request wants them
    # (it asked, and has no output yet: a resumed request's were delivered); None otherwise.
    prompt_logprobs: Logprobs | None = None
    # Its row in the model runner's persistent decode state (``decode_state.py``), which the runner
    # owns: the row's index, how many of its block-table entries the row mirrors, and whether the
    # row holds its next token and position (written on the device by the step that sampled it).
    decode_row: int | None = None
    decode_blocks: int = 0
    decode_live: bool = False
    # Its structured output's matcher, at the end of its output so far (grammar_masks.py); None: free text.
    grammar: OutputMatcher | None = None
    # A structured output that waits for its text (``StructuredOutput.starts_after``): the compiled
    # grammar and the text's token ids; once the output ends with them, ``grammar`` takes over.
    grammar_waits: tuple[OutputGrammar, tuple[int, ...]] | None = None
    # What ends it, read once at admission rather than from its parameters after every token: the tokens
    # that stop it once its output is longer than ``min_tokens`` (its stop tokens, and EOS unless it ignores
    # EOS), and the most output it may reach (max_tokens, within the executor's max_model_len).
    stop_token_ids: frozenset[int] = frozenset()
    max_output: int = 0
    # Output tokens sampled on the device but not yet read on the host (0 or 1): with overlapped steps
    # (``Engine``), a step is launched before the last one's tokens are read. They count as tokens of
    # the sequence (its next decode feeds one from its decode row), not yet in ``output_ids``.
    num_pending: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def final_len(self) -> int:
        """The most tokens this sequence can reach: room the KV allocator tries to keep free after it."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending - self.num_computed

    @property
    def is_decoding(self) -> bool:
        # Read every step for every running sequence: spelled out rather than through num_uncomputed.
        computed = self.num_computed
        return computed > 0 and len(self.prompt_ids) + len(self.output_ids) + self.num_pending - computed == 1

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids ``start..end-1`` of prompt + output."""
        prompt_len = len(self.prompt_ids)
        if end <= prompt_len:
            return self.prompt_ids[start:end]
        if start >= prompt_len:
            return self.output_ids[start - prompt_len : end - prompt_len]
        return self.prompt_ids[start:] + self.output_ids[: end - prompt_len]

    def reset_cache(self) -> None:
        """Forget computed K/V (after its blocks were released), so a resume recomputes everything."""
        self.num_computed = 0
        self.num_named = 0
        self.num_pending = 0  # a token still on the device is dropped with the step's cache
