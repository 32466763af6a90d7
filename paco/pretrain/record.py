"""The record each pretraining build leaves beside its weights: ``pretrain.json``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pydantic

from paco.core.io import write_json
from paco.pretrain.views import SUBJECT_NAMES

#: the file name of the record in each built directory
RECORD_FILE = "pretrain.json"


def write_record(out_dir: str | Path, model: str, figures: Mapping[str, Any], recipe: pydantic.BaseModel) -> None:
    """Write ``{"model", "figures", "recipe"}`` to ``out_dir/pretrain.json`` (key-sorted, atomic;
    the recipe as JSON values). :mod:`paco.pretrain.__main__` adds the environment and checks the
    record against the shipped recipe file.

    Raises:
        ValueError: a NaN or infinite figure (never written as a number it is not).
    """
    write_json(Path(out_dir) / RECORD_FILE, {"model": model, "figures": dict(figures),
                                             "recipe": recipe.model_dump(mode="json")})


def contrastive_figures(model: str, steps: int, seconds: float, losses: Sequence[float],
                        before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of a contrastive build (CLIP, the judge's vision tower): steps, training
    seconds, the mean loss of the first and last 10 steps, chance accuracy among the 16
    photographs, and the evaluation ``before`` and ``after`` training."""
    return {"model": model, "steps": steps, "seconds": round(seconds, 1),
            "loss_first": float(np.mean(losses[:10])), "loss_last": float(np.mean(losses[-10:])),
            "chance_accuracy": 1.0 / len(SUBJECT_NAMES), "random_init": dict(before), "pretrained": dict(after)}
