"""Composite (multi-panel grid image) sources for ``composites.parquet`` (docs/architecture.md §3).

- ``generate``: the policy pipeline (FLUX.1) renders each prompt's grid prompt for N seeds
  (paper §3.1: 4 seeds per prompt, 1024 x 1024, 2x2);
- ``import``: a folder of existing composites plus a manifest;
- ``photos``: grids built from real photographs (:mod:`paco.data.photos`, the embedded default).

Every source returns the same columns: composite_id (``<prompt_id>-s<seed>`` for generated and
photo composites), prompt_id, seed, image (PNG cell), height, width; ``photos`` adds its ground
truth (panel_bboxes, panel_levels, subject, drift_subject, drift_style).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from paco.core.io import (
    ArtifactError, ImageDecodeError, OutsideDatasetError, dataset_path, encode_image, image_file_byte_limit,
    iter_text_lines, load_image, read_dataset_file,
)
from paco.core.params import GenerateParams, ImportParams
from paco.core.seeding import stable_seed

COMPOSITE_COLUMNS = ["composite_id", "prompt_id", "seed", "image", "height", "width"]


def composite_id(prompt_id: str, seed: int) -> str:
    return f"{prompt_id}-s{seed}"


def generation_batches(
    prompts: pd.DataFrame, cfg: GenerateParams, seeds_per_prompt: int,
) -> list[list[tuple[dict[str, Any], int]]]:
    """The render batches of :func:`generate_composites`: ``(prompt row, k)`` jobs sorted by
    output size (stable: prompt order, then k), cut into batches of ``cfg.batch_size`` that never
    mix sizes. Batch ``n`` is the unit a process owns in a multi-process run."""

    def size(row: dict[str, Any]) -> tuple[int, int]:
        return cfg.height or int(row["height"]), cfg.width or int(row["width"])

    jobs = sorted(
        ((row, k) for row in prompts.to_dict("records") for k in range(seeds_per_prompt)),
        key=lambda job: size(job[0]),
    )
    return [
        b[i : i + cfg.batch_size]
        for b in ([j for j in jobs if size(j[0]) == s] for s in dict.fromkeys(size(r) for r, _ in jobs))
        for i in range(0, len(b), cfg.batch_size)
    ]


def composite_order(prompts: pd.DataFrame, cfg: GenerateParams, seeds_per_prompt: int) -> list[str]:
    """The composite ids in the row order :func:`generate_composites` writes (batch order)."""
    return [composite_id(r["prompt_id"], k) for b in generation_batches(prompts, cfg, seeds_per_prompt) for r, k in b]


def generate_composites(
    prompts: pd.DataFrame,
    pipeline: Any,
    cfg: GenerateParams,
    seeds_per_prompt: int,
    seed: int,
    progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it,
    owns: Callable[[int], bool] = lambda n: True,
) -> pd.DataFrame:
    """Render ``seeds_per_prompt`` composites per prompt with a diffusers text-to-image pipeline.

    The initial noise of composite ``k`` of prompt ``p`` comes from a CPU ``torch.Generator``
    seeded with ``stable_seed(seed, p, k)``, so a composite does not depend on batch size, row
    order or device count. Height/width are the prompt's unless overridden in ``cfg``.

    Args:
        prompts: rows with prompt_id, prompt (the full grid prompt), height, width.
        pipeline: a loaded ``FluxPipeline`` (or any pipeline with the same call signature).
        owns: which batches of :func:`generation_batches` to render (a process's share:
            :meth:`paco.core.distributed.Processes.owns`); the batches are the same whatever the
            share, so every composite is the one a single process renders.

    Returns:
        The composite table (``COMPOSITE_COLUMNS``) of the rendered batches in batch order,
        ``seed`` = k.
    """
    import torch

    batches = [b for n, b in enumerate(generation_batches(prompts, cfg, seeds_per_prompt)) if owns(n)]
    records = []
    for batch in progress(batches):
        height, width = cfg.height or int(batch[0][0]["height"]), cfg.width or int(batch[0][0]["width"])
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


class ManifestError(ArtifactError):
    """The import manifest as a whole is unusable: missing or unreadable, lacking a column,
    repeating a composite_id, or leaving no composite to import."""


class ManifestRowError(ArtifactError):
    """One manifest row is unusable. The message names the manifest row (``manifest.jsonl:3``
    or ``manifest.parquet row 3``), the composite_id when known, the field and the file."""

    def __init__(self, where: str, reason: str, *, composite_id: str | None = None,
                 field: str | None = None, file: str | None = None):
        self.where, self.reason, self.composite_id, self.field, self.file = where, reason, composite_id, field, file
        who = f" composite {composite_id!r}" if composite_id is not None else ""
        super().__init__(f"{where}:{who} {reason}")


class CompositeFileMissingError(ManifestRowError):
    """A manifest row's ``file`` does not exist (names the row, the composite and the path)."""


class CompositeFileOutsideError(ManifestRowError, OutsideDatasetError):
    """A manifest row's ``file`` is absolute or leads out of the import folder (through ``..`` or
    a symlink): the folder is the stage's declared dependency, so DVC would not see such a file
    change."""


#: Columns every manifest row needs.
MANIFEST_COLUMNS = ("composite_id", "prompt_id", "seed", "file")

#: Smallest panel side (px) an imported composite must leave for every panel of its prompt's
#: grid: a ``rows x cols`` prompt needs a composite at least ``cols * MIN_PANEL_PX`` wide and
#: ``rows * MIN_PANEL_PX`` high. Below that a panel has no content to compare, and the refine
#: split (which ignores 2% at each line end and searches a window around each cut) has nothing
#: to work on; a 1x1 image cannot even be cut into a 2x2 grid.
MIN_PANEL_PX = 8


def _is_missing(v: Any) -> bool:
    return v is None or v is pd.NA or (isinstance(v, (float, np.floating)) and math.isnan(v))


def read_manifest(path: Path, *, strict: bool = True) -> tuple[list[tuple[str, dict[str, Any]]], list[dict[str, Any]]]:
    """Read an import manifest (``.jsonl`` or ``.parquet``) whose rows give composite_id,
    prompt_id, seed and file (a path relative to the import folder ``composites.import.dir``,
    which must hold the manifest and every file: see :func:`import_composites`).

    A ``.jsonl`` manifest is read as UTF-8 (a leading byte-order mark is ignored); each
    non-blank line must be a JSON object.

    Returns:
        ``(rows, skipped)``: ``rows`` are ``(where, record)`` with ``where`` the row's location
        (``"<path>:<line>"`` for jsonl, ``"<path> row <n>"``, 1-based, for Parquet);
        ``skipped`` lists ``{"row", "composite_id", "field", "file", "reason"}`` for lines that
        are not valid UTF-8, not JSON or not an object (always empty when ``strict``).

    Raises:
        ManifestError: no manifest, an unreadable Parquet file, a column that no row has, or a
            manifest without rows.
        ManifestRowError: (``strict``) the first line that is not UTF-8, JSON or an object.
    """
    if not path.is_file():
        raise ManifestError(f"{path}: no import manifest")
    rows: list[tuple[str, dict[str, Any]]] = []
    skipped: list[dict[str, Any]] = []
    if path.suffix == ".parquet":
        try:
            df = pd.read_parquet(path)
        except Exception as exc:  # pyarrow raises several unrelated types for a bad file
            raise ManifestError(f"{path}: cannot read Parquet manifest ({exc})") from exc
        for n, rec in enumerate(df.to_dict("records"), 1):
            rows.append((f"{path} row {n}", rec))
        present = set(df.columns)
    else:
        present = set()
        for n, text, err in iter_text_lines(path):
            where = f"{path}:{n}"
            try:
                if err is not None:
                    raise ManifestRowError(where, err)
                if not text.strip():
                    continue
                try:
                    rec = json.loads(text)
                except (ValueError, RecursionError) as exc:  # JSONDecodeError, digit limit, deep nesting
                    raise ManifestRowError(where, f"invalid JSON ({exc})") from None
                if not isinstance(rec, dict):
                    raise ManifestRowError(where, f"a row must be a JSON object, got {type(rec).__name__}")
            except ManifestRowError as exc:
                if strict:
                    raise
                skipped.append(_skip_entry(exc))
                continue
            present |= set(rec)
            rows.append((where, rec))
    missing = [c for c in MANIFEST_COLUMNS if c not in present]
    if rows and missing:
        raise ManifestError(f"{path}: manifest lacks column(s) {missing}")
    if not rows and not skipped:
        raise ManifestError(f"{path}: the import manifest has no rows")
    return rows, skipped


def _skip_entry(exc: ManifestRowError) -> dict[str, Any]:
    return {"row": exc.where, "composite_id": exc.composite_id, "field": exc.field, "file": exc.file,
            "reason": str(exc)}


def _check_row(where: str, rec: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Validate one manifest record; returns composite_id (str), prompt_id (str), seed (int),
    file (str) and path. Raises ManifestRowError naming the field."""
    cid = rec.get("composite_id")
    if _is_missing(cid):
        raise ManifestRowError(where, "field 'composite_id' is missing", field="composite_id")
    if isinstance(cid, (bool, np.bool_)) or not isinstance(cid, (str, int, np.integer)) or not str(cid).strip():
        raise ManifestRowError(
            where, f"field 'composite_id' must be a non-empty string or an integer, got {type(cid).__name__} {cid!r}",
            field="composite_id",
        )
    cid = str(cid)
    for col in MANIFEST_COLUMNS[1:]:
        if _is_missing(rec.get(col)):
            raise ManifestRowError(where, f"field {col!r} is missing", composite_id=cid, field=col)
    pid = rec["prompt_id"]
    if isinstance(pid, (bool, np.bool_)) or not isinstance(pid, (str, int, np.integer)):
        raise ManifestRowError(where, f"field 'prompt_id' must be a string, got {type(pid).__name__} {pid!r}",
                               composite_id=cid, field="prompt_id")
    seed = rec["seed"]
    value: int | None = None
    if isinstance(seed, (bool, np.bool_)):
        value = None
    elif isinstance(seed, (int, np.integer)):
        value = int(seed)
    elif isinstance(seed, (float, np.floating)) and float(seed).is_integer():
        value = int(seed)
    elif isinstance(seed, str) and seed.strip().isdigit() and seed.strip().isascii():
        value = int(seed.strip())
    if value is None or value < 0:
        raise ManifestRowError(where, f"field 'seed' must be a non-negative integer, got {type(seed).__name__} {seed!r}",
                               composite_id=cid, field="seed")
    file = rec["file"]
    if not isinstance(file, str) or not file.strip():
        raise ManifestRowError(where, f"field 'file' must be a non-empty path string, got {type(file).__name__} {file!r}",
                               composite_id=cid, field="file")
    full = folder / file
    try:
        dataset_path(folder, file, what="field 'file'")
    except OutsideDatasetError as exc:
        raise CompositeFileOutsideError(where, str(exc), composite_id=cid, field="file", file=file) from None
    except ArtifactError as exc:
        if "\x00" not in file and not full.exists():
            raise CompositeFileMissingError(where, f"field 'file': {file!r} not found (looked for {full})",
                                            composite_id=cid, field="file", file=file) from None
        raise ManifestRowError(where, str(exc), composite_id=cid, field="file", file=file) from None
    return {"composite_id": cid, "prompt_id": str(pid), "seed": value, "file": file, "path": full}


def _check_unique(checked: list[tuple[str, dict[str, Any]]]) -> None:
    """Refuse two rows with one composite_id, or with one (prompt_id, seed): a prompt's
    composites are its candidates, one per seed, so two of one seed would be silently merged."""
    first: dict[str, str] = {}
    first_seed: dict[tuple[str, int], tuple[str, str]] = {}
    for where, row in checked:
        cid = row["composite_id"]
        if cid in first:
            raise ManifestError(f"duplicate composite_id {cid!r}: {first[cid]} and {where}")
        first[cid] = where
        key = (row["prompt_id"], row["seed"])
        if key in first_seed:
            w0, c0 = first_seed[key]
            raise ManifestError(
                f"two composites of prompt_id {key[0]!r} and seed {key[1]}: {w0} (composite {c0!r}) and {where} "
                f"(composite {cid!r}); a prompt has one composite per seed"
            )
        first_seed[key] = (where, cid)


def _check_grid_size(where: str, cid: str, file: str, image: Any, layout: tuple[int, int] | None) -> None:
    if layout is None:
        return
    rows, cols = (int(v) for v in layout)
    if image.width < cols * MIN_PANEL_PX or image.height < rows * MIN_PANEL_PX:
        raise ManifestRowError(
            where, f"field 'file': the image is {image.width}x{image.height} px (width x height), too small for "
            f"its prompt's {rows}x{cols} grid (rows x cols): it needs at least {cols * MIN_PANEL_PX}x"
            f"{rows * MIN_PANEL_PX} px, {MIN_PANEL_PX} px per panel side",
            composite_id=cid, field="file", file=file,
        )


def _load_row(where: str, row: dict[str, Any], folder: Path, max_pixels: int,
              layout: tuple[int, int] | None) -> tuple[Any, Any]:
    """Read (bounded, inside ``folder``) and decode one checked row's image; check its size."""
    cid = row["composite_id"]
    try:
        data = read_dataset_file(folder, row["file"], what="field 'file'", max_bytes=image_file_byte_limit(max_pixels))
    except ArtifactError as exc:
        raise ManifestRowError(where, str(exc), composite_id=cid, field="file", file=row["file"]) from exc
    image, info = load_image(data, what=f"{where}: composite {cid!r} (file {row['path']})", max_pixels=max_pixels)
    _check_grid_size(where, cid, row["file"], image, layout)
    return image, info


def import_composites(
    cfg: ImportParams, prompt_ids: set[str], *, strict: bool = True,
    layouts: Mapping[str, tuple[int, int]] | None = None,
) -> tuple[pd.DataFrame, list[dict[str, Any]], dict[str, Any]]:
    """Load existing composites listed in ``<cfg.dir>/<cfg.manifest>``.

    ``cfg.dir`` is the dataset folder (the stage's declared dependency): the manifest and every
    row's ``file`` (relative to ``cfg.dir``) must be regular files inside it, symlinks followed
    (:func:`paco.core.io.dataset_path`). A file is read only up to :func:`paco.core.io.image_file_byte_limit`.
    With ``layouts`` (prompt_id -> (rows, cols)) a composite must be at least
    :data:`MIN_PANEL_PX` px per panel side of its prompt's grid.

    Each image is decoded by :func:`paco.core.io.load_image` with ``max_pixels=cfg.max_pixels``: EXIF
    orientation applied, 16-bit greyscale scaled to 8 bits, alpha composited onto
    :data:`paco.core.io.ALPHA_BACKGROUND` (white), then stored as an RGB PNG cell.

    Returns:
        ``(composites, skipped, conversions)``. ``composites`` has ``COMPOSITE_COLUMNS``.
        ``skipped`` (only with ``strict=False``) lists ``{"row", "composite_id", "field",
        "file", "reason"}`` for every row left out: a line that is not UTF-8/JSON/an object, a
        missing or mistyped field, a missing file or one outside ``cfg.dir``, a file over
        :func:`paco.core.io.image_file_byte_limit`, an image that cannot be decoded, is too large, has an
        unsupported mode, or is too small for its prompt's grid. ``conversions`` counts the imported images that were
        changed on decoding: ``exif_rotated``, ``rescaled_16bit``, ``alpha_flattened``, and
        lists the composite_ids in ``alpha_flattened_ids``.

    Raises:
        ManifestError: manifest problems (see :func:`read_manifest`), a composite_id that
            repeats (``1`` and ``"1"`` are the same id), two rows with the same prompt_id and
            seed (both named, whatever ``strict``), or nothing left to import.
        paco.core.io.OutsideDatasetError: the manifest is outside ``cfg.dir``.
        ArtifactError: a prompt_id that is not in the prompts.
        ManifestRowError: (strict) a bad row (names row, field and file);
            :class:`CompositeFileMissingError` for a missing file,
            :class:`CompositeFileOutsideError` (also an ``OutsideDatasetError``) for a file
            outside ``cfg.dir``; a file over :func:`paco.core.io.image_file_byte_limit`, or an image too small for
            its prompt's grid.
        ImageDecodeError: (strict) an unreadable image; :class:`paco.core.io.ImageTooLargeError`
            above ``cfg.max_pixels``; :class:`paco.core.io.UnsupportedImageModeError`. The message
            names the manifest row, the composite_id and the file.
    """
    folder = Path(cfg.dir)
    try:
        dataset_path(folder, cfg.manifest, what="composites.import.manifest")
    except OutsideDatasetError:
        raise
    except ArtifactError:
        pass  # missing, or not a file: read_manifest says so
    manifest, skipped = read_manifest(folder / cfg.manifest, strict=strict)
    checked: list[tuple[str, dict[str, Any]]] = []
    for where, rec in manifest:
        try:
            checked.append((where, _check_row(where, rec, folder)))
        except ManifestRowError as exc:
            if strict:
                raise
            skipped.append(_skip_entry(exc))
    _check_unique(checked)
    unknown = sorted({row["prompt_id"] for _, row in checked} - prompt_ids)
    if unknown:
        raise ArtifactError(f"import manifest: prompt_id(s) not in prompts: {unknown[:5]}")
    records = []
    conversions: dict[str, Any] = {"exif_rotated": 0, "rescaled_16bit": 0, "alpha_flattened": 0,
                                   "alpha_flattened_ids": []}
    for where, row in checked:
        cid, path = row["composite_id"], row["path"]
        try:
            image, info = _load_row(where, row, folder, cfg.max_pixels,
                                    None if layouts is None else layouts.get(row["prompt_id"]))
        except (ImageDecodeError, ManifestRowError) as exc:
            if strict:
                raise
            skipped.append({"row": where, "composite_id": cid, "field": "file", "file": row["file"],
                            "reason": str(exc)})
            continue
        conversions["exif_rotated"] += info.orientation != 1
        conversions["rescaled_16bit"] += info.rescaled_16bit
        if info.alpha_flattened:
            conversions["alpha_flattened"] += 1
            conversions["alpha_flattened_ids"].append(cid)
        records.append(
            {
                "composite_id": cid,
                "prompt_id": row["prompt_id"],
                "seed": row["seed"],
                "image": encode_image(image, path=path.name),
                "height": image.height,
                "width": image.width,
            }
        )
    if not records:
        reasons = "; ".join(s["reason"] for s in skipped[:3])
        raise ManifestError(
            f"{folder / cfg.manifest}: no composite could be imported ({len(skipped)} row(s) skipped"
            + (f": {reasons}" if reasons else "") + ")"
        )
    return pd.DataFrame.from_records(records, columns=COMPOSITE_COLUMNS), skipped, conversions
