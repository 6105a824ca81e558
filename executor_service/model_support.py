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

Some models no backend can serve exactly, whatever it computes (``ModelTraits.unservable``): their
attention bypasses transformers' attention interface, where Baton's paged attention plugs in, or
their layers keep a state beyond a KV cache (state-space, linear-attention, convolution layers), or
they attend in chunks, or their RoPE scales by the longest position of a whole forward call (which a
packed step shares between requests), or their attention reads what it needs from the mask that
paged attention replaces. Each was found serving wrong tokens before it was refused here.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any, cast

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING


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
    unservable: tuple[str, ...] = ()  # what of the model no backend computes exactly (the reasons)

    @classmethod
    def from_config(cls, config: Any) -> ModelTraits:
        """The traits of a transformers ``PretrainedConfig`` (or anything with its attributes)."""
        softcap = getattr(config, "attn_logit_softcapping", None)
        window = _sliding_window(config)
        model_class = _model_class(config)
        return cls(
            model_type=str(getattr(config, "model_type", "") or "unknown"),
            hidden_act=str(getattr(config, "hidden_act", "") or ""),
            sliding_window=window,
            every_layer_windowed=window is not None and _every_layer_windowed(config),
            attn_logit_softcapping=float(softcap) if softcap else None,
            attention_sinks=bool(getattr(config, "attention_sinks", None) or getattr(config, "sinks", None))
            or (model_class is not None and _passes_to_attention(model_class, "s_aux=")),
            unservable=_unservable(config, window, model_class),
        )


# Layer kinds paged attention computes; anything else but chunked attention (checked on its own:
# attention_chunk_size) keeps a state beyond the KV cache: linear_attention, conv, mamba...
_PAGED_LAYER_KINDS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
# RoPE variants that pick their scaling from the longest position in the forward call: in a packed
# step that is another request's, so a request's output would depend on its batch.
_LENGTH_SCALED_ROPE = frozenset({"longrope", "dynamic"})
# Families whose attention goes through the interface but computes more than one softmax attention.
_OWN_ATTENTION = {
    "diffllama": "its differential attention calls the attention function twice per layer, with different values",
    "doge": "its attention adds a dynamic mask of its own, which paged attention does not read",
}


def _unservable(config: Any, window: int | None, model_class: type | None) -> tuple[str, ...]:
    found: list[str] = []
    if model_class is not None and not getattr(model_class, "_supports_attention_backend", False):
        found.append("its attention does not go through transformers' attention interface")
    kinds = set(getattr(config, "layer_types", None) or ()) - _PAGED_LAYER_KINDS
    if kinds:
        found.append(f"it has {', '.join(sorted(kinds))} layers, whose state a paged KV cache does not hold")
    if getattr(config, "attention_chunk_size", None):
        found.append(f"it attends in chunks of {config.attention_chunk_size} tokens")
    rope = _rope_types(config) & _LENGTH_SCALED_ROPE
    if rope:
        found.append(f"its RoPE ({', '.join(sorted(rope))}) scales by the longest position of a whole forward call")
    model_type = str(getattr(config, "model_type", ""))
    if model_type in _OWN_ATTENTION:
        found.append(_OWN_ATTENTION[model_type])
    if window is not None and model_class is not None and not _passes_to_attention(model_class, "sliding_window="):
        found.append("its attention applies its sliding window only through the mask, which paged attention replaces")
    return tuple(found)


def _model_class(config: Any) -> type | None:
    """The causal-LM class transformers builds for ``config``; None for a config it does not map."""
    try:
        return cast(type, MODEL_FOR_CAUSAL_LM_MAPPING[type(config)])
    except (KeyError, ValueError, AttributeError):
        return None


def _rope_types(config: Any) -> set[str]:
    """Every RoPE type the config names (per layer kind where it keeps one set per kind, as Gemma 3)."""
    types: set[str] = set()
    for params in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if not isinstance(params, dict):
            continue
        for entry in (params, *(v for v in params.values() if isinstance(v, dict))):
            kind = entry.get("rope_type") or entry.get("type")
            if isinstance(kind, str):
                types.add(kind)
    return types


def _passes_to_attention(model_class: type, argument: str) -> bool:
    """Whether the model's modules hand ``argument`` (``"sliding_window="``, ``"s_aux="``) to the
    attention function, read from the model's own source, as nothing else records it: a window
    that modules apply through the mask alone (Qwen2-MoE, PhiMoE) never reaches paged attention,
    and attention sinks (gpt-oss, Granite's windowed variants) are a module's parameter, not the
    config's."""
    module = sys.modules.get(model_class.__module__)
    try:
        return module is not None and argument in inspect.getsource(module)
    except (OSError, TypeError):
        return False


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
