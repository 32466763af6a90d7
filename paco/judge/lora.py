"""LoRA on the judge's language model (paper §3.2: the vision tower and the patch merger stay
frozen): :func:`lora_config` restricts the adapters (by a regex) to the language model's decoder
layers, and, only where ``lora.vision_target_modules`` names some (not in the paper), to those
layers of the vision tower and merger; :func:`apply_lora` wraps the model with ``peft`` and
checks what is trainable, :func:`parameter_counts` counts the parameters.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from paco.core.params import LoraParams


def language_model_prefix(model: torch.nn.Module) -> str:
    """Dotted name of the judge's language model (decoder stack) inside ``model``.

    transformers 5 Qwen2.5-VL: ``model.language_model`` (vision tower: ``model.visual``).
    """
    inner = getattr(model, "model", None)
    lm = getattr(inner, "language_model", None)
    if lm is None:
        get_decoder = getattr(model, "get_decoder", None)
        lm = get_decoder() if callable(get_decoder) else None
    if lm is None:
        raise ValueError(f"{type(model).__name__}: cannot find the language model")
    for name, module in model.named_modules():
        if module is lm:
            return name
    raise ValueError(f"{type(model).__name__}: the language model is not a submodule")


def vision_prefix(model: torch.nn.Module) -> str:
    """Dotted name of the judge's vision tower (with its patch merger) inside ``model``:
    ``model.visual`` (transformers 5 Qwen2.5-VL) or ``visual``."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "visual":
            return name
    raise ValueError(f"{type(model).__name__}: cannot find the vision tower")


def _check_targets(model: torch.nn.Module, prefix: str, names: list[str], what: str, where: str) -> None:
    found = {n: 0 for n in names}
    for name, module in model.named_modules():
        if name.startswith(prefix + ".") and isinstance(module, torch.nn.Linear):
            for n in found:
                if name.endswith("." + n):
                    found[n] += 1
    missing = [n for n, c in found.items() if c == 0]
    if missing:
        raise ValueError(f"{what} {missing} match no linear layer of {where} ({prefix})")


def lora_config(model: torch.nn.Module, lora: LoraParams) -> Any:
    """A ``peft.LoraConfig`` whose ``target_modules`` regex matches only the modules named in
    ``lora.target_modules`` inside the language model (its decoder layers), not the vision
    tower or the merger, whose MLPs reuse names such as ``gate_proj``, unless
    ``lora.vision_target_modules`` names layers there (dotted suffixes, e.g. ``attn.proj``,
    ``mlp.0``; not in the paper); the output head (``lm_head``, outside the decoder) is not
    adapted either, as in the paper's setup.

    Raises:
        ValueError: a target name matches no ``nn.Linear`` inside the language model, or a
            vision target none inside the vision tower (a typo).
    """
    from peft import LoraConfig

    prefix = language_model_prefix(model)
    names = list(dict.fromkeys(lora.target_modules))
    _check_targets(model, prefix, names, "lora.target_modules", "the language model")
    regex = rf"{re.escape(prefix)}\..*\.(?:{'|'.join(re.escape(n) for n in names)})"
    vision = list(dict.fromkeys(lora.vision_target_modules))
    if vision:
        vprefix = vision_prefix(model)
        _check_targets(model, vprefix, vision, "lora.vision_target_modules", "the vision tower")
        regex = rf"(?:{regex}|{re.escape(vprefix)}\..*\.(?:{'|'.join(re.escape(n) for n in vision)}))"
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=regex,
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: torch.nn.Module, lora: LoraParams) -> Any:
    """``peft.get_peft_model`` with :func:`lora_config`; checks that every trainable parameter
    is a LoRA weight inside the language model (or the vision tower, with
    ``lora.vision_target_modules``)."""
    from peft import get_peft_model

    prefixes = [language_model_prefix(model)] + ([vision_prefix(model)] if lora.vision_target_modules else [])
    peft_model = get_peft_model(model, lora_config(model, lora))
    bad = [n for n, p in peft_model.named_parameters()
           if p.requires_grad and (not any(f".{q}." in f".{n}" for q in prefixes) or "lora_" not in n)]
    if bad:
        raise RuntimeError(f"parameters other than the LoRA weights of {prefixes} are trainable: {bad[:5]}")
    return peft_model


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """``{"trainable": ..., "total": ..., "frozen": ...}`` parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"trainable": int(trainable), "total": int(total), "frozen": int(total - trainable)}
