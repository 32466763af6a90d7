"""T2IS-Bench's locally computed scores (stage ``benchmark@<subtask>``, ``protocol: t2is``): the
official VQAScore prompt alignment and the LAION aesthetics, both GPU extras at paper scale, both
optional (``benchmark.<k>.t2is``: ``prompt_alignment: t2v_metrics``, ``aesthetics: laion``), never
faked: a missing environment, package, weights file or model is a named error before any
evaluator is asked (:func:`check_local`).

* ``prompt_alignment: t2v_metrics``: each panel of :attr:`T2ISPlan.local_pa
  <paco.benchmark.t2is_run.T2ISPlan>` scored against its criteria by
  :func:`paco.benchmark.vqascore.vqascore_panels` (chengyou-jia/T2IS ``vqa_alignment.py``) in
  the separate t2v_metrics 3.0 environment ``vqascore_python`` (a subprocess, the weights read
  from ``vqascore_cache_dir``), all panels of the plan in one run, one score per question,
  aggregated by :func:`paco.benchmark.t2is_bench.aggregate_pa` as the yes/no
  approximation's are. The score does not depend on the VC evaluator: every evaluator column
  shows the same Entity / Attribute / Relation.
* ``aesthetics: laion``: every panel scored by :class:`paco.benchmark.aesthetics.LaionAesthetics`,
  aggregated by :func:`paco.benchmark.aesthetics.aggregate_aesthetics` (per case the mean, over
  cases the mean, / 10), a stand-in (the released T2IS code has no aesthetics).

The panels are cut again from the plan's sample images (:attr:`T2ISPlan.sources`) as
:func:`paco.benchmark.t2is_run.plan_t2is` cuts them, so no panel is held in memory between the
stages of the run. The scores are not cached: a rerun of the stage computes them again.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from paco.benchmark.aesthetics import aggregate_aesthetics
from paco.benchmark.cases import VARIANTS, paired
from paco.benchmark.t2is_panels import cut_panels, official_file_name
from paco.core.io import ArtifactError, decode_image

__all__ = ["VQASCORE_EVALUATOR", "AESTHETICS_EVALUATOR", "LocalScores", "check_local", "source_panels",
           "score_local", "local_pa_records", "local_rows", "aesthetics_summary", "aesthetics_values"]

#: the ``evaluator`` of the official VQAScore rows in scores.parquet
VQASCORE_EVALUATOR = "t2v_metrics:clip-flant5-xxl"
#: the ``evaluator`` of the aesthetics rows in scores.parquet (protocol ``aesthetics``)
AESTHETICS_EVALUATOR = "laion_aesthetics"


@dataclass
class LocalScores:
    """``pa``: VQAScore of each question of ``plan.local_pa`` (None: not scored); ``aesthetics``:
    ``{variant: {case_id: [raw score of each panel]}}`` (None: not scored)."""

    pa: list[float] | None = None
    aesthetics: dict[str, dict[str, list[float]]] | None = None


def check_local(plan: Any, t2is: Any) -> None:
    """Fail before the evaluators are asked when a configured local scorer cannot run.

    Args:
        plan: :class:`~paco.benchmark.t2is_run.T2ISPlan`.
        t2is: ``benchmark.<k>.t2is`` (:class:`paco.core.params.benchmark.T2ISProtocolParams`).

    Raises:
        VQAScoreUnavailableError: ``t2v_metrics`` chosen and PA questions planned, but the
            environment's preflight fails (:func:`paco.benchmark.vqascore.preflight`: no such
            interpreter, t2v_metrics not importable there, the model not listed, weights missing
            from the cache dir).
        VQAScoreError: the preflight failed otherwise (timeout, crash).
        AestheticWeightsError: ``laion`` and the weights file is missing.
        ArtifactError: ``laion`` and the CLIP directory is missing.
    """
    from paco.benchmark.aesthetics import weights_file
    from paco.benchmark.vqascore import OFFICIAL_MODEL, preflight

    if t2is.prompt_alignment == "t2v_metrics" and plan.local_pa:
        preflight(t2is.vqascore_python, t2is.vqascore_cache_dir, model=OFFICIAL_MODEL)
    if t2is.aesthetics == "laion":
        weights_file(t2is.aesthetics_weights)
        if not Path(t2is.aesthetics_clip).is_dir():
            raise ArtifactError(f"aesthetics laion: CLIP directory {t2is.aesthetics_clip} not found (a models role: "
                                "openai/clip-vit-large-patch14)")


def source_panels(plan: Any) -> Iterator[tuple[dict[str, Any], list[Image.Image]]]:
    """``(source, panels)`` of each sample of the plan, its grid cut row-major as in planning."""
    for src in plan.sources:
        grid = decode_image(src["image"], what=f"sample {src['sample_id']}")
        yield src, cut_panels(grid, (src["rows"], src["cols"]))


def _vqascore_inputs(plan: Any) -> tuple[list[tuple[str, str, int]], dict[tuple[str, str, int], list[int]]]:
    """The panels asked (variant, case_id, k) in order and, per panel, its questions' indices."""
    groups: dict[tuple[str, str, int], list[int]] = {}
    for i, q in enumerate(plan.local_pa):
        groups.setdefault((q["variant"], q["case_id"], q["panels"][0]), []).append(i)
    return list(groups), groups


def _score_pa(plan: Any, t2is: Any, device: str, tmp_dir: str | Path | None) -> list[float]:
    """VQAScore of every planned question: all panels in one worker run (one model load), each
    file under its official name in a folder per variant (``base/{case_id}_{k:04d}.png``)."""
    from paco.benchmark.vqascore import OFFICIAL_MODEL, vqascore_panels

    keys, groups = _vqascore_inputs(plan)
    wanted = set(keys)
    items: list[tuple[str, str, int]] = []

    def inputs() -> Iterator[tuple[str, Image.Image, list[str]]]:  # one grid decoded at a time
        for src, panels in source_panels(plan):
            for k in range(len(panels)):
                key = (src["variant"], src["case_id"], k)
                if key in wanted:
                    items.append(key)
                    yield (f"{key[0]}/{official_file_name(key[1], k)}", panels[k],
                           [plan.local_pa[i]["criterion"] for i in groups[key]])

    rows = vqascore_panels(inputs(), python=t2is.vqascore_python, cache_dir=t2is.vqascore_cache_dir,
                           model=OFFICIAL_MODEL, device=device, tmp_dir=tmp_dir)
    scores = [float("nan")] * len(plan.local_pa)
    for key, row in zip(items, rows, strict=True):
        for i, s in zip(groups[key], row, strict=True):
            scores[i] = s
    return scores


def score_local(plan: Any, t2is: Any, *, device: str | None = None, aesthetics: Any = None,
                tmp_dir: str | Path | None = None) -> LocalScores:
    """The configured local scores of the plan (module docstring).

    Args:
        plan: :class:`~paco.benchmark.t2is_run.T2ISPlan`.
        t2is: ``benchmark.<k>.t2is``.
        device: torch device of the models (VQAScore's in its worker too); default ``cuda`` when
            available, else ``cpu``.
        aesthetics: an already built aesthetic scorer (else :class:`paco.benchmark.aesthetics.LaionAesthetics`
            is built when needed).
        tmp_dir: where VQAScore's temporary panel files go (the system's temporary directory).

    Raises:
        the errors of :func:`check_local`, :func:`~paco.benchmark.vqascore.vqascore_panels`,
        :class:`~paco.benchmark.aesthetics.LaionAesthetics` and its ``scores``.
    """
    import torch

    out = LocalScores()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if t2is.prompt_alignment == "t2v_metrics" and plan.local_pa:
        out.pa = _score_pa(plan, t2is, device, tmp_dir)
    elif t2is.prompt_alignment == "t2v_metrics":
        out.pa = []
    if t2is.aesthetics == "laion":
        if aesthetics is None:
            from paco.benchmark.aesthetics import LaionAesthetics

            aesthetics = LaionAesthetics(t2is.aesthetics_clip, t2is.aesthetics_weights, device=device)
        out.aesthetics = {v: {} for v in VARIANTS}
        for src, panels in source_panels(plan):
            out.aesthetics[src["variant"]][src["case_id"]] = [float(s) for s in aesthetics.scores(panels)]
    return out


def local_pa_records(plan: Any, local: LocalScores, variant: str) -> list[dict[str, Any]]:
    """The VQAScore records of ``variant`` for :func:`~paco.benchmark.t2is_bench.aggregate_pa`.

    Raises:
        ArtifactError: questions planned but no VQAScore for them.
    """
    if not plan.local_pa:
        return []
    if local.pa is None or len(local.pa) != len(plan.local_pa):
        raise ArtifactError(f"{len(plan.local_pa)} VQAScore questions planned, "
                            f"{'none' if local.pa is None else len(local.pa)} scored")
    return [{"case_id": q["case_id"], "dimension": q["dimension"], "panel": q["panels"][0],
             "criterion_index": q["criterion_index"], "score": s}
            for q, s in zip(plan.local_pa, local.pa, strict=True) if q["variant"] == variant]


def local_rows(plan: Any, local: LocalScores) -> list[dict[str, Any]]:
    """scores.parquet rows of the local scores: one per VQAScore question (``protocol`` ``pa``,
    ``evaluator`` :data:`VQASCORE_EVALUATOR`, ``question`` the text t2v_metrics asks) and one per
    panel's aesthetics (``protocol`` ``aesthetics``, ``evaluator`` :data:`AESTHETICS_EVALUATOR`,
    ``panels`` [k], ``score`` the predictor's raw score on the AVA scale, no question)."""
    rows = []
    if local.pa:
        for q, s in zip(plan.local_pa, local.pa, strict=True):
            rows.append({**{k: v for k, v in q.items() if k != "criterion_index"}, "evaluator": VQASCORE_EVALUATOR,
                         "score": s, "parsed": True, "attempt": 0})
    if local.aesthetics:
        ids = {(s["variant"], s["case_id"]): s["sample_id"] for s in plan.sources}
        for variant, cases in local.aesthetics.items():
            for cid, values in cases.items():
                rows += [{"sample_id": ids[variant, cid], "case_id": cid, "variant": variant,
                          "evaluator": AESTHETICS_EVALUATOR, "protocol": "aesthetics", "panels": [k], "score": s,
                          "parsed": True, "attempt": 0} for k, s in enumerate(values)]
    return rows


def aesthetics_summary(local: LocalScores) -> dict[str, Any] | None:
    """metrics.json's ``aesthetics_laion``: per variant ``aggregate_aesthetics`` less its per-case
    dict, and ``lora_minus_base`` (paired over cases, AVA scale); None when not scored."""
    if local.aesthetics is None:
        return None
    agg = {v: aggregate_aesthetics(local.aesthetics[v]) for v in VARIANTS}
    out: dict[str, Any] = {"scale": "AVA rating (about 1-10); aesthetics = mean_raw / 10"}
    for v in VARIANTS:
        out[v] = {k: agg[v][k] for k in ("aesthetics", "mean_raw", "n_cases", "n_panels", "skipped_cases")}
    out["lora_minus_base"] = paired(agg["base"]["cases"], agg["lora"]["cases"])
    return out


def aesthetics_values(local: LocalScores) -> Mapping[str, float | None]:
    """``{variant: aesthetics on the 0-1 scale}`` (``None`` each when not scored)."""
    summary = aesthetics_summary(local)
    return {v: None if summary is None else summary[v]["aesthetics"] for v in VARIANTS}
