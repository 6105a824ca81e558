"""What the executor's attention serves exactly, checked when a model loads.

Baton's paged attention is plain causal softmax attention over every earlier token. Some model
families change that: attention-logit soft-capping (Gemma 2), attention sinks (gpt-oss), or a
sliding window (Mistral, Qwen2 with ``use_sliding_window``, Gemma 2/3's alternating layers). A
model whose attention differs would run and answer wrongly, so it is refused at start with the
reason, or, for a sliding window, served with its context capped to the window: while prompt and
output stay inside the window, windowed and full causal attention attend to the same tokens, so
the output is exact.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


class UnsupportedModel(ValueError):
    """The model needs an attention feature the executor does not compute exactly."""


@dataclass(frozen=True)
class ModelSupport:
    """The verdict for a loadable model: the longest sequence it may be served at."""

    max_model_len: int
    sliding_window: int | None  # the window the context was capped to, when one applies


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


def check_model_support(config: Any, max_model_len: int) -> ModelSupport:
    """The support verdict for a transformers ``config``; ``UnsupportedModel`` names what is missing."""
    name = getattr(config, "model_type", "this model")
    if getattr(config, "attn_logit_softcapping", None):
        raise UnsupportedModel(
            f"{name} soft-caps its attention logits (attn_logit_softcapping="
            f"{config.attn_logit_softcapping}), which Baton's attention does not compute: refusing to serve "
            "it rather than answer wrongly"
        )
    if getattr(config, "attention_sinks", None) or getattr(config, "sinks", None):
        raise UnsupportedModel(f"{name} uses attention sinks, which Baton's attention does not compute")
    window = _sliding_window(config)
    if window is not None and window < max_model_len:
        log.warning(
            "%s attends within a sliding window of %d tokens; serving it with max_model_len %d (was %d), "
            "where windowed and full attention agree",
            name,
            window,
            window,
            max_model_len,
        )
        return ModelSupport(window, window)
    return ModelSupport(max_model_len, window)
