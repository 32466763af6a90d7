"""Composite (multi-panel grid image) sources for ``composites.parquet`` (DESIGN.md §2).

- ``generate``: the policy pipeline (FLUX.1) renders each prompt's grid prompt for N seeds
  (paper §3.1: 4 seeds per prompt, 1024 x 1024, 2x2);
- ``import``: a folder of existing composites plus a manifest;
- ``photos``: grids built from real photographs (:mod:`paco.photos`, the embedded default).

Every source returns the same columns: composite_id (``<prompt_id>-s<seed>`` for generated and
photo composites), prompt_id, seed, image (PNG cell), height, width; ``photos`` adds its ground
truth (panel_bboxes, panel_levels, subject, drift_subject, drift_style).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from paco.io import ArtifactError, ImageDecodeError, decode_image, encode_image
from paco.params import GenerateParams, ImportParams
from paco.photos import stable_hash

COMPOSITE_COLUMNS = ["composite_id", "prompt_id", "seed", "image", "height", "width"]


def stable_seed(*parts: Any) -> int:
    """A 63-bit integer seed from the parts' text, stable across processes and runs."""
    return stable_hash("\x1f".join(str(p) for p in parts)) >> 1


def composite_id(prompt_id: str, seed: int) -> str:
    return f"{prompt_id}-s{seed}"


def generate_composites(
    prompts: pd.DataFrame,
    pipeline: Any,
    cfg: GenerateParams,
    seeds_per_prompt: int,
    seed: int,
    progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it,
) -> pd.DataFrame:
    """Render ``seeds_per_prompt`` composites per prompt with a diffusers text-to-image pipeline.

    The initial noise of composite ``k`` of prompt ``p`` comes from a CPU ``torch.Generator``
    seeded with ``stable_seed(seed, p, k)``, so a composite does not depend on batch size, row
    order or device count. Height/width are the prompt's unless overridden in ``cfg``.

    Args:
        prompts: rows with prompt_id, prompt (the full grid prompt), height, width.
        pipeline: a loaded ``FluxPipeline`` (or any pipeline with the same call signature).

    Returns:
        The composite table (``COMPOSITE_COLUMNS``), ``seed`` = k.
    """
    import torch

    def size(row: dict[str, Any]) -> tuple[int, int]:
        return cfg.height or int(row["height"]), cfg.width or int(row["width"])

    jobs = sorted(
        ((row, k) for row in prompts.to_dict("records") for k in range(seeds_per_prompt)),
        key=lambda job: size(job[0]),  # stable: same-size jobs batch together, in prompt order
    )
    batches = [
        b[i : i + cfg.batch_size]
        for b in ([j for j in jobs if size(j[0]) == s] for s in dict.fromkeys(size(r) for r, _ in jobs))
        for i in range(0, len(b), cfg.batch_size)
    ]
    records = []
    for batch in progress(batches):
        height, width = size(batch[0][0])
        out = pipeline(
            prompt=[r["prompt"] for r, _ in batch],
            height=height,
            width=width,
            num_inference_steps=cfg.num_inference_steps,
            guidance_scale=cfg.guidance_scale,
            max_sequence_length=cfg.max_sequence_length,
            generator=[torch.Generator("cpu").manual_seed(stable_seed(seed, r["prompt_id"], k)) for r, k in batch],
            output_type="pil",
        )
        for (r, k), image in zip(batch, out.images, strict=True):
            cid = composite_id(r["prompt_id"], k)
            records.append(
                {
                    "composite_id": cid,
                    "prompt_id": r["prompt_id"],
                    "seed": k,
                    "image": encode_image(image, path=f"{cid}.png"),
                    "height": image.height,
                    "width": image.width,
                }
            )
    return pd.DataFrame.from_records(records, columns=COMPOSITE_COLUMNS)


def read_manifest(path: Path) -> pd.DataFrame:
    """Read an import manifest (``.jsonl`` or ``.parquet``) with composite_id, prompt_id, seed,
    file (a path relative to the manifest's folder).

    Raises:
        ArtifactError: missing file or column, duplicate composite_id, malformed line.
    """
    if not path.is_file():
        raise ArtifactError(f"{path}: no import manifest")
    if path.suffix == ".parquet":
        df = pd.read_parquet(path)
    else:
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ArtifactError(f"{path}:{n}: invalid JSON ({exc})") from exc
        df = pd.DataFrame.from_records(rows)
    missing = {"composite_id", "prompt_id", "seed", "file"} - set(df.columns)
    if missing:
        raise ArtifactError(f"{path}: manifest lacks column(s) {sorted(missing)}")
    dup = df["composite_id"][df["composite_id"].duplicated()].tolist()
    if dup:
        raise ArtifactError(f"{path}: duplicate composite_id(s) {dup[:5]}")
    return df


def import_composites(
    cfg: ImportParams, prompt_ids: set[str], *, strict: bool = True
) -> tuple[pd.DataFrame, list[dict[str, str]]]:
    """Load existing composites listed in ``<cfg.dir>/<cfg.manifest>``.

    Returns:
        ``(composites, skipped)``; with ``strict=False`` an unreadable image is skipped and
        reported in ``skipped`` as ``{"composite_id", "reason"}``.

    Raises:
        ArtifactError: manifest problems, an unknown prompt_id, or (strict) an unreadable image
            (the message names the composite_id and file).
    """
    folder = Path(cfg.dir)
    manifest = read_manifest(folder / cfg.manifest)
    unknown = sorted(set(manifest["prompt_id"].astype(str)) - prompt_ids)
    if unknown:
        raise ArtifactError(f"import manifest: prompt_id(s) not in prompts: {unknown[:5]}")
    records, skipped = [], []
    for row in manifest.to_dict("records"):
        cid, file = str(row["composite_id"]), folder / str(row["file"])
        try:
            image = decode_image(file.read_bytes() if file.is_file() else None, what=f"composite {cid} ({file})")
        except ImageDecodeError as exc:
            if strict:
                raise
            skipped.append({"composite_id": cid, "reason": str(exc)})
            continue
        records.append(
            {
                "composite_id": cid,
                "prompt_id": str(row["prompt_id"]),
                "seed": int(row["seed"]),
                "image": encode_image(image, path=file.name),
                "height": image.height,
                "width": image.width,
            }
        )
    return pd.DataFrame.from_records(records, columns=COMPOSITE_COLUMNS), skipped
