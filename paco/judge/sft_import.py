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
  (or absolute, or ``{"bytes", "path"}`` cells in Parquet); their bytes are kept as published
  after a full decode check.
* The assistant turn is the SFT target as it is (``Yes. <reason>...</reason>``); its first word
  gives the ``label`` (:func:`paco.judge.response.parse_response`).

Each imported row becomes an SFT row (:data:`paco.judge.reasons.SFT_COLUMNS`) of the training
split with ``teacher`` ``import:<dataset>``, ``task`` as the params say for that dataset
(``t2is``, ``edit_pf`` or ``edit_sc``; :mod:`paco.judge.sft_data` never augments editing rows) and
``pair_id`` ``import-<dataset>-<row:06d>``. A malformed row is an :class:`SFTImportError` naming
the file and row, or with ``strict: false`` a skip counted with its reason.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from paco.core.io import ArtifactError, ImageDecodeError, decode_image, iter_text_lines
from paco.judge.response import parse_response

#: LLaMA-Factory's defaults (data/README.md)
_SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                  "system_tag": "system"}
_SHAREGPT_COLUMNS = {"messages": "conversations"}
_ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output"}
_SUFFIXES = (".json", ".jsonl", ".parquet")
_LEADING_IMAGES = re.compile(r"^\s*((?:<image>\s*)*)")
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
    if not path.is_file():
        raise SFTImportError(f"{path} does not exist: a LLaMA-Factory dataset_dir holds dataset_info.json "
                             f"(PaCo-Dataset: `hf download X-GenGroup/PaCo-Dataset --repo-type dataset`)")
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SFTImportError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(info, dict):
        raise SFTImportError(f"{path}: expected an object of dataset descriptions")
    return info


def _files(dataset_dir: Path, name: str, entry: Mapping[str, Any]) -> list[Path]:
    remote = [k for k in ("hf_hub_url", "ms_hub_url", "script_url", "cloud_file_name") if entry.get(k)]
    if remote and not entry.get("file_name"):
        raise SFTImportError(f"dataset {name!r} is remote ({remote[0]}: {entry[remote[0]]!r}); download it and "
                             f"describe it with file_name")
    file_name = entry.get("file_name")
    if not isinstance(file_name, str) or not file_name:
        raise SFTImportError(f"dataset {name!r}: no file_name in dataset_info.json")
    path = dataset_dir / file_name
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _SUFFIXES)
        if not files:
            raise SFTImportError(f"dataset {name!r}: {path} holds no {'/'.join(_SUFFIXES)} file")
        return files
    if not path.is_file():
        raise SFTImportError(f"dataset {name!r}: {path} does not exist")
    if path.suffix not in _SUFFIXES:
        raise SFTImportError(f"dataset {name!r}: {path} is not {'/'.join(_SUFFIXES)}")
    return [path]


def _records(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` of one data file; a row that is not JSON is ``(where, SFTImportError)``."""
    if path.suffix == ".parquet":
        try:
            df = pd.read_parquet(path)
        except Exception as exc:  # pyarrow raises several types for a bad file
            raise SFTImportError(f"{path}: not a readable Parquet file ({exc})") from None
        for i, row in enumerate(df.to_dict("records")):
            yield f"{path}: row {i}", row
    elif path.suffix == ".jsonl":
        for line_no, text, error in iter_text_lines(path):
            where = f"{path}: line {line_no}"
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
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SFTImportError(f"{path}: not readable JSON ({exc})") from None
        if not isinstance(rows, list):
            raise SFTImportError(f"{path}: a .json dataset is a list of rows")
        for i, row in enumerate(rows):
            yield f"{path}: row {i}", row


def _listish(value: Any) -> list[Any] | None:
    if isinstance(value, list):
        return value
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # numpy arrays from Parquet
        out = value.tolist()
        return out if isinstance(out, list) else None
    return None


def _turns(where: str, row: Mapping[str, Any], entry: Mapping[str, Any]) -> tuple[str, str]:
    """(user text, assistant text) of a row."""
    alpaca = entry.get("formatting", "alpaca") == "alpaca"  # LLaMA-Factory's default formatting
    columns = {**(_ALPACA_COLUMNS if alpaca else _SHAREGPT_COLUMNS), **(entry.get("columns") or {})}
    if alpaca:
        prompt, query, response = (row.get(columns[k]) for k in ("prompt", "query", "response"))
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise SFTImportError(f"{where}: alpaca row needs string {columns['prompt']!r} and {columns['response']!r}")
        user = prompt if not isinstance(query, str) or not query else f"{prompt}\n{query}"
        return user, response
    tags = {**_SHAREGPT_TAGS, **(entry.get("tags") or {})}
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


def _image_cell(where: str, value: Any, dataset_dir: Path, max_pixels: int | None) -> dict[str, Any]:
    if isinstance(value, Mapping) and value.get("bytes"):
        cell = {"bytes": bytes(value["bytes"]), "path": value.get("path")}
    elif isinstance(value, str) and value:
        path = Path(value) if Path(value).is_absolute() else dataset_dir / value
        try:
            cell = {"bytes": path.read_bytes(), "path": value}
        except OSError as exc:
            raise SFTImportError(f"{where}: image {value!r}: {exc.strerror or exc}") from None
    else:
        raise SFTImportError(f"{where}: an image is neither a path nor a {{bytes, path}} cell: {value!r:.80}")
    try:
        decode_image(cell, what=f"{where} image {cell['path']!r}", max_pixels=max_pixels)
    except ImageDecodeError as exc:
        raise SFTImportError(str(exc)) from None
    return cell


def import_row(where: str, row: Any, entry: Mapping[str, Any], dataset_dir: Path,
               max_pixels: int | None = None) -> dict[str, Any]:
    """One LLaMA-Factory row as ``{instruction, image_a, image_b, label, reasons, response}``.

    Raises:
        SFTImportError: not an object, not one user + one assistant turn, not exactly two
            ``<image>`` tokens leading the user turn and two images, an image that does not decode
            (or has more than ``max_pixels``), or a target that does not start with Yes / No.
    """
    if isinstance(row, Exception):
        raise row
    if not isinstance(row, Mapping):
        raise SFTImportError(f"{where}: not a JSON object")
    user, assistant = _turns(where, row, entry)
    images_col = (entry.get("columns") or {}).get("images", "images")
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
    cells = [_image_cell(where, v, dataset_dir, max_pixels) for v in images]
    return {"instruction": question, "image_a": cells[0], "image_b": cells[1], "label": bool(label),
            "reasons": list(reasons), "response": assistant}


def import_sft(dataset_dir: str | Path, datasets: Mapping[str, str], *, strict: bool = True,
               max_pixels: int | None = None) -> SFTImport:
    """The SFT rows of the named LLaMA-Factory datasets of ``dataset_dir`` (module docstring).

    Args:
        dataset_dir: the folder holding ``dataset_info.json`` (PaCo-Dataset after ``decompress.sh``).
        datasets: dataset name -> task of its rows (``t2is`` | ``edit_pf`` | ``edit_sc``), in the
            order to import.
        strict: raise on the first malformed row; ``False`` skips it and records the reason.
        max_pixels: refuse images with more pixels (``None``: Pillow's guard).

    Returns:
        :class:`SFTImport`: rows in ``SFT_COLUMNS`` order, sorted by ``pair_id``.

    Raises:
        SFTImportError: a missing or malformed ``dataset_info.json``, an unknown dataset name, a
            remote-only, ranking or unknown-format dataset, an unknown task, a missing file, a
            malformed row (``strict``), or a dataset with no importable row.
    """
    from paco.judge.reasons import SFT_COLUMNS

    dataset_dir = Path(dataset_dir)
    info = _dataset_info(dataset_dir)
    out = SFTImport(table=pd.DataFrame(columns=SFT_COLUMNS))
    records = []
    for name, task in datasets.items():
        if task not in TASKS:
            raise SFTImportError(f"dataset {name!r}: task {task!r} is not one of {TASKS}")
        entry = info.get(name)
        if not isinstance(entry, Mapping):
            raise SFTImportError(f"dataset {name!r} is not in {dataset_dir / 'dataset_info.json'} "
                                 f"(it has {sorted(info)[:20]})")
        if entry.get("ranking"):
            raise SFTImportError(f"dataset {name!r} is a ranking (preference) dataset; the judge's SFT takes "
                                 f"supervised rows")
        if entry.get("formatting", "alpaca") not in ("alpaca", "sharegpt"):
            raise SFTImportError(f"dataset {name!r}: formatting {entry.get('formatting')!r} (alpaca | sharegpt)")
        n = position = 0
        for path in _files(dataset_dir, name, entry):
            for where, row in _records(path):
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
