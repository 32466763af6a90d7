"""Training views of the shipped subject photographs for the project's own pretraining.

The embedded default's tiny models are pretrained (:mod:`paco.pretrain`) on the 16 subject
photographs that the photo composites and edits are made of (:data:`paco.data.photos.SUBJECTS`),
so that its base samples are images of their prompt's subject and its base edits resemble their
input. Every view here is drawn from a ``numpy.random.Generator`` the caller seeds:
the same generator state gives the same arrays on any host (numpy's PCG64 and Pillow's bilinear
resize are integer-exact).

Arrays are ``float32``, shape ``(H, W, 3)``, values in ``[0, 1]``; :func:`to_tensor` stacks them
into the ``[-1, 1]`` ``(B, 3, H, W)`` layout the VAEs take.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from paco.data.photos import SUBJECTS, _view, load_subject

#: the photographs, in :data:`SUBJECTS` order (the class index of a contrastive or matching task)
SUBJECT_NAMES: tuple[str, ...] = tuple(SUBJECTS)

_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


def subject_view(name: str, width: int, height: int, rng: np.random.Generator, *,
                 crop_scale: tuple[float, float] = (0.4, 1.0), jitter: float = 0.1, flip: float = 0.5) -> np.ndarray:
    """A random view of photograph ``name``: a crop of area fraction in ``crop_scale`` at aspect
    ``width / height`` (:func:`paco.data.photos._view`), a horizontal flip with probability ``flip``
    (one uniform draw whatever ``flip`` is, so the random stream does not depend on it), then
    brightness, contrast and saturation factors each uniform in ``[1 - jitter, 1 + jitter]``.

    Returns:
        float32 ``(height, width, 3)`` in [0, 1].

    Raises:
        ValueError: an unknown subject (from :func:`paco.data.photos.load_subject`).
    """
    arr = _view(load_subject(name), int(width), int(height), rng, crop_scale, bool(rng.random() < flip))
    b, c, s = 1.0 + rng.uniform(-jitter, jitter, 3)
    grey = (arr @ _LUMA)[..., None]
    arr = grey + (arr - grey) * s
    mean = float(arr.mean())
    arr = (arr - mean) * c + mean
    return np.clip(arr * b, 0.0, 1.0).astype(np.float32)


def cell_boxes(width: int, height: int, rows: int, cols: int) -> list[tuple[int, int, int, int]]:
    """The ``rows x cols`` cells ``(x0, y0, x1, y1)`` (exclusive ends) of an even grid, row-major,
    edges at ``round(k * size / n)``: the layout the composites use without gutters."""
    xs = np.linspace(0, width, cols + 1).round().astype(int)
    ys = np.linspace(0, height, rows + 1).round().astype(int)
    return [(int(xs[j]), int(ys[i]), int(xs[j + 1]), int(ys[i + 1])) for i in range(rows) for j in range(cols)]


def layout_grid(name: str, rows: int, cols: int, width: int, height: int, rng: np.random.Generator,
                **view_kwargs: Any) -> np.ndarray:
    """A composite of ``rows x cols`` independent views of photograph ``name`` (one per cell of
    :func:`cell_boxes`): what a T2IS prompt naming ``name`` in that layout should look like.

    Returns:
        float32 ``(height, width, 3)`` in [0, 1].
    """
    out = np.zeros((height, width, 3), np.float32)
    for x0, y0, x1, y1 in cell_boxes(width, height, rows, cols):
        out[y0:y1, x0:x1] = subject_view(name, x1 - x0, y1 - y0, rng, **view_kwargs)
    return out


def to_tensor(arrays: Sequence[np.ndarray]) -> torch.Tensor:
    """Stack ``(H, W, 3)`` [0, 1] arrays into a float32 ``(B, 3, H, W)`` tensor in [-1, 1]."""
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous() * 2.0 - 1.0


def to_pil(array: np.ndarray) -> Image.Image:
    """An ``(H, W, 3)`` [0, 1] array as an 8-bit RGB image (rounded, clipped)."""
    return Image.fromarray((np.clip(array, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8), mode="RGB")


def parse_layout(layout: str) -> tuple[int, int]:
    """``"2x3"`` -> ``(2, 3)`` (rows, cols).

    Raises:
        ValueError: not ``<rows>x<cols>`` with positive integers.
    """
    try:
        rows, cols = (int(v) for v in str(layout).lower().split("x"))
    except ValueError as exc:
        raise ValueError(f"layout {layout!r} is not '<rows>x<cols>'") from exc
    if rows < 1 or cols < 1:
        raise ValueError(f"layout {layout!r} needs rows and cols >= 1")
    return rows, cols


def load_t2is_prompts(path: str | Path) -> list[dict[str, Any]]:
    """The T2IS prompts file (jsonl) as dicts with at least ``prompt``, ``layout``, ``subject``,
    ``height`` and ``width`` (px, the composite's size: its aspect sets the sampled size).

    Raises:
        ValueError: a row without one of those keys or with an unknown subject.
    """
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        missing = [k for k in ("prompt", "layout", "subject", "height", "width") if not row.get(k)]
        if missing:
            raise ValueError(f"{path}:{n}: row without {missing}")
        if row["subject"] not in SUBJECTS:
            raise ValueError(f"{path}:{n}: unknown subject {row['subject']!r}")
        parse_layout(row["layout"])
        rows.append(row)
    return rows


def train_edit_subjects(subjects: Sequence[str], test_photos: int, seed: int) -> list[str]:
    """The photographs of the ``edits`` stage's train split for these ``edits.photos`` params
    (the split :func:`paco.data.edits.photo_edits` draws), sorted: the editing policies are
    pretrained on these only, so the held-out photographs stay unseen.

    Raises:
        ValueError: the params :func:`paco.data.edits.photo_edits` refuses.
    """
    from paco.data.edits import photo_edits

    items = photo_edits(list(subjects), ["mirror"], 32, int(test_photos), int(seed))
    return sorted(items.loc[items["split"] == "train", "subject"].unique().tolist())


def edit_example(subject: str, operation: str, size: int, rng: np.random.Generator, *,
                 others: Sequence[str], crop_scale: tuple[float, float] = (0.5, 1.0),
                 jitter: float = 0.05) -> tuple[np.ndarray, np.ndarray, str]:
    """One editing example: a square random view of ``subject`` (the input), the operation's
    correct result on it (the target, :data:`paco.data.edits.OPERATIONS`) and its instruction.

    ``replace_subject`` replaces by a view of a photograph drawn from ``others`` (not
    ``subject``), named in the instruction as the edits stage names it.

    Returns:
        ``(input, target, instruction)``: two float32 ``(size, size, 3)`` arrays in [0, 1] and
        the instruction text.

    Raises:
        ValueError: an unknown operation, or ``replace_subject`` without another photograph.
    """
    from paco.data.edits import OPERATIONS, _name

    if operation not in OPERATIONS:
        raise ValueError(f"unknown edit operation {operation!r}; known: {sorted(OPERATIONS)}")
    op = OPERATIONS[operation]
    source = to_pil(subject_view(subject, size, size, rng, crop_scale=crop_scale, jitter=jitter))
    other = subject
    if operation == "replace_subject":
        pool = [o for o in others if o != subject]
        if not pool:
            raise ValueError(f"replace_subject on {subject!r} needs another photograph in {list(others)}")
        other = pool[int(rng.integers(len(pool)))]
    other_view = to_pil(subject_view(other, size, size, rng, crop_scale=crop_scale, jitter=jitter))
    target = op.apply(source, other_view).convert("RGB")
    as_array = lambda im: np.asarray(im, dtype=np.float32) * (1.0 / 255.0)  # noqa: E731
    return as_array(source), as_array(target), op.instruction.format(other=_name(other))
