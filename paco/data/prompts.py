"""Text-to-ImageSet (T2IS) prompt sets: parse the jsonl format, split by prompt.

The layout and panel-tag parsing each row uses: :mod:`paco.data.panel_prompts`.

File format (T2IS-Bench, as redistributed with grid prompts by PaCo-RL)
-----------------------------------------------------------------------
One JSON object per line (blank lines are ignored). Keys:

==================  ========  ================================================================
key                 required  type and meaning
==================  ========  ================================================================
``idx``             yes       int or str. The prompt's id: an int (or an all-digit string such
                              as ``"0007"``, as in the released files) gives ``t2is-0007``;
                              any other string is sanitised (lower case, runs of characters
                              outside ``[a-z0-9._-]`` become ``-``) and prefixed ``t2is-``.
``prompt``          yes       str. The grid prompt: a global description, then one
                              ``<panel tag>: <panel prompt>`` per panel (the tags:
                              :mod:`paco.data.panel_prompts`).
``height``          yes       int in 1..:data:`MAX_IMAGE_SIDE`, pixels of the whole grid image.
``width``           yes       int in 1..:data:`MAX_IMAGE_SIDE`, pixels of the whole grid image.
``layout``          yes       str ``"<ROWS>x<COLS>"`` (also ``X``, ``×``, ``⨉``), at least 2
                              panels. ROWS first: ``"1x3"`` is one row of three panels.
``theme``           yes       str. The user instruction the set was written from.
``category``        yes       str, one of the five T2IS-Bench categories (see
                              :data:`T2IS_CATEGORIES`; other strings are accepted).
``task_name``       yes       str, the T2IS-Bench sub-category (``"Multi-view"``, ...).
``criteria``        yes       object ``{dimension: {criterion name: text}}``; T2IS-Eval's
                              dimensions are ``Identity``, ``Style`` and ``Logic``. Other
                              dimension names (the released data has a few ``Surroundings``)
                              are kept. A criterion whose text is ``null`` or blank is
                              dropped and counted (the released data has them, e.g. case
                              ``0557``: ``"image": null``; the reference scorer skips them
                              with ``if c_t``, PaCo-GRPO ``rewards/consistency_scorer.py``).
                              Stored as a JSON string with sorted keys.
``editing_prompts`` no        list of rows*cols str: the first describes panel 1, each next
                              one edits the previous panel into the next (the editing
                              subtasks' input, PaCo-RL §7).
``subject``         no        str. Our extension: the photo subject name the ``photos``
                              composite source builds this prompt's grids from; one of
                              :data:`PHOTO_SUBJECTS` (the shipped photographs). Rows without
                              it (T2IS-Bench's own) get one picked by the ``photos`` source.
``split``           no        ``"train"`` or ``"test"``. Absent: the pipeline assigns one
                              with :func:`assign_split`.
``alignment``       no        list of rows*cols objects, panel ``k`` row-major: ``{"Entity":
                              [text, ...], "Attribute": [...], "Relation": [...]}``, each a
                              non-empty list of non-empty strings (T2IS-Bench's
                              ``prompt_alignment.json``, sub-ids in file order; chengyou-jia/T2IS
                              ``T2IS_Eval/vqa_alignment.py`` lines 7, 37-38, 61-64). Stored as
                              the JSON string column ``alignment`` (sorted keys), ``None`` where
                              absent; the column exists only when some row has it, so a set
                              without it writes the same ``prompts.parquet`` as before.
                              :mod:`paco.data.t2is_bench_import` writes it.
==================  ========  ================================================================

Other keys (``from``, ``original_idx``, ...) are ignored. The file is UTF-8; a leading
byte-order mark is ignored (``utf-8-sig``).

Conventions checked against the public data (PaCo-RL's ``dataset/T2IS/*/*_metadata.jsonl``,
the T2IS-Bench dataset card, and PaCo-RL's ``paco_grpo/utils.py``): ``layout`` is ROWS x COLS
(``divide_image`` crops ``rows = a`` horizontal bands of height ``H // a`` for ``"axb"``; a
``"1x3"`` row is 512 high and 1536 wide, a ``"2x3"`` one 1024 x 1536); panels are numbered
row-major; ``idx`` is a zero-padded string; the grid prompt opens with ``"FOUR-PANEL Images
with a 2x2 grid layout ..."``. Categories are ``Character Generation``, ``Design Style
Generation``, ``Story Generation``, ``Process Generation`` and ``Instruction Generation``.

Errors
------
:class:`PromptFormatError` (an :class:`~paco.core.io.ArtifactError`, so a ``ValueError``) with the
file, 1-based line number and reason, for: a line that is not valid UTF-8 (names the byte and
its column), invalid JSON or a non-object line, a missing key, a wrong type or empty required
string, a criterion text that is neither a string nor ``null``, a criteria dimension with no
non-blank criterion, a bad layout, a panel tag that does not fit the layout,
a duplicate panel position, a panel count other than rows*cols, an empty panel prompt, a
``"<r>x<c> grid"`` in the prompt text that contradicts ``layout``, a height or width that is
not positive or above :data:`MAX_IMAGE_SIDE`, a ``subject`` that names no shipped photograph,
an unknown split, an ``editing_prompts`` or ``alignment`` list of the wrong length or shape,
and a duplicate
``prompt_id``. With ``strict=False`` such rows are skipped and listed instead (see
:func:`read_t2is_jsonl_report`); nothing is dropped silently. A file that yields no valid row
(empty, or every row skipped) raises :class:`EmptyPromptSetError` whatever ``strict`` is.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dataclasses import dataclass, field

import pandas as pd

from paco.core.io import iter_text_lines
from paco.data.panel_prompts import PromptFormatError, parse_layout, parse_panel_prompts
from paco.data.photos import SUBJECTS

__all__ = [
    "PROMPT_COLUMNS",
    "ALIGNMENT_COLUMN",
    "PA_DIMENSIONS",
    "MAX_IMAGE_SIDE",
    "PHOTO_SUBJECTS",
    "SPLITS",
    "T2IS_CATEGORIES",
    "EmptyPromptSetError",
    "T2ISReadResult",
    "assign_split",
    "parse_alignment",
    "parse_record",
    "prompt_id_from_idx",
    "read_t2is_jsonl",
    "read_t2is_jsonl_with_report",
    "read_t2is_jsonl_report",
]

#: Columns of the table :func:`read_t2is_jsonl` returns (``prompts.parquet``, docs/architecture.md §3).
PROMPT_COLUMNS = [
    "prompt_id", "split", "prompt", "global_prompt", "theme", "rows", "cols", "panel_prompts",
    "height", "width", "category", "task_name", "criteria", "subject", "editing_prompts",
]

#: The five T2IS-Bench categories, spelled as in the released data and dataset card.
T2IS_CATEGORIES = (
    "Character Generation",
    "Design Style Generation",
    "Story Generation",
    "Process Generation",
    "Instruction Generation",
)

#: Photo subject names a prompt's ``subject`` may take in the shipped prompt set
#: (``data/raw/t2is_prompts.jsonl``): the real photographs the ``photos`` composite source uses.
PHOTO_SUBJECTS = tuple(SUBJECTS)

SPLITS = ("train", "test")

#: Largest ``height`` / ``width`` (px) a row may ask for. T2IS-Bench's grids are 512 to 1536 px a
#: side and FLUX renders up to about 2 Mpx; 16384 leaves room for any real set while refusing
#: sizes no generator renders (and values past int64, which the table cannot hold).
MAX_IMAGE_SIDE = 16384

_REQUIRED = ("idx", "prompt", "height", "width", "layout", "theme", "category", "task_name",
             "criteria")

#: The optional per-panel prompt-alignment column and its dimensions (vqa_alignment.py:7).
ALIGNMENT_COLUMN = "alignment"
PA_DIMENSIONS = ("Entity", "Attribute", "Relation")

_GRID_IN_TEXT_RE = re.compile(r"\b(\d+)\s*[xX×⨉]\s*(\d+)\s+grid\b", re.IGNORECASE)


class EmptyPromptSetError(PromptFormatError):
    """A prompt file yields no valid prompt (it is empty, or every row was skipped)."""


# --------------------------------------------------------------------------------------------
# rows
# --------------------------------------------------------------------------------------------


def prompt_id_from_idx(idx: Any) -> str:
    """Stable prompt id: ``7`` and ``"0007"`` -> ``t2is-0007``; ``"A b"`` -> ``t2is-a-b``.

    Raises:
        PromptFormatError: idx is not an int or string, negative, or sanitises to nothing.
    """
    if isinstance(idx, bool) or not isinstance(idx, (int, str)):
        raise PromptFormatError(f"idx must be an int or a string, got {type(idx).__name__}")
    if isinstance(idx, str) and idx.strip().isdigit() and idx.strip().isascii():
        idx = int(idx.strip())
    if isinstance(idx, int):
        if idx < 0:
            raise PromptFormatError(f"idx must be >= 0, got {idx}")
        return f"t2is-{idx:04d}"
    clean = re.sub(r"[^a-z0-9._-]+", "-", idx.strip().lower()).strip("-._")
    if not clean:
        raise PromptFormatError(f"idx {idx!r} gives an empty prompt id")
    return f"t2is-{clean}"


def _str_field(rec: Mapping[str, Any], key: str, *, allow_empty: bool = False) -> str:
    v = rec[key]
    if not isinstance(v, str):
        raise PromptFormatError(f"{key!r} must be a string, got {type(v).__name__}")
    if not allow_empty and not v.strip():
        raise PromptFormatError(f"{key!r} is empty")
    return v


def _size_field(rec: Mapping[str, Any], key: str) -> int:
    v = rec[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise PromptFormatError(f"{key!r} must be an integer, got {type(v).__name__} {v!r}")
    if v <= 0:
        raise PromptFormatError(f"{key!r} must be positive, got {v}")
    if v > MAX_IMAGE_SIDE:
        raise PromptFormatError(f"{key!r} must be at most {MAX_IMAGE_SIDE} px, got {v}")
    return v


def _criteria_field(rec: Mapping[str, Any]) -> tuple[str, list[tuple[str, str]]]:
    """The criteria JSON without null/blank criteria, and the ``(dimension, name)`` dropped.

    A null or blank text carries no criterion: PaCo-GRPO's scorer skips it
    (``[c_t for c_t in dimension_criteria.values() if c_t]``), so it is dropped here too. Any
    other non-string text, an empty name, and a dimension left with no criterion (which the
    reference would score 0 for every image) are errors.
    """
    crit = rec["criteria"]
    if not isinstance(crit, dict) or not crit:
        raise PromptFormatError("'criteria' must be a non-empty object {dimension: {name: text}}")
    kept: dict[str, dict[str, str]] = {}
    dropped: list[tuple[str, str]] = []
    for dim, items in crit.items():
        if not isinstance(items, dict) or not items:
            raise PromptFormatError(f"criteria[{dim!r}] must be a non-empty object {{name: text}}")
        kept[dim] = {}
        for name, text in items.items():
            if not name.strip() or not (text is None or isinstance(text, str)):
                raise PromptFormatError(f"criteria[{dim!r}][{name!r}] must be a string (or null)")
            if text is None or not text.strip():
                dropped.append((dim, name))
            else:
                kept[dim][name] = text
        if not kept[dim]:
            raise PromptFormatError(
                f"criteria[{dim!r}] has no criterion with text (all {len(items)} are null or blank)"
            )
    return json.dumps(kept, sort_keys=True, ensure_ascii=False), dropped


def parse_alignment(value: Any, n_panels: int) -> str:
    """One row's ``alignment`` as its stored JSON string (sorted keys, UTF-8 text kept).

    Args:
        value: a list of ``n_panels`` objects ``{"Entity": [str], "Attribute": [str],
            "Relation": [str]}`` (panel ``k`` row-major), or that list's JSON string.
        n_panels: rows * cols of the row's layout.

    Raises:
        PromptFormatError: invalid JSON, not a list, a length other than ``n_panels``, an entry
            that is not an object with exactly the three keys, or a key whose value is not a
            non-empty list of non-empty strings (vqa_alignment.py:37-38 divides by its length).
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise PromptFormatError(f"'alignment' is not valid JSON: {e.msg}") from None
    if not isinstance(value, list):
        raise PromptFormatError(f"'alignment' must be a list (one object a panel), got {type(value).__name__}")
    if len(value) != n_panels:
        raise PromptFormatError(f"'alignment' has {len(value)} entries, the layout has {n_panels} panels")
    for k, entry in enumerate(value):
        if not isinstance(entry, dict) or set(entry) != set(PA_DIMENSIONS):
            keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise PromptFormatError(f"'alignment'[{k}] must be an object with exactly the keys "
                                    f"{list(PA_DIMENSIONS)}, got {keys}")
        for dim in PA_DIMENSIONS:
            texts = entry[dim]
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t.strip() for t in texts):
                raise PromptFormatError(f"'alignment'[{k}][{dim!r}] must be a non-empty list of "
                                        f"non-empty strings, got {texts!r}")
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def parse_record(rec: Any, *, dropped_criteria: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """Validate one decoded jsonl object and return its ``prompts.parquet`` row.

    Criteria whose text is null or blank are left out of the row's ``criteria``; their
    ``(dimension, name)`` are appended to ``dropped_criteria`` when it is given.

    Raises:
        PromptFormatError: any of the failures listed in the module docstring (no line number;
            the readers add it).
    """
    if not isinstance(rec, dict):
        raise PromptFormatError(f"a row must be a JSON object, got {type(rec).__name__}")
    missing = [k for k in _REQUIRED if k not in rec]
    if missing:
        raise PromptFormatError(f"missing key(s): {', '.join(missing)}")

    prompt_id = prompt_id_from_idx(rec["idx"])
    prompt = _str_field(rec, "prompt")
    theme = _str_field(rec, "theme", allow_empty=True)
    category = _str_field(rec, "category")
    task_name = _str_field(rec, "task_name")
    height = _size_field(rec, "height")
    width = _size_field(rec, "width")
    rows, cols = parse_layout(rec["layout"])
    criteria, dropped = _criteria_field(rec)

    for m in _GRID_IN_TEXT_RE.finditer(prompt):
        said = (int(m.group(1)), int(m.group(2)))
        if said != (rows, cols):
            raise PromptFormatError(
                f"prompt says '{m.group(0)}' but layout is {rows}x{cols}"
            )
    global_prompt, panels = parse_panel_prompts(prompt, rows, cols)

    subject = rec.get("subject")
    if subject is not None:
        subject = _str_field(rec, "subject")
        if subject not in PHOTO_SUBJECTS:
            raise PromptFormatError(f"'subject': unknown photo subject {subject!r} (known subjects: "
                                    f"{sorted(PHOTO_SUBJECTS)}); leave the key out when the row has none")

    split = rec.get("split")
    if split is not None and split not in SPLITS:
        raise PromptFormatError(f"unknown split {split!r}: expected one of {list(SPLITS)}")

    editing = rec.get("editing_prompts")
    if editing is not None:
        if not isinstance(editing, list) or not all(
            isinstance(e, str) and e.strip() for e in editing
        ):
            raise PromptFormatError("'editing_prompts' must be a list of non-empty strings")
        if len(editing) != rows * cols:
            raise PromptFormatError(
                f"'editing_prompts' has {len(editing)} entries, layout {rows}x{cols} needs "
                f"{rows * cols} (one per panel)"
            )
        editing = list(editing)

    alignment = rec.get(ALIGNMENT_COLUMN)
    if alignment is not None:
        alignment = parse_alignment(alignment, rows * cols)

    if dropped_criteria is not None:
        dropped_criteria.extend(dropped)
    return {
        "prompt_id": prompt_id,
        "split": split,
        "prompt": prompt,
        "global_prompt": global_prompt,
        "theme": theme,
        "rows": rows,
        "cols": cols,
        "panel_prompts": panels,
        "height": height,
        "width": width,
        "category": category,
        "task_name": task_name,
        "criteria": criteria,
        "subject": subject,
        "editing_prompts": editing,
        ALIGNMENT_COLUMN: alignment,
    }


def _to_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    cols: dict[str, Any] = {}
    names = PROMPT_COLUMNS + ([ALIGNMENT_COLUMN] if any(r[ALIGNMENT_COLUMN] is not None for r in records) else [])
    for name in names:
        values = [r[name] for r in records]
        if name in ("rows", "cols", "height", "width"):
            cols[name] = pd.Series(values, dtype="int64")
        else:
            # object dtype keeps None as None (not NaN) and lists as lists
            cols[name] = pd.Series(values, dtype=object)
    return pd.DataFrame(cols, columns=names)


@dataclass
class T2ISReadResult:
    """What :func:`read_t2is_jsonl_report` read.

    Attributes:
        table: :data:`PROMPT_COLUMNS`, one row per valid line in file order (``rows``,
            ``cols``, ``height``, ``width`` int64; the rest object columns whose missing
            ``split``/``subject``/``editing_prompts`` are ``None``), then ``alignment`` (JSON
            string or ``None``) only when some row has one.
        skipped: ``{"line": n, "reason": str}`` per malformed row (1-based); empty when strict.
        dropped_criteria: ``{"line", "prompt_id", "dimension", "criterion"}`` per null or blank
            criterion left out of a kept row's ``criteria``.
    """

    table: pd.DataFrame
    skipped: list[dict[str, Any]] = field(default_factory=list)
    dropped_criteria: list[dict[str, Any]] = field(default_factory=list)


def read_t2is_jsonl_report(path: str | Path, strict: bool = True) -> T2ISReadResult:
    """Read a T2IS-format jsonl into a ``prompts.parquet`` table, with what was skipped or dropped.

    The file is read as UTF-8 with an optional byte-order mark (``utf-8-sig``); lines end at
    ``\\n``, ``\\r\\n`` or ``\\r``; blank lines are ignored but counted. A line with bytes that
    are not UTF-8 is a malformed row like any other (line number, byte and column named). A
    row whose ``prompt_id`` repeats an earlier one is skipped (or raises) and the first kept.

    Raises:
        PromptFormatError: (``strict=True``) the first malformed row, with its line number, or
            the file does not exist.
        EmptyPromptSetError: no valid row at all (an empty file, or every row skipped); the
            message lists the first skip reasons.
    """
    path = Path(path)
    records: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    dropped_all: list[dict[str, Any]] = []
    first_line: dict[str, int] = {}
    if not path.is_file():
        raise PromptFormatError("no such prompt file", path=str(path))
    for lineno, raw, bad_bytes in iter_text_lines(path):
        if raw is not None and not raw.strip():
            continue
        dropped: list[tuple[str, str]] = []
        try:
            if bad_bytes is not None:
                raise PromptFormatError(bad_bytes)
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError as e:
                raise PromptFormatError(f"invalid JSON: {e.msg} (column {e.colno})") from None
            except (ValueError, RecursionError) as e:  # an integer past the digit limit, deep nesting
                raise PromptFormatError(f"invalid JSON: {e}") from None
            row = parse_record(rec, dropped_criteria=dropped)
            pid = row["prompt_id"]
            if pid in first_line:
                raise PromptFormatError(
                    f"duplicate prompt_id {pid!r} (first on line {first_line[pid]})"
                )
        except PromptFormatError as e:
            if strict:
                raise PromptFormatError(e.reason, line=lineno, path=str(path)) from None
            skipped.append({"line": lineno, "reason": e.reason})
            continue
        first_line[pid] = lineno
        records.append(row)
        dropped_all.extend(
            {"line": lineno, "prompt_id": pid, "dimension": dim, "criterion": name} for dim, name in dropped
        )
    if not records:
        detail = "; ".join(f"line {s['line']}: {s['reason']}" for s in skipped[:3])
        raise EmptyPromptSetError(
            "no valid prompt row"
            + (f" ({len(skipped)} malformed row(s) skipped: {detail})" if skipped else " (the file is empty)"),
            path=str(path),
        )
    return T2ISReadResult(_to_frame(records), skipped, dropped_all)


def read_t2is_jsonl_with_report(
    path: str | Path, strict: bool = True
) -> tuple[pd.DataFrame, list[dict[str, Any]]]:
    """``(table, skipped)`` of :func:`read_t2is_jsonl_report` (which also lists the dropped
    null/blank criteria).

    Raises:
        PromptFormatError: (``strict=True``) the first malformed row, with its line number.
        EmptyPromptSetError: the file yields no valid row.
    """
    res = read_t2is_jsonl_report(path, strict=strict)
    return res.table, res.skipped


def read_t2is_jsonl(path: str | Path, strict: bool = True) -> pd.DataFrame:
    """Read a T2IS-format jsonl into a ``prompts.parquet`` table (:data:`PROMPT_COLUMNS`).

    The skipped-row report lives in :func:`read_t2is_jsonl_report`; this function issues one
    ``UserWarning`` naming every skipped line (``strict=False``) and one naming every dropped
    null/blank criterion, so nothing disappears without notice.

    Raises:
        PromptFormatError: (``strict=True``) the first malformed row, with its line number.
        EmptyPromptSetError: the file yields no valid row.
    """
    res = read_t2is_jsonl_report(path, strict=strict)
    if res.skipped:
        detail = "; ".join(f"line {s['line']}: {s['reason']}" for s in res.skipped)
        warnings.warn(f"{path}: skipped {len(res.skipped)} malformed row(s): {detail}", stacklevel=2)
    if res.dropped_criteria:
        detail = "; ".join(f"line {d['line']}: {d['dimension']}/{d['criterion']}" for d in res.dropped_criteria)
        warnings.warn(f"{path}: dropped {len(res.dropped_criteria)} null or blank criteria: {detail}", stacklevel=2)
    return res.table


# --------------------------------------------------------------------------------------------
# split
# --------------------------------------------------------------------------------------------


def _key(seed: int, text: str) -> bytes:
    return hashlib.sha256(f"{seed}\x1f{text}".encode()).digest()


def _n_test(n: int, test_fraction: float) -> int:
    if n < 2 or test_fraction <= 0:
        return 0
    return min(n - 1, max(1, round(test_fraction * n)))


def assign_split(
    prompt_ids: Iterable[str],
    test_fraction: float,
    seed: int,
    *,
    categories: Mapping[str, str] | Sequence[str] | None = None,
) -> dict[str, str]:
    """Deterministic train/test split by prompt.

    Each prompt gets the key ``sha256(f"{seed}\\x1f{prompt_id}")``; the prompts with the
    smallest keys go to test. The result therefore depends only on the set of ids, the
    fraction and the seed: never on row order, Python's ``hash`` or the process.

    The test size is ``round(test_fraction * n)`` (Python's ``round``, half to even), raised
    to 1 when ``test_fraction > 0`` and ``n >= 2``, and capped at ``n - 1`` so train is never
    empty; with ``n < 2`` or ``test_fraction == 0`` everything is train.

    With ``categories`` (a mapping id -> category, or a sequence aligned with ``prompt_ids``)
    the split is stratified: each category gets ``floor(test_fraction * n_c)`` test prompts,
    and the few left to reach the total go to the categories with the largest remainders,
    preferring categories that keep at least one train prompt (ties by a seeded hash of the
    category name). Within a category the smallest keys go to test.

    Raises:
        ValueError: duplicate ids, a fraction outside [0, 1), or categories missing an id.
    """
    ids = list(prompt_ids)
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"duplicate prompt ids: {dup[:5]}")
    if not (0.0 <= test_fraction < 1.0) or math.isnan(test_fraction):
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    n = len(ids)
    total = _n_test(n, test_fraction)
    order = sorted(ids, key=lambda i: (_key(seed, i), i))
    if categories is None or total == 0:
        test = set(order[:total])
        return {i: ("test" if i in test else "train") for i in ids}

    if isinstance(categories, Mapping):
        missing = [i for i in ids if i not in categories]
        if missing:
            raise ValueError(f"categories lack prompt ids: {missing[:5]}")
        cat_of = {i: str(categories[i]) for i in ids}
    else:
        cats = list(categories)
        if len(cats) != n:
            raise ValueError(f"categories has {len(cats)} entries for {n} prompt ids")
        cat_of = {i: str(c) for i, c in zip(ids, cats, strict=True)}

    members: dict[str, list[str]] = {}
    for i in order:  # key order within each category
        members.setdefault(cat_of[i], []).append(i)
    quota = {c: math.floor(test_fraction * len(m)) for c, m in members.items()}
    left = total - sum(quota.values())
    ranked = sorted(
        members,
        key=lambda c: (
            quota[c] + 1 >= len(members[c]),  # False first: keeps a train prompt
            -(test_fraction * len(members[c]) - quota[c]),  # largest remainder
            _key(seed, "category:" + c),
        ),
    )
    for c in ranked:
        if left <= 0:
            break
        if quota[c] < len(members[c]):
            quota[c] += 1
            left -= 1
    test = {i for c, m in members.items() for i in m[: quota[c]]}
    return {i: ("test" if i in test else "train") for i in ids}
