"""Which backend runs the loaded model: the first, fastest first, whose declared support covers it.

Selection looks only at the model's traits (``model_support.ModelTraits``, read from its config),
the device and the dtype, so a model no backend serves is refused before its weights load, with
each backend's reason. ``executor.backend`` may name one instead of ``auto``; it is refused the
same way when it cannot serve the model.
"""

from __future__ import annotations

import logging

import torch

from executor_service.backends.base import Backend
from executor_service.backends.cpu_native import CpuNativeBackend
from executor_service.backends.cpu_transformers import CpuTransformersBackend
from executor_service.backends.cuda import CudaBackend
from executor_service.backends.torch_reference import TorchBackend
from executor_service.model_support import ModelTraits, UnsupportedModel

log = logging.getLogger(__name__)

AUTO = "auto"
# Fastest first; the reference backend last, as the default for whatever the others do not serve.
BACKENDS: tuple[type[Backend], ...] = (CpuNativeBackend, CpuTransformersBackend, CudaBackend, TorchBackend)


def backend_names() -> tuple[str, ...]:
    return tuple(backend.name for backend in BACKENDS)


def _serving(model: ModelTraits, device: torch.device, dtype: torch.dtype) -> str:
    return f"{model.model_type} on {device.type} in {str(dtype).removeprefix('torch.')}"


def select_backend(
    model: ModelTraits, device: torch.device, dtype: torch.dtype, requested: str = AUTO
) -> type[Backend]:
    """The backend to run ``model``; ``UnsupportedModel`` says what no backend (or not the one asked for) serves."""
    serving = _serving(model, device, dtype)
    if requested != AUTO:
        chosen = next((backend for backend in BACKENDS if backend.name == requested), None)
        if chosen is None:
            raise ValueError(f"executor.backend {requested!r} is not one of {', '.join((AUTO, *backend_names()))}")
        gaps = chosen.support.gaps(model, device, dtype)
        if gaps:
            raise UnsupportedModel(f"executor.backend {requested} cannot serve {serving}: {', '.join(gaps)}")
        log.info("backend %s for %s, as executor.backend asks", chosen.name, serving)
        return chosen
    passed_over: dict[str, tuple[str, ...]] = {}
    for backend in BACKENDS:
        gaps = backend.support.gaps(model, device, dtype)
        if not gaps:
            skipped = "; ".join(f"{name}: {', '.join(found)}" for name, found in passed_over.items())
            log.info("backend %s for %s%s", backend.name, serving, f" (not {skipped})" if skipped else "")
            return backend
        passed_over[backend.name] = gaps
    each = "; ".join(f"{name}: {', '.join(found)}" for name, found in passed_over.items())
    # An attention feature that every backend lacks is the reason to name first: the model's, not the host's.
    first, *others = (backend.support.attention_gaps(model) for backend in BACKENDS)
    common = [gap for gap in first if all(gap in found for found in others)]
    if common:
        raise UnsupportedModel(
            f"{model.model_type}: {', '.join(common)}, which no backend computes; refusing to serve it rather "
            f"than answer wrongly ({each})"
        )
    raise UnsupportedModel(f"no backend serves {serving}; refusing to serve it rather than answer wrongly ({each})")
