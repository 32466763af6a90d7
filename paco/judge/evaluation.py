"""Judge benchmarks: ConsistencyRank (paper Table 2) and EditReward-style pairwise accuracy
(paper Table 1), for the trained judge and the baselines (base judge zero-shot, CLIP-I).

ConsistencyRank: each held-out ranking instance has a reference panel and 4 candidates; a
scorer gives each (reference, candidate) a consistency score, the predicted order sorts
candidates by score (:func:`paco.judge.metrics.order_from_scores`) and is compared with the reference
order by :func:`paco.judge.metrics.consistency_rank_metrics`. Significance: a one-sample t-test of the
per-instance accuracy against chance (0.25 for 4 candidates), on instances and, more
conservatively, on per-prompt means (instances of one prompt share images), and a paired test
of the trained judge against each baseline.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from PIL import Image

from paco.core.io import ArtifactError, decode_image
from paco.judge.metrics import chance_levels, chance_test, consistency_rank_metrics, order_from_scores

#: scorer(list of (reference image, candidate image, instruction)) -> scores (higher = more consistent)
PairScorer = Callable[[Sequence[tuple[Image.Image, Image.Image, str]]], list[float]]


def rank_predictions(
    instances: pd.DataFrame,
    panels: dict[str, Image.Image],
    instruction_of: dict[str, str],
    scorer: PairScorer,
    name: str,
    *,
    progress: Callable[[Any], Any] = lambda it: it,
    chunk: int = 64,
) -> pd.DataFrame:
    """Score every (reference, candidate) of every instance and order the candidates.

    Args:
        instances: ``rank_instances.parquet`` rows (instance_id, prompt_id, ref_panel_id,
            candidate_panel_ids, ranking).
        panels: panel_id -> decoded image.
        instruction_of: prompt_id -> judge instruction.
        scorer: batch scorer; must return one finite float per triple.

    Returns:
        One row per instance: instance_id, prompt_id, scorer, scores (per candidate, candidate
        order), predicted_order / reference_order (candidate indices, best first).

    Raises:
        ArtifactError: a scorer returned the wrong count or a non-finite score (never replaced).
    """
    triples, keys = [], []
    for inst in instances.itertuples(index=False):
        for k, cand in enumerate(inst.candidate_panel_ids):
            triples.append((panels[inst.ref_panel_id], panels[cand], instruction_of[inst.prompt_id]))
            keys.append((inst.instance_id, k))
    scores: list[float] = []
    for i in progress(range(0, len(triples), chunk)):
        got = scorer(triples[i : i + chunk])
        if len(got) != len(triples[i : i + chunk]):
            raise ArtifactError(f"scorer {name} returned {len(got)} scores for {len(triples[i:i + chunk])} pairs")
        scores += [float(s) for s in got]
    if not np.all(np.isfinite(scores)):
        bad = keys[int(np.flatnonzero(~np.isfinite(scores))[0])]
        raise ArtifactError(f"scorer {name}: non-finite score for instance {bad[0]} candidate {bad[1]}")
    rows, pos = [], 0
    for inst in instances.itertuples(index=False):
        cands = list(inst.candidate_panel_ids)
        s = scores[pos : pos + len(cands)]
        pos += len(cands)
        rows.append(
            {
                "instance_id": inst.instance_id,
                "prompt_id": inst.prompt_id,
                "scorer": name,
                "scores": s,
                "predicted_order": order_from_scores(s),
                "reference_order": [cands.index(c) for c in inst.ranking],
            }
        )
    return pd.DataFrame.from_records(rows)


def summarise_rankings(pred: pd.DataFrame) -> dict[str, Any]:
    """ConsistencyRank metrics of one scorer, with chance tests on instances and prompts."""
    m = consistency_rank_metrics(
        pred["predicted_order"].map(list).tolist(), pred["reference_order"].map(list).tolist(), per_instance=True
    )
    per = m.pop("per_instance")
    n_cand = len(pred["reference_order"].iloc[0])
    chance = chance_levels(n_cand)
    acc = np.asarray(per["accuracy"])
    by_prompt = pd.Series(acc).groupby(pred["prompt_id"].to_numpy()).mean().to_numpy()
    m["chance"] = {"accuracy": chance["accuracy"], "kendall_tau": 0.0}
    m["accuracy_vs_chance"] = _test(acc, chance["accuracy"])
    m["accuracy_vs_chance_per_prompt"] = _test(by_prompt, chance["accuracy"])
    m["kendall_tau_vs_chance"] = _test(np.asarray(per["kendall_tau"]), 0.0)
    return m


def _test(values: np.ndarray, chance: float) -> dict[str, float]:
    if len(values) < 2:
        return {"n": len(values)}
    t = chance_test(values, chance)
    return {k: t[k] for k in ("mean", "p_value", "ci_low", "ci_high", "n")}


def paired_comparison(a: pd.DataFrame, b: pd.DataFrame, metric: str = "accuracy") -> dict[str, Any]:
    """Paired test of scorer ``a`` minus scorer ``b`` on the same instances.

    Top-level keys (``mean``, ``p_value``, ``ci_low``, ``ci_high``, ``n``): one-sided ``a > b``
    t-test of the per-instance differences of ``metric`` against 0
    (:func:`paco.judge.metrics.chance_test`). ``per_prompt``: the same test on the per-prompt means of
    the differences (instances of one prompt share panels and are not independent, so this is
    the conservative statement; ``n`` is the prompt count).
    """
    from paco.judge.metrics import rank_metrics

    merged = a.merge(b, on="instance_id", suffixes=("_a", "_b"), validate="one_to_one")
    diff = np.array(
        [
            rank_metrics(list(r.predicted_order_a), list(r.reference_order_a))[metric]
            - rank_metrics(list(r.predicted_order_b), list(r.reference_order_b))[metric]
            for r in merged.itertuples(index=False)
        ]
    )
    by_prompt = pd.Series(diff).groupby(merged["prompt_id_a"].to_numpy()).mean().to_numpy()
    return {**_test(diff, 0.0), "per_prompt": _test(by_prompt, 0.0)}


# --------------------------------------------------------------------------------------------
# EditReward-style pairwise benchmark
# --------------------------------------------------------------------------------------------


def read_edit_benchmark(path: str | Path) -> pd.DataFrame:
    """Read an EditReward-Bench-format jsonl: one object per line with ``instruction``,
    ``input_image``, ``output_a``, ``output_b`` (image paths relative to the file, ``output_a``
    the preferred edit) and ``dimension`` (e.g. ``consistency``, ``instruction_following``,
    ``overall``).

    Raises:
        ArtifactError: a missing file, key or image (names the line).
    """
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: no EditReward benchmark file")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"{path}:{n}: invalid JSON ({exc})") from exc
        missing = {"instruction", "input_image", "output_a", "output_b", "dimension"} - rec.keys()
        if missing:
            raise ArtifactError(f"{path}:{n}: missing key(s) {sorted(missing)}")
        for key in ("input_image", "output_a", "output_b"):
            file = path.parent / rec[key]
            rec[key] = decode_image(file.read_bytes() if file.is_file() else None, what=f"{path}:{n} {key}")
        rows.append(rec)
    return pd.DataFrame.from_records(rows)


def edit_accuracy(bench: pd.DataFrame, score_sc: PairScorer, score_pf: PairScorer) -> dict[str, Any]:
    """Pairwise accuracy per dimension: the preferred output must score higher.

    Scores: semantic consistency ``SC = P_yes(edit_sc)``, prompt following
    ``PF = P_yes(edit_pf)``, overall ``sqrt(SC * PF)`` (the reference GRPO editing reward);
    ``consistency`` uses SC, ``instruction_following`` PF, anything else the overall score.
    """
    from paco.judge.templates import EDIT_PF, EDIT_SC

    def scores(out_col: str) -> tuple[np.ndarray, np.ndarray]:
        sc = score_sc([(r.input_image, getattr(r, out_col), EDIT_SC.format(prompt=r.instruction)) for r in bench.itertuples()])
        pf = score_pf([(r.input_image, getattr(r, out_col), EDIT_PF.format(prompt=r.instruction)) for r in bench.itertuples()])
        return np.asarray(sc), np.asarray(pf)

    sc_a, pf_a = scores("output_a")
    sc_b, pf_b = scores("output_b")
    chosen = {
        "consistency": (sc_a, sc_b),
        "instruction_following": (pf_a, pf_b),
    }
    out: dict[str, Any] = {}
    for dim, group in bench.groupby("dimension"):
        idx = group.index.to_numpy()
        a, b = chosen.get(dim, (np.sqrt(sc_a * pf_a), np.sqrt(sc_b * pf_b)))
        out[dim] = {"accuracy": float(np.mean(a[idx] > b[idx])), "n": len(idx)}
    return out


def decode_panels(panels: pd.DataFrame, needed: set[str]) -> dict[str, Image.Image]:
    """Decode the needed panels once (panel_id -> RGB image)."""
    sub = panels[panels["panel_id"].isin(needed)]
    missing = needed - set(sub["panel_id"])
    if missing:
        raise ArtifactError(f"instances reference panels missing from panels.parquet: {sorted(missing)[:5]}")
    return {pid: decode_image(c, what=f"panel {pid}") for pid, c in zip(sub["panel_id"], sub["image"])}
