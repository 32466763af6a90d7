"""LoRA on the judge's language model only (paper §3.2: the vision tower and the patch merger stay
frozen): :func:`lora_config` restricts the adapters (by a regex) to the language model's decoder
layers, :func:`apply_lora` wraps the model with ``peft`` and checks what is trainable,
:func:`parameter_counts` counts the parameters.
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


def lora_config(model: torch.nn.Module, lora: LoraParams) -> Any:
    """A ``peft.LoraConfig`` whose ``target_modules`` regex matches only the modules named in
    ``lora.target_modules`` inside the language model (its decoder layers), never the vision
    tower or the merger, whose MLPs reuse names such as ``gate_proj``; the output head
    (``lm_head``, outside the decoder) is not adapted either, as in the paper's setup.

    Raises:
        ValueError: a target name matches no ``nn.Linear`` inside the language model (a typo).
    """
    from peft import LoraConfig

    prefix = language_model_prefix(model)
    names = list(dict.fromkeys(lora.target_modules))
    found = {n: 0 for n in names}
    for name, module in model.named_modules():
        if name.startswith(prefix + ".") and isinstance(module, torch.nn.Linear):
            leaf = name.rsplit(".", 1)[-1]
            if leaf in found:
                found[leaf] += 1
    missing = [n for n, c in found.items() if c == 0]
    if missing:
        raise ValueError(
            f"lora.target_modules {missing} match no linear layer of the language model ({prefix})"
        )
    regex = rf"{re.escape(prefix)}\..*\.(?:{'|'.join(re.escape(n) for n in names)})"
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
    is a LoRA weight inside the language model (vision tower and merger frozen)."""
    from peft import get_peft_model

    prefix = language_model_prefix(model)
    peft_model = get_peft_model(model, lora_config(model, lora))
    bad = [n for n, p in peft_model.named_parameters()
           if p.requires_grad and (f".{prefix}." not in f".{n}" or "lora_" not in n)]
    if bad:
        raise RuntimeError(f"parameters outside the language model's LoRA are trainable: {bad[:5]}")
    return peft_model


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """``{"trainable": ..., "total": ..., "frozen": ...}`` parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"trainable": int(trainable), "total": int(total), "frozen": int(total - trainable)}
