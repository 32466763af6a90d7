"""Artifact I/O shared by every stage: Parquet tables with embedded images, atomic writes.

Image columns follow the Hugging Face ``datasets`` ``Image`` feature convention: a Parquet
``struct<bytes: binary, path: string>`` whose ``bytes`` hold a PNG file, so every table is
self-contained and ``datasets.load_dataset("parquet", ...)`` decodes it as images
(docs/architecture.md §3).

Every writer here is atomic: it writes to a temporary file in the destination directory and
``os.replace``-s it into place, so an interrupted stage never leaves a half-written artifact.
"""

from __future__ import annotations

import io
import json
import os
import re
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageOps, UnidentifiedImageError

#: Arrow type of an image cell (``datasets.Image`` storage type).
IMAGE_TYPE = pa.struct([pa.field("bytes", pa.binary()), pa.field("path", pa.string())])

#: Colour (RGB, 0-255) that partly transparent pixels are composited onto when an image with an
#: alpha channel (``RGBA``, ``LA``, ``PA``, or a palette/greyscale/RGB image with a
#: ``transparency`` entry) is decoded or encoded: white, the page colour of a printed image set.
ALPHA_BACKGROUND: tuple[int, int, int] = (255, 255, 255)

_MODES_16BIT = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})


class ArtifactError(ValueError):
    """A stage input is missing, malformed or inconsistent with its contract."""


class ImageDecodeError(ArtifactError):
    """An image cell could not be decoded (corrupt, truncated or not an image)."""


class ImageTooLargeError(ImageDecodeError):
    """An image has more pixels than allowed (a decompression-bomb guard); nothing was decoded."""


class UnsupportedImageModeError(ImageDecodeError):
    """An image's pixel mode has no faithful 8-bit RGB rendering (e.g. 32-bit float ``F``)."""


class OutsideDatasetError(ArtifactError):
    """A file named inside a dataset (a manifest entry, a row's image path, a shard) leads outside
    the dataset's folder: absolute, through ``..``, or through a symlink. Such a file is no
    declared dependency of the stage, so DVC would not see it change."""


# --------------------------------------------------------------------------------------------
# files named by a dataset
# --------------------------------------------------------------------------------------------


def dataset_path(root: str | os.PathLike[str], name: Any, *, what: str) -> Path:
    """The regular file that ``name``, as a dataset's own files write it, means inside ``root``.

    ``name`` must be a non-empty relative path (``str`` or :class:`os.PathLike`); it is joined to
    ``root`` and resolved with every symlink followed, and the result must lie inside ``root``
    (itself resolved) and be a regular file. ``sub/../a.png`` is fine; ``../a.png``,
    ``/abs/a.png``, a symlink to a file elsewhere, ``/dev/zero`` or a FIFO are not.

    Args:
        root: the dataset folder (the stage's declared dependency).
        name: the path as the dataset names it.
        what: a label for error messages, e.g. ``"manifest row 3 'file'"``.

    Returns:
        The resolved path (inside ``root.resolve()``).

    Raises:
        OutsideDatasetError: ``name`` is absolute or resolves outside ``root``.
        ArtifactError: ``name`` is not a non-empty path string, or names nothing, a folder, a
            device, a FIFO or a socket. Every message names ``what`` and ``name``.
    """
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str) or not name.strip():
        raise ArtifactError(f"{what}: expected a relative file path, got {name!r}")
    if "\x00" in name:
        raise ArtifactError(f"{what}: path {name!r} contains a NUL character")
    rel = Path(name)
    if rel.is_absolute() or rel.drive:
        raise OutsideDatasetError(f"{what}: {name!r} is an absolute path; a dataset names its files relative to "
                                  f"its folder {Path(root)}")
    base = Path(root).resolve()
    resolved = (base / rel).resolve()
    if not resolved.is_relative_to(base):
        raise OutsideDatasetError(f"{what}: {name!r} leads outside the dataset folder {base} (to {resolved}); "
                                  "copy the file into the folder")
    if not resolved.exists():
        raise ArtifactError(f"{what}: {name!r} does not exist in {base}")
    if not resolved.is_file():
        raise ArtifactError(f"{what}: {name!r} is not a regular file ({resolved})")
    return resolved


def image_file_byte_limit(max_pixels: int | None) -> int:
    """The most bytes an image file of at most ``max_pixels`` pixels is read with, for
    :func:`read_dataset_file`: 8 bytes a pixel (16-bit RGBA stored uncompressed, the most a
    decodable image of that size needs) plus 16 MiB of metadata (ICC profile, EXIF, XMP).
    ``None`` takes Pillow's own guard, ``2 * PIL.Image.MAX_IMAGE_PIXELS`` pixels."""
    pixels = int(max_pixels) if max_pixels is not None else 2 * int(Image.MAX_IMAGE_PIXELS or 89_478_485)
    return 8 * pixels + (16 << 20)


def read_dataset_file(root: str | os.PathLike[str], name: Any, *, what: str, max_bytes: int) -> bytes:
    """The bytes of :func:`dataset_path` ``(root, name)``, at most ``max_bytes`` of them.

    Raises:
        OutsideDatasetError, ArtifactError: as :func:`dataset_path`; also a file larger than
            ``max_bytes`` (checked before reading, and again while reading) or unreadable.
    """
    path = dataset_path(root, name, what=what)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise ArtifactError(f"{what}: {name!r} is {size} bytes, more than the limit of {max_bytes}")
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise ArtifactError(f"{what}: cannot read {name!r} ({exc.strerror or exc})") from exc
    if len(data) > max_bytes:
        raise ArtifactError(f"{what}: {name!r} grew past the limit of {max_bytes} bytes while read")
    return data


# --------------------------------------------------------------------------------------------
# text files
# --------------------------------------------------------------------------------------------

_NEWLINE_RE = re.compile(rb"\r\n|\r|\n")


def iter_text_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, str | None, str | None]]:
    """Yield ``(lineno, text, error)`` for every line of a UTF-8 text file (jsonl readers).

    ``lineno`` is 1-based. Lines end at ``\\n``, ``\\r\\n`` or ``\\r`` (as Python's universal
    newlines) and ``text`` has no line ending. A UTF-8 byte-order mark at the start of the file
    is removed (``utf-8-sig``). A line that is not valid UTF-8 gives ``text=None`` and ``error``
    naming the first bad byte and its 1-based byte column, so a caller can report or skip just
    that line; the other lines are unaffected.

    Raises:
        FileNotFoundError, OSError: the file cannot be read.
    """
    data = Path(path).read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    if not data:
        return
    lines = _NEWLINE_RE.split(data)
    if lines and lines[-1] == b"":  # a final newline does not start another line
        lines.pop()
    for lineno, raw in enumerate(lines, start=1):
        try:
            yield lineno, raw.decode("utf-8"), None
        except UnicodeDecodeError as exc:
            bad = raw[exc.start : exc.end]
            yield lineno, None, f"invalid UTF-8 byte(s) {bad!r} at byte column {exc.start + 1} ({exc.reason})"


# --------------------------------------------------------------------------------------------
# images
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodedImageInfo:
    """What :func:`load_image` did to turn a file into RGB pixels.

    Attributes:
        mode: the file's Pillow mode before conversion (``"RGB"``, ``"I;16"``, ``"RGBA"``, ...).
        orientation: the EXIF orientation tag that was applied (1..8; 1 = none or upright).
        rescaled_16bit: 16-bit samples were scaled to 8 bits (``round(v * 255 / 65535)``).
        alpha_flattened: the image had pixels with alpha < 255, composited onto
            :data:`ALPHA_BACKGROUND`. An alpha channel that is fully opaque is not counted.
    """

    mode: str
    orientation: int = 1
    rescaled_16bit: bool = False
    alpha_flattened: bool = False


def _has_alpha(im: Image.Image) -> bool:
    return im.mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in im.info


def _to_rgb(im: Image.Image, what: str, *, keep_l: bool = False) -> tuple[Image.Image, bool, bool]:
    """Convert a loaded image to 8-bit RGB (or ``L`` with ``keep_l``) by its real mode.

    Returns ``(image, rescaled_16bit, alpha_flattened)``.

    * ``I;16*`` (16-bit greyscale, e.g. a 16-bit PNG) and ``I`` with all values in 0..65535 (how
      older Pillow opens 16-bit PNGs): ``round(v * 255 / 65535)`` -> ``L``. Pillow's own
      ``convert`` clips these at 255, which turns a 16-bit image almost white.
    * ``I`` with values outside 0..65535 and ``F`` (float): no known range; refused.
    * alpha (see :func:`_has_alpha`): ``out = a/255 * c + (1 - a/255) * bg`` per channel with
      ``bg`` = :data:`ALPHA_BACKGROUND`, computed by Pillow's ``alpha_composite`` (integer
      arithmetic: within 1 level of the exact value); fully opaque alpha is just dropped.
    * anything else: Pillow ``convert("RGB")`` (``P``, ``1``, ``CMYK``, ``YCbCr``, ...).
    """
    rescaled = flattened = False
    if im.mode in _MODES_16BIT or im.mode == "I":
        arr = np.asarray(im).astype(np.int64)
        if arr.size and (arr.min() < 0 or arr.max() > 65535):
            raise UnsupportedImageModeError(
                f"{what}: mode {im.mode!r} image with values in [{arr.min()}, {arr.max()}] is not "
                "16-bit greyscale (0..65535); convert it to 8-bit or 16-bit first"
            )
        im = Image.fromarray(np.rint(arr * (255.0 / 65535.0)).astype(np.uint8), mode="L")
        rescaled = True
    elif im.mode == "F":
        raise UnsupportedImageModeError(
            f"{what}: mode 'F' (32-bit float) image has no defined value range; convert it to "
            "8-bit or 16-bit first"
        )
    if _has_alpha(im):
        rgba = im.convert("RGBA")
        if rgba.getextrema()[3][0] < 255:
            bg = Image.new("RGBA", rgba.size, (*ALPHA_BACKGROUND, 255))
            rgba = Image.alpha_composite(bg, rgba)
            flattened = True
        return rgba.convert("RGB"), rescaled, flattened
    if keep_l and im.mode == "L":
        return im, rescaled, flattened
    return (im if im.mode == "RGB" else im.convert("RGB")), rescaled, flattened


def encode_image(image: Image.Image, path: str | None = None) -> dict[str, Any]:
    """Encode a PIL image as an image cell ``{"bytes": PNG bytes, "path": path}``.

    PNG is lossless, so ``decode_image(encode_image(im))`` returns the same pixels. ``RGB`` and
    greyscale ``L`` are stored as they are; other modes are converted as :func:`load_image`
    does (16-bit scaled to 8-bit, alpha composited onto :data:`ALPHA_BACKGROUND`).

    Raises:
        UnsupportedImageModeError: a float (``F``) or out-of-range ``I`` image.
    """
    if image.mode not in ("RGB", "L"):
        image, _, _ = _to_rgb(image, "image to encode", keep_l=True)
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False, compress_level=1)
    return {"bytes": buf.getvalue(), "path": path}


def load_image(
    cell: Mapping[str, Any] | bytes | None, *, what: str = "image", max_pixels: int | None = None
) -> tuple[Image.Image, DecodedImageInfo]:
    """Decode an image cell (or raw encoded bytes) into a fully loaded 8-bit RGB PIL image.

    The image is decoded by its real mode and orientation: the EXIF orientation tag is applied
    (``PIL.ImageOps.exif_transpose``), 16-bit greyscale is scaled to 8 bits and alpha is
    composited onto :data:`ALPHA_BACKGROUND` (details in :class:`DecodedImageInfo`).

    Args:
        cell: ``{"bytes": ..., "path": ...}`` as stored in Parquet, or the raw bytes.
        what: a label for error messages, e.g. ``"composite c-001"``.
        max_pixels: refuse images with more than this many pixels (width x height), checked
            from the header before any pixel is decoded. ``None``: Pillow's own guard
            (``2 * PIL.Image.MAX_IMAGE_PIXELS``, about 179 Mpx). Pillow's guard also applies
            when ``max_pixels`` is larger.

    Returns:
        ``(image, info)``: an ``RGB`` image of the (oriented) size, and what was done to it.

    Raises:
        ImageTooLargeError: more pixels than ``max_pixels`` or Pillow's guard allows.
        UnsupportedImageModeError: a mode with no defined 8-bit rendering (``F``, ``I`` outside
            0..65535).
        ImageDecodeError: the cell is empty, truncated, or not a decodable image. Every message
            names ``what``.
    """
    data = cell.get("bytes") if isinstance(cell, Mapping) else cell
    if not data:
        raise ImageDecodeError(f"{what}: image cell has no bytes")
    try:
        with warnings.catch_warnings():
            if max_pixels is not None:  # our limit replaces Pillow's warning threshold
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                n = im.width * im.height
                if max_pixels is not None and n > max_pixels:
                    raise ImageTooLargeError(
                        f"{what}: image is {im.width}x{im.height} = {n} pixels, more than "
                        f"max_pixels={max_pixels}"
                    )
                return render_rgb(im, what)
    except Image.DecompressionBombError as exc:
        raise ImageTooLargeError(f"{what}: image too large for Pillow's decompression-bomb guard ({exc})") from exc
    except ImageDecodeError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, TypeError, KeyError) as exc:
        raise ImageDecodeError(f"{what}: cannot decode image ({exc})") from exc


def render_rgb(im: Image.Image, what: str = "image") -> tuple[Image.Image, DecodedImageInfo]:
    """The 8-bit RGB rendering of an opened image, as :func:`load_image` renders every file:
    decoded in full, the EXIF orientation applied, 16-bit greyscale scaled, alpha composited
    onto :data:`ALPHA_BACKGROUND`. For callers that open images themselves (the judge server
    opens with one Pillow plugin and bounds pixels from the headers first).

    Raises:
        UnsupportedImageModeError: a mode with no defined 8-bit rendering.
        OSError, SyntaxError, ValueError: Pillow's decoder on truncated or corrupt data
            (:func:`load_image` turns them into :class:`ImageDecodeError`).
    """
    im.load()  # forces a full decode: truncated files raise here, not later
    mode = im.mode
    orientation = int(im.getexif().get(0x0112, 1) or 1)
    if orientation != 1:
        im = ImageOps.exif_transpose(im)
    rgb, rescaled, flattened = _to_rgb(im, what)
    info = DecodedImageInfo(
        mode=mode, orientation=orientation if 1 <= orientation <= 8 else 1,
        rescaled_16bit=rescaled, alpha_flattened=flattened,
    )
    return rgb, info


def decode_image(
    cell: Mapping[str, Any] | bytes | None, *, what: str = "image", max_pixels: int | None = None
) -> Image.Image:
    """Decode an image cell (or raw encoded bytes) into a fully loaded RGB PIL image.

    :func:`load_image` without the report: EXIF orientation applied, 16-bit greyscale scaled to
    8 bits, alpha composited onto :data:`ALPHA_BACKGROUND`.

    Args:
        cell: ``{"bytes": ..., "path": ...}`` as stored in Parquet, or the raw bytes.
        what: a label for error messages, e.g. ``"composite c-001"``.
        max_pixels: see :func:`load_image`.

    Raises:
        ImageDecodeError: the cell is empty, truncated, or not a decodable image (subclasses
            :class:`ImageTooLargeError`, :class:`UnsupportedImageModeError`). The message
            names ``what``.
    """
    return load_image(cell, what=what, max_pixels=max_pixels)[0]


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
