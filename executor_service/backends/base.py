"""The contract of a forward-pass backend, and the support each declares.

A backend turns one packed step (every chunk's tokens side by side, with an ``AttentionBatch``
saying where each request's context lies in the paged KV cache) into K/V written to the cache and
the logits of the rows to sample. Backends differ in how fast they do it and in which models they
can compute exactly; the registry (``registry.py``) picks the fastest whose declared
``BackendSupport`` covers the loaded model, device and dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from torch import nn

    from executor_service.kv_cache import KVPool
    from executor_service.model_support import ModelTraits
    from executor_service.paged_attention import AttentionBatch
    from executor_service.sliding_window import SlidingWindow


class DecodeRead(Enum):
    """How a single-token decode reads its context from the paged KV cache (``paged_attention.py``)."""

    # Every decode of the step in one call of the native paged kernel per layer, through its block table (CPU).
    NATIVE = "native"
    # A view of the pool where the context's blocks are consecutive, one SDPA call each (CPU, where
    # copying a context costs more than attending to it); scattered contexts are gathered as below.
    IN_PLACE = "in_place"
    # Every decode's blocks gathered into one padded batch, one SDPA call (where kernel launches are dear: CUDA).
    GATHERED = "gathered"
    # Every decode of a full-attention layer read in place through its block table by one kernel call
    # (``paged_decode.py``: torch's FlashAttention on CUDA); windowed layers' decodes are gathered.
    PAGED = "paged"


@dataclass(frozen=True)
class BackendSupport:
    """What a backend computes exactly; anything outside it the registry never hands it."""

    devices: frozenset[str]  # torch device types: "cpu", "cuda"
    dtypes: frozenset[torch.dtype]
    # transformers model types it runs; None: any model whose attention goes through transformers'
    # attention interface (which is where Baton's paged attention plugs in).
    model_types: frozenset[str] | None = None
    hidden_acts: frozenset[str] | None = None  # MLP activations it runs; None: whatever the model's own modules do
    # A sliding window (every layer's, or some layers'), computed exactly at any length: each windowed
    # layer reads only its window (paged_attention.ContextReads), on every read path the backend takes.
    # False: full attention only.
    sliding_window: bool = False
    attn_logit_softcapping: bool = False  # tanh soft-capped attention logits (Gemma 2)
    attention_sinks: bool = False  # learned attention sinks (gpt-oss)

    def __post_init__(self) -> None:
        if not self.devices or not self.dtypes:
            raise ValueError("a backend supports at least one device and one dtype")

    def attention_gaps(self, model: ModelTraits) -> tuple[str, ...]:
        """What of the model's attention this support does not compute; empty when it computes all of it."""
        found = list(model.unservable)  # no backend computes these
        if model.attn_logit_softcapping is not None and not self.attn_logit_softcapping:
            found.append(
                f"the model soft-caps its attention logits (attn_logit_softcapping={model.attn_logit_softcapping:g})"
            )
        if model.attention_sinks and not self.attention_sinks:
            found.append("the model uses attention sinks")
        if model.sliding_window is not None and not self.sliding_window:
            found.append(f"the model attends within a sliding window ({model.sliding_window} tokens)")
        return tuple(found)

    def gaps(self, model: ModelTraits, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        """What of ``model`` on ``device`` in ``dtype`` falls outside this support; empty when it serves it exactly."""
        found = list(self.attention_gaps(model))
        if self.model_types is not None and model.model_type not in self.model_types:
            found.append(f"model type {model.model_type} (runs {', '.join(sorted(self.model_types))})")
        if self.hidden_acts is not None and model.hidden_act not in self.hidden_acts:
            found.append(f"activation {model.hidden_act or 'unnamed'} (runs {', '.join(sorted(self.hidden_acts))})")
        if device.type not in self.devices:
            found.append(f"device {device.type} (runs on {', '.join(sorted(self.devices))})")
        if dtype not in self.dtypes:
            names = ", ".join(sorted(_dtype_name(d) for d in self.dtypes))
            found.append(f"dtype {_dtype_name(dtype)} (runs {names})")
        return tuple(found)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Backend(ABC):
    """Runs the model's forward pass over a packed step, its attention over the paged KV cache.

    The contract:

    - ``name`` and ``support`` are class attributes, so the registry chooses before any weight loads.
      A backend is constructed only for a model, device and dtype its ``support`` covers.
    - It is constructed once per loaded model, after the model is on its device in its dtype and
      before the KV pool is allocated; it may replace modules of the model (packed linear layers),
      never their values.
    - ``decode_read`` is fixed once the KV pool exists (``bind_kv``, called before the model runner
      is built): the model runner builds each step's ``AttentionBatch`` for it.
    - ``static_shapes`` True: decode-only steps reach ``forward`` padded to a few fixed batch sizes
      and table widths (``decode_step.py``), with no host synchronisation inside ``forward``, so the
      model runner may capture them as CUDA graphs (``executor.cuda_graphs``). False (the default):
      each step with its own shapes. Set it on any backend to run the padded path eagerly (tests do,
      on the CPU).
    - ``forward`` writes every row's K/V into the pool at ``batch.slot_mapping`` and returns the logits
      of the ``keep`` rows, [len(keep), vocab], in the model's dtype or float32.
    - Exactness: for any model its support covers, greedy output in float32 equals ``model.generate``
      on the prompt alone, token for token, whatever else runs in the batch. A piece it would use
      that this host lacks (a native kernel that did not build, a private torch op that failed its
      self-test) is replaced by public torch ops and said so in the log, never skipped silently.
    - ``describe`` says, in one line for the log, which path each of its pieces takes.
    """

    name: ClassVar[str]
    support: ClassVar[BackendSupport]

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, private_torch: bool = True) -> None:
        """``private_torch`` False: never use torch's private ops, even where their self-tests would pass."""
        self.model = model
        self.device = device
        self.dtype = dtype
        self.decode_read = DecodeRead.GATHERED
        self.static_shapes = False

    def bind_kv(self, pool: KVPool, window: SlidingWindow | None) -> None:
        """The KV pool is allocated (and the model's sliding window known): a backend whose decode
        reads depend on its layout may choose them now. The default keeps the constructor's."""
        return None

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """``input_ids`` and ``positions`` [N] (the packed step), ``keep`` [S] row indices -> logits [S, vocab]."""

    @abstractmethod
    def describe(self) -> str:
        """Which path each piece takes, for the log: e.g. "decode attention native, linear layers oneDNN"."""
