"""T2IS-Bench on ``final_samples``' grids (stage ``benchmark@<subtask>``, ``protocol: t2is``;
paper Table 3): the questions, their answers from every evaluator, the ``scores.parquet`` rows
and the metrics, by :mod:`paco.benchmark.t2is_bench` (the official aggregation) and
:mod:`paco.benchmark.t2is_panels` (the official panels).

Each case (a prompt and seed, :mod:`paco.benchmark.cases`) is one T2IS-Bench case per variant:
its grid cut row-major into the prompt's ``rows x cols`` equal cells
(:func:`~paco.benchmark.t2is_panels.cut_panels`), each panel resized as the official VC code
feeds Qwen2.5-VL (:func:`~paco.benchmark.t2is_panels.resize_for_vc`, 504 px) and asked the
official VC question of every criterion for every pair ``i < j``
(:func:`~paco.benchmark.t2is_bench.vc_questions`, ``Style`` / ``Identity`` / ``Logic`` and any
other dimension, reported apart). With ``prompt_alignment: yes_no``, each panel (as cut) is asked
the VQAScore question of each of its Entity / Attribute / Relation criteria (the prompts table's
``alignment`` column, when it has one) as a yes/no log-prob: an approximation of the official
``clip-flant5-xxl`` VQAScore. Aesthetics are never scored (``None``), so Avg is ``None`` too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from paco.benchmark.cases import VARIANTS, ask_in_chunks, paired, score_frame, select_samples
from paco.benchmark.serving import BenchEvaluator, ask_evaluators
from paco.benchmark.t2is_bench import aggregate_pa, aggregate_vc, case_from_prompt_row, pa_questions, t2is_metrics
from paco.benchmark.t2is_bench import vc_questions
from paco.benchmark.t2is_panels import cut_panels, resize_for_vc
from paco.core.io import ArtifactError, decode_image
from paco.judge.chat import png_bytes

#: the prompts.parquet columns read
PROMPT_COLUMNS = ["prompt_id", "rows", "cols", "criteria"]
#: the per-case figures compared LoRA minus base
PAIRED_KEYS = ("vc", "identity", "style", "logic")


@dataclass
class T2ISPlan:
    """The questions of a run: ``cases[variant]`` (case dicts of :mod:`paco.benchmark.t2is_bench`),
    ``questions`` (one dict per question: the scores.parquet fields but ``evaluator`` and
    ``score``) and ``requests`` (``(images as PNG bytes, text)``, aligned with ``questions``)."""

    cases: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {v: [] for v in VARIANTS})
    questions: list[dict[str, Any]] = field(default_factory=list)
    requests: list[tuple[list[bytes], str]] = field(default_factory=list)


def _alignment(row: dict[str, Any]) -> Any:
    value = row.get("alignment")
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"prompt {row['prompt_id']}: alignment is not JSON ({exc.msg})") from None
    return value


def plan_t2is(samples: pd.DataFrame, prompts: pd.DataFrame, *, seeds_per_prompt: int | None,
              max_prompts: int | None, prompt_alignment: str) -> T2ISPlan:
    """The questions of the chosen cases (module docstring).

    Args:
        samples: ``samples.parquet`` (:data:`paco.benchmark.cases.SAMPLE_COLUMNS`).
        prompts: ``prompts.parquet`` (:data:`PROMPT_COLUMNS`, optionally ``alignment``).
        prompt_alignment: ``none`` or ``yes_no``.

    Raises:
        ArtifactError: a sample whose prompt is not in ``prompts``, an undecodable image, and the
            errors of :func:`~paco.benchmark.cases.select_samples` and the T2IS modules.
    """
    chosen = select_samples(samples, seeds_per_prompt=seeds_per_prompt, max_prompts=max_prompts)
    by_id = {str(r["prompt_id"]): r for r in prompts.to_dict("records")}
    plan = T2ISPlan()
    for row in chosen.to_dict("records"):
        prompt = by_id.get(row["prompt_id"])
        if prompt is None:
            raise ArtifactError(f"sample {row['sample_id']}: prompt {row['prompt_id']!r} is not in the prompts table")
        grid = decode_image(row["image"], what=f"sample {row['sample_id']}")
        panels = cut_panels(grid, (int(prompt["rows"]), int(prompt["cols"])))
        case = case_from_prompt_row({**prompt, "alignment": _alignment(prompt)}, case_id=row["case_id"],
                                    n_panels=len(panels))
        plan.cases[row["variant"]].append(case)
        base = {"sample_id": row["sample_id"], "case_id": row["case_id"], "variant": row["variant"]}
        vc_images = [png_bytes(resize_for_vc(p)) for p in panels]
        for q in vc_questions(case):
            i, j = q["panels"]
            plan.questions.append({**base, "protocol": "vc", "dimension": q["dimension"], "criterion": q["criterion"],
                                   "panels": [i, j], "question": q["question"]})
            plan.requests.append(([vc_images[i], vc_images[j]], q["question"]))
        if prompt_alignment == "yes_no":
            pa_images = [png_bytes(p.convert("RGB")) for p in panels]
            for q in pa_questions(case):
                plan.questions.append({**base, "protocol": "pa", "dimension": q["dimension"],
                                       "criterion": q["criterion"], "panels": [q["panel"]],
                                       "question": q["question"], "criterion_index": q["criterion_index"]})
                plan.requests.append(([pa_images[q["panel"]]], q["question"]))
    return plan


def ask_t2is(plan: T2ISPlan, evaluators: Sequence[BenchEvaluator], *, together: bool, chunk: int
             ) -> dict[str, list[float]]:
    """Every evaluator's P(Yes) of every question (``{name: scores in question order}``)."""
    def work(ev: BenchEvaluator) -> list[float]:
        return ask_in_chunks(ev.yes_probabilities, plan.requests, desc=f"t2is {ev.name}", chunk=chunk,
                             position=evaluators.index(ev))

    first = (lambda ev: ev.pending("yes_no", plan.requests) > 0)
    answers = ask_evaluators(list(evaluators), work, together=together, first=first)
    return {ev.name: a for ev, a in zip(evaluators, answers, strict=True)}


def _records(plan: T2ISPlan, scores: list[float], variant: str, protocol: str) -> list[dict[str, Any]]:
    out = []
    for q, s in zip(plan.questions, scores, strict=True):
        if q["variant"] == variant and q["protocol"] == protocol:
            rec = {"case_id": q["case_id"], "dimension": q["dimension"], "score": s}
            if protocol == "vc":
                rec.update(criterion=q["criterion"], panels=tuple(q["panels"]))
            else:
                rec.update(panel=q["panels"][0], criterion_index=q["criterion_index"])
            out.append(rec)
    return out


def score_t2is(plan: T2ISPlan, answers: dict[str, list[float]], *, prompt_alignment: str
               ) -> tuple[pd.DataFrame, dict[str, Any], dict[str, Any]]:
    """``(scores.parquet, metrics, report)`` of the answers.

    metrics: ``protocol``, ``cases``, ``questions`` ({vc, pa}: per variant and evaluator),
    ``scores`` ({variant: {evaluator: identity, style, logic, vc, entity, attribute, relation,
    pa, aesthetics, avg}}, :func:`~paco.benchmark.t2is_bench.t2is_metrics`; ``None`` where not
    measured), ``lora_minus_base`` ({evaluator: {vc, identity, style, logic: paired test over
    cases}}, per-case figures of :func:`~paco.benchmark.t2is_bench.aggregate_vc`: a dimension
    is compared over the cases that have a scored criterion of it, a case lacking it is left out
    of that test (its ``vc`` still counts the lacking dimension as 0, as the official per-case
    score does, test_prompt_consistency.py:178-185)), ``skipped_cases`` (no criteria or no
    image), ``unparsed`` (0: a yes/no answer always scores). report: per variant and evaluator the
    extra dimensions, skipped cases and panels, cases without alignment, and what is not scored.
    """
    rows, scores, pairs, detail = [], {}, {}, {}
    for name, values in answers.items():
        for q, s in zip(plan.questions, values, strict=True):
            rows.append({**{k: v for k, v in q.items() if k != "criterion_index"}, "evaluator": name, "score": s,
                         "parsed": True, "attempt": 0})
        per_case = {}
        for variant in VARIANTS:
            vc = aggregate_vc(plan.cases[variant], _records(plan, values, variant, "vc"))
            pa = (aggregate_pa(plan.cases[variant], _records(plan, values, variant, "pa"))
                  if prompt_alignment == "yes_no" else None)
            scores.setdefault(variant, {})[name] = t2is_metrics(vc, pa, aesthetics=None)
            # a dimension the case lacks is None here (the paired test skips the case), 0 only in its vc
            per_case[variant] = {cid: {"vc": c["overall"], **{k.lower(): v if c["criteria"].get(k) else None
                                                              for k, v in c["dimensions"].items()}}
                                 for cid, c in vc["cases"].items()}
            detail.setdefault(variant, {})[name] = {
                "extra_dimensions": vc["extra_dimensions"], "skipped_cases": vc["skipped"],
                "n_nonzero": vc["n_nonzero"],
                "pa": None if pa is None else {"n_panels": pa["n_panels"], "skipped_panels": pa["skipped_panels"],
                                               "cases_without_alignment": pa["cases_without_alignment"]}}
        pairs[name] = {k: paired({c: v[k] for c, v in per_case["base"].items()},
                                 {c: v[k] for c, v in per_case["lora"].items()}) for k in PAIRED_KEYS}
    n_vc = sum(1 for q in plan.questions if q["protocol"] == "vc" and q["variant"] == "base")
    n_pa = sum(1 for q in plan.questions if q["protocol"] == "pa" and q["variant"] == "base")
    first = next(iter(detail["base"].values()))
    metrics = {"protocol": "t2is", "cases": len(plan.cases["base"]), "questions": {"vc": n_vc, "pa": n_pa},
               "scores": scores, "lora_minus_base": pairs, "skipped_cases": len(first["skipped_cases"]),
               "unparsed": 0}
    not_scored = {"aesthetics": "the released T2IS code has no aesthetics metric; none is made up (Avg is null)"}
    if prompt_alignment == "none":
        not_scored["pa"] = "benchmark.<k>.t2is.prompt_alignment is none (Entity / Attribute / Relation not scored)"
    elif n_pa == 0:
        not_scored["pa"] = "no case has Entity / Attribute / Relation criteria (the prompts table has no alignment)"
    report = {"detail": detail, "not_scored": not_scored}
    return score_frame(rows), metrics, report
