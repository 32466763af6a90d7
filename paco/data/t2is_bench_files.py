"""T2IS-Bench's official files, read as the official scripts read them.

The files are the Hugging Face dataset ``ChengyouJia/T2IS-Bench`` (chengyou-jia/T2IS
``T2IS_Eval/README.md``: "Download the following files"). The official scripts read only:

* ``T2IS-Bench.json``: ``{case_id: {"output_image_count": n, "task_name_case_id": str, ...}}``
  (``T2IS_Eval/test_prompt_consistency.py`` lines 61, 95, 190-191);
* ``prompt_consistency.json``: ``{case_id: {dimension: [{name: text}]}}``, of which only the
  list's first object is read (lines 70, 111): :func:`official_criteria`;
* ``prompt_alignment.json``: ``{case_id: {sub_id: {"Entity": [text], "Attribute": [...],
  "Relation": [...]}}}``, the sub-ids in file order being panels 0, 1, ...
  (``T2IS_Eval/vqa_alignment.py`` lines 7, 61-64).

Two readers use this module, each raising its own error class (the ``error`` argument):
:mod:`paco.data.t2is_bench_import` (the prompts jsonl, ``T2ISBenchImportError``) and
:func:`paco.benchmark.t2is_panels.load_official_bench` (the benchmark's cases,
``CriteriaFormatError``). They differ on purpose where a case of ``T2IS-Bench.json`` is missing
from ``prompt_consistency.json`` (or its entry is null):

* the importer refuses the case (or skips and lists it with ``allow_skips``): a prompt row needs
  VC criteria, although the official ``vqa_alignment.py`` iterates ``prompt_alignment.json`` and
  would still score PA for such a case;
* ``load_official_bench`` keeps it with criteria ``{}``, which VC skips as
  ``test_prompt_consistency.py`` lines 69-73 do (``criteria_data.get(case_id, {})`` falsy) while
  PA still scores its alignment.

Likewise a case whose every criterion is null or blank: the importer refuses it, the benchmark
keeps it with criteria ``{}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from paco.core.io import ArtifactError

__all__ = ["T2ISBenchFileError", "load_official_json", "load_official_files", "official_criteria"]


class T2ISBenchFileError(ArtifactError):
    """A T2IS-Bench official file cannot be read or an entry has the wrong shape (the default
    ``error`` of this module's functions; the message names the file and the entry)."""


def load_official_json(source: Any, what: str, *, error: type[Exception] = T2ISBenchFileError
                       ) -> Mapping[str, Any]:
    """One official file as its JSON object keyed by case id.

    Args:
        source: a path (``str`` / :class:`~pathlib.Path`; UTF-8, a leading BOM allowed) or the
            already decoded object, returned as is once checked.
        what: the file's name in messages (``"T2IS-Bench.json"``, ...).
        error: the exception class raised (one message argument).

    Raises:
        error: the file cannot be read, is not valid JSON, or is not a JSON object.
    """
    obj = source
    if isinstance(source, (str, Path)):
        try:
            obj = json.loads(Path(source).read_text(encoding="utf-8-sig"))
        except OSError as e:
            raise error(f"{what}: cannot read {source}: {e}") from None
        except json.JSONDecodeError as e:
            raise error(f"{what}: {source} is not valid JSON: {e.msg} (line {e.lineno})") from None
    if not isinstance(obj, Mapping):
        where = f" {source}" if isinstance(source, (str, Path)) else ""
        raise error(f"{what}:{where} must be a JSON object keyed by case id")
    return obj


def load_official_files(dataset: Any, consistency: Any, alignment: Any = None, *,
                        error: type[Exception] = T2ISBenchFileError
                        ) -> tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]]:
    """``(T2IS-Bench.json, prompt_consistency.json, prompt_alignment.json)`` as JSON objects
    keyed by case id (:func:`load_official_json` of each; ``alignment`` ``None``: ``{}``).

    Raises:
        error: a file cannot be read, is not valid JSON, or is not a JSON object (checked in
            that order of files).
    """
    return (load_official_json(dataset, "T2IS-Bench.json", error=error),
            load_official_json(consistency, "prompt_consistency.json", error=error),
            {} if alignment is None else load_official_json(alignment, "prompt_alignment.json", error=error))


def official_criteria(cid: str, entry: Any, report: Mapping[str, list], *,
                      error: type[Exception] = T2ISBenchFileError) -> dict[str, dict[str, str]]:
    """A ``prompt_consistency.json`` entry ``{dimension: [{name: text}, ...]}`` as the official
    code reads it: ``{dimension: {name: text}}`` from each list's first object only
    (test_prompt_consistency.py line 111), order kept.

    A null or blank text is dropped (the official script would ask about the literal text
    ``"None"``) and a dimension left with none is dropped; further objects in a list are
    ignored. Each is listed in ``report`` (appended to its lists ``"dropped_criteria"``
    ``[{case_id, dimension, criterion}]``, ``"dropped_dimensions"`` ``[{case_id, dimension}]``,
    ``"ignored_extra_objects"`` ``[{case_id, dimension, count}]``). The result may be ``{}``:
    the caller decides what a case without criteria means (module docstring).

    Raises:
        error: ``entry`` is not an object, a dimension's value is not a non-empty list whose
            first element is an object, or a text is neither a string nor null.
    """
    if not isinstance(entry, Mapping):
        raise error(f"prompt_consistency[{cid!r}] must be an object {{dimension: [{{name: text}}]}}")
    out: dict[str, dict[str, str]] = {}
    for dim, lst in entry.items():
        if not isinstance(lst, Sequence) or isinstance(lst, str) or not lst or not isinstance(lst[0], Mapping):
            raise error(f"prompt_consistency[{cid!r}][{dim!r}] must be a list whose first element is an "
                        "object {name: text}")
        if len(lst) > 1:
            report["ignored_extra_objects"].append({"case_id": cid, "dimension": dim, "count": len(lst) - 1})
        kept = {}
        for name, text in lst[0].items():
            if text is None or (isinstance(text, str) and not text.strip()):
                report["dropped_criteria"].append({"case_id": cid, "dimension": dim, "criterion": name})
            elif not isinstance(text, str):
                raise error(f"prompt_consistency[{cid!r}][{dim!r}][{name!r}] must be a string")
            else:
                kept[name] = text
        if kept:
            out[dim] = kept
        else:
            report["dropped_dimensions"].append({"case_id": cid, "dimension": dim})
    return out
