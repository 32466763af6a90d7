"""GRPO policy families: one class per diffusers pipeline family, chosen by name in the params
(``grpo.<subtask>.family``, ``final_samples.<subtask>.family``).

=================  =========================  ======================================================
family             diffusers pipeline          subtask (paper §7, Table 4)
=================  =========================  ======================================================
flux               ``FluxPipeline``            text-to-image sets (FLUX.1-dev)
flux_kontext       ``FluxKontextPipeline``     image editing (FLUX.1-Kontext-dev)
qwen_image_edit    ``QwenImageEditPipeline``   image editing (Qwen-Image-Edit)
=================  =========================  ======================================================

The interface and the shared sampling live in :mod:`paco.grpo.policies.base`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from paco.grpo.policies.base import (
    OLD_ADAPTER,
    TRAINED_ADAPTER,
    Conditioning,
    Policy,
    Rollout,
    grid_size,
)
from paco.grpo.policies.flux import FluxKontextPolicy, FluxPolicy
from paco.grpo.policies.qwen_image import QwenImageEditPolicy

#: family name -> policy class
FAMILIES: dict[str, type[Policy]] = {cls.family: cls for cls in (FluxPolicy, FluxKontextPolicy, QwenImageEditPolicy)}

__all__ = ["FAMILIES", "OLD_ADAPTER", "TRAINED_ADAPTER", "Conditioning", "FluxKontextPolicy", "FluxPolicy",
           "Policy", "QwenImageEditPolicy", "Rollout", "grid_size", "load_policy", "policy_class"]


def policy_class(family: str) -> type[Policy]:
    """The policy class of ``family``.

    Raises:
        ValueError: an unknown family (the message lists the known ones).
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown policy family {family!r}; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[family]


def load_policy(family: str, model_dir: str | Path, lora: Any | None, settings: Any, *, seed: int = 0,
                dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Policy:
    """Load ``model_dir`` as ``family``'s diffusers pipeline (:func:`paco.models.loading.load_pipeline`),
    move it to ``device`` and wrap it with ``lora`` adapters (``None``: none).

    Args:
        settings: an object whose attributes named in the family's ``option_keys`` (e.g.
            ``max_sequence_length``, ``guidance_scale``, ``reference_aspect``) are the
            constructor's options: ``grpo.<subtask>.rollout`` or ``final_samples.<subtask>``.
        seed: seeds the LoRA init.

    Raises:
        ValueError: an unknown family, or ``settings`` lacks one of the family's options.
        paco.models.loading.ModelDirectoryError: a missing or incomplete model directory.
    """
    from paco.models.loading import load_pipeline

    cls = policy_class(family)
    missing = [k for k in cls.option_keys if not hasattr(settings, k)]
    if missing:
        raise ValueError(f"policy family {family!r} needs the settings {missing}")
    pipe = load_pipeline(model_dir, cls.pipeline_class, cls.components, dtype, cls.component_overrides(model_dir))
    pipe.to(device)
    return cls(pipe, lora, seed=seed, **{k: getattr(settings, k) for k in cls.option_keys})
