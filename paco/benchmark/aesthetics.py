"""The LAION aesthetic predictor: T2IS-Bench's Aesthetics column (paper Table 3), a documented stand-in.

The released T2IS-Bench code (chengyou-jia/T2IS ``T2IS_Eval``) has no aesthetics metric and the
paper does not say which predictor or scale it used. This module offers the LAION
"improved aesthetic predictor" (christophschuhmann/improved-aesthetic-predictor, weights
``sac+logos+ava1-l14-linearMSE.pth``) with the same model and formula as its
``simple_inference.py`` (commit 3ade56d, lines 92-117: embed, normalise, MLP), not bit-exact:

* the image embedding: CLIP ViT-L/14's image features. The official code embeds with OpenAI's
  ``clip.load("ViT-L/14")``, in float16 on CUDA, with that package's own preprocessing; here
  ``openai/clip-vit-large-patch14`` through transformers ``CLIPModel.get_image_features`` and
  its ``CLIPProcessor`` in float32 (:class:`paco.models.clip.ClipScorer`: resize of the shortest
  edge to 224 px, centre crop, CLIP mean/std), so the scores differ from the official ones in
  the last digits. The embedding is L2-normalised (``normalized``, simple_inference.py lines
  84-89; a zero vector is left as is); ClipScorer's embeddings are already L2-normalised, so
  this second normalisation changes nothing beyond rounding and is kept as the official step;
* the score: the MLP of simple_inference.py lines 40-64 (:class:`AestheticMLP`, keys
  ``layers.0`` ... ``layers.7``): ``Linear(768, 1024), Dropout(0.2), Linear(1024, 128),
  Dropout(0.2), Linear(128, 64), Dropout(0.1), Linear(64, 16), Linear(16, 1)``, no activation
  (the ReLUs are commented out there), in eval mode: an affine map of the embedding whose output
  is on the AVA rating scale (about 1 to 10).

Aggregation (:func:`aggregate_aesthetics`): per panel the score, per case (image set) the mean
over its panels, the benchmark value the mean over cases; on the table's 0-1 scale that mean is
divided by :data:`SCORE_SCALE` (10, the AVA rating's maximum). Neither the case weighting nor the
scale is published by the paper: both are this pipeline's choices, reported as such.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from paco.core.io import ArtifactError

__all__ = [
    "WEIGHTS_FILE", "WEIGHTS_URL", "EMBEDDING_DIM", "SCORE_SCALE", "AestheticsError", "AestheticWeightsError",
    "EmbeddingDimensionError", "AestheticMLP", "weights_file", "load_mlp", "l2_normalise", "LaionAesthetics",
    "aggregate_aesthetics",
]

#: the official weights file (trained on SAC + LAION-logos + AVA, linear MSE head)
WEIGHTS_FILE = "sac+logos+ava1-l14-linearMSE.pth"
#: where the official file is published (the user downloads it: docs/running.md)
WEIGHTS_URL = ("https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/"
               "sac%2Blogos%2Bava1-l14-linearMSE.pth")
#: CLIP ViT-L/14's image embedding size, the official MLP's input (simple_inference.py:92 ``MLP(768)``)
EMBEDDING_DIM = 768
#: the AVA rating scale's maximum: the table's 0-1 aesthetics is the mean score / SCORE_SCALE
SCORE_SCALE = 10.0
#: the official Sequential's Linear layers (index in ``layers``) and their (out, in) shapes; the
#: first layer's input is the embedding size
_LINEAR = {0: (1024, None), 2: (128, 1024), 4: (64, 128), 6: (16, 64), 7: (1, 16)}


class AestheticsError(ArtifactError):
    """The aesthetic predictor cannot score (base of this module's errors)."""


class AestheticWeightsError(AestheticsError):
    """The MLP weights file is missing, unreadable, or not the official MLP's state dict."""


class EmbeddingDimensionError(AestheticsError):
    """The CLIP model's image embedding size is not the MLP's input size (768: ViT-L/14)."""


class AestheticMLP(torch.nn.Module):
    """The official MLP (simple_inference.py lines 40-64; state-dict keys ``layers.{0,2,4,6,7}.{weight,bias}``).

    Args:
        input_size: the embedding size (768 for the official weights).

    ``forward(x)``: ``(n, input_size)`` float32 -> ``(n, 1)`` float32 scores (AVA scale).
    """

    def __init__(self, input_size: int = EMBEDDING_DIM):
        super().__init__()
        self.input_size = int(input_size)
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(self.input_size, 1024), torch.nn.Dropout(0.2),
            torch.nn.Linear(1024, 128), torch.nn.Dropout(0.2),
            torch.nn.Linear(128, 64), torch.nn.Dropout(0.1),
            torch.nn.Linear(64, 16),
            torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def weights_file(path: str | Path) -> Path:
    """The MLP weights file ``path`` names: the file itself, or :data:`WEIGHTS_FILE` in the
    directory ``path`` (a ``data/models/<role>`` snapshot).

    Raises:
        AestheticWeightsError: no such file (the message says where to download it).
    """
    p = Path(path)
    if p.is_dir():
        p = p / WEIGHTS_FILE
    if not p.is_file():
        raise AestheticWeightsError(f"aesthetic predictor weights {p} not found: download {WEIGHTS_FILE} from "
                                    f"{WEIGHTS_URL} (docs/running.md, 'Benchmarks')")
    return p


def _check_state(state: Any, where: Path) -> int:
    """The input size of a state dict of the official MLP's layout, else a named error."""
    if not isinstance(state, Mapping):
        raise AestheticWeightsError(f"{where}: not a state dict (got {type(state).__name__})")
    want = {f"layers.{i}.{k}" for i in _LINEAR for k in ("weight", "bias")}
    if set(state) != want:
        raise AestheticWeightsError(f"{where}: keys {sorted(state)} are not the official MLP's {sorted(want)}")
    first = state["layers.0.weight"]
    if not isinstance(first, torch.Tensor) or first.ndim != 2:
        raise AestheticWeightsError(f"{where}: layers.0.weight must be a 2-D tensor")
    input_size = int(first.shape[1])
    for i, (out, inp) in _LINEAR.items():
        w, b = state[f"layers.{i}.weight"], state[f"layers.{i}.bias"]
        shape = (out, input_size if inp is None else inp)
        if tuple(w.shape) != shape or tuple(b.shape) != (out,):
            raise AestheticWeightsError(f"{where}: layers.{i} has weight {tuple(w.shape)} and bias {tuple(b.shape)}, "
                                        f"the official MLP {shape} and ({out},)")
    return input_size


def load_mlp(path: str | Path) -> AestheticMLP:
    """The official MLP, in eval mode (dropout off), float32, on CPU, from its state dict.

    Args:
        path: the ``.pth`` file (``torch.save`` of the state dict, as published), or a directory
            holding :data:`WEIGHTS_FILE` (a ``data/models/<role>`` snapshot).

    Raises:
        AestheticWeightsError: no such file, a file torch cannot load as tensors (loaded with
            ``weights_only=True``), or keys / shapes other than the official MLP's.
    """
    file = weights_file(path)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a bad file
        raise AestheticWeightsError(f"{file}: cannot be loaded as a state dict ({type(exc).__name__}: {exc})") from None
    mlp = AestheticMLP(_check_state(state, file))
    mlp.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return mlp.eval()


def l2_normalise(embeddings: np.ndarray | torch.Tensor) -> np.ndarray:
    """simple_inference.py ``normalized`` (lines 84-89): each row divided by its L2 norm, a zero
    row left unchanged. ``(n, d)`` -> ``(n, d)`` float64 numpy."""
    a = np.asarray(embeddings.detach().cpu().numpy() if isinstance(embeddings, torch.Tensor) else embeddings,
                   dtype=np.float64)
    norm = np.atleast_1d(np.linalg.norm(a, 2, -1))
    norm[norm == 0] = 1
    return a / np.expand_dims(norm, -1)


class LaionAesthetics:
    """The LAION aesthetic predictor on a CLIP model of the ``models`` stage.

    Args:
        clip_dir: CLIP directory (``openai/clip-vit-large-patch14`` as a ``data/models/<role>``),
            loaded by :class:`paco.models.clip.ClipScorer`.
        weights: the MLP's state dict file (or directory), :func:`load_mlp`.
        device: torch device of the CLIP forward passes and the MLP.

    Raises:
        AestheticWeightsError: as :func:`load_mlp` (checked before CLIP is loaded).
        EmbeddingDimensionError: the CLIP's projection size differs from the MLP's input (the
            official MLP takes ViT-L/14's 768; the embedded default's tiny CLIP has 64).
        paco.models.loading.ModelDirectoryError: ``clip_dir`` missing or incomplete.
    """

    def __init__(self, clip_dir: str | Path, weights: str | Path, device: str | torch.device = "cpu"):
        from paco.models.clip import ClipScorer

        self.mlp = load_mlp(weights)
        self.clip = ClipScorer(clip_dir, device=device)
        if self.clip.dim != self.mlp.input_size:
            raise EmbeddingDimensionError(
                f"CLIP {clip_dir} embeds images in {self.clip.dim} dimensions, the aesthetic MLP {weights} takes "
                f"{self.mlp.input_size} (the official weights: CLIP ViT-L/14, openai/clip-vit-large-patch14)")
        self.mlp.to(self.clip.device)

    @torch.no_grad()
    def scores(self, images: Sequence[Image.Image], batch_size: int = 32) -> np.ndarray:
        """The predictor's score of each image: ``(n,)`` float64 on the AVA scale (about 1-10).

        Raises:
            AestheticsError: a non-finite score.
        """
        if not images:
            return np.zeros(0)
        emb = l2_normalise(self.clip.image_embeddings(list(images), batch_size=batch_size))
        x = torch.from_numpy(emb).to(self.clip.device, torch.float32)
        out = self.mlp(x)[:, 0].double().cpu().numpy()
        if not np.isfinite(out).all():
            raise AestheticsError(f"the aesthetic predictor gave a non-finite score: {out.tolist()}")
        return out


def aggregate_aesthetics(per_case: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """The benchmark's aesthetics from per-panel scores (module docstring).

    Args:
        per_case: ``{case_id: [score of each panel]}`` (AVA scale); a case with no panel is
            skipped and counted.

    Returns:
        ``{"aesthetics": mean over cases of the per-case mean / SCORE_SCALE (None when no case
        was scored), "mean_raw": the same on the AVA scale, "n_cases", "n_panels",
        "skipped_cases": [case_id], "cases": {case_id: per-case mean (AVA scale)}}``.

    Raises:
        AestheticsError: a score that is not a finite number.
    """
    cases, skipped, panels = {}, [], 0
    for cid, values in per_case.items():
        vals = [float(v) for v in values]
        if any(not math.isfinite(v) for v in vals):
            raise AestheticsError(f"case {cid!r}: non-finite aesthetic score in {vals}")
        if not vals:
            skipped.append(cid)
            continue
        cases[cid] = sum(vals) / len(vals)
        panels += len(vals)
    raw = sum(cases.values()) / len(cases) if cases else None
    return {"aesthetics": None if raw is None else raw / SCORE_SCALE, "mean_raw": raw, "n_cases": len(cases),
            "n_panels": panels, "skipped_cases": skipped, "cases": cases}
