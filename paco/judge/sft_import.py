"""Judge SFT data imported as published: the LLaMA-Factory dataset layout of PaCo-Dataset.

The authors train PaCo-Reward with LLaMA-Factory on ``dataset_dir: PaCo-Dataset`` and
``dataset: consistency_reward_cot_train, sharegpt_editing_cot`` (the released
``PaCo-Reward/config/paco_reward_lora.yaml``): the second set holds the 5,695 verified
consistent ShareGPT-4o-Image editing pairs (paper §3.1) with their reasons. This module reads
any such set as LLaMA-Factory does (its ``data/README.md``):

* ``<dataset_dir>/dataset_info.json`` maps a dataset name to ``file_name`` (a ``.json`` list, a
  ``.jsonl`` file, a ``.parquet`` file, or a folder of them, read in sorted order),
  ``formatting`` (``sharegpt`` or ``alpaca``; ``ranking`` sets are refused), ``columns`` and, for
  ``sharegpt``, ``tags``, with LLaMA-Factory's defaults (``conversations``; ``from`` / ``value``;
  ``human`` / ``gpt`` / ``system``).
* A row is one user turn and one assistant turn (a leading system turn is dropped). The user turn
  starts with one ``<image>`` token per entry of the ``images`` column, and the judge takes
  exactly two: the first image is ``image_a``, the second ``image_b``, and the text after the
  tokens is the row's question (``instruction``). Images are paths relative to ``dataset_dir``
  or ``{"bytes", "path"}`` cells (Parquet); they are decoded (EXIF orientation applied, alpha
  flattened: :func:`paco.core.io.decode_image`) and stored as PNG (:func:`paco.core.io.encode_image`,
  the published path kept as the cell's ``path``), as every image cell of the pipeline.
* Every file the dataset names (``file_name``, the files of a ``file_name`` folder, image paths)
  must be a regular file inside ``dataset_dir`` once symlinks are followed
  (:func:`paco.core.io.dataset_path`): an absolute path, ``..`` out of the folder or a symlink to
  elsewhere is refused, since the stage declares only the folder as its input. An image file is
  read with a byte bound (:func:`paco.core.io.image_file_byte_limit`), so a device or a huge file is never read whole.
* The assistant turn is the SFT target as it is (``Yes. <reason>...</reason>``); its first word
  gives the ``label`` (:func:`paco.judge.response.parse_response`). It must start with ``Yes`` or
  ``No`` itself: the judge's reward reads the first token, and leading whitespace would make that
  token a space (LLaMA-Factory trains on the text as it is).

Each imported row becomes an SFT row (:data:`paco.judge.reasons.SFT_COLUMNS`) of the training
split with ``teacher`` ``import:<dataset>``, ``task`` as the params say for that dataset
(``t2is``, ``edit_pf`` or ``edit_sc``; :mod:`paco.judge.sft_data` never augments editing rows) and
``pair_id`` ``import-<dataset>-<row:06d>``. A malformed row is an :class:`SFTImportError` naming
the file and row, or with ``strict: false`` a skip counted with its reason. A malformed
``dataset_info.json`` entry or a data file that cannot be read (or lies outside the folder) is
always an error naming the dataset and the file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from paco.core.io import (ArtifactError, OutsideDatasetError, dataset_path, decode_image, encode_image,
                          image_file_byte_limit, iter_text_lines, read_dataset_file)
from paco.judge.response import NO, YES, parse_response

#: LLaMA-Factory's defaults (data/README.md)
_SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                  "system_tag": "system"}
_SHAREGPT_COLUMNS = {"messages": "conversations"}
_ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output"}
_SUFFIXES = (".json", ".jsonl", ".parquet")
_LEADING_IMAGES = re.compile(r"^\s*((?:<image>\s*)*)")
_ANSWER_FIRST = re.compile(rf"(?:{YES}|{NO})\b")
TASKS = ("t2is", "edit_pf", "edit_sc")


class SFTImportError(ArtifactError):
    """A LLaMA-Factory dataset or one of its rows cannot be imported (the message names which)."""


@dataclass
class SFTImport:
    """The imported SFT rows (``SFT_COLUMNS``) and what was skipped (``strict: false``)."""

    table: pd.DataFrame
    rows: dict[str, int] = field(default_factory=dict)     # dataset -> rows imported
    skipped: list[dict[str, str]] = field(default_factory=list)  # {"dataset", "where", "reason"}


def _dataset_info(dataset_dir: Path) -> dict[str, Any]:
    path = dataset_dir / "dataset_info.json"
    if not path.exists() and not path.is_symlink():
        raise SFTImportError(f"{path} does not exist: a LLaMA-Factory dataset_dir holds dataset_info.json "
                             f"(PaCo-Dataset: `hf download X-GenGroup/PaCo-Dataset --repo-type dataset`)")
    try:
        path = dataset_path(dataset_dir, "dataset_info.json", what=str(dataset_dir))
    except ArtifactError as exc:
        raise SFTImportError(str(exc)) from None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SFTImportError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(info, dict):
        raise SFTImportError(f"{path}: expected an object of dataset descriptions")
    return info


def _string_map(label: str, entry: Mapping[str, Any], key: str, what: str) -> dict[str, str]:
    value = entry.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                 for k, v in value.items()):
        raise SFTImportError(f"{label}: {key!r} must be an object of {what} (name -> non-empty "
                             f"string), got {value!r:.80}")
    return dict(value)


@dataclass(frozen=True)
class _Layout:
    """A dataset entry's formatting, columns and tags, checked, over LLaMA-Factory's defaults."""

    alpaca: bool
    columns: dict[str, str]
    tags: dict[str, str]


def _layout(label: str, entry: Mapping[str, Any]) -> _Layout:
    """Raises SFTImportError (naming ``label``): an unknown formatting, ``columns`` / ``tags`` that
    are not objects of names."""
    formatting = entry.get("formatting", "alpaca")  # LLaMA-Factory's default formatting
    if formatting not in ("alpaca", "sharegpt"):
        raise SFTImportError(f"{label}: formatting {formatting!r} (alpaca | sharegpt)")
    alpaca = formatting == "alpaca"
    columns = {**(_ALPACA_COLUMNS if alpaca else _SHAREGPT_COLUMNS), "images": "images",
               **_string_map(label, entry, "columns", "column names")}
    tags = {**_SHAREGPT_TAGS, **_string_map(label, entry, "tags", "tag names")}
    return _Layout(alpaca, columns, tags)


def _folder_names(dataset_dir: Path, file_name: str, what: str) -> list[str]:
    """The data files under folder ``file_name``, as names relative to ``dataset_dir``, sorted."""
    folder = dataset_dir / file_name
    names = []
    for root, dirs, files in os.walk(folder):
        sub = Path(file_name) / Path(root).relative_to(folder)
        for d in dirs:
            if (Path(root) / d).is_symlink():  # os.walk would not enter it: never a silent gap
                raise SFTImportError(f"{what}: {(sub / d).as_posix()!r} is a symlinked folder; copy its files "
                                     f"into the dataset folder")
        names += [(sub / f).as_posix() for f in files if Path(f).suffix in _SUFFIXES]
    return sorted(names, key=lambda n: dataset_dir / n)


def _files(dataset_dir: Path, name: str, entry: Mapping[str, Any]) -> list[tuple[Path, Path]]:
    """``(path as the dataset names it, resolved path)`` of each data file of a dataset.

    Raises:
        SFTImportError: a remote-only dataset, no ``file_name``, a file or folder outside
            ``dataset_dir`` (absolute, ``..``, a symlink) or a file of the folder that is, a
            missing file, a folder with no data file, or an unknown suffix.
    """
    remote = [k for k in ("hf_hub_url", "ms_hub_url", "script_url", "cloud_file_name") if entry.get(k)]
    if remote and not entry.get("file_name"):
        raise SFTImportError(f"dataset {name!r} is remote ({remote[0]}: {entry[remote[0]]!r}); download it and "
                             f"describe it with file_name")
    file_name = entry.get("file_name")
    if not isinstance(file_name, str) or not file_name:
        raise SFTImportError(f"dataset {name!r}: no file_name in dataset_info.json")
    what = f"dataset {name!r} file_name"
    path = dataset_dir / file_name
    try:
        base, target = dataset_dir.resolve(), path.resolve()
        if Path(file_name).is_absolute() or not target.is_dir():
            real = dataset_path(dataset_dir, file_name, what=what)
            if path.suffix not in _SUFFIXES:
                raise SFTImportError(f"dataset {name!r}: {path} is not {'/'.join(_SUFFIXES)}")
            return [(path, real)]
        if not target.is_relative_to(base):
            raise OutsideDatasetError(f"{what}: {file_name!r} leads outside the dataset folder {base} (to {target}); "
                                      f"copy the files into the folder")
        files = [(dataset_dir / n, dataset_path(dataset_dir, n, what=what)) for n in
                 _folder_names(dataset_dir, file_name, what)]
    except SFTImportError:
        raise
    except ArtifactError as exc:  # OutsideDatasetError included
        raise SFTImportError(str(exc)) from None
    if not files:
        raise SFTImportError(f"dataset {name!r}: {path} holds no {'/'.join(_SUFFIXES)} file")
    return files


def _records(shown: Path, path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` of one data file (``path``, named ``shown`` in messages); a row that is not
    JSON is ``(where, SFTImportError)``.

    Raises:
        SFTImportError: the file is not readable Parquet / JSON, or a ``.json`` file is not a list.
    """
    if path.suffix == ".parquet":
        try:
            df = pd.read_parquet(path)
        except Exception as exc:  # pyarrow raises several types for a bad file
            raise SFTImportError(f"{shown}: not a readable Parquet file ({exc})") from None
        for i, row in enumerate(df.to_dict("records")):
            yield f"{shown}: row {i}", row
    elif path.suffix == ".jsonl":
        try:
            lines = list(iter_text_lines(path))
        except OSError as exc:
            raise SFTImportError(f"{shown}: cannot read ({exc.strerror or exc})") from None
        for line_no, text, error in lines:
            where = f"{shown}: line {line_no}"
            if error is not None:
                yield where, SFTImportError(f"{where}: {error}")
            elif text.strip():
                try:
                    yield where, json.loads(text)
                except json.JSONDecodeError as exc:
                    yield where, SFTImportError(f"{where}: not JSON ({exc})")
    else:
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SFTImportError(f"{shown}: not readable JSON ({exc})") from None
        if not isinstance(rows, list):
            raise SFTImportError(f"{shown}: a .json dataset is a list of rows")
        for i, row in enumerate(rows):
            yield f"{shown}: row {i}", row


def _listish(value: Any) -> list[Any] | None:
    if isinstance(value, list):
        return value
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # numpy arrays from Parquet
        out = value.tolist()
        return out if isinstance(out, list) else None
    return None


def _turns(where: str, row: Mapping[str, Any], layout: _Layout) -> tuple[str, str]:
    """(user text, assistant text) of a row."""
    columns, tags = layout.columns, layout.tags
    if layout.alpaca:
        prompt, query, response = (row.get(columns[k]) for k in ("prompt", "query", "response"))
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise SFTImportError(f"{where}: alpaca row needs string {columns['prompt']!r} and {columns['response']!r}")
        user = prompt if not isinstance(query, str) or not query else f"{prompt}\n{query}"
        return user, response
    messages = _listish(row.get(columns["messages"]))
    if messages is None:
        raise SFTImportError(f"{where}: no message list in column {columns['messages']!r}")
    turns = []
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get(tags["content_tag"]), str):
            raise SFTImportError(f"{where}: a message is not an object with a string {tags['content_tag']!r}")
        turns.append((m.get(tags["role_tag"]), m[tags["content_tag"]]))
    if turns and turns[0][0] == tags["system_tag"]:
        turns = turns[1:]
    roles = [r for r, _ in turns]
    if roles != [tags["user_tag"], tags["assistant_tag"]]:
        raise SFTImportError(f"{where}: expected one {tags['user_tag']!r} turn then one {tags['assistant_tag']!r} "
                             f"turn, got roles {roles}")
    return turns[0][1], turns[1][1]


def _image_cell(where: str, k: int, value: Any, dataset_dir: Path, max_pixels: int | None) -> dict[str, Any]:
    """Image ``k`` (1-based) of a row as a PNG cell of its decoded pixels."""
    what = f"{where}: image {k}"
    try:
        if isinstance(value, str):
            path = value
            data = read_dataset_file(dataset_dir, value, what=what, max_bytes=image_file_byte_limit(max_pixels))
        elif isinstance(value, Mapping) and value.get("bytes") is not None:
            data, path = value["bytes"], value.get("path")
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise SFTImportError(f"{what}: the cell's bytes are {type(data).__name__}, not binary")
            if path is not None and not isinstance(path, str):
                raise SFTImportError(f"{what}: the cell's path is {type(path).__name__}, not a string")
        else:
            raise SFTImportError(f"{what}: neither a path nor a {{bytes, path}} cell: {value!r:.80}")
        image = decode_image(bytes(data), what=f"{what} {path!r}", max_pixels=max_pixels)
    except SFTImportError:
        raise
    except ArtifactError as exc:  # outside the folder, not a file, too large, not decodable
        raise SFTImportError(str(exc)) from None
    return encode_image(image, path)


def import_row(where: str, row: Any, entry: Mapping[str, Any], dataset_dir: Path,
               max_pixels: int | None = None) -> dict[str, Any]:
    """One LLaMA-Factory row as ``{instruction, image_a, image_b, label, reasons, response}``.

    Raises:
        SFTImportError: a malformed ``entry`` (formatting, columns, tags); a row that is not an
            object, not one user + one assistant turn, not exactly two ``<image>`` tokens leading
            the user turn and two images; an image path outside ``dataset_dir`` (or not a regular
            file, or over :func:`paco.core.io.image_file_byte_limit`); an image that does not decode (or has more
            than ``max_pixels``); a target that does not start with ``Yes`` / ``No`` (leading
            whitespace included).
    """
    if isinstance(row, Exception):
        raise row
    if not isinstance(row, Mapping):
        raise SFTImportError(f"{where}: not a JSON object")
    layout = _layout(where, entry)
    user, assistant = _turns(where, row, layout)
    images_col = layout.columns["images"]
    images = _listish(row.get(images_col))
    if images is None or len(images) != 2:
        raise SFTImportError(f"{where}: the judge takes two images; column {images_col!r} holds "
                             f"{'none' if images is None else len(images)}")
    lead = _LEADING_IMAGES.match(user)
    question = user[lead.end():].strip()
    if lead.group(1).count("<image>") != 2 or "<image>" in question:
        raise SFTImportError(f"{where}: the user turn must start with the two <image> tokens "
                             f"(found {user.count('<image>')}, {lead.group(1).count('<image>')} leading)")
    if not question:
        raise SFTImportError(f"{where}: the user turn has no question after its images")
    label, reasons = parse_response(assistant)
    if label is None:
        raise SFTImportError(f"{where}: the target does not start with Yes or No: {assistant[:80]!r}")
    if not _ANSWER_FIRST.match(assistant):
        raise SFTImportError(f"{where}: the target must start with {YES!r} or {NO!r} itself (the reward reads its "
                             f"first token), not with whitespace: {assistant[:80]!r}")
    cells = [_image_cell(where, k, v, dataset_dir, max_pixels) for k, v in enumerate(images, 1)]
    return {"instruction": question, "image_a": cells[0], "image_b": cells[1], "label": bool(label),
            "reasons": list(reasons), "response": assistant}


def _check_entry(info: Mapping[str, Any], dataset_dir: Path, name: str, task: str) -> Mapping[str, Any]:
    if task not in TASKS:
        raise SFTImportError(f"dataset {name!r}: task {task!r} is not one of {TASKS}")
    entry = info.get(name)
    if not isinstance(entry, Mapping):
        raise SFTImportError(f"dataset {name!r} is not in {dataset_dir / 'dataset_info.json'} "
                             f"(it has {sorted(info)[:20]})")
    if entry.get("ranking"):
        raise SFTImportError(f"dataset {name!r} is a ranking (preference) dataset; the judge's SFT takes "
                             f"supervised rows")
    _layout(f"dataset {name!r}", entry)
    return entry


def import_sft(dataset_dir: str | Path, datasets: Mapping[str, str], *, strict: bool = True,
               max_pixels: int | None = None) -> SFTImport:
    """The SFT rows of the named LLaMA-Factory datasets of ``dataset_dir`` (module docstring).

    Args:
        dataset_dir: the folder holding ``dataset_info.json`` (PaCo-Dataset after ``decompress.sh``).
        datasets: dataset name -> task of its rows (``t2is`` | ``edit_pf`` | ``edit_sc``), in the
            order to import.
        strict: raise on the first malformed row; ``False`` skips it and records the reason.
        max_pixels: refuse images with more pixels (``None``: Pillow's guard); image files are
            read with :func:`paco.core.io.image_file_byte_limit` of it.

    Returns:
        :class:`SFTImport`: rows in ``SFT_COLUMNS`` order, sorted by ``pair_id``.

    Raises:
        SFTImportError: a missing or malformed ``dataset_info.json``, an unknown dataset name, a
            remote-only, ranking or unknown-format dataset, ``columns`` / ``tags`` that are not
            objects of names, an unknown task, a data file that is missing, unreadable or outside
            ``dataset_dir``, a malformed row (``strict``; see :func:`import_row`), or a dataset
            with no importable row.
    """
    from paco.judge.reasons import SFT_COLUMNS

    dataset_dir = Path(dataset_dir)
    info = _dataset_info(dataset_dir)
    out = SFTImport(table=pd.DataFrame(columns=SFT_COLUMNS))
    records = []
    for name, task in datasets.items():
        entry = _check_entry(info, dataset_dir, name, task)
        n = position = 0
        for shown, path in _files(dataset_dir, name, entry):
            for where, row in _records(shown, path):
                index, position = position, position + 1  # the row's place in the dataset, skips included
                try:
                    got = import_row(where, row, entry, dataset_dir, max_pixels)
                except SFTImportError as exc:
                    if strict:
                        raise
                    out.skipped.append({"dataset": name, "where": where, "reason": str(exc)})
                    continue
                pid = f"import-{name}-{index:06d}"
                records.append({"pair_id": pid, "instance_id": pid, "prompt_id": f"import-{name}", "split": "train",
                                "task": task, **got, "teacher": f"import:{name}", "status": "ok", "error": None,
                                "attempts": 0})
                n += 1
        if n == 0:
            raise SFTImportError(f"dataset {name!r}: no importable row ({position} skipped)")
        out.rows[name] = n
    out.table = pd.DataFrame(records, columns=SFT_COLUMNS).sort_values("pair_id", ignore_index=True)
    return out
