"""GEdit-Bench on ``final_samples``' edits (stage ``benchmark@<subtask>``, ``protocol: gedit``;
paper Table 4): the SC and PQ requests of every case and variant, their answers from every
evaluator, the ``scores.parquet`` rows and the metrics, by :mod:`paco.benchmark.gedit_bench`
(stepfun-ai/Step1X-Edit ``GEdit-Bench/``, VIEScore).

Each case (an edit item and seed, :mod:`paco.benchmark.cases`) gives per variant the official
requests (:func:`~paco.benchmark.gedit_bench.item_requests`: the edited image in RGB resized to the
input's size; SC with ``[input, edited]``, PQ with the edited image). ``scoring: reply``: the
official VIEScore loop (:func:`~paco.benchmark.gedit_bench.score_item`: the reply parsed as
``mllm_output_to_dict``, one re-query of an item that does not parse, then unparsed, or the
official random guess with ``official_random``), asked round by round for all cases at once.
``scoring: expected_score``: one first-token request per SC and PQ, scored
:func:`~paco.benchmark.gedit_bench.expected_score` (the embedded default's stand-in: a tiny model
writes no JSON). Per variant and evaluator the cells EN, EN-I, CN, CN-I of
:func:`~paco.benchmark.gedit_bench.aggregate` (the macro mean over task types: the official 11 when
every item's type is one of them, else the types present, listed); the ``-I`` cells need the items'
``intersection_exist`` (GEdit-Bench's ``Intersection_exist``; an item whose value is null is outside
them, as ``calculate_statistics.py``'s truthiness test reads it), else they are null with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from paco.benchmark.cases import VARIANTS, ask_in_chunks, finite_or_none, paired, score_frame, select_samples
from paco.benchmark.gedit_bench import (OFFICIAL_TASK_TYPES, GEditError, NoScoreTokenError, aggregate, expected_score,
                                        item_requests, item_scores, parse_reply, score_item)
from paco.benchmark.serving import BenchEvaluator, ask_evaluators
from paco.core.io import ArtifactError, decode_image
from paco.judge.chat import png_bytes

#: the edits.parquet columns read (``intersection_exist`` too, when there)
EDIT_COLUMNS = ["item_id", "task_type", "instruction", "language", "input_image"]
#: the cells reported (metrics.json keys), as aggregate names them
CELLS = ("en", "en_i", "cn", "cn_i")
KINDS = ("sc", "pq")


@dataclass
class GEditPlan:
    """The units of a run (one per case and variant: its fields and ``{"sc": (png list, text),
    "pq": ...}`` requests), whether the ``-I`` cells can be scored, and the task types averaged."""

    units: list[dict[str, Any]] = field(default_factory=list)
    intersection: bool = False
    task_types: list[str] = field(default_factory=list)


def plan_gedit(samples: pd.DataFrame, edits: pd.DataFrame, *, seeds_per_prompt: int | None,
               max_prompts: int | None) -> GEditPlan:
    """The requests of the chosen cases (module docstring).

    Raises:
        ArtifactError: a sample whose item is not in ``edits``, an undecodable image, a non-bool
            ``intersection_exist``, and the errors of :func:`~paco.benchmark.cases.select_samples`.
    """
    chosen = select_samples(samples, seeds_per_prompt=seeds_per_prompt, max_prompts=max_prompts)
    by_id = {str(r["item_id"]): r for r in edits.to_dict("records")}
    plan = GEditPlan()
    sources: dict[str, tuple[Any, bytes]] = {}
    for row in chosen.to_dict("records"):
        item = by_id.get(row["prompt_id"])
        if item is None:
            raise ArtifactError(f"sample {row['sample_id']}: edit item {row['prompt_id']!r} is not in the edits table")
        if row["prompt_id"] not in sources:
            image = decode_image(item["input_image"], what=f"edit {row['prompt_id']} input_image")
            sources[row["prompt_id"]] = (image, png_bytes(image))
        source, source_png = sources[row["prompt_id"]]
        edited = decode_image(row["image"], what=f"sample {row['sample_id']}")
        reqs = item_requests(str(item["instruction"]), source, edited)
        ready = png_bytes(reqs["pq"][1][0])
        inter = item.get("intersection_exist")
        if isinstance(inter, np.bool_):
            inter = bool(inter)
        if inter is not None and not isinstance(inter, bool):
            raise ArtifactError(f"edit {row['prompt_id']}: intersection_exist must be a bool, got {inter!r}")
        plan.units.append({"sample_id": row["sample_id"], "case_id": row["case_id"], "variant": row["variant"],
                           "task_type": str(item["task_type"]), "language": str(item["language"]),
                           "intersection": inter,
                           "requests": {"sc": ([source_png, ready], reqs["sc"][0]), "pq": ([ready], reqs["pq"][0])}})
    # the -I cells need the field; a row without it is outside them, as the official truthiness test reads None
    plan.intersection = any(u["intersection"] is not None for u in plan.units)
    present = sorted({u["task_type"] for u in plan.units})
    plan.task_types = list(OFFICIAL_TASK_TYPES) if set(present) <= set(OFFICIAL_TASK_TYPES) else present
    return plan


class _NeedRound(Exception):
    """score_item asked for a round not fetched yet."""


def _expected(ev: BenchEvaluator, plan: GEditPlan, cfg: Any, chunk: int, position: int) -> list[dict[str, Any]]:
    reqs = [u["requests"][k] for u in plan.units for k in KINDS]
    tops = ask_in_chunks(lambda part: ev.score_token_logprobs_many(part, text_first=cfg.text_first), reqs,
                         desc=f"gedit {ev.name}", chunk=chunk, position=position)
    out = []
    for n, _ in enumerate(plan.units):
        got = {}
        for k, kind in enumerate(KINDS):
            try:
                got[kind] = expected_score(tops[2 * n + k])
            except NoScoreTokenError:
                got[kind] = None
        res = {"sc": None, "pq": None, "overall": None, "parsed": False, "rounds": 1, "guessed": [],
               "sc_scores": None if got["sc"] is None else [got["sc"]],
               "pq_scores": None if got["pq"] is None else [got["pq"]], "replies": {}}
        if got["sc"] is not None and got["pq"] is not None:
            res["sc"], res["pq"], res["overall"] = item_scores([got["sc"]], [got["pq"]])
            res["parsed"] = True
        out.append(res)
    return out


def _replies(ev: BenchEvaluator, plan: GEditPlan, cfg: Any, chunk: int, position: int) -> list[dict[str, Any]]:
    """The official loop for every unit, asked round by round (each round one batch)."""
    texts: dict[tuple[int, str, int], str] = {}
    results: list[dict[str, Any] | None] = [None] * len(plan.units)
    todo, rnd = list(range(len(plan.units))), 0
    while todo:
        keys = [(n, kind) for n in todo for kind in KINDS]
        got = ask_in_chunks(lambda part: ev.replies(part, cfg.max_tokens, text_first=cfg.text_first, attempt=rnd),
                            [plan.units[n]["requests"][kind] for n, kind in keys],
                            desc=f"gedit {ev.name} round {rnd}", chunk=chunk, position=position)
        for (n, kind), text in zip(keys, got, strict=True):
            texts[(n, kind, rnd)] = text
        again = []
        for n in todo:
            def ask(kind: str, r: int, n: int = n) -> str:
                if (n, kind, r) not in texts:
                    raise _NeedRound
                return texts[(n, kind, r)]
            try:
                res = score_item(ask, official_random=cfg.official_random, seed=cfg.seed)
            except _NeedRound:
                again.append(n)
                continue
            res["replies"] = {(kind, r): texts[(n, kind, r)] for kind in KINDS for r in range(res["rounds"])}
            results[n] = res
        todo, rnd = again, rnd + 1
    return results  # type: ignore[return-value]


def ask_gedit(plan: GEditPlan, evaluators: Sequence[BenchEvaluator], cfg: Any, *, together: bool, chunk: int
              ) -> dict[str, list[dict[str, Any]]]:
    """Every evaluator's item results (:func:`~paco.benchmark.gedit_bench.score_item`'s dict plus
    ``replies`` {(kind, round): text}), ``{name: results in unit order}``; ``cfg``:
    ``benchmark.<k>.gedit``."""
    def work(ev: BenchEvaluator) -> list[dict[str, Any]]:
        fn = _expected if cfg.scoring == "expected_score" else _replies
        return fn(ev, plan, cfg, chunk, evaluators.index(ev))

    def first(ev: BenchEvaluator) -> bool:
        reqs = [u["requests"][k] for u in plan.units for k in KINDS]
        if cfg.scoring == "expected_score":
            return ev.pending("score_tokens", reqs, text_first=cfg.text_first) > 0
        return ev.pending("reply", reqs, max_tokens=cfg.max_tokens, text_first=cfg.text_first) > 0

    answers = ask_evaluators(list(evaluators), work, together=together, first=first)
    return {ev.name: a for ev, a in zip(evaluators, answers, strict=True)}


def _rows(plan: GEditPlan, name: str, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for unit, res in zip(plan.units, results, strict=True):
        base = {"sample_id": unit["sample_id"], "case_id": unit["case_id"], "variant": unit["variant"],
                "evaluator": name, "task_type": unit["task_type"], "language": unit["language"]}
        for kind in KINDS:
            for r in range(res["rounds"]):
                last = r == res["rounds"] - 1
                reply = res["replies"].get((kind, r))
                scores = res[f"{kind}_scores"] if last else parse_reply(reply)
                rows.append({**base, "protocol": kind, "question": unit["requests"][kind][1], "reply": reply,
                             "score_list": None if scores is None else [float(s) for s in scores],
                             "score": None if scores is None else float(min(scores)), "parsed": scores is not None,
                             "attempt": r, "guessed": last and kind in res["guessed"]})
    return rows


def _partial_cells(scores: dict[str, dict[str, dict[str, Any]]]) -> dict[str, list[str]]:
    """``{cell: task types missing (union over variants and evaluators)}`` of the cells that have a
    scored item but miss a task type averaged: there the figure is a mean over fewer task types
    than GEdit-Bench's (the official ``np.mean``, calculate_statistics.py:84-117, would be NaN). A
    cell with no scored item is not listed (its figures are null, and ``not_scored`` says why)."""
    out: dict[str, set[str]] = {}
    for per_eval in scores.values():
        for cells in per_eval.values():
            for c, v in cells.items():
                if v["items"] > 0 and v["missing_task_types"]:
                    out.setdefault(c, set()).update(v["missing_task_types"])
    return {c: sorted(out[c]) for c in CELLS if c in out}


def score_gedit(plan: GEditPlan, answers: dict[str, list[dict[str, Any]]], cfg: Any
                ) -> tuple[pd.DataFrame, dict[str, Any], dict[str, Any]]:
    """``(scores.parquet, metrics, report)`` of the answers.

    metrics: ``protocol``, ``scoring``, ``cases``, ``scores`` ({variant: {evaluator: {en, en_i, cn,
    cn_i: {sc, pq, overall, items, unparsed, missing_task_types}}}}: null figures where a cell has no
    scored item or, for ``-I``, no ``intersection_exist``; ``missing_task_types``: the task types
    averaged with no scored item in the cell, left out of its mean, null for a cell not computed),
    ``lora_minus_base`` ({evaluator: {overall, sc, pq:
    paired test over the cases both variants scored}}), ``unparsed`` and ``guessed``
    ({variant: {evaluator: count}}). report: the task types averaged, ``official_task_types``
    (true only when the types averaged are GEdit-Bench's 11 and no scored cell misses one),
    ``partial_cells`` (:func:`_partial_cells`), the per-task-type figures, the task types missing
    per cell, and why a cell is not scored.
    """
    rows, scores, pairs, unparsed, guessed, detail = [], {}, {}, {}, {}, {}
    for name, results in answers.items():
        rows += _rows(plan, name, results)
        per_case: dict[str, dict[str, dict[str, float | None]]] = {v: {} for v in VARIANTS}
        for variant in VARIANTS:
            picked = [(u, r) for u, r in zip(plan.units, results, strict=True) if u["variant"] == variant]
            agg_rows = [{"task_type": u["task_type"], "language": u["language"], "sc": r["sc"], "pq": r["pq"],
                         "parsed": r["parsed"], **({"Intersection_exist": bool(u["intersection"])}
                                                   if plan.intersection else {})} for u, r in picked]
            try:
                cells = aggregate(agg_rows, task_types=plan.task_types, intersection=plan.intersection,
                                  require_all_task_types=False)
            except GEditError as exc:
                raise ArtifactError(f"GEdit-Bench aggregation ({variant}, {name}): {exc}") from None
            scores.setdefault(variant, {})[name] = {
                c: {k: finite_or_none(cells[c][k]) if c in cells else None for k in ("sc", "pq", "overall")}
                | {"items": cells[c]["items"] if c in cells else 0, "unparsed": cells[c]["unparsed"] if c in cells
                   else 0, "missing_task_types": list(cells[c]["missing_task_types"]) if c in cells else None}
                for c in CELLS}
            detail.setdefault(variant, {})[name] = {
                c: {"task_types": cells[c]["task_types"], "missing_task_types": cells[c]["missing_task_types"]}
                for c in CELLS if c in cells} | {"other_languages": cells["other_languages"]}
            unparsed.setdefault(variant, {})[name] = sum(1 for _, r in picked if not r["parsed"])
            guessed.setdefault(variant, {})[name] = sum(len(r["guessed"]) for _, r in picked)
            per_case[variant] = {u["case_id"]: {k: r[k] for k in ("overall", "sc", "pq")} for u, r in picked}
        pairs[name] = {k: paired({c: v[k] for c, v in per_case["base"].items()},
                                 {c: v[k] for c, v in per_case["lora"].items()}) for k in ("overall", "sc", "pq")}
    metrics = {"protocol": "gedit", "scoring": cfg.scoring, "cases": sum(u["variant"] == "base" for u in plan.units),
               "scores": scores, "lora_minus_base": pairs, "unparsed": unparsed, "guessed": guessed}
    not_scored = {}
    if not plan.intersection:
        not_scored["en_i, cn_i"] = ("the edit items have no intersection_exist (GEdit-Bench's Intersection_exist): "
                                    "the photos source, or an import without that field")
    languages = {u["language"].strip().casefold() for u in plan.units}
    for lang in ("en", "cn"):
        if lang not in languages:
            not_scored[lang] = f"no edit item in language {lang!r}"
    partial = _partial_cells(scores)
    official = plan.task_types == list(OFFICIAL_TASK_TYPES) and not partial
    report = {"task_types": plan.task_types, "official_task_types": official, "partial_cells": partial,
              "detail": detail, "not_scored": not_scored}
    return score_frame(rows), metrics, report
