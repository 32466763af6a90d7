"""A policy LoRA directory loaded into a diffusers pipeline, in either of the two layouts a LoRA
comes in, with nothing left out.

=============  =====================================================  ==========================================
layout         files                                                  written by
=============  =====================================================  ==========================================
``diffusers``  ``pytorch_lora_weights.safetensors`` (keys              this project's ``grpo`` stage
               ``transformer.<module>.lora_{A,B}.weight``, the          (:func:`paco.grpo.checkpointing.save_lora`:
               adapter's ``r`` / ``lora_alpha`` in the file's           the pipeline class's ``save_lora_weights``)
               ``lora_adapter_metadata``)
``peft``       ``adapter_config.json`` + ``adapter_model.safetensors``  the reference trainers: ``save_ckpt`` calls
               (keys ``base_model.model.<module>.lora_{A,B}.weight``)   ``PeftModel.save_pretrained`` (X-GenGroup/
                                                                      PaCo-RL ``scripts/train_flux.py`` l.729-738);
                                                                      PEFT writes the second adapter ``old``
                                                                      (l.834-842) into ``old/``, ignored here
=============  =====================================================  ==========================================

Both go through the pipeline's own ``load_lora_weights`` (what a user of a released LoRA does): a
PEFT directory is first rewritten, in a temporary folder, as the diffusers file of the same
weights, with ``r``, ``lora_alpha`` and ``target_modules`` (and ``use_rslora``, ``rank_pattern``,
``alpha_pattern``, ``exclude_modules``, ``layers_to_transform``, ``layers_pattern`` where set)
from ``adapter_config.json`` as the adapter metadata, so the scale ``lora_alpha / r`` (2 for the
reference's ``r=64, lora_alpha=128``, ``train_flux.py`` l.822-826) is the one PEFT applies.
diffusers only logs LoRA keys that match no module, so :func:`load_lora` then compares the
adapter the transformer holds with the file's weights, key by key and value by value, and refuses
any difference (:class:`LoraLoadError`).
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
from pathlib import Path
from typing import Any, Literal

import torch

from paco.core.io import ArtifactError

log = logging.getLogger("paco.grpo.lora_io")

#: the diffusers layout's weights file
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
#: the PEFT layout's config and weights files
PEFT_CONFIG = "adapter_config.json"
PEFT_FILE = "adapter_model.safetensors"
#: ``adapter_config.json`` keys carried into diffusers' adapter metadata (``peft.LoraConfig`` kwargs)
_PEFT_META_KEYS = ("r", "lora_alpha", "target_modules", "use_rslora", "rank_pattern", "alpha_pattern",
                   "exclude_modules", "layers_to_transform", "layers_pattern")
_DIFFUSERS_KEY = re.compile(r"transformer\.(.+\.lora_[AB]\.weight)")
_PEFT_KEY = re.compile(r"base_model\.model\.(.+\.lora_[AB]\.weight)")


class LoraLoadError(ArtifactError):
    """A LoRA directory has no (or an ambiguous) known layout, keys of another layout, an
    unsupported PEFT config, or weights the pipeline's transformer did not take in full."""


def lora_format(directory: str | Path) -> Literal["diffusers", "peft"]:
    """The layout of the LoRA in ``directory`` (see the module docstring).

    Raises:
        LoraLoadError: no directory, neither layout's files, or both (naming the files found).
    """
    d = Path(directory)
    if not d.is_dir():
        raise LoraLoadError(f"{d}: no LoRA directory")
    diffusers = (d / DIFFUSERS_FILE).is_file()
    peft = (d / PEFT_CONFIG).is_file() and (d / PEFT_FILE).is_file()
    if diffusers and peft:
        raise LoraLoadError(f"{d}: holds both a diffusers LoRA ({DIFFUSERS_FILE}) and a PEFT one ({PEFT_CONFIG} + "
                            f"{PEFT_FILE}): keep one (models.allow_patterns for a fetched LoRA)")
    if not (diffusers or peft):
        found = sorted(p.name for p in d.iterdir())
        raise LoraLoadError(f"{d}: no LoRA: neither {DIFFUSERS_FILE} (diffusers) nor {PEFT_CONFIG} + {PEFT_FILE} "
                            f"(PEFT); found {found}")
    return "diffusers" if diffusers else "peft"


def _matching(weights: dict[str, torch.Tensor], pattern: re.Pattern[str], path: Path) -> dict[str, torch.Tensor]:
    """``weights`` keyed by the transformer module path (``<module>.lora_A.weight``).

    Raises:
        LoraLoadError: a key not of ``pattern``'s form (another model's or layout's, e.g. a text
            encoder LoRA or DoRA magnitudes), or no key at all.
    """
    other = sorted(k for k in weights if not pattern.fullmatch(k))
    if other:
        raise LoraLoadError(f"{path}: {len(other)} key(s) not of the form {pattern.pattern} (a transformer LoRA's "
                            f"lora_A / lora_B weights), e.g. {other[:3]}")
    if not weights:
        raise LoraLoadError(f"{path}: no LoRA weights")
    return {pattern.fullmatch(k)[1]: v for k, v in weights.items()}  # type: ignore[index]


def peft_metadata(config_path: str | Path) -> dict[str, Any]:
    """diffusers' adapter metadata (``peft.LoraConfig`` kwargs) for a PEFT ``adapter_config.json``.

    Raises:
        LoraLoadError: unreadable JSON, a ``peft_type`` other than ``LORA``, DoRA
            (``use_dora``), a ``lora_bias``, or no ``r`` / ``lora_alpha`` / ``target_modules``.
    """
    path = Path(config_path)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraLoadError(f"{path}: unreadable ({exc})") from None
    if not isinstance(config, dict):
        raise LoraLoadError(f"{path}: not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraLoadError(f"{path}: peft_type {config['peft_type']!r}, only LORA adapters are loaded")
    for flag in ("use_dora", "lora_bias"):
        if config.get(flag):
            raise LoraLoadError(f"{path}: {flag} is set; only plain LoRA adapters are loaded")
    missing = [k for k in ("r", "lora_alpha", "target_modules") if config.get(k) is None]
    if missing:
        raise LoraLoadError(f"{path}: no {missing}")
    return {k: config[k] for k in _PEFT_META_KEYS if config.get(k) not in (None, {})}


def read_lora(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The transformer LoRA weights in ``directory`` (either layout), keyed
    ``<module>.lora_{A,B}.weight`` as stored (dtype kept, CPU), and for the PEFT layout its
    adapter metadata (:func:`peft_metadata`; ``None`` for the diffusers layout, whose file
    carries its own). A PEFT directory's ``old/`` (the reference's second adapter) is not read.

    Raises:
        LoraLoadError: see :func:`lora_format`, :func:`_matching`, :func:`peft_metadata`.
    """
    from safetensors.torch import load_file

    d = Path(directory)
    if lora_format(d) == "diffusers":
        return _matching(load_file(str(d / DIFFUSERS_FILE)), _DIFFUSERS_KEY, d / DIFFUSERS_FILE), None
    return _matching(load_file(str(d / PEFT_FILE)), _PEFT_KEY, d / PEFT_FILE), peft_metadata(d / PEFT_CONFIG)


def load_lora(pipe: Any, directory: str | Path) -> str:
    """Load the LoRA in ``directory`` into ``pipe``'s transformer with ``pipe.load_lora_weights``
    and check that every weight of the file is in the new adapter, unchanged (up to the
    transformer's dtype), and that the adapter has no weight the file lacks.

    Args:
        pipe: a diffusers pipeline with a ``transformer`` (``FluxPipeline``,
            ``FluxKontextPipeline``, ``QwenImageEditPipeline``); its class's ``save_lora_weights``
            writes the temporary diffusers file of a PEFT LoRA.
        directory: a LoRA directory in either layout (module docstring).

    Returns:
        The name diffusers gave the new adapter (active on return).

    Raises:
        LoraLoadError: see :func:`read_lora`; ``load_lora_weights`` failed (e.g. a weight whose
            shape fits no module); or the transformer took the weights only in part (keys of
            modules it lacks, modules given no weight, or a value that differs).
    """
    from peft.utils import get_peft_model_state_dict

    d = Path(directory)
    weights, meta = read_lora(d)
    before = set(getattr(pipe.transformer, "peft_config", None) or {})
    try:
        if meta is None:
            pipe.load_lora_weights(str(d))
        else:
            with tempfile.TemporaryDirectory(prefix="paco-lora-") as tmp:
                type(pipe).save_lora_weights(tmp, transformer_lora_layers=weights,
                                             transformer_lora_adapter_metadata=meta, safe_serialization=True)
                pipe.load_lora_weights(tmp)
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:  # e.g. a shape that fits no module
        raise LoraLoadError(f"{d}: the pipeline's load_lora_weights refused it: {exc}") from exc
    added = sorted(set(getattr(pipe.transformer, "peft_config", None) or {}) - before)
    if len(added) != 1:
        raise LoraLoadError(f"{d}: the pipeline's load_lora_weights added {len(added)} transformer adapters, not 1")
    name = added[0]
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=name)
    unused, absent = sorted(set(weights) - set(loaded)), sorted(set(loaded) - set(weights))
    if unused or absent:
        raise LoraLoadError(f"{d}: partial load into the {type(pipe.transformer).__name__}: {len(unused)} LoRA "
                            f"weight(s) match no module (e.g. {unused[:3]}), {len(absent)} adapter weight(s) have "
                            f"none in the file (e.g. {absent[:3]})")
    changed = sorted(k for k, v in loaded.items()
                     if not torch.equal(v.detach().cpu(), weights[k].to(dtype=v.dtype)))
    if changed:
        raise LoraLoadError(f"{d}: {len(changed)} weight(s) differ after loading, e.g. {changed[:3]}")
    cfg = pipe.transformer.peft_config[name]
    log.info("LoRA %s (%s layout): %d weights, r=%s, lora_alpha=%s", d, "diffusers" if meta is None else "PEFT",
             len(weights), cfg.r, cfg.lora_alpha)
    return name
