"""The panel table: composites -> one row per sub-figure (``panels.parquet``, docs/architecture.md §3).

Box finding is :func:`paco.data.subfigures.split_grid`; this module joins composites with their
layouts, decodes and crops, assigns stable panel IDs (``<composite_id>-p<index>``, index
row-major), carries the ``photos`` source's drift level through, and scores boxes against true
ones when the composites record them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pandas as pd

from paco.core.io import ArtifactError, ImageDecodeError, decode_image, encode_image
from paco.data.subfigures import GridTooSmallError, box_iou, crop_panels, split_grid

PANEL_COLUMNS = [
    "panel_id", "composite_id", "prompt_id", "seed", "row", "col", "index", "bbox", "image", "level",
]


def panel_id(composite_id: str, index: int) -> str:
    """Stable panel ID: ``<composite_id>-p<index>`` with the row-major panel index."""
    return f"{composite_id}-p{index}"


def extract_panels(
    composites: pd.DataFrame,
    prompts: pd.DataFrame,
    *,
    method: str = "refine",
    tolerance: float = 0.08,
    strict: bool = True,
    progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it,
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Cut every composite into ``rows x cols`` panels.

    Args:
        composites: ``composites.parquet`` rows (composite_id, prompt_id, seed, image; optional
            ``panel_bboxes`` true boxes and ``panel_levels`` drift levels).
        prompts: ``prompts.parquet`` rows (prompt_id, rows, cols).
        method, tolerance: passed to :func:`paco.data.subfigures.split_grid`.
        strict: an undecodable composite, or one with fewer pixels than its grid has cells,
            raises; otherwise it is skipped and reported.

    Returns:
        ``(panels, report)``: the panel table (columns ``PANEL_COLUMNS``; ``bbox`` is
        ``[x0, y0, x1, y1]`` in pixels, x1/y1 exclusive; ``level`` is null without a drift level)
        and a metrics dict (counts, skipped composites with reasons, IoU against true boxes).

    Raises:
        ImageDecodeError: (strict) a composite image cannot be decoded; names its composite_id.
        ArtifactError: (strict) a composite too small for its grid (names its composite_id); a
            composite's prompt_id has no layout in ``prompts``, or its recorded
            true boxes/levels do not match the layout.
    """
    layout = prompts.set_index("prompt_id")[["rows", "cols"]]
    unknown = sorted(set(composites["prompt_id"]) - set(layout.index))
    if unknown:
        raise ArtifactError(f"composites reference prompt_id(s) missing from prompts: {unknown[:5]}")
    has_truth = "panel_bboxes" in composites.columns
    has_levels = "panel_levels" in composites.columns

    records: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    ious: list[float] = []
    for comp in progress(composites.itertuples(index=False)):
        cid = comp.composite_id
        rows, cols = (int(v) for v in layout.loc[comp.prompt_id])
        try:
            image = decode_image(comp.image, what=f"composite {cid}")
        except ImageDecodeError as exc:
            if strict:
                raise
            skipped.append({"composite_id": cid, "reason": str(exc)})
            continue
        try:
            boxes = split_grid(image, rows, cols, method=method, tolerance=tolerance)
        except GridTooSmallError as exc:
            if strict:
                raise ArtifactError(f"composite {cid}: {exc}") from exc
            skipped.append({"composite_id": cid, "reason": str(exc)})
            continue
        crops = crop_panels(image, boxes)
        levels = list(comp.panel_levels) if has_levels and comp.panel_levels is not None else None
        truth = list(comp.panel_bboxes) if has_truth and comp.panel_bboxes is not None else None
        for name, seq in (("panel_levels", levels), ("panel_bboxes", truth)):
            if seq is not None and len(seq) != rows * cols:
                raise ArtifactError(f"composite {cid}: {name} has {len(seq)} entries, layout {rows}x{cols}")
        for index, (box, crop) in enumerate(zip(boxes, crops, strict=True)):
            if truth is not None:
                ious.append(box_iou(box, tuple(int(v) for v in truth[index])))
            pid = panel_id(cid, index)
            records.append(
                {
                    "panel_id": pid,
                    "composite_id": cid,
                    "prompt_id": comp.prompt_id,
                    "seed": int(comp.seed),
                    "row": index // cols,
                    "col": index % cols,
                    "index": index,
                    "bbox": [int(v) for v in box],
                    "image": encode_image(crop, path=f"{pid}.png"),
                    "level": int(levels[index]) if levels is not None else None,
                }
            )
    panels = pd.DataFrame.from_records(records, columns=PANEL_COLUMNS)
    panels["level"] = panels["level"].astype("Int64")
    report: dict[str, Any] = {
        "composites": int(len(composites) - len(skipped)),
        "panels": int(len(panels)),
        "skipped_composites": len(skipped),
        "skipped": skipped,
        "method": method,
    }
    if ious:
        report["bbox_iou"] = {"mean": float(np.mean(ious)), "min": float(np.min(ious))}
    return panels, report
