"""What a model asks of the executor's attention and layers, read from its config when it loads.

Baton's paged attention is plain causal softmax attention over every earlier token. Some model
families change that: attention-logit soft-capping (Gemma 2), attention sinks (gpt-oss), or a
sliding window (Mistral, Qwen2 with ``use_sliding_window``, Gemma 2/3's alternating layers). The
backend registry (``backends/registry.py``) holds these traits against what each backend declares
it computes exactly; a model no backend serves is refused at start with the reason
(``UnsupportedModel``), since it would run and answer wrongly. A sliding window is served with the
context capped to the window (``served_length``): while prompt and output stay inside the window,
windowed and full causal attention attend to the same tokens, so the output is exact.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


class UnsupportedModel(ValueError):
    """The model needs something (an attention feature, a layout) no backend computes exactly."""


@dataclass(frozen=True)
class ModelTraits:
    """What the registry matches against the backends' declared support."""

    model_type: str  # transformers' model_type: "llama", "qwen3", ...
    hidden_act: str  # the MLP's activation ("silu", "gelu_pytorch_tanh", ...); "" when the config names none
    sliding_window: int | None  # the attention window the model really uses; None for full attention
    attn_logit_softcapping: float | None  # the cap of tanh soft-capped attention logits, when it has one
    attention_sinks: bool  # learned attention sinks (a per-head logit every query attends to)

    @classmethod
    def from_config(cls, config: Any) -> ModelTraits:
        """The traits of a transformers ``PretrainedConfig`` (or anything with its attributes)."""
        softcap = getattr(config, "attn_logit_softcapping", None)
        return cls(
            model_type=str(getattr(config, "model_type", "") or "unknown"),
            hidden_act=str(getattr(config, "hidden_act", "") or ""),
            sliding_window=_sliding_window(config),
            attn_logit_softcapping=float(softcap) if softcap else None,
            attention_sinks=bool(getattr(config, "attention_sinks", None) or getattr(config, "sinks", None)),
        )


def _sliding_window(config: Any) -> int | None:
    """The attention window the model really uses, or None for full attention everywhere."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    # Qwen2-style configs carry a window that applies only with use_sliding_window.
    if getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def served_length(traits: ModelTraits, max_model_len: int) -> int:
    """The longest sequence to serve the model at: ``max_model_len``, capped to a sliding window."""
    window = traits.sliding_window
    if window is None or window >= max_model_len:
        return max_model_len
    log.warning(
        "%s attends within a sliding window of %d tokens; serving it with max_model_len %d (was %d), "
        "where windowed and full attention agree",
        traits.model_type,
        window,
        window,
        max_model_len,
    )
    return window
