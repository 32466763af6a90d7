"""Fixed, non-learned yardsticks of the embedded default's pretrained models.

* **Subject match** of a generated panel: the panel and a bank of views of every subject
  photograph are box-downsampled to 16 x 16 px (Pillow ``BOX``), their RGB values / 255 flattened
  (768 values), and the panel takes the subject of its nearest bank view by squared L2 distance.
  The bank holds :data:`BANK_VIEWS` views per photograph (crop area 0.4-1.0, flips, no colour
  jitter) drawn at the panel's own size from ``default_rng(BANK_SEED)``, so the figure depends on
  nothing learned. Real photo panels (the composites stage at drift level 0) match at about 0.92;
  chance is 1/16.
* **Edit fidelity**: SSIM (``skimage.metrics.structural_similarity``, data range 1, over RGB) of an
  edited image to its input, the input resized (bicubic) to the edit's size.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
from PIL import Image

from paco.pretrain.views import SUBJECT_NAMES, subject_view

#: views per subject photograph in the matching bank, and the bank's rng seed
BANK_VIEWS = 48
BANK_SEED = 123
#: side of the box-downsampled feature (px)
FEATURE_PX = 16


def panel_feature(image: Image.Image | np.ndarray) -> np.ndarray:
    """The fixed feature of a panel: 16 x 16 px box-downsampled RGB in [0, 1], flattened.

    Args:
        image: a PIL image (any mode, read as RGB) or a float ``(H, W, 3)`` array in [0, 1].

    Returns:
        float32 ``(768,)``.
    """
    if isinstance(image, np.ndarray):
        image = Image.fromarray((np.clip(image, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8), mode="RGB")
    small = image.convert("RGB").resize((FEATURE_PX, FEATURE_PX), Image.Resampling.BOX)
    return np.asarray(small, dtype=np.float32).reshape(-1) / 255.0


@functools.lru_cache(maxsize=32)
def _bank(width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(BANK_SEED)
    feats, labels = [], []
    for k, name in enumerate(SUBJECT_NAMES):
        for _ in range(BANK_VIEWS):
            feats.append(panel_feature(subject_view(name, width, height, rng, crop_scale=(0.4, 1.0), jitter=0.0)))
            labels.append(k)
    return np.stack(feats), np.asarray(labels)


def nearest_subject(panel: Image.Image | np.ndarray) -> str:
    """The subject photograph whose bank view is nearest to ``panel`` (module docstring).

    Returns:
        a name of :data:`paco.data.photos.SUBJECTS`.
    """
    width, height = (panel.size if isinstance(panel, Image.Image) else (panel.shape[1], panel.shape[0]))
    feats, labels = _bank(int(width), int(height))
    dist = ((feats - panel_feature(panel)[None]) ** 2).sum(axis=1)
    return SUBJECT_NAMES[int(labels[int(dist.argmin())])]


def subject_match_share(panels: Sequence[Image.Image | np.ndarray], subjects: Sequence[str]) -> float:
    """The share of ``panels`` whose :func:`nearest_subject` is the paired entry of ``subjects``.

    Raises:
        ValueError: different lengths, or no panels.
    """
    if len(panels) != len(subjects) or not panels:
        raise ValueError(f"need as many subjects as panels (>= 1); got {len(panels)} panels, {len(subjects)} subjects")
    return float(np.mean([nearest_subject(p) == s for p, s in zip(panels, subjects)]))


def edit_ssim(edited: Image.Image, source: Image.Image) -> float:
    """SSIM of ``edited`` to ``source`` (resized bicubic to ``edited``'s size), RGB, data range 1.

    Returns:
        a float in [-1, 1]; 1 for identical images.
    """
    from skimage.metrics import structural_similarity

    a = np.asarray(edited.convert("RGB"), dtype=np.float64) / 255.0
    b = np.asarray(source.convert("RGB").resize(edited.size, Image.Resampling.BICUBIC), dtype=np.float64) / 255.0
    return float(structural_similarity(a, b, data_range=1.0, channel_axis=2))
