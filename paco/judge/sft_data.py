"""The judge's SFT examples: rows of ``sft.parquet``, their optional augmentation, and their encoding.

Paper §3.1 / §3.2: each example is a pair ``[image A, image B]``, the question, and the target
``Yes. <reason>...</reason>`` / ``No. ...``. :func:`load_sft_rows` reads the ``status == "ok"``
rows of one split (sorted by ``pair_id``), :func:`subsample` caps their number,
:func:`augment_pair` / :func:`row_images` give the optional label-preserving view of a training
pair (``augment``: swap A/B, horizontal flips, crops; deterministic per row/epoch), and
:func:`encode_rows` makes a training batch (:func:`paco.judge.model.encode_sft`) and checks
that each target starts with its label's answer token.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from PIL import Image

from paco.core.io import ArtifactError, decode_image, read_parquet
from paco.core.params import PairAugmentParams
from paco.judge.losses import answer_positions
from paco.judge.model import AnswerTokens, encode_sft

#: the columns an sft table must have
SFT_COLUMNS = ("pair_id", "split", "instruction", "image_a", "image_b", "label", "response", "status")


@dataclass(frozen=True)
class SftRow:
    """One training/eval example: PNG bytes of both images, the question, the target, and the
    task (``t2is``: a symmetric consistency question; ``edit_pf`` / ``edit_sc``: the original
    first and the edit second, so no augmentation applies: a swap or independent crops would
    change the label)."""

    pair_id: str
    image_a: bytes
    image_b: bytes
    instruction: str
    response: str
    label: bool
    task: str = "t2is"


def _cell_bytes(cell: Any, what: str) -> bytes:
    data = cell.get("bytes") if isinstance(cell, dict) else cell
    if not data:
        raise ArtifactError(f"{what}: image cell has no bytes")
    return bytes(data)


def load_sft_rows(sft: str | os.PathLike[str] | pd.DataFrame, split: str) -> list[SftRow]:
    """The ``status == "ok"`` rows of ``split`` (sorted by ``pair_id``) of an sft table.

    Raises:
        ArtifactError: missing file/columns, duplicate ``pair_id``, an empty response or image.
    """
    df = read_parquet(sft, required=SFT_COLUMNS) if not isinstance(sft, pd.DataFrame) else sft
    missing = [c for c in SFT_COLUMNS if c not in df.columns]
    if missing:
        raise ArtifactError(f"sft table: missing column(s) {missing}")
    sel = df[(df["split"] == split) & (df["status"] == "ok")].sort_values("pair_id", kind="stable")
    if sel["pair_id"].duplicated().any():
        dup = sel.loc[sel["pair_id"].duplicated(), "pair_id"].tolist()[:5]
        raise ArtifactError(f"sft table: duplicate pair_id(s) {dup}")
    rows = []
    for r in sel.itertuples(index=False):
        if not isinstance(r.response, str) or not r.response.strip():
            raise ArtifactError(f"sft table: pair {r.pair_id} has an empty response")
        rows.append(
            SftRow(
                pair_id=str(r.pair_id),
                image_a=_cell_bytes(r.image_a, f"pair {r.pair_id} image_a"),
                image_b=_cell_bytes(r.image_b, f"pair {r.pair_id} image_b"),
                instruction=str(r.instruction),
                response=str(r.response),
                label=bool(r.label),
                task=str(getattr(r, "task", "t2is")),
            )
        )
    return rows


def subsample(rows: Sequence[SftRow], max_rows: int | None, seed: int) -> list[SftRow]:
    """At most ``max_rows`` rows chosen with ``numpy.random.default_rng(seed)``, in input order."""
    if max_rows is None or len(rows) <= max_rows:
        return list(rows)
    keep = np.sort(np.random.default_rng(seed).permutation(len(rows))[:max_rows])
    return [rows[i] for i in keep]


def augment_pair(image_a: Image.Image, image_b: Image.Image, aug: PairAugmentParams,
                 rng: np.random.Generator) -> tuple[Image.Image, Image.Image]:
    """A label-preserving random view of one training pair (see :class:`PairAugmentParams`).

    Draws the same count of random numbers whatever the outcome (9: swap, then flip, crop area,
    crop x, crop y for each image), so a row's view depends only on its generator. A crop keeps
    the image's aspect ratio and is resized back to the original size (bicubic), so the judge
    sees as many visual tokens as without augmentation.

    Returns:
        ``(view_a, view_b)``, RGB images of the input sizes, possibly swapped.
    """
    swap = rng.random() < aug.swap
    out = []
    for im in (image_a, image_b):
        flip = rng.random() < aug.hflip
        area = rng.uniform(*aug.crop_scale)
        fx, fy = rng.random(), rng.random()
        if area < 1.0:
            w, h = im.size
            cw, ch = max(1, round(w * math.sqrt(area))), max(1, round(h * math.sqrt(area)))
            x0, y0 = int(fx * (w - cw + 1)), int(fy * (h - ch + 1))
            im = im.crop((x0, y0, x0 + cw, y0 + ch)).resize((w, h), Image.Resampling.BICUBIC)
        if flip:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        out.append(im)
    return (out[1], out[0]) if swap else (out[0], out[1])


def row_images(row: SftRow, aug: PairAugmentParams | None = None, *, seed: int = 0, epoch: int = 0,
               index: int = 0) -> tuple[Image.Image, Image.Image]:
    """The decoded pair of ``row``; with an enabled ``aug``, its augmented view for training row
    ``index`` (position in the sorted training rows) in ``epoch``, drawn from
    ``numpy.random.default_rng([seed, epoch, index])`` (independent of processes and resumes).

    Raises:
        ArtifactError: an undecodable image (names the pair).
    """
    a = decode_image(row.image_a, what=f"pair {row.pair_id} image_a")
    b = decode_image(row.image_b, what=f"pair {row.pair_id} image_b")
    if aug is None or not aug.enabled or row.task != "t2is":
        return a, b
    return augment_pair(a, b, aug, np.random.default_rng([seed, epoch, index]))


def encode_rows(processor: Any, rows: Sequence[SftRow], answer: AnswerTokens,
                images: Sequence[tuple[Image.Image, Image.Image]] | None = None) -> dict[str, torch.Tensor]:
    """:func:`paco.judge.model.encode_sft` of ``rows`` (decoding the PNGs, or the given ``images``, one
    ``(image_a, image_b)`` per row), checking that each row's first response token is the
    answer token of its label.

    Raises:
        ValueError: a response does not start with the ``Yes``/``No`` token matching ``label``.
    """
    if images is None:
        images = [row_images(r) for r in rows]
    batch = encode_sft(processor, [(a, b, r.instruction, r.response) for r, (a, b) in zip(rows, images, strict=True)])
    pos = answer_positions(batch["labels"])
    first = batch["labels"][torch.arange(len(rows)), pos].tolist()
    for r, tok in zip(rows, first):
        want = answer.yes[0] if r.label else answer.no[0]
        if tok != want:
            raise ValueError(
                f"pair {r.pair_id}: response {r.response[:40]!r} starts with token {tok}, expected "
                f"the {'Yes' if r.label else 'No'} token {want} (label {r.label})"
            )
    return batch
