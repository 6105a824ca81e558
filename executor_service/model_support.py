"""What a model asks of the executor's attention and layers, read from its config when it loads.

Baton's paged attention is causal softmax attention over every earlier token, or over a sliding
window of them where a layer asks for one (``sliding_window.py``). Some model families change that:
attention-logit soft-capping (Gemma 2), attention sinks (gpt-oss), or a sliding window (Mistral,
Qwen2 with ``use_sliding_window``, Gemma 2/3's alternating layers). The backend registry
(``backends/registry.py``) holds these traits against what each backend declares it computes
exactly; a model no backend serves is refused at start with the reason (``UnsupportedModel``),
since it would run and answer wrongly. A windowed model is served at its whole ``max_model_len``:
its windowed layers read their window at any length, and where every layer is windowed the blocks
the window has passed are released.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class UnsupportedModel(ValueError):
    """The model needs something (an attention feature, a layout) no backend computes exactly."""


@dataclass(frozen=True)
class ModelTraits:
    """What the registry matches against the backends' declared support."""

    model_type: str  # transformers' model_type: "llama", "qwen3", ...
    hidden_act: str  # the MLP's activation ("silu", "gelu_pytorch_tanh", ...); "" when the config names none
    sliding_window: int | None  # the attention window the model really uses; None for full attention
    every_layer_windowed: bool  # every layer attends within the window (False when there is none)
    attn_logit_softcapping: float | None  # the cap of tanh soft-capped attention logits, when it has one
    attention_sinks: bool  # learned attention sinks (a per-head logit every query attends to)

    @classmethod
    def from_config(cls, config: Any) -> ModelTraits:
        """The traits of a transformers ``PretrainedConfig`` (or anything with its attributes)."""
        softcap = getattr(config, "attn_logit_softcapping", None)
        window = _sliding_window(config)
        return cls(
            model_type=str(getattr(config, "model_type", "") or "unknown"),
            hidden_act=str(getattr(config, "hidden_act", "") or ""),
            sliding_window=window,
            every_layer_windowed=window is not None and _every_layer_windowed(config),
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


def _every_layer_windowed(config: Any) -> bool:
    """Whether every layer uses the window: configs with ``layer_types`` name each layer's attention
    (Gemma 2 alternates; Qwen2 windows the layers from ``max_window_layers`` on); those without one
    (Mistral, Phi-3) window every layer."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return True
    return all(kind == "sliding_attention" for kind in layer_types)
