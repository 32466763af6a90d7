"""Model library: tiny offline builds, hub/local materialisation, ``from_pretrained`` loaders.

Public API (imported lazily, so ``import paco.models`` does not import torch/transformers):

* :func:`materialise` (``fetch``) - spec (``tiny:<name>`` | local dir | hub id) -> HF directory;
* :func:`build_tiny`, :data:`TINY_NAMES` (``tiny``) - tiny random-init models from a seed;
* :func:`load_judge`, :func:`load_qwen_vl_processor`, :func:`load_clip`,
  :func:`load_flux_pipeline`, :func:`load_pipeline`, :class:`Qwen2_5_VLImageOnlyProcessor`,
  :class:`ModelDirectoryError` (``loading``);
* :func:`train_qwen_tokenizer`, :func:`train_clip_tokenizer`, :func:`train_t5_tokenizer`
  (``tokenizers``); :data:`PAIRWISE_TEMPLATE`, :data:`CRITERIA_TEMPLATE` (``corpus``);
* the CLIP scorer (``clip``) and the GPU smoke run's paper-width models (``smoke``).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "materialise": "fetch",
    "hub_offline": "fetch",
    "hub_cache_dir": "fetch",
    "build_tiny": "tiny",
    "TINY_NAMES": "tiny",
    "JUDGE_MIN_PIXELS": "tiny",
    "JUDGE_MAX_PIXELS": "tiny",
    "load_judge": "loading",
    "load_qwen_vl_processor": "loading",
    "load_clip": "loading",
    "load_flux_pipeline": "loading",
    "load_pipeline": "loading",
    "Qwen2_5_VLImageOnlyProcessor": "loading",
    "ModelDirectoryError": "loading",
    "train_qwen_tokenizer": "tokenizers",
    "train_clip_tokenizer": "tokenizers",
    "train_t5_tokenizer": "tokenizers",
    "QWEN_SPECIAL_TOKENS": "tokenizers",
    "QWEN_CHAT_TEMPLATE": "tokenizers",
    "PAIRWISE_TEMPLATE": "corpus",
    "CRITERIA_TEMPLATE": "corpus",
    "corpus_lines": "corpus",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
