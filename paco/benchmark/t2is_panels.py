"""T2IS-Bench panels and the benchmark's official file layout (paper Table 3).

* :func:`cut_panels`: a grid image -> its panels, row-major, equal cells (the reference's
  ``divide_image``, :func:`paco.data.subfigures.split_grid` ``method="equal"``).
* :func:`resize_for_vc`: a panel as the official VC code (chengyou-jia/T2IS
  ``T2IS_Eval/test_prompt_consistency.py`` lines 126-127, through qwen_vl_utils
  ``fetch_image``) hands it to Qwen2.5-VL.
* :func:`write_official_layout`, :func:`to_official_json`: panels and criteria as the official
  scripts read them (``{case_id}_{k:04d}.png``, ``T2IS-Bench.json``,
  ``prompt_consistency.json``, ``prompt_alignment.json``), so they run on this pipeline's
  samples unchanged; :func:`load_official_bench` reads the benchmark's own files into the case
  dicts of :mod:`paco.benchmark.t2is_bench`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from paco.benchmark.t2is_bench import (
    CriteriaFormatError,
    OfficialLayoutError,
    T2ISBenchError,
    _normalise_case,
    grid_shape,
    parse_criteria,
)
from paco.data.subfigures import crop_panels, split_grid
from paco.data.t2is_bench_files import load_official_files, official_criteria

__all__ = [
    "VC_REQUESTED_SIDE", "QWEN_PATCH_FACTOR", "cut_panels", "vc_image_side", "resize_for_vc",
    "official_file_name", "check_official_case_ids", "write_official_layout",
    "load_official_bench", "to_official_json",
]

#: The panel side the official VC messages request (test_prompt_consistency.py:126-127).
VC_REQUESTED_SIDE = 512
#: qwen_vl_utils ``fetch_image`` rounds a requested size to a multiple of 28 (Qwen2.5-VL).
QWEN_PATCH_FACTOR = 28

_CASE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


# --------------------------------------------------------------------------------------------
# panels
# --------------------------------------------------------------------------------------------


def cut_panels(image: Image.Image, layout: str | Sequence[int]) -> list[Image.Image]:
    """The grid's panels, row-major, as equal cells (the reference's ``divide_image``).

    Args:
        image: the grid (any PIL mode); ``W // cols`` x ``H // rows`` px cells from the top-left
            corner, a remainder of under one cell dropped (``split_grid(method="equal")``).
        layout: ``"<rows>x<cols>"`` (T2IS-Bench uses 1x2 to 2x4) or ``(rows, cols)``.

    Returns:
        ``rows * cols`` PIL images in the image's mode, panel ``k`` at row ``k // cols``.

    Raises:
        T2ISBenchError: not a PIL image, or a bad layout; GridTooSmallError: fewer pixels than cells.
    """
    if not isinstance(image, Image.Image):
        raise T2ISBenchError(f"image must be a PIL.Image, got {type(image).__name__}")
    rows, cols = grid_shape(layout)
    return crop_panels(image, split_grid(image, rows, cols, method="equal"))


def vc_image_side(requested: int = VC_REQUESTED_SIDE, factor: int | None = QWEN_PATCH_FACTOR) -> int:
    """The side the VC evaluator sees: qwen_vl_utils ``smart_resize`` of the requested size.

    ``max(factor, round(requested / factor) * factor)`` (Python ``round``): 512 -> 504 for
    Qwen2.5-VL's 28 px patches (``fetch_image`` with ``resized_height/width``); ``factor=None``
    gives ``requested`` itself.

    Raises:
        ValueError: a side or factor < 1.
    """
    if requested < 1 or (factor is not None and factor < 1):
        raise ValueError(f"requested and factor must be >= 1, got {requested}, {factor}")
    return requested if factor is None else max(factor, round(requested / factor) * factor)


def resize_for_vc(image: Image.Image, *, side: int | None = None) -> Image.Image:
    """A panel as the official VC code feeds it to Qwen2.5-VL: RGB, square, bicubic.

    qwen_vl_utils ``fetch_image`` converts to RGB and calls ``image.resize((w, h))``, whose
    Pillow default filter for RGB is ``BICUBIC``; the requested 512 x 512 is rounded to
    504 x 504 first (:func:`vc_image_side`). Sending the 504 px image through an
    OpenAI-compatible Qwen server is then a no-op resize on the server.

    Args:
        side: the output side in px; default :func:`vc_image_side` () = 504.

    Returns:
        a new RGB image of ``side x side`` px.

    Raises:
        T2ISBenchError: not a PIL image; ValueError: side < 1.
    """
    if not isinstance(image, Image.Image):
        raise T2ISBenchError(f"image must be a PIL.Image, got {type(image).__name__}")
    side = vc_image_side() if side is None else side
    if side < 1:
        raise ValueError(f"side must be >= 1, got {side}")
    return image.convert("RGB").resize((side, side), Image.Resampling.BICUBIC)


# --------------------------------------------------------------------------------------------
# the official file layout
# --------------------------------------------------------------------------------------------


def official_file_name(case_id: str, k: int, *, start: int = 0) -> str:
    """``{case_id}_{k + start:04d}.png``: test_prompt_consistency.py:82-92 takes the files that
    start with the case id and sorts them by the number after the last ``_``;
    vqa_alignment.py:15,65 opens ``{task_id}_{idx:04d}.png`` with ``idx`` from ``--start_idx``
    (``0`` in the shipped ``run_prompt_alignment.sh:12``; the argparse default is 1).

    Raises:
        OfficialLayoutError: a case id that is not ``[A-Za-z0-9][A-Za-z0-9._-]*``, or k < 0.
    """
    if not isinstance(case_id, str) or not _CASE_ID_RE.match(case_id):
        raise OfficialLayoutError(f"case_id {case_id!r} must match {_CASE_ID_RE.pattern}")
    if k < 0 or start < 0:
        raise OfficialLayoutError(f"panel index and start must be >= 0, got {k}, {start}")
    return f"{case_id}_{k + start:04d}.png"


def check_official_case_ids(case_ids: Iterable[str]) -> None:
    """Raise when the official VC script would mix two cases' files in one directory: it takes
    every ``*.png`` whose name starts with the case id (line 83), so no id may be a prefix of
    another (``t2is-1`` would take ``t2is-10_0000.png``).

    Raises:
        OfficialLayoutError: a repeated id, an id that is a prefix of another, or a bad id.
    """
    ids = sorted(case_ids)
    for a in ids:
        official_file_name(a, 0)
    for a, b in zip(ids, ids[1:]):
        if b.startswith(a):
            raise OfficialLayoutError(f"case id {a!r} is a prefix of {b!r} (or repeated): the "
                                      f"official VC script would read {b!r}'s panels as {a!r}'s")


def write_official_layout(panels: Sequence[Image.Image], case_id: str, out_dir: str | Path,
                          *, start: int = 0) -> list[Path]:
    """Write a case's panels as ``out_dir/{case_id}_{k:04d}.png`` (RGB PNG), row-major.

    Returns:
        the paths written, in panel order (existing files of the same name are replaced).

    Raises:
        OfficialLayoutError: no panels, a non-image panel, or a bad case id.
    """
    if not panels:
        raise OfficialLayoutError(f"case {case_id!r}: no panels to write")
    names = [official_file_name(case_id, k, start=start) for k in range(len(panels))]
    for k, p in enumerate(panels):
        if not isinstance(p, Image.Image):
            raise OfficialLayoutError(f"case {case_id!r}: panel {k} is a {type(p).__name__}, "
                                      "not a PIL image")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, p in zip(names, panels):
        p.convert("RGB").save(out / name, format="PNG")
        paths.append(out / name)
    return paths


def load_official_bench(dataset: Any, consistency: Any, alignment: Any = None
                        ) -> tuple[list[dict[str, Any]], dict[str, list]]:
    """Cases from T2IS-Bench's own files (``T2IS-Bench.json``, ``prompt_consistency.json``,
    optionally ``prompt_alignment.json``; paths or decoded objects), read as the official
    scripts read them (:mod:`paco.data.t2is_bench_files`: the layouts; alignment sub-entries in
    file order are the panels, vqa_alignment.py:61-64).

    A case missing from ``prompt_consistency.json`` (or null there, or whose every criterion is
    null or blank) is kept with criteria ``{}``: VC skips it as test_prompt_consistency.py
    lines 69-73 do, PA still scores its alignment (the importer
    :mod:`paco.data.t2is_bench_import` refuses such a case instead).

    Returns:
        ``(cases, report)``: one case per dataset entry in file order (``n_panels`` =
        ``output_image_count``, the expected panels; ``criteria`` ``{}`` where the case has
        none, which :func:`aggregate_vc` skips as the official code does;
        ``task_name_case_id``), and ``{"dropped_criteria": [...], "dropped_dimensions": [...],
        "ignored_extra_objects": [...], "alignment_without_case": [case_id]}``
        (:func:`paco.data.t2is_bench_files.official_criteria`).

    Raises:
        CriteriaFormatError: unreadable or invalid JSON, or an entry of the wrong shape.
    """
    dataset, consistency, alignment = load_official_files(dataset, consistency, alignment, error=CriteriaFormatError)
    report: dict[str, list] = {"dropped_criteria": [], "dropped_dimensions": [], "ignored_extra_objects": [],
                               "alignment_without_case": sorted(set(alignment) - set(dataset))}
    cases = []
    for cid, meta in dataset.items():
        n = meta.get("output_image_count") if isinstance(meta, Mapping) else None
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise CriteriaFormatError(f"T2IS-Bench.json[{cid!r}]: output_image_count must be "
                                      f"an int >= 0, got {n!r}")
        entry = consistency.get(cid)  # lines 70-71: criteria_data.get(case_id, {}) falsy -> VC skips the case
        crit = {} if entry is None else parse_criteria(official_criteria(cid, entry, report,
                                                                         error=CriteriaFormatError))
        al = alignment.get(cid)
        if al is not None and not isinstance(al, Mapping):
            raise CriteriaFormatError(f"prompt_alignment[{cid!r}] must be an object {{sub_id: criteria}}")
        case = {"case_id": cid, "n_panels": n, "criteria": crit,
                "alignment": None if al is None else list(al.values()),
                "task_name_case_id": meta.get("task_name_case_id")}
        _normalise_case(case)
        cases.append(case)
    return cases, report


def to_official_json(cases: Iterable[Mapping[str, Any]]) -> tuple[dict, dict, dict]:
    """The three official JSON objects for these cases, so the official scripts can score panels
    written by :func:`write_official_layout` unchanged: ``(T2IS-Bench.json,
    prompt_consistency.json, prompt_alignment.json)`` in the layouts of
    :func:`load_official_bench` (sub ids ``"0000"``, ``"0001"``, ...; cases without alignment
    are left out of the third).

    Raises:
        T2ISBenchError / CriteriaFormatError: a malformed case.
    """
    dataset, consistency, alignment = {}, {}, {}
    for case in cases:
        c = _normalise_case(case)
        cid = c["case_id"]
        dataset[cid] = {"task_name_case_id": case.get("task_name_case_id") or cid,
                        "output_image_count": c["n_panels"]}
        if c["criteria"]:
            consistency[cid] = {d: [dict(items)] for d, items in c["criteria"].items()}
        if c["alignment"] is not None:
            alignment[cid] = {f"{k:04d}": dict(e) for k, e in enumerate(c["alignment"])}
    return dataset, consistency, alignment
