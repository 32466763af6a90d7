"""The T2IS-Bench protocol (paper Table 3): questions, panel pairs, aggregation, Avg.

Exact to the benchmark's official evaluation code, chengyou-jia/T2IS (commit a40b858):

* visual consistency (VC): ``T2IS_Eval/test_prompt_consistency.py``. For each case, each
  criterion of the dimensions ``Style``, ``Identity``, ``Logic`` (lines 99-115) is asked of every
  unordered panel pair ``i < j`` (lines 119-120), both panels requested at 512 x 512 (line
  126-127), with the question :data:`VC_QUESTION` (line 128); the score is the soft-max of the
  ``Yes`` and ``No`` first-token logits (lines 152-158). Per criterion the mean over pairs
  (171-174), per dimension the mean over its criteria, 0.0 for a dimension with no score
  (176-182); across cases each dimension averages only its cases with a score ``> 0`` (218-234:
  "Only add non-zero scores"; a dimension no case scores stays 0.0); VC is the mean of the three
  (236-237). Cases with no criteria (69-73) or no image (94-96) are skipped.
* prompt alignment (PA): ``T2IS_Eval/vqa_alignment.py``. Each panel is scored against each of
  its ``Entity``, ``Attribute``, ``Relation`` criteria (line 7, 26-31) with VQAScore
  (``clip-flant5-xxl``, line 9), whose question is :data:`PA_QUESTION` (t2v_metrics
  ``t2v_metrics/models/vqascore_models/clip_t5_model.py`` lines 8-9); per panel the mean over
  each dimension's criteria (34-39); across panels the plain mean over the panels found (77-94),
  a missing image skipped (19-20, 88-89).
* Avg and aesthetics: the released code has neither. :func:`t2is_avg` is inferred from paper
  Table 3 (see there). Aesthetics is taken as given; this module never makes one up.

Panels (cutting, the VC resize) and the official file layout (``{case_id}_{k:04d}.png``, the
benchmark's JSON files): :mod:`paco.benchmark.t2is_panels`.

A *case* is a plain dict: ``case_id`` (str), ``criteria`` (``{dimension: {name: text}}`` or the
prompts table's JSON string of it), ``n_panels`` (int, the panels present; 0 when the sample has
no image) and, for PA, ``alignment`` (one ``{"Entity": [text, ...], "Attribute": [...],
"Relation": [...]}`` per panel, row-major). :func:`case_from_prompt_row` builds one from a
``prompts.parquet`` row, :func:`paco.benchmark.t2is_panels.load_official_bench` from the
benchmark's JSON files.
A score record is a dict with the question's keys (as :func:`vc_questions` /
:func:`pa_questions` return them) plus ``score`` (float in [0, 1]); the caller groups records by
variant and evaluator before aggregating.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from paco.core.io import ArtifactError
from paco.data.panel_prompts import PromptFormatError, parse_layout

__all__ = [
    "VC_DIMENSIONS", "PA_DIMENSIONS", "VC_QUESTION", "PA_QUESTION", "AVG_WEIGHTS",
    "T2ISBenchError", "CriteriaFormatError", "ScoreError", "OfficialLayoutError",
    "parse_criteria", "grid_shape", "case_from_prompt_row", "vc_pairs", "vc_questions",
    "vc_case_scores", "aggregate_vc", "pa_questions", "aggregate_pa", "t2is_avg", "t2is_metrics",
]

#: The dimensions VC scores, in the official loop order (test_prompt_consistency.py:99-106).
VC_DIMENSIONS = ("Style", "Identity", "Logic")
#: The PA dimensions (vqa_alignment.py:7).
PA_DIMENSIONS = ("Entity", "Attribute", "Relation")
#: test_prompt_consistency.py:128, verbatim (``{criterion}`` is the criterion's text).
VC_QUESTION = "Do images meet the following criteria? {criterion} Please answer Yes or No."
#: linzhiqiu/t2v_metrics 8e106a5 clip_t5_model.py:9 ``default_question_template``, verbatim (answer ``"Yes"``, line 10).
PA_QUESTION = 'Does this figure show "{}"? Please answer yes or no.'
#: Avg weights of (aesthetics, mean PA, mean VC), inferred from paper Table 3.
AVG_WEIGHTS = (0.2, 0.3, 0.5)


class T2ISBenchError(ArtifactError):
    """A T2IS-Bench input is malformed or inconsistent (base of this module's errors)."""


class CriteriaFormatError(T2ISBenchError):
    """Criteria (a case's, or the benchmark's JSON files) are not of the documented shape."""


class ScoreError(T2ISBenchError):
    """A score is missing, repeated, unexpected, or not a finite number in [0, 1]."""


class OfficialLayoutError(T2ISBenchError):
    """Panels cannot be written in the official ``{case_id}_{k:04d}.png`` layout."""


# --------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------


def _nonempty_str(v: Any) -> bool:
    return isinstance(v, str) and bool(v.strip())


def parse_criteria(criteria: Any) -> dict[str, dict[str, str]]:
    """A case's VC criteria as ``{dimension: {name: text}}`` (order kept).

    Args:
        criteria: that dict, or its JSON string (the ``criteria`` column of ``prompts.parquet``),
            or ``None`` / ``{}`` (no criteria: the case is skipped by :func:`aggregate_vc`).

    Raises:
        CriteriaFormatError: invalid JSON, not an object, a dimension that is not a non-empty
            object, an empty name, or a text that is not a non-empty string.
    """
    if criteria is None:
        return {}
    if isinstance(criteria, str):
        try:
            criteria = json.loads(criteria)
        except json.JSONDecodeError as e:
            raise CriteriaFormatError(f"criteria is not valid JSON: {e.msg}") from None
    if not isinstance(criteria, Mapping):
        raise CriteriaFormatError(f"criteria must be an object {{dimension: {{name: text}}}}, "
                                  f"got {type(criteria).__name__}")
    out: dict[str, dict[str, str]] = {}
    for dim, items in criteria.items():
        if not _nonempty_str(dim) or not isinstance(items, Mapping) or not items:
            raise CriteriaFormatError(f"criteria[{dim!r}] must be a non-empty object {{name: text}}")
        for name, text in items.items():
            if not _nonempty_str(name) or not _nonempty_str(text):
                raise CriteriaFormatError(f"criteria[{dim!r}][{name!r}]: name and text must be "
                                          f"non-empty strings, got {text!r}")
        out[dim] = dict(items)
    return out


def _parse_alignment(alignment: Any, case_id: str) -> list[dict[str, list[str]]] | None:
    if alignment is None:
        return None
    if not isinstance(alignment, Sequence) or isinstance(alignment, str):
        raise CriteriaFormatError(f"case {case_id!r}: alignment must be a list (one entry a panel)")
    out = []
    for k, panel in enumerate(alignment):
        if not isinstance(panel, Mapping):
            raise CriteriaFormatError(f"case {case_id!r}: alignment[{k}] must be an object")
        entry = {}
        for dim in PA_DIMENSIONS:
            texts = panel.get(dim)
            # vqa_alignment.py:37-38 divides by len(criteria[dim]): a missing or empty list fails there
            if (not isinstance(texts, Sequence) or isinstance(texts, str) or not texts
                    or not all(_nonempty_str(t) for t in texts)):
                raise CriteriaFormatError(f"case {case_id!r}: alignment[{k}][{dim!r}] must be a "
                                          f"non-empty list of non-empty strings, got {texts!r}")
            entry[dim] = list(texts)
        out.append(entry)
    return out


def _normalise_case(case: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(case, Mapping):
        raise T2ISBenchError(f"a case must be a dict, got {type(case).__name__}")
    cid = case.get("case_id")
    if not _nonempty_str(cid):
        raise T2ISBenchError(f"a case needs a non-empty string case_id, got {cid!r}")
    n = case.get("n_panels")
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise T2ISBenchError(f"case {cid!r}: n_panels must be an int >= 0, got {n!r}")
    return {"case_id": cid, "n_panels": int(n), "criteria": parse_criteria(case.get("criteria")),
            "alignment": _parse_alignment(case.get("alignment"), cid)}


def grid_shape(layout: str | Sequence[int]) -> tuple[int, int]:
    """``(rows, cols)`` of ``"<rows>x<cols>"`` (:func:`paco.data.panel_prompts.parse_layout`, at
    least 2 panels) or of a pair of ints >= 1.

    Raises:
        T2ISBenchError: anything else.
    """
    if isinstance(layout, str):
        try:
            return parse_layout(layout)
        except PromptFormatError as e:
            raise T2ISBenchError(e.reason) from None
    try:
        rows, cols = layout
    except (TypeError, ValueError):
        raise T2ISBenchError(f"layout must be 'RxC' or (rows, cols), got {layout!r}") from None
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (rows, cols)):
        raise T2ISBenchError(f"layout must be two ints >= 1, got {layout!r}")
    return rows, cols


def case_from_prompt_row(row: Mapping[str, Any], *, case_id: str | None = None,
                         n_panels: int | None = None) -> dict[str, Any]:
    """A case dict from a ``prompts.parquet`` row (or a decoded T2IS jsonl record).

    Args:
        row: has ``criteria`` and either ``rows`` and ``cols`` or ``layout`` (``"2x2"``); the
            case id is ``case_id``, else ``prompt_id``, else ``idx``. An ``alignment`` entry
            (PA criteria, see the module docstring) is carried over when present.
        n_panels: the panels present; default ``rows * cols``.

    Returns:
        ``{"case_id", "rows", "cols", "n_panels", "criteria", "alignment"}``.

    Raises:
        T2ISBenchError: no case id or layout; CriteriaFormatError: malformed criteria.
    """
    if hasattr(row, "to_dict"):
        row = row.to_dict()
    cid = case_id or row.get("prompt_id") or row.get("idx")
    if "rows" in row and "cols" in row:
        rows, cols = int(row["rows"]), int(row["cols"])
    elif "layout" in row:
        rows, cols = grid_shape(row["layout"])
    else:
        raise T2ISBenchError(f"row {cid!r} has neither rows/cols nor layout")
    case = {"case_id": None if cid is None else str(cid), "rows": rows, "cols": cols,
            "n_panels": rows * cols if n_panels is None else n_panels,
            "criteria": row.get("criteria"), "alignment": row.get("alignment")}
    return {**case, **_normalise_case(case)}


# --------------------------------------------------------------------------------------------
# visual consistency
# --------------------------------------------------------------------------------------------


def vc_pairs(n_panels: int) -> list[tuple[int, int]]:
    """Every unordered pair ``(i, j)``, ``i < j``, of ``n_panels`` panels in the official order
    (test_prompt_consistency.py:119-120): ``n * (n - 1) / 2`` pairs."""
    return [(i, j) for i in range(n_panels) for j in range(i + 1, n_panels)]


def _vc_dimensions(criteria: Mapping[str, Any], extra: bool) -> list[str]:
    dims = [d for d in VC_DIMENSIONS if d in criteria]
    return dims + ([d for d in criteria if d not in VC_DIMENSIONS] if extra else [])


def vc_questions(case: Mapping[str, Any], *, extra_dimensions: bool = True) -> list[dict[str, Any]]:
    """The VC questions of one case: each criterion x each panel pair.

    Order: dimensions Style, Identity, Logic (then, with ``extra_dimensions``, the case's other
    dimensions such as ``Surroundings``, which the official code ignores and
    :func:`aggregate_vc` reports apart), criteria in the case's order, pairs as :func:`vc_pairs`.

    Returns:
        one dict a question: ``case_id``, ``dimension``, ``criterion`` (name),
        ``criterion_text``, ``panels`` (``(i, j)``, 0-based row-major), ``question``
        (:data:`VC_QUESTION` filled), ``official`` (bool: the dimension counts in VC).
        Empty for a case with no criteria or fewer than 2 panels.

    Raises:
        T2ISBenchError / CriteriaFormatError: a malformed case.
    """
    c = _normalise_case(case)
    out = []
    for dim in _vc_dimensions(c["criteria"], extra_dimensions):
        for name, text in c["criteria"][dim].items():
            for pair in vc_pairs(c["n_panels"]):
                out.append({"case_id": c["case_id"], "dimension": dim, "criterion": name,
                            "criterion_text": text, "panels": pair,
                            "question": VC_QUESTION.format(criterion=text),
                            "official": dim in VC_DIMENSIONS})
    return out


def _check_score(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0.0 <= v <= 1.0:
        raise ScoreError(f"{where}: a score must be a finite number in [0, 1], got {v!r}")
    return float(v)


def _index_scores(records: Iterable[Mapping[str, Any]], key_fields: Sequence[str]
                  ) -> dict[tuple, float]:
    out: dict[tuple, float] = {}
    for r in records:
        try:
            key = tuple(tuple(int(p) for p in r[f]) if f == "panels" else r[f] for f in key_fields)
        except (KeyError, TypeError, ValueError) as e:
            raise ScoreError(f"a score record needs {list(key_fields)}; {r!r}: {e}") from None
        if key in out:
            raise ScoreError(f"two scores for {key}")
        out[key] = _check_score(r.get("score"), str(key))
    return out


def _take(scores: dict[tuple, float], key: tuple) -> float:
    try:
        return scores.pop(key)
    except KeyError:
        raise ScoreError(f"no score for {key}") from None


def _case_vc(c: dict[str, Any], scores: dict[tuple, float]) -> dict[str, Any]:
    """One case's per-criterion and per-dimension scores (test_prompt_consistency.py:105-185)."""
    crit_means: dict[str, dict[str, float]] = {}
    dims: dict[str, float] = {}
    pairs = vc_pairs(c["n_panels"])
    for dim in _vc_dimensions(c["criteria"], True):
        crit_means[dim] = {}
        for name in c["criteria"][dim]:
            values = [_take(scores, (c["case_id"], dim, name, p)) for p in pairs]
            if values:  # lines 172-174: a criterion with no pair adds no score
                crit_means[dim][name] = sum(values) / len(values)
    for dim in list(VC_DIMENSIONS) + [d for d in crit_means if d not in VC_DIMENSIONS]:
        s = list(crit_means.get(dim, {}).values())
        dims[dim] = sum(s) / len(s) if s else 0.0  # lines 178-182
    official = [dims[d] for d in VC_DIMENSIONS]
    return {"criteria": crit_means, "dimensions": {d: dims[d] for d in VC_DIMENSIONS},
            "extra_dimensions": {d: v for d, v in dims.items() if d not in VC_DIMENSIONS},
            "overall": sum(official) / len(official)}  # line 185


def vc_case_scores(case: Mapping[str, Any], scores: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One case's VC scores, exact to test_prompt_consistency.py:171-185.

    Args:
        case: a case dict with at least 2 panels for non-zero scores.
        scores: one record per question of :func:`vc_questions` (``case_id``, ``dimension``,
            ``criterion``, ``panels``, ``score`` = P(Yes) in [0, 1]).

    Returns:
        ``{"criteria": {dim: {name: mean over pairs}}, "dimensions": {Style, Identity, Logic:
        mean over criteria, 0.0 when the case lacks the dimension}, "extra_dimensions":
        {other dim: same}, "overall": mean of the three}``.

    Raises:
        ScoreError: a question without a score, a score for no question of the case, a
            repeated score, or a score outside [0, 1].
    """
    c = _normalise_case(case)
    idx = _index_scores(scores, ("case_id", "dimension", "criterion", "panels"))
    out = _case_vc(c, idx)
    if idx:
        raise ScoreError(f"{len(idx)} score(s) match no question of case {c['case_id']!r}: "
                         f"{sorted(idx)[:3]}")
    return out


def _nonzero_mean(values: Sequence[float]) -> tuple[float, int]:
    """Lines 219-234: the mean of the values > 0 (0.0 when none) and their count."""
    total, count = 0.0, 0
    for v in values:
        if v > 0:
            total += v
            count += 1
    return (total / count if count else 0.0), count


def _check_unique(cases: Sequence[dict[str, Any]]) -> None:
    seen: set[str] = set()
    for c in cases:
        if c["case_id"] in seen:
            raise T2ISBenchError(f"case_id {c['case_id']!r} appears twice")
        seen.add(c["case_id"])


def aggregate_vc(cases: Iterable[Mapping[str, Any]], scores: Iterable[Mapping[str, Any]]
                 ) -> dict[str, Any]:
    """Benchmark VC over cases, exact to test_prompt_consistency.py:61-237.

    A case with no criteria (lines 69-73) or ``n_panels == 0`` (lines 94-96) is skipped and
    listed. Each scored case gets the three dimension scores of :func:`vc_case_scores` (0.0 for
    a dimension it lacks); each dimension then averages the cases where it is ``> 0`` (lines
    224-226: strictly positive, so a case that lacks the dimension drops out, and so would a
    present dimension scoring exactly 0.0); a dimension with no such case is 0.0 and still
    counts in VC = (Style + Identity + Logic) / 3 (line 237). Other dimensions (``Surroundings``)
    are aggregated the same way under ``extra_dimensions`` and never enter VC. Sums run in case
    order, as the official loops do, so values match bit for bit given the same scores.

    Args:
        cases: case dicts (module docstring); case ids unique.
        scores: records as :func:`vc_case_scores` takes, for all cases.

    Returns:
        ``{"identity", "style", "logic", "vc"}`` (floats in [0, 1]; all ``None`` when no case
        was scored), ``"n_cases"`` (scored), ``"n_nonzero"`` ({Identity, Style, Logic: cases
        counted}), ``"skipped"`` ([{"case_id", "reason"}]), ``"extra_dimensions"``
        ({dim: {"mean", "n_nonzero", "n_cases"}}), ``"cases"`` ({case_id: per-case dict}).

    Raises:
        T2ISBenchError: a malformed or repeated case; ScoreError: as :func:`vc_case_scores`, or
            a score for a skipped or unknown case.
    """
    normal = [_normalise_case(c) for c in cases]
    _check_unique(normal)
    idx = _index_scores(scores, ("case_id", "dimension", "criterion", "panels"))
    per_case: dict[str, dict[str, Any]] = {}
    skipped = []
    for c in normal:
        if not c["criteria"]:
            skipped.append({"case_id": c["case_id"], "reason": "no criteria"})
        elif c["n_panels"] == 0:
            skipped.append({"case_id": c["case_id"], "reason": "no images"})
        else:
            per_case[c["case_id"]] = _case_vc(c, idx)
    if idx:
        raise ScoreError(f"{len(idx)} score(s) match no question of a scored case: {sorted(idx)[:3]}")
    result: dict[str, Any] = {"n_cases": len(per_case), "skipped": skipped, "cases": per_case,
                              "n_nonzero": {}, "extra_dimensions": {}}
    finals = {}
    for dim in VC_DIMENSIONS:
        finals[dim], result["n_nonzero"][dim] = _nonzero_mean(
            [r["dimensions"][dim] for r in per_case.values()])
    extra_names = list(dict.fromkeys(d for r in per_case.values() for d in r["extra_dimensions"]))
    for dim in extra_names:
        vals = [r["extra_dimensions"][dim] for r in per_case.values() if dim in r["extra_dimensions"]]
        mean, count = _nonzero_mean(vals)
        result["extra_dimensions"][dim] = {"mean": mean, "n_nonzero": count, "n_cases": len(vals)}
    if not per_case:  # the official script would print 0.0; nothing was measured
        result.update(identity=None, style=None, logic=None, vc=None)
        return result
    result.update(identity=finals["Identity"], style=finals["Style"], logic=finals["Logic"],
                  vc=sum(finals[d] for d in VC_DIMENSIONS) / len(VC_DIMENSIONS))
    return result


# --------------------------------------------------------------------------------------------
# prompt alignment
# --------------------------------------------------------------------------------------------


def pa_questions(case: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The PA questions of one case: each present panel x each of its criteria.

    Panel ``k`` (0-based row-major) is asked about ``alignment[k]``, the official ``sub_id``
    number ``k`` in file order (vqa_alignment.py:64); panels ``k >= n_panels`` have no image and
    are not asked (lines 19-20); panels beyond ``len(alignment)`` have no criteria and are not
    asked either (the official loop runs over the criteria file).

    Returns:
        one dict a question: ``case_id``, ``panel`` (k), ``dimension`` (Entity, Attribute,
        Relation), ``criterion_index``, ``criterion`` (text), ``question``
        (:data:`PA_QUESTION` filled). Empty without ``alignment``.

    Raises:
        T2ISBenchError / CriteriaFormatError: a malformed case or alignment entry.
    """
    c = _normalise_case(case)
    out = []
    for k, entry in enumerate(c["alignment"] or []):
        if k >= c["n_panels"]:
            break
        for dim in PA_DIMENSIONS:
            for i, text in enumerate(entry[dim]):
                out.append({"case_id": c["case_id"], "panel": k, "dimension": dim,
                            "criterion_index": i, "criterion": text,
                            "question": PA_QUESTION.format(text)})
    return out


def aggregate_pa(cases: Iterable[Mapping[str, Any]], scores: Iterable[Mapping[str, Any]]
                 ) -> dict[str, Any]:
    """Benchmark PA over panels, exact to vqa_alignment.py:26-97 (in float64, where the official
    code sums float32 torch tensors: differences of about 1e-7).

    Per panel and dimension the mean of its criteria's scores (lines 36-39); each dimension's
    benchmark value is the sum over panels divided by the number of panels scored (lines 81-94),
    so a case weighs by its panel count. Panels without an image are skipped and counted.

    Args:
        cases: case dicts with ``alignment``; cases without it are listed, not scored.
        scores: one record per :func:`pa_questions` question (``case_id``, ``panel``,
            ``dimension``, ``criterion_index``, ``score`` in [0, 1]; VQAScore or P(Yes)).

    Returns:
        ``{"entity", "attribute", "relation"}`` (panel-weighted means) and ``"pa"`` (their
        mean, not in the official code; the Avg's PA term), all ``None`` when no panel was
        scored; ``"n_panels"`` (scored), ``"skipped_panels"`` ([{"case_id", "panel",
        "reason"}]), ``"cases_without_alignment"`` ([case_id]), ``"panels"``
        ({(case_id, k): {dim: mean}}).

    Raises:
        T2ISBenchError: a malformed or repeated case; ScoreError: a question without a score,
            a score for no question, a repeated or out-of-range score.
    """
    normal = [_normalise_case(c) for c in cases]
    _check_unique(normal)
    idx = _index_scores(scores, ("case_id", "panel", "dimension", "criterion_index"))
    totals = {d: 0.0 for d in PA_DIMENSIONS}
    panels: dict[tuple[str, int], dict[str, float]] = {}
    skipped, no_alignment = [], []
    for c in normal:
        if c["alignment"] is None:
            no_alignment.append(c["case_id"])
            continue
        for k, entry in enumerate(c["alignment"]):
            if k >= c["n_panels"]:
                skipped.append({"case_id": c["case_id"], "panel": k, "reason": "no image"})
                continue
            dims = {}
            for dim in PA_DIMENSIONS:
                vals = [_take(idx, (c["case_id"], k, dim, i)) for i in range(len(entry[dim]))]
                dims[dim] = sum(vals) / len(vals)
                totals[dim] += dims[dim]
            panels[(c["case_id"], k)] = dims
    if idx:
        raise ScoreError(f"{len(idx)} score(s) match no PA question: {sorted(idx)[:3]}")
    n = len(panels)
    means = {d.lower(): (totals[d] / n if n else None) for d in PA_DIMENSIONS}
    pa = sum(means.values()) / len(means) if n else None
    return {**means, "pa": pa, "n_panels": n, "skipped_panels": skipped,
            "cases_without_alignment": no_alignment, "panels": panels}


# --------------------------------------------------------------------------------------------
# Avg
# --------------------------------------------------------------------------------------------


def t2is_avg(aesthetics: float | None, *, entity: float | None, attribute: float | None,
             relation: float | None, identity: float | None, style: float | None,
             logic: float | None) -> float | None:
    """Table 3's Avg: ``0.2 Aes + 0.3 mean(Entity, Attribute, Relation) + 0.5 mean(Identity,
    Style, Logic)``.

    Inferred from paper Table 3 (PaCo-RL, arXiv 2512.04784): neither the paper's text nor the
    released T2IS code defines it; these weights reproduce all ten rows of the table's
    Qwen2.5-VL column to three decimals. ``aesthetics`` is on the table's 0-1
    scale (how the paper scaled its aesthetic score is not published).

    Returns:
        the Avg in [0, 1], or ``None`` when any input is ``None`` (no aesthetics scored, no PA
        criteria): never a made-up number.

    Raises:
        ScoreError: an input that is not a number in [0, 1].
    """
    parts = {"aesthetics": aesthetics, "entity": entity, "attribute": attribute,
             "relation": relation, "identity": identity, "style": style, "logic": logic}
    if any(v is None for v in parts.values()):
        return None
    p = {k: _check_score(v, k) for k, v in parts.items()}
    w_aes, w_pa, w_vc = AVG_WEIGHTS
    pa = (p["entity"] + p["attribute"] + p["relation"]) / 3
    vc = (p["identity"] + p["style"] + p["logic"]) / 3
    return w_aes * p["aesthetics"] + w_pa * pa + w_vc * vc


def t2is_metrics(vc: Mapping[str, Any], pa: Mapping[str, Any] | None = None,
                 aesthetics: float | None = None) -> dict[str, float | None]:
    """The ``metrics.json`` entry of one variant and evaluator: ``identity, style, logic, vc,
    entity, attribute, relation, pa, aesthetics, avg`` from :func:`aggregate_vc` and
    :func:`aggregate_pa` results (``None`` where not measured; Avg by :func:`t2is_avg`)."""
    pa = pa or {}
    out = {k: vc.get(k) for k in ("identity", "style", "logic", "vc")}
    out.update({k: pa.get(k) for k in ("entity", "attribute", "relation", "pa")})
    out["aesthetics"] = aesthetics
    out["avg"] = t2is_avg(aesthetics, **{k: out[k] for k in (
        "entity", "attribute", "relation", "identity", "style", "logic")})
    return out
