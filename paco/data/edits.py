"""Image-editing items for PaCo-GRPO's editing subtasks (paper §7): an input image and an edit
instruction per item, split into train and test.

Two sources (``edits.source``):

* ``photos`` (the embedded default): every photograph of ``edits.photos.subjects`` (shipped in
  installed wheels, :func:`paco.data.photos.load_subject`) is cut to a square view of
  ``edits.photos.size`` px and given one instruction per operation of
  :data:`OPERATIONS`, whose correct result the project computes (``target_image``): grey-scale,
  mirror, posterise, a warm or cool colour cast, a centre zoom, or replacing the subject with
  another photograph. Items are split by source photograph: ``edits.photos.test_photos``
  photographs (drawn with ``edits.seed``) give the test items, so no test photo is seen in
  training.
* ``import``: the GEdit-Bench layout (``stepfun-ai/GEdit-Bench``): a Parquet file (the
  ``datasets`` export: ``key``, ``task_type``, ``instruction``, ``instruction_language``,
  ``input_image`` as ``{bytes, path}``) or a jsonl file whose ``input_image`` is a path relative
  to the file, inside the file's folder (:func:`paco.core.io.dataset_path`: no absolute path, no
  ``..`` out of it, no symlink to elsewhere) and read with a byte bound
  (:func:`paco.core.io.image_file_byte_limit`). ``edits.import.languages`` keeps only those instruction languages,
  compared case-insensitively (the benchmark writes ``en`` / ``cn``); the rows it leaves out are
  counted per language (``skipped_by_language``). Then, as the reference's
  ``dataset/GEdit-Bench/preprocess.py``, ``random.seed(split_seed)`` +
  ``random.sample(range(n), test_items)`` pick the test items and the rest is train.
  ``target_image`` is null. ``key`` (a string, or an integer kept exactly: ``0`` is a key),
  ``instruction`` and ``input_image`` are required; ``instruction_language`` defaults to ``en``
  and ``task_type`` to empty when a row has none (the reference uses neither beyond the language
  filter). ``Intersection_exist`` (a bool, or absent: null) is kept as the column
  ``intersection_exist`` (:data:`GEDIT_COLUMNS`; GEdit-Bench's ``-I`` subset, stage ``benchmark``).

A malformed row (a missing, null or float key, a missing or blank instruction, an unreadable or
outside image, a bad language, a jsonl line that is not UTF-8 or not JSON) raises
:class:`EditsError` naming the file, the row (or line) and the reason; with ``edits.strict: false``
it is skipped and reported (``skipped``), never dropped silently. A file that is not readable
Parquet is an error naming it, whatever ``strict`` says.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageOps

from paco.core.io import (ArtifactError, ImageDecodeError, decode_image, encode_image, image_file_byte_limit, iter_text_lines,
                          read_dataset_file)
from paco.core.seeding import stable_seed
from paco.data.photos import SUBJECTS, load_subject

#: Columns of ``edits.parquet`` (``target_image`` may be null).
EDIT_COLUMNS = ("item_id", "split", "source", "subject", "task_type", "instruction", "language",
                "input_image", "target_image", "height", "width")
#: Its image columns (``datasets`` Image cells, :func:`paco.core.io.write_parquet`).
EDIT_IMAGE_COLUMNS = ("input_image", "target_image")
#: The further column of a GEdit-Bench import: the benchmark's ``Intersection_exist`` (bool, null when a
#: row has none), which selects the ``-I`` cells of its scores (``paco.benchmark.gedit_bench.aggregate``)
GEDIT_COLUMNS = ("intersection_exist",)


class EditsError(ArtifactError):
    """An editing source file or row is malformed."""


def _name(subject: str) -> str:
    return subject.replace("_", " ")


def _cast(colour: tuple[int, int, int], alpha: float) -> Callable[[Image.Image, Any], Image.Image]:
    def op(image: Image.Image, _: Any) -> Image.Image:
        return Image.blend(image, Image.new("RGB", image.size, colour), alpha)

    return op


def _zoom(image: Image.Image, _: Any) -> Image.Image:
    w, h = image.size
    box = (w // 4, h // 4, w // 4 + w // 2, h // 4 + h // 2)
    return image.crop(box).resize((w, h), Image.Resampling.LANCZOS)


@dataclass(frozen=True)
class Operation:
    """An edit whose correct result is computed: ``instruction`` (``{other}`` is the replacing
    subject's name) and ``apply(image, other_view)`` -> the edited image, same size."""

    name: str
    instruction: str
    apply: Callable[[Image.Image, Any], Image.Image]
    colour_only: bool = False  # meaningless on a grey-scale photograph


#: The embedded default's edit families.
OPERATIONS: dict[str, Operation] = {op.name: op for op in (
    Operation("greyscale", "Convert the photo to black and white.",
              lambda im, _: ImageOps.grayscale(im).convert("RGB"), colour_only=True),
    Operation("mirror", "Flip the image horizontally, as in a mirror.", lambda im, _: ImageOps.mirror(im)),
    Operation("posterise", "Posterize the photo to four tones per colour channel.",
              lambda im, _: ImageOps.posterize(im, 2)),
    Operation("warm_cast", "Give the whole photo a warm orange tint.", _cast((255, 140, 0), 0.3)),
    Operation("cool_cast", "Give the whole photo a cool blue tint.", _cast((0, 90, 255), 0.3)),
    Operation("zoom", "Zoom in on the centre: crop to the middle half and enlarge it to the full frame.", _zoom),
    Operation("replace_subject", "Replace the picture with a photo of the {other}.", lambda im, other: other),
)}


def _square_view(subject: str, size: int) -> Image.Image:
    im = load_subject(subject)
    w, h = im.size
    s = min(w, h)
    box = ((w - s) // 2, (h - s) // 2, (w - s) // 2 + s, (h - s) // 2 + s)
    return im.crop(box).resize((size, size), Image.Resampling.LANCZOS)


def photo_edits(subjects: list[str], operations: list[str], size: int, test_photos: int, seed: int
                ) -> pd.DataFrame:
    """The ``photos`` source (see the module docstring): one item per (subject, operation),
    ``colour_only`` operations skipped on grey-scale photographs.

    Raises:
        ValueError: an unknown subject or operation, fewer than two subjects, ``test_photos`` not in
            ``[1, len(subjects) - 1]``, or ``replace_subject`` with a split of one photograph (the
            replacement is another photograph of the item's split).
    """
    from paco.data.photos import GREYSCALE_SUBJECTS

    unknown = sorted(set(subjects) - set(SUBJECTS)) + sorted(set(operations) - set(OPERATIONS))
    if unknown:
        raise ValueError(f"unknown subject(s) or operation(s) {unknown}; subjects {sorted(SUBJECTS)}, "
                         f"operations {sorted(OPERATIONS)}")
    if len(subjects) < 2 or not 1 <= test_photos < len(subjects):
        raise ValueError(f"edits.photos: need >= 2 subjects and 1 <= test_photos < {len(subjects)}, "
                         f"got {len(subjects)} subjects and test_photos {test_photos}")
    if "replace_subject" in operations and min(test_photos, len(subjects) - test_photos) < 2:
        raise ValueError(f"edits.photos: replace_subject takes its replacement from the item's own split, so "
                         f"each split needs >= 2 photographs; got test_photos {test_photos} of {len(subjects)}")
    ordered = sorted(subjects)
    rng = np.random.default_rng(stable_seed(seed, "edits-split"))
    test = set(rng.choice(ordered, size=test_photos, replace=False).tolist())
    views = {s: _square_view(s, size) for s in ordered}
    rows = []
    for subject in ordered:
        for name in operations:
            op = OPERATIONS[name]
            if op.colour_only and subject in GREYSCALE_SUBJECTS:
                continue
            # the replacement comes from the same split: a training item never shows a held-out photograph
            others = [o for o in ordered if o != subject and (o in test) == (subject in test)]
            other = others[stable_seed(seed, "edits-other", subject) % len(others)] if others else subject
            edited = op.apply(views[subject], views[other])  # only replace_subject uses ``other``
            rows.append({
                "item_id": f"{subject}-{name}", "split": "test" if subject in test else "train",
                "source": "photos", "subject": subject, "task_type": name,
                "instruction": op.instruction.format(other=_name(other)), "language": "en",
                "input_image": encode_image(views[subject]), "target_image": encode_image(edited),
                "height": size, "width": size,
            })
    return pd.DataFrame(rows, columns=list(EDIT_COLUMNS))


def _parquet_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """Rows as Arrow gives them (an int column with nulls stays int and ``None``, not float)."""
    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise EditsError(f"{path}: not a readable Parquet file ({exc})") from None
    return [(f"{path}: row {i}", row) for i, row in enumerate(rows)]


def _gedit_rows(path: Path, max_pixels: int) -> list[tuple[str, dict[str, Any]]]:
    """``(where, row)`` of a GEdit-Bench Parquet or jsonl file; a jsonl image path is read as bytes
    inside the file's folder; a row that cannot be read is ``{"_error": reason}``.

    Raises:
        EditsError: a Parquet file that cannot be read, a jsonl file that cannot be opened.
    """
    if path.suffix == ".parquet":
        return _parquet_rows(path)
    try:
        lines = list(iter_text_lines(path))
    except OSError as exc:
        raise EditsError(f"{path}: cannot read ({exc.strerror or exc})") from None
    rows = []
    for line_no, line, error in lines:
        where = f"{path}: line {line_no}"
        if error is not None:
            rows.append((where, {"_error": error}))
            continue
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            rows.append((where, {"_error": f"not JSON ({exc})"}))
            continue
        if not isinstance(row, dict):
            rows.append((where, {"_error": "not a JSON object"}))
            continue
        image = row.get("input_image")
        if isinstance(image, str):
            try:
                data = read_dataset_file(path.parent, image, what="input_image", max_bytes=image_file_byte_limit(max_pixels))
                row = {**row, "input_image": {"bytes": data, "path": image}}
            except ArtifactError as exc:  # outside the folder, not a regular file, too large, unreadable
                row = {"_error": str(exc)}
        rows.append((where, row))
    return rows


def _gedit_key(where: str, row: dict[str, Any]) -> str:
    """The row's ``key`` as an exact id: a string (stripped) or an integer (``0`` included)."""
    key = row.get("key")
    if key is None:
        raise EditsError(f"{where}: missing key ({'null' if 'key' in row else 'no key field'})")
    if isinstance(key, float):
        raise EditsError(f"{where}: key {key!r} is a float; GEdit-Bench keys are strings (integers are kept as "
                         f"they are)")
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise EditsError(f"{where}: key {key!r:.40} is a {type(key).__name__}, not a string or an integer")
    if not str(key).strip():
        raise EditsError(f"{where}: missing key (blank)")
    return str(key).strip()


def _gedit_item(where: str, row: dict[str, Any], max_pixels: int) -> dict[str, Any]:
    if "_error" in row:
        raise EditsError(f"{where}: {row['_error']}")
    key = _gedit_key(where, row)
    instruction = row.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        raise EditsError(f"{where}: missing or blank instruction")
    language = row.get("instruction_language", "en")
    if not isinstance(language, str) or not language.strip():
        raise EditsError(f"{where}: instruction_language must be a non-empty string, got {language!r}")
    cell = row.get("input_image")
    if cell is None:
        raise EditsError(f"{where}: no input_image")
    try:
        image = decode_image(cell, what=f"{where} input_image", max_pixels=max_pixels)
    except ImageDecodeError as exc:
        raise EditsError(str(exc)) from None
    path = cell.get("path") if isinstance(cell, dict) else None
    task_type = row.get("task_type")
    inter = row.get("Intersection_exist", row.get("intersection_exist"))
    if inter is not None and not isinstance(inter, bool):  # a string would be truthy in the official statistics
        raise EditsError(f"{where}: Intersection_exist must be a bool, got {inter!r:.40}")
    return {"item_id": key, "source": "gedit", "subject": "", "task_type": "" if task_type is None else str(task_type),
            "instruction": instruction.strip(), "language": language.strip(),
            "input_image": encode_image(image, path if isinstance(path, str) else None),
            "target_image": None, "height": image.height, "width": image.width, "intersection_exist": inter}


@dataclass
class ImportResult:
    """The imported items, the rows skipped as malformed (``strict: false``: ``{"where", "reason"}``)
    and the rows left out by ``languages`` (lower-cased language -> count)."""

    table: pd.DataFrame
    skipped: list[dict[str, str]]
    skipped_by_language: dict[str, int] = field(default_factory=dict)


def import_gedit(path: str | Path, *, languages: list[str] | None, test_items: int, split_seed: int,
                 strict: bool, max_pixels: int) -> ImportResult:
    """The ``import`` source (see the module docstring).

    Raises:
        EditsError: a missing file, a Parquet file that cannot be read, a malformed row or line
            (``strict``), duplicate keys, no item, or fewer items than ``test_items``.
    """
    path = Path(path)
    if not path.is_file():
        raise EditsError(f"edits.import.path: {path} is not a file (GEdit-Bench .parquet or .jsonl)")
    wanted = None if languages is None else {lang.strip().casefold() for lang in languages}
    items, skipped, by_language = [], [], Counter()
    for where, row in _gedit_rows(path, max_pixels):
        try:
            item = _gedit_item(where, row, max_pixels)
        except EditsError as exc:
            if strict:
                raise
            skipped.append({"where": where, "reason": str(exc)})
            continue
        if wanted is None or item["language"].casefold() in wanted:
            items.append(item)
        else:
            by_language[item["language"].casefold()] += 1
    if not items:
        raise EditsError(f"{path}: no editing item (languages {languages}, {sum(by_language.values())} left out by "
                         f"language, {len(skipped)} rows skipped)")
    keys = [it["item_id"] for it in items]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise EditsError(f"{path}: duplicate keys {dupes[:5]}")
    if test_items > len(items):
        raise EditsError(f"{path}: {len(items)} items, fewer than edits.import.test_items {test_items}")
    test = set(random.Random(split_seed).sample(range(len(items)), test_items))  # the reference's split
    for i, item in enumerate(items):
        item["split"] = "test" if i in test else "train"
    return ImportResult(pd.DataFrame(items, columns=list(EDIT_COLUMNS + GEDIT_COLUMNS)), skipped,
                        dict(sorted(by_language.items())))
