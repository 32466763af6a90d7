"""VQAScore through linzhiqiu/t2v_metrics: T2IS-Bench's official prompt-alignment scorer (paper Table 3).

chengyou-jia/T2IS ``T2IS_Eval/vqa_alignment.py`` (commit a40b858) builds
``t2v_metrics.VQAScore(model='clip-flant5-xxl')`` once (line 9) and, for each panel file
``{task_id}_{k:04d}.png`` (line 15), calls it with that one path and the panel's criteria texts,
Entity then Attribute then Relation, concatenated (lines 26-31: ``scores =
clip_flant5_score(images=[image_path], texts=texts)``), reading ``scores[0][i]``. The texts are
the raw criteria: t2v_metrics wraps each in its own question template
(:data:`paco.benchmark.t2is_bench.PA_QUESTION`, ``clip_t5_model.py`` lines 8-9) and returns
P("Yes"), a ``[n_images, n_texts]`` tensor (``t2v_metrics/score.py`` ``Score.forward``).

:func:`vqascore_panels` does the same: each panel written as an RGB PNG under its official name
in a temporary directory (t2v_metrics reads paths), one call per panel with its criteria, the
``[1, n_texts]`` result checked and returned. t2v_metrics is a GPU extra, imported only when
:func:`load_vqascore` is called (``pip install "paco-pipeline[t2v]"``; the 11B-parameter
``clip-flant5-xxl`` is downloaded by t2v_metrics itself into its Hugging Face cache).
"""

from __future__ import annotations

import importlib.util
import math
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from paco.core.io import ArtifactError

__all__ = ["OFFICIAL_MODEL", "INSTALL_COMMAND", "VQAScoreError", "VQAScoreUnavailableError", "check_t2v_metrics",
           "load_vqascore", "vqascore_panels"]

#: vqa_alignment.py:9
OFFICIAL_MODEL = "clip-flant5-xxl"
#: how to install the extra (pyproject.toml ``[project.optional-dependencies] t2v``)
INSTALL_COMMAND = 'pip install "paco-pipeline[t2v]"  (or: pip install t2v-metrics; a CUDA GPU is needed)'


class VQAScoreError(ArtifactError):
    """VQAScore gave no usable score (base of this module's errors)."""


class VQAScoreUnavailableError(VQAScoreError):
    """``t2v_metrics`` is not installed (``prompt_alignment: t2v_metrics`` needs it)."""


def check_t2v_metrics() -> None:
    """Raise :class:`VQAScoreUnavailableError` (with :data:`INSTALL_COMMAND`) when ``t2v_metrics``
    cannot be found; imports nothing."""
    if "t2v_metrics" in sys.modules:  # imported already (or blocked: None)
        present = sys.modules["t2v_metrics"] is not None
    else:
        present = importlib.util.find_spec("t2v_metrics") is not None
    if not present:
        raise VQAScoreUnavailableError(f"prompt_alignment t2v_metrics: the t2v_metrics package is not installed; "
                                       f"install it with {INSTALL_COMMAND}")


def load_vqascore(model: str = OFFICIAL_MODEL, device: str = "cuda") -> Callable[..., Any]:
    """``t2v_metrics.VQAScore(model=model, device=device)`` (vqa_alignment.py:9; its ``device``
    defaults to ``cuda`` in t2v_metrics).

    Raises:
        VQAScoreUnavailableError: ``t2v_metrics`` is not installed.
    """
    try:
        import t2v_metrics
    except ImportError as exc:
        raise VQAScoreUnavailableError(f"prompt_alignment t2v_metrics: cannot import t2v_metrics ({exc}); install "
                                       f"it with {INSTALL_COMMAND}") from None
    return t2v_metrics.VQAScore(model=model, device=device)


def _row(out: Any, n_texts: int, where: str) -> list[float]:
    """``out[0]`` of a ``[1, n_texts]`` tensor / array / nested list, as floats in [0, 1]."""
    if hasattr(out, "detach"):
        out = out.detach().double().cpu().tolist()
    elif hasattr(out, "tolist"):
        out = out.tolist()
    if (not isinstance(out, list) or len(out) != 1 or not isinstance(out[0], list)
            or len(out[0]) != n_texts):
        raise VQAScoreError(f"{where}: VQAScore returned {out!r}, not a [1, {n_texts}] score matrix")
    row = []
    for v in out[0]:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0.0 <= v <= 1.0:
            raise VQAScoreError(f"{where}: VQAScore {v!r} is not a probability in [0, 1]")
        row.append(float(v))
    return row


def vqascore_panels(scorer: Callable[..., Any], panels: Iterable[tuple[str, Image.Image, Sequence[str]]],
                    *, tmp_dir: str | Path | None = None) -> list[list[float]]:
    """VQAScore of each panel against its criteria, one call per panel as vqa_alignment.py:26-31.

    Args:
        scorer: :func:`load_vqascore`'s model (any callable ``scorer(images=[path], texts=[...])``
            returning a ``[1, len(texts)]`` tensor).
        panels: ``(file name, panel image, criteria texts)``; the file name is the official
            ``{case_id}_{k:04d}.png`` (:func:`paco.benchmark.t2is_panels.official_file_name`),
            the texts the raw criteria (t2v_metrics adds the question), at least one.
        tmp_dir: where the PNG files go (a fresh temporary directory, removed afterwards, by
            default); each file is deleted after its call.

    Returns:
        one list a panel: P("Yes") of each text, in order.

    Raises:
        VQAScoreError: a panel without texts, a result that is not ``[1, n_texts]`` or holds a
            value outside [0, 1] (a failed model, never scored 0).
    """
    with tempfile.TemporaryDirectory(prefix="vqascore-", dir=tmp_dir) as tmp:
        out = []
        for name, image, texts in panels:
            texts = [str(t) for t in texts]
            if not texts:
                raise VQAScoreError(f"panel {name}: no criteria texts to score")
            path = Path(tmp) / name
            image.convert("RGB").save(path, format="PNG")
            try:
                result = scorer(images=[str(path)], texts=texts)
            finally:
                path.unlink(missing_ok=True)
            out.append(_row(result, len(texts), f"panel {name}"))
        return out
