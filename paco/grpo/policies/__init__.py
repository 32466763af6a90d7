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
from typing import Protocol

import torch

from paco.core.params import PolicyLoraParams
from paco.grpo.policies.base import (
    OLD_ADAPTER,
    TRAINED_ADAPTER,
    Conditioning,
    Policy,
    TrajectoryBatch,
    Transitions,
    grid_size,
)
from paco.grpo.policies.flux import FluxKontextPolicy, FluxPolicy
from paco.grpo.policies.qwen_image import QwenImageEditPolicy

#: family name -> policy class
FAMILIES: dict[str, type[Policy]] = {cls.family: cls for cls in (FluxPolicy, FluxKontextPolicy, QwenImageEditPolicy)}

__all__ = ["FAMILIES", "OLD_ADAPTER", "TRAINED_ADAPTER", "Conditioning", "FluxKontextPolicy", "FluxPolicy", "Policy",
           "PolicySettings", "QwenImageEditPolicy", "TrajectoryBatch", "Transitions", "grid_size", "load_policy",
           "policy_class"]


class PolicySettings(Protocol):
    """The sampling options a policy family's constructor takes from the params (the union of the
    families' ``option_keys``). ``grpo.<subtask>.rollout`` (:class:`paco.core.params.grpo.RolloutParams`)
    and ``final_samples.<subtask>`` (:class:`paco.core.params.grpo.FinalSamplesParams`) have them
    all; an object with only the chosen family's options (e.g. a ``types.SimpleNamespace``) is
    enough for :func:`load_policy`."""

    #: ``flux``, ``flux_kontext``: T5 prompt tokens, ``<= 512``
    max_sequence_length: int
    #: ``flux``, ``flux_kontext``: the guidance embedding's scale; ``qwen_image_edit``: true CFG's scale
    guidance_scale: float
    #: editing families: ``"keep"`` or ``"square"`` (:meth:`Policy.set_reference_aspect`)
    reference_aspect: str
    #: ``qwen_image_edit``: the negative prompt of true CFG (``None``: no guidance)
    negative_prompt: str | None


def policy_class(family: str) -> type[Policy]:
    """The policy class of ``family``.

    Raises:
        ValueError: an unknown family (the message lists the known ones).
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown policy family {family!r}; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[family]


def load_policy(family: str, model_dir: str | Path, lora: PolicyLoraParams | None, settings: PolicySettings, *,
                seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Policy:
    """Load ``model_dir`` as ``family``'s diffusers pipeline (:func:`paco.models.loading.load_pipeline`),
    move it to ``device`` and wrap it with ``lora`` adapters (``None``: none).

    Args:
        lora: ``grpo.<subtask>.lora`` (:class:`paco.core.params.grpo.PolicyLoraParams`: ``rank``,
            ``alpha``, ``dropout``, ``target_modules``), or ``None``.
        settings: the constructor's options (:class:`PolicySettings`): ``grpo.<subtask>.rollout``
            or ``final_samples.<subtask>``; only the attributes in the family's ``option_keys`` are
            read.
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
