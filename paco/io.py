"""Artifact I/O shared by every stage: Parquet tables with embedded images, atomic writes.

Image columns follow the Hugging Face ``datasets`` ``Image`` feature convention: a Parquet
``struct<bytes: binary, path: string>`` whose ``bytes`` hold a PNG file, so every table is
self-contained and ``datasets.load_dataset("parquet", ...)`` decodes it as images
(DESIGN.md §2).

Every writer here is atomic: it writes to a temporary file in the destination directory and
``os.replace``-s it into place, so an interrupted stage never leaves a half-written artifact.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, UnidentifiedImageError

#: Arrow type of an image cell (``datasets.Image`` storage type).
IMAGE_TYPE = pa.struct([pa.field("bytes", pa.binary()), pa.field("path", pa.string())])


class ArtifactError(ValueError):
    """A stage input is missing, malformed or inconsistent with its contract."""


class ImageDecodeError(ArtifactError):
    """An image cell could not be decoded (corrupt, truncated or not an image)."""


# --------------------------------------------------------------------------------------------
# images
# --------------------------------------------------------------------------------------------


def encode_image(image: Image.Image, path: str | None = None) -> dict[str, Any]:
    """Encode a PIL image as an image cell ``{"bytes": PNG bytes, "path": path}``.

    PNG is lossless, so ``decode_image(encode_image(im))`` returns the same pixels. RGBA and
    palette images are converted to RGB; greyscale (``L``) is kept.
    """
    if image.mode not in ("RGB", "L"):
        image = image.convert("RGB")
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False, compress_level=1)
    return {"bytes": buf.getvalue(), "path": path}


def decode_image(cell: Mapping[str, Any] | bytes | None, *, what: str = "image") -> Image.Image:
    """Decode an image cell (or raw encoded bytes) into a fully loaded RGB PIL image.

    Args:
        cell: ``{"bytes": ..., "path": ...}`` as stored in Parquet, or the raw bytes.
        what: a label for error messages, e.g. ``"composite c-001"``.

    Raises:
        ImageDecodeError: the cell is empty, truncated, or not a decodable image. The message
            names ``what``.
    """
    data = cell.get("bytes") if isinstance(cell, Mapping) else cell
    if not data:
        raise ImageDecodeError(f"{what}: image cell has no bytes")
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()  # forces a full decode: truncated files raise here, not later
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise ImageDecodeError(f"{what}: cannot decode image ({exc})") from exc


# --------------------------------------------------------------------------------------------
# atomic writes
# --------------------------------------------------------------------------------------------


def _atomic_target(path: str | os.PathLike[str]) -> tuple[Path, str]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return path, tmp


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same directory + rename)."""
    path, tmp = _atomic_target(path)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as pretty, key-sorted JSON atomically (stable bytes for DVC metrics)."""
    text = json.dumps(obj, indent=2, sort_keys=True, allow_nan=False, default=_json_default)
    atomic_write_bytes(path, (text + "\n").encode())


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def write_parquet(
    path: str | os.PathLike[str],
    df: pd.DataFrame,
    *,
    image_columns: Iterable[str] = (),
    image_list_columns: Iterable[str] = (),
    schema: pa.Schema | None = None,
) -> None:
    """Write ``df`` to Parquet atomically; ``image_columns`` are stored as ``IMAGE_TYPE``,
    ``image_list_columns`` (lists of cells) as ``list<IMAGE_TYPE>``.

    Image columns must hold cells from :func:`encode_image`. The ``datasets`` feature metadata
    (``Image`` / ``Sequence(Image)``) is attached so Hugging Face ``datasets`` decodes them.
    """
    image_columns = list(image_columns)
    image_list_columns = list(image_list_columns)
    table = pa.Table.from_pandas(df, preserve_index=False, schema=schema)
    for name, typ in [(n, IMAGE_TYPE) for n in image_columns] + [(n, pa.list_(IMAGE_TYPE)) for n in image_list_columns]:
        idx = table.schema.get_field_index(name)
        if idx < 0:
            raise ArtifactError(f"image column {name!r} is not in the table")
        table = table.set_column(idx, pa.field(name, typ), table.column(name).cast(typ))
    if image_columns or image_list_columns:
        features: dict[str, Any] = {name: {"_type": "Image"} for name in image_columns}
        features.update({name: {"_type": "Sequence", "feature": {"_type": "Image"}} for name in image_list_columns})
        meta = dict(table.schema.metadata or {})
        meta[b"huggingface"] = json.dumps({"info": {"features": features}}).encode()
        table = table.replace_schema_metadata(meta)
    path, tmp = _atomic_target(path)
    try:
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_parquet(path: str | os.PathLike[str], *, required: Iterable[str] = ()) -> pd.DataFrame:
    """Read a stage's Parquet table, checking that the ``required`` columns are present.

    Raises:
        ArtifactError: the file is missing, unreadable, or lacks a required column (the message
            names the file and the missing columns).
    """
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: no such table (did its producing stage run?)")
    try:
        df = pq.read_table(path).to_pandas()
    except (pa.ArrowException, OSError) as exc:
        raise ArtifactError(f"{path}: cannot read Parquet ({exc})") from exc
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise ArtifactError(f"{path}: missing column(s) {missing}; has {list(df.columns)}")
    return df
