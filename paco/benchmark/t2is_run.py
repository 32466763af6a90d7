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
``clip-flant5-xxl`` VQAScore. With ``prompt_alignment: t2v_metrics`` the same panels and criteria
are scored by the official VQAScore instead (:mod:`paco.benchmark.t2is_local`, not asked of the
evaluators), and with ``aesthetics: laion`` every panel by the LAION aesthetic predictor; without
it aesthetics are not scored (``None``), and neither is Avg.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from paco.benchmark.cases import VARIANTS, ask_in_chunks, paired, score_frame, select_samples
from paco.benchmark.serving import BenchEvaluator, ask_evaluators
from paco.benchmark.t2is_bench import aggregate_pa, aggregate_vc, case_from_prompt_row, pa_questions, t2is_metrics
from paco.benchmark.t2is_bench import vc_questions
from paco.benchmark.t2is_local import LocalScores, aesthetics_summary, aesthetics_values, local_pa_records, local_rows
from paco.benchmark.t2is_panels import cut_panels, resize_for_vc
from paco.core.io import ArtifactError, decode_image
from paco.judge.chat import png_bytes

#: the prompts.parquet columns read
PROMPT_COLUMNS = ["prompt_id", "rows", "cols", "criteria"]
#: the per-case figures compared LoRA minus base
PAIRED_KEYS = ("vc", "identity", "style", "logic")
#: ``benchmark.<k>.t2is.prompt_alignment`` values (:class:`paco.core.params.benchmark.T2ISProtocolParams`)
PROMPT_ALIGNMENT = ("none", "yes_no", "t2v_metrics")


@dataclass
class T2ISPlan:
    """The questions of a run: ``cases[variant]`` (case dicts of :mod:`paco.benchmark.t2is_bench`),
    ``questions`` (one dict per question: the scores.parquet fields but ``evaluator`` and
    ``score``), ``requests`` (``(images as PNG bytes, text)``, aligned with ``questions``),
    ``local_pa`` (the PA questions scored by t2v_metrics, not asked of the evaluators, as
    ``questions``) and ``sources`` (one dict per sample: ``variant``, ``case_id``, ``sample_id``,
    ``image`` (the samples table's cell, not copied), ``rows``, ``cols``)."""

    cases: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {v: [] for v in VARIANTS})
    questions: list[dict[str, Any]] = field(default_factory=list)
    requests: list[tuple[list[bytes], str]] = field(default_factory=list)
    local_pa: list[dict[str, Any]] = field(default_factory=list)
    sources: list[dict[str, Any]] = field(default_factory=list)


def _alignment(row: dict[str, Any]) -> Any:
    value = row.get("alignment")
    if value is None or (isinstance(value, float) and math.isnan(value)):  # a null cell (pandas: NaN)
        return None
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
        prompt_alignment: ``none``, ``yes_no`` (PA asked of the evaluators) or ``t2v_metrics``
            (PA questions kept in ``local_pa``).

    Raises:
        ArtifactError: an unknown ``prompt_alignment``, a sample whose prompt is not in
            ``prompts``, an undecodable image, and the errors of
            :func:`~paco.benchmark.cases.select_samples` and the T2IS modules.
    """
    if prompt_alignment not in PROMPT_ALIGNMENT:
        raise ArtifactError(f"prompt_alignment {prompt_alignment!r}: one of {list(PROMPT_ALIGNMENT)}")
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
        plan.sources.append({**base, "image": row["image"], "rows": int(prompt["rows"]), "cols": int(prompt["cols"])})
        vc_images = [png_bytes(resize_for_vc(p)) for p in panels]
        for q in vc_questions(case):
            i, j = q["panels"]
            plan.questions.append({**base, "protocol": "vc", "dimension": q["dimension"], "criterion": q["criterion"],
                                   "panels": [i, j], "question": q["question"]})
            plan.requests.append(([vc_images[i], vc_images[j]], q["question"]))
        if prompt_alignment == "none":
            continue
        pa_images = [png_bytes(p.convert("RGB")) for p in panels] if prompt_alignment == "yes_no" else []
        for q in pa_questions(case):
            question = {**base, "protocol": "pa", "dimension": q["dimension"], "criterion": q["criterion"],
                        "panels": [q["panel"]], "question": q["question"], "criterion_index": q["criterion_index"]}
            if prompt_alignment == "t2v_metrics":
                plan.local_pa.append(question)
                continue
            plan.questions.append(question)
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


def _pa(plan: T2ISPlan, values: list[float], variant: str, prompt_alignment: str, local: LocalScores
        ) -> dict[str, Any] | None:
    """One variant's PA aggregate for one evaluator: its own yes/no answers, or the (evaluator-independent)
    VQAScore of ``local``; None when PA is not scored."""
    if prompt_alignment == "yes_no":
        return aggregate_pa(plan.cases[variant], _records(plan, values, variant, "pa"))
    if prompt_alignment == "t2v_metrics":
        return aggregate_pa(plan.cases[variant], local_pa_records(plan, local, variant))
    return None


def _not_scored(prompt_alignment: str, n_pa: int, local: LocalScores) -> dict[str, str]:
    not_scored = {}
    if local.aesthetics is None:  # aesthetics: none (the LAION stand-in is opt-in)
        not_scored["aesthetics"] = "the released T2IS code has no aesthetics metric; none is made up (Avg is null)"
    if prompt_alignment == "none":
        not_scored["pa"] = "benchmark.<k>.t2is.prompt_alignment is none (Entity / Attribute / Relation not scored)"
    elif n_pa == 0:
        not_scored["pa"] = "no case has Entity / Attribute / Relation criteria (the prompts table has no alignment)"
    return not_scored


def score_t2is(plan: T2ISPlan, answers: dict[str, list[float]], *, prompt_alignment: str,
               local: LocalScores | None = None) -> tuple[pd.DataFrame, dict[str, Any], dict[str, Any]]:
    """``(scores.parquet, metrics, report)`` of the answers and the local scores
    (:func:`paco.benchmark.t2is_local.score_local`: VQAScore with ``prompt_alignment: t2v_metrics``,
    the LAION aesthetics; default none).

    metrics: ``protocol``, ``cases``, ``questions`` ({vc, pa}: per variant and evaluator),
    ``scores`` ({variant: {evaluator: identity, style, logic, vc, entity, attribute, relation,
    pa, aesthetics, avg}}, :func:`~paco.benchmark.t2is_bench.t2is_metrics`; ``None`` where not
    measured; VQAScore PA and aesthetics are the same in every evaluator's entry),
    ``lora_minus_base`` ({evaluator: {vc, identity, style, logic: paired test over
    cases}}, per-case figures of :func:`~paco.benchmark.t2is_bench.aggregate_vc`: a dimension
    is compared over the cases that have a scored criterion of it, a case lacking it is left out
    of that test (its ``vc`` still counts the lacking dimension as 0, as the official per-case
    score does, test_prompt_consistency.py:178-185)), ``skipped_cases`` (no criteria or no
    image), ``unparsed`` (0: a yes/no answer always scores), ``aesthetics_laion``
    (:func:`~paco.benchmark.t2is_local.aesthetics_summary`; only when aesthetics are scored). report: per
    variant and evaluator the extra dimensions, skipped cases and panels, cases without alignment,
    and what is not scored.

    Raises:
        ArtifactError: ``t2v_metrics`` PA questions without their VQAScores; the aggregation's
            errors (:mod:`paco.benchmark.t2is_bench`).
    """
    local = local or LocalScores()
    aes = aesthetics_values(local)
    rows, scores, pairs, detail = [], {}, {}, {}
    for name, values in answers.items():
        for q, s in zip(plan.questions, values, strict=True):
            rows.append({**{k: v for k, v in q.items() if k != "criterion_index"}, "evaluator": name, "score": s,
                         "parsed": True, "attempt": 0})
        per_case = {}
        for variant in VARIANTS:
            vc = aggregate_vc(plan.cases[variant], _records(plan, values, variant, "vc"))
            pa = _pa(plan, values, variant, prompt_alignment, local)
            scores.setdefault(variant, {})[name] = t2is_metrics(vc, pa, aesthetics=aes[variant])
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
    rows += local_rows(plan, local)
    n_vc = sum(1 for q in plan.questions if q["protocol"] == "vc" and q["variant"] == "base")
    n_pa = sum(1 for q in plan.questions + plan.local_pa if q["protocol"] == "pa" and q["variant"] == "base")
    first = next(iter(detail["base"].values()))
    metrics = {"protocol": "t2is", "cases": len(plan.cases["base"]), "questions": {"vc": n_vc, "pa": n_pa},
               "scores": scores, "lora_minus_base": pairs, "skipped_cases": len(first["skipped_cases"]),
               "unparsed": 0}
    if local.aesthetics is not None:
        metrics["aesthetics_laion"] = aesthetics_summary(local)
    report = {"detail": detail, "not_scored": _not_scored(prompt_alignment, n_pa, local)}
    return score_frame(rows), metrics, report
