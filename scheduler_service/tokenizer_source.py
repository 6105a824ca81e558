"""Finds the model's tokenizer and limits: from config, else from what executors registered in Redis."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import AutoTokenizer

from common.errors import NotReady
from common.sampling_defaults import SamplingDefaults
from scheduler_service.store.fleet import FleetRegistry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelLimits:
    model: str
    max_model_len: int
    vocab_size: int
    # Tokens per KV block, as the executors registered it: submit names a prompt's blocks with it
    # for placement by cached prefix (prompt_prefix.py). 0: unknown, the prompt goes unnamed.
    block_size: int = 0
    # What the model's generation_config recommends (``ModelInfo`` hands it to the OpenAI gateway).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)


class TokenizerSource:
    def __init__(
        self,
        fleet: FleetRegistry,
        configured: str = "",
        after_load: Callable[[], object] | None = None,
    ) -> None:
        """``after_load``: called once the tokenizer is loaded (``serve`` freezes the heap again, since
        the tokenizer is loaded on the first request, after startup's freeze)."""
        self._fleet = fleet
        self._configured = configured
        self._after_load = after_load
        self._lock = asyncio.Lock()
        self.tokenizer: object | None = None
        self.limits: ModelLimits | None = None

    async def get(self) -> tuple[object, ModelLimits]:
        if self.tokenizer is not None and self.limits is not None:
            return self.tokenizer, self.limits
        async with self._lock:
            if self.tokenizer is None or self.limits is None:
                await self._load()
        assert self.tokenizer is not None and self.limits is not None
        return self.tokenizer, self.limits

    async def _load(self) -> None:
        record = await self._fleet.newest_record()
        model = self._configured or record.get("model", "")
        if not model or "max_model_len" not in record:
            raise NotReady("no executor has registered yet; the model's tokenizer and limits are unknown")
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, model)
        vocab = int(record.get("vocab_size", 0)) or len(tokenizer)
        block_size = int(record.get("block_size") or 0)
        defaults = SamplingDefaults.from_json(record.get("sampling_defaults", "{}"))
        self.limits = ModelLimits(record.get("model", model), int(record["max_model_len"]), vocab, block_size, defaults)
        self.tokenizer = tokenizer
        log.info("tokenizer loaded from %s (max_model_len %d)", model, self.limits.max_model_len)
        if self._after_load is not None:
            self._after_load()
