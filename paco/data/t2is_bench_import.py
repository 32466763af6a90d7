"""T2IS-Bench's own release -> the ``prompts`` stage's jsonl (``data/raw/T2IS-Bench.jsonl``).

Usage::

    python -m paco.data.t2is_bench_import --bench T2IS-Bench.json \\
        --consistency prompt_consistency.json --alignment prompt_alignment.json \\
        --grid-prompts test_metadata.jsonl --out data/raw/T2IS-Bench.jsonl

The inputs
----------
* ``T2IS-Bench.json``, ``prompt_consistency.json``, ``prompt_alignment.json``: the Hugging Face
  dataset ``ChengyouJia/T2IS-Bench`` (chengyou-jia/T2IS ``T2IS_Eval/README.md``: "Download the
  following files"), read as the official scripts read them by :mod:`paco.data.t2is_bench_files`
  (their layouts; where this importer and the benchmark's reader of the same files differ).
* ``--grid-prompts``: T2IS-Bench ships the user *instructions*, not the grid prompts with
  panel tags a generator is given (its own AutoT2IS plans those with an LLM; the T2IS README's
  example prompt ``"THREE-PANEL Images with a 1x3 grid layout ... [LEFT]: ..."``). The grid
  prompts PaCo-RL trained and tested with are X-GenGroup/PaCo-RL
  ``PaCo-GRPO/dataset/T2IS/all/test_metadata.jsonl`` (commit 08caac6f): 596 rows in this
  pipeline's jsonl format (:mod:`paco.data.prompts`), each with ``original_idx``, the T2IS-Bench
  case id. Any file in that format, keyed the same way, will do.

The rules
---------
One output record per dataset case, in the dataset's order, keyed ``idx`` = the case id
(``prompt_id`` ``t2is-<case id>``):

* ``prompt``, ``theme``, ``layout`` and ``editing_prompts`` (when present) from the grid-prompt
  row whose ``--match-key`` (default ``original_idx``) is the case id; a row without ``layout``
  gets :func:`layout_for_count` of ``output_image_count``.
* ``rows * cols`` must equal ``output_image_count``.
* ``height`` = ``rows * panel_side``, ``width`` = ``cols * panel_side`` (512 px a panel: the
  T2IS README's ``sub_height = sub_width = 512``; every row of the PaCo-RL file has it); a
  grid-prompt row whose ``height``/``width`` disagree is an error.
* ``category`` and ``task_name`` from the case id's first four digits (:data:`T2IS_TASKS`, the
  dataset card's "Supported Tasks" list); a grid-prompt row that says otherwise is an error.
* ``criteria`` from ``prompt_consistency.json``: each dimension's first object (the official
  reading, :func:`paco.data.t2is_bench_files.official_criteria`); a case not in that file, or
  left with no criterion, is an error (a prompt row needs VC criteria); a null or blank text
  is dropped and listed (the official script would ask about the text ``"None"``); a dimension
  left with none is dropped and listed; further objects in a dimension's list are ignored and
  listed.
* ``alignment``: the case's sub-entries in file order, exactly the keys ``Entity``,
  ``Attribute``, ``Relation`` (other keys are left out and listed), one per panel.

Errors
------
:class:`T2ISBenchImportError` (an ``ArtifactError``) for an unreadable or non-object file, an
alignment case that is not in the dataset, and (unless ``allow_skips``) every case that cannot
become a valid row: no ``output_image_count``, no grid-prompt row, a count that does not match
the layout, an unknown task id, no consistency criteria, alignment of the wrong shape, or a
record :func:`paco.data.prompts.parse_record` rejects. All such cases are named in one message.
With ``allow_skips`` they are left out and listed in the report instead: nothing is dropped
silently.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from paco.core.io import ArtifactError, iter_text_lines
from paco.data.panel_prompts import PromptFormatError, parse_layout
from paco.data.prompts import ALIGNMENT_COLUMN, PA_DIMENSIONS, parse_record
from paco.data.t2is_bench_files import load_official_files, official_criteria

__all__ = ["T2IS_TASKS", "LAYOUT_OF_COUNT", "PANEL_SIDE", "T2ISBenchImportError", "layout_for_count",
           "convert", "write_jsonl", "main"]

#: T2IS-Bench task id (a case id's first four digits) -> (category, task_name): the dataset card
#: (huggingface.co/datasets/ChengyouJia/T2IS-Bench, "Supported Tasks"), spelled as PaCo-RL's
#: metadata spells them (all 596 rows agree with this table).
T2IS_TASKS = {
    "0001": ("Character Generation", "Multi-Scenario"), "0002": ("Character Generation", "Multi-Expression"),
    "0003": ("Character Generation", "Portrait Design"), "0004": ("Character Generation", "Multi-view"),
    "0005": ("Character Generation", "Multi-pose"), "0006": ("Design Style Generation", "Creative Style"),
    "0007": ("Design Style Generation", "Poster Design"), "0008": ("Design Style Generation", "Font Design"),
    "0009": ("Design Style Generation", "IP Product"), "0010": ("Design Style Generation", "Home Decoration"),
    "0011": ("Story Generation", "Movie Shot"), "0012": ("Story Generation", "Comic Story"),
    "0013": ("Story Generation", "Children Book"), "0014": ("Story Generation", "News Illustration"),
    "0015": ("Story Generation", "Hist. Narrative"), "0016": ("Process Generation", "Growth Process"),
    "0017": ("Process Generation", "Draw Process"), "0018": ("Process Generation", "Cooking Process"),
    "0019": ("Process Generation", "Physical Law"), "0020": ("Process Generation", "Arch. Building"),
    "0021": ("Instruction Generation", "Evolution Illustration"),
    "0022": ("Instruction Generation", "Education Illustration"),
    "0023": ("Instruction Generation", "Historical Panel"), "0024": ("Instruction Generation", "Product Instruction"),
    "0025": ("Instruction Generation", "Travel Guide"), "0026": ("Instruction Generation", "Activity Arrange"),
}

#: ``output_image_count`` -> ``(rows, cols)``: the layout every PaCo-RL T2IS row of that many
#: panels has (``all/test_metadata.jsonl`` at 08caac6f: 2 -> 1x2 (7 rows), 3 -> 1x3 (112),
#: 4 -> 2x2 (285), 5 -> 1x5 (116), 6 -> 2x3 (68), 7 -> 1x7 (5), 8 -> 2x4 (3)).
LAYOUT_OF_COUNT = {2: (1, 2), 3: (1, 3), 4: (2, 2), 5: (1, 5), 6: (2, 3), 7: (1, 7), 8: (2, 4)}

#: Pixels a panel side (T2IS README: ``sub_height = 512``, ``sub_width = 512``).
PANEL_SIDE = 512


class T2ISBenchImportError(ArtifactError):
    """The T2IS-Bench files cannot be turned into the prompts jsonl (the message names why)."""


def layout_for_count(n: Any) -> tuple[int, int]:
    """``(rows, cols)`` for ``n`` panels (:data:`LAYOUT_OF_COUNT`).

    Raises:
        T2ISBenchImportError: ``n`` not an int in :data:`LAYOUT_OF_COUNT`.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n not in LAYOUT_OF_COUNT:
        raise T2ISBenchImportError(f"output_image_count {n!r} has no T2IS-Bench layout "
                                   f"(known: {sorted(LAYOUT_OF_COUNT)})")
    return LAYOUT_OF_COUNT[n]


def _load_grid_prompts(path: str | Path, key: str) -> dict[str, dict[str, Any]]:
    if not Path(path).is_file():
        raise T2ISBenchImportError(f"grid prompts: no such file {path}")
    rows: dict[str, dict[str, Any]] = {}
    for lineno, raw, bad in iter_text_lines(Path(path)):
        if bad is not None:
            raise T2ISBenchImportError(f"grid prompts: {path} line {lineno}: {bad}")
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError as e:
            raise T2ISBenchImportError(f"grid prompts: {path} line {lineno}: invalid JSON: {e.msg}") from None
        cid = rec.get(key) if isinstance(rec, dict) else None
        if not isinstance(cid, str) or not cid:
            raise T2ISBenchImportError(f"grid prompts: {path} line {lineno}: no string {key!r}")
        if cid in rows:
            raise T2ISBenchImportError(f"grid prompts: {path} line {lineno}: {key} {cid!r} repeats")
        rows[cid] = rec
    return rows


def _criteria(cid: str, entry: Any, report: dict[str, list]) -> dict[str, dict[str, str]]:
    out = official_criteria(cid, entry, report, error=T2ISBenchImportError)
    if not out:
        raise T2ISBenchImportError(f"case {cid!r}: no consistency criterion with text")
    return out


def _alignment(cid: str, entry: Any, report: dict[str, list]) -> list[dict[str, Any]]:
    if not isinstance(entry, Mapping) or not entry:
        raise T2ISBenchImportError(f"prompt_alignment[{cid!r}] must be a non-empty object {{sub_id: criteria}}")
    out = []
    for sub_id, crit in entry.items():
        if not isinstance(crit, Mapping):
            raise T2ISBenchImportError(f"prompt_alignment[{cid!r}][{sub_id!r}] must be an object")
        extra = sorted(set(crit) - set(PA_DIMENSIONS))
        if extra:
            report["ignored_alignment_keys"].append({"case_id": cid, "sub_id": sub_id, "keys": extra})
        missing = [d for d in PA_DIMENSIONS if d not in crit]
        if missing:
            raise T2ISBenchImportError(f"prompt_alignment[{cid!r}][{sub_id!r}] lacks {missing}")
        out.append({d: crit[d] for d in PA_DIMENSIONS})
    return out


def _record(cid: str, meta: Any, grid: dict[str, Any] | None, consistency: Mapping[str, Any],
            alignment: Mapping[str, Any], panel_side: int, report: dict[str, list]) -> dict[str, Any]:
    n = meta.get("output_image_count") if isinstance(meta, Mapping) else None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise T2ISBenchImportError(f"T2IS-Bench.json[{cid!r}]: output_image_count must be an int >= 1, got {n!r}")
    if grid is None:
        raise T2ISBenchImportError(f"case {cid!r}: no grid-prompt row")
    try:
        rows, cols = parse_layout(grid["layout"]) if "layout" in grid else layout_for_count(n)
    except PromptFormatError as e:
        raise T2ISBenchImportError(f"case {cid!r}: grid-prompt layout: {e.reason}") from None
    if rows * cols != n:
        raise T2ISBenchImportError(f"case {cid!r}: layout {rows}x{cols} has {rows * cols} panels, "
                                   f"output_image_count is {n}")
    height, width = rows * panel_side, cols * panel_side
    for key, want in (("height", height), ("width", width)):
        if key in grid and grid[key] != want:
            raise T2ISBenchImportError(f"case {cid!r}: grid-prompt {key} {grid[key]!r} != {want} "
                                       f"({rows}x{cols} panels of {panel_side} px)")
    task = T2IS_TASKS.get(cid.split("_")[0])
    if task is None:
        raise T2ISBenchImportError(f"case {cid!r}: unknown T2IS-Bench task id {cid.split('_')[0]!r}")
    for key, want in zip(("category", "task_name"), task):
        if key in grid and grid[key] != want:
            raise T2ISBenchImportError(f"case {cid!r}: grid-prompt {key} {grid[key]!r} != {want!r} (dataset card)")
    if cid not in consistency:
        raise T2ISBenchImportError(f"case {cid!r}: not in prompt_consistency.json")
    rec = {"idx": cid, "prompt": grid.get("prompt"), "height": height, "width": width,
           "layout": f"{rows}x{cols}", "theme": grid.get("theme"), "category": task[0],
           "task_name": task[1], "criteria": _criteria(cid, consistency[cid], report), "from": "T2IS-Bench"}
    if meta.get("task_name_case_id") is not None:
        rec["task_name_case_id"] = meta["task_name_case_id"]
    if grid.get("editing_prompts") is not None:
        rec["editing_prompts"] = grid["editing_prompts"]
    if cid in alignment:
        rec[ALIGNMENT_COLUMN] = _alignment(cid, alignment[cid], report)
    try:
        parse_record(rec)
    except PromptFormatError as e:
        raise T2ISBenchImportError(f"case {cid!r}: {e.reason}") from None
    return rec


def convert(bench: str | Path, consistency: str | Path, grid_prompts: str | Path,
            alignment: str | Path | None = None, *, match_key: str = "original_idx",
            panel_side: int = PANEL_SIDE, allow_skips: bool = False
            ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The prompts-jsonl records of T2IS-Bench's cases (module docstring: the rules).

    Args:
        bench, consistency, alignment: the three official JSON files (``alignment`` optional:
            then no record has ``alignment``).
        grid_prompts: a jsonl of grid prompts keyed by ``match_key``.
        panel_side: px a panel side (default 512).
        allow_skips: leave out (and list) the cases that cannot become rows instead of raising.

    Returns:
        ``(records, report)``: records in the dataset's order; the report has ``cases``,
        ``written``, ``skipped`` ([{case_id, reason}]), ``dropped_criteria``,
        ``dropped_dimensions``, ``ignored_extra_objects``, ``ignored_alignment_keys``,
        ``cases_without_alignment`` and ``grid_rows_not_in_bench`` (lists of case ids).

    Raises:
        T2ISBenchImportError: the module docstring's errors.
    """
    if isinstance(panel_side, bool) or not isinstance(panel_side, int) or panel_side < 1:
        raise T2ISBenchImportError(f"panel_side must be an int >= 1, got {panel_side!r}")
    dataset, crit, align = load_official_files(bench, consistency, alignment, error=T2ISBenchImportError)
    grid = _load_grid_prompts(grid_prompts, match_key)
    orphans = sorted(set(align) - set(dataset))
    if orphans:
        raise T2ISBenchImportError(f"prompt_alignment.json has {len(orphans)} case(s) not in T2IS-Bench.json: "
                                   f"{orphans[:10]}")
    report: dict[str, Any] = {k: [] for k in ("skipped", "dropped_criteria", "dropped_dimensions",
                                              "ignored_extra_objects", "ignored_alignment_keys")}
    records = []
    for cid, meta in dataset.items():
        try:
            records.append(_record(cid, meta, grid.get(cid), crit, align, panel_side, report))
        except T2ISBenchImportError as e:
            report["skipped"].append({"case_id": cid, "reason": str(e)})
    if report["skipped"] and not allow_skips:
        raise T2ISBenchImportError(f"{len(report['skipped'])} case(s) cannot be converted: "
                                   + "; ".join(s["reason"] for s in report["skipped"]))
    if not records:
        raise T2ISBenchImportError("no case could be converted")
    report.update(cases=len(dataset), written=len(records),
                  cases_without_alignment=[r["idx"] for r in records if ALIGNMENT_COLUMN not in r],
                  grid_rows_not_in_bench=sorted(set(grid) - set(dataset)))
    return records, report


def write_jsonl(records: list[dict[str, Any]], out: str | Path) -> None:
    """Write ``records`` one JSON object a line (UTF-8, non-ASCII kept), creating the folder."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); exit 0, or 2 with the error on stderr."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench", type=Path, required=True, help="T2IS-Bench.json")
    p.add_argument("--consistency", type=Path, required=True, help="prompt_consistency.json")
    p.add_argument("--alignment", type=Path, help="prompt_alignment.json (optional)")
    p.add_argument("--grid-prompts", type=Path, required=True,
                   help="jsonl of grid prompts (PaCo-RL PaCo-GRPO/dataset/T2IS/all/test_metadata.jsonl)")
    p.add_argument("--match-key", default="original_idx", help="the grid-prompt key holding the case id")
    p.add_argument("--panel-side", type=int, default=PANEL_SIDE, help="px a panel side")
    p.add_argument("--allow-skips", action="store_true", help="leave out (and list) bad cases")
    p.add_argument("--out", type=Path, required=True, help="the jsonl to write")
    p.add_argument("--report", type=Path, help="where to write the report as JSON")
    args = p.parse_args(argv)
    try:
        records, report = convert(args.bench, args.consistency, args.grid_prompts, args.alignment,
                                  match_key=args.match_key, panel_side=args.panel_side,
                                  allow_skips=args.allow_skips)
    except T2ISBenchImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_jsonl(records, args.out)
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    for s in report["skipped"]:
        print(f"skipped {s['case_id']}: {s['reason']}", file=sys.stderr)
    print(f"wrote {report['written']} of {report['cases']} cases to {args.out} ({len(report['skipped'])} skipped, "
          f"{len(report['cases_without_alignment'])} without alignment, {len(report['dropped_criteria'])} "
          "null or blank criteria dropped)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
