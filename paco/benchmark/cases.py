"""What both benchmark protocols of the ``benchmark@<subtask>`` stage share: the cases chosen from
``final_samples``' samples, the paired LoRA-minus-base comparison over cases, the
``scores.parquet`` layout and the asking of an evaluator in progress-reported chunks.

A *case* is one (prompt or edit item, seed) of ``final_samples``: its two samples (variants
``base`` and ``lora``) share the initial noise (:mod:`paco.grpo.final_samples`), so the LoRA's
effect is the paired difference over cases. Its id is ``<prompt_id>-s<seed>``, the sample ids
``<case_id>-<variant>`` (final_samples' own ``sample_id``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pandas as pd
import pyarrow as pa
from tqdm import tqdm

from paco.core.io import ArtifactError
from paco.core.statistics import paired_test

#: final_samples' variants, in their order (the LoRA minus the base is the comparison)
VARIANTS = ("base", "lora")
#: the samples.parquet columns the stage reads
SAMPLE_COLUMNS = ["sample_id", "prompt_id", "seed", "variant", "image"]
#: scores.parquet: one row per question asked, in this order, and its Arrow types: ``panels``
#: the panel pair (vc) or panel (pa, aesthetics) indices, 0-based row-major, null for GEdit; ``score``
#: P(Yes) in [0, 1] (vc, pa; pa by t2v_metrics: its VQAScore), the LAION predictor's raw AVA-scale
#: score (protocol ``aesthetics``, no question), or the official min of the parsed score list (sc,
#: pq), NaN when unparsed;
#: ``score_list`` the parsed list (sc, pq; null for vc, pa and unparsed replies); ``reply`` the raw
#: text (sc, pq with ``scoring: reply``); ``attempt`` 0, or 1 for the official re-query;
#: ``guessed`` the official random guess (``official_random``); ``task_type``, ``language``: GEdit's
SCORE_SCHEMA = pa.schema([
    ("sample_id", pa.string()), ("case_id", pa.string()), ("variant", pa.string()), ("evaluator", pa.string()),
    ("protocol", pa.string()), ("dimension", pa.string()), ("criterion", pa.string()), ("panels", pa.list_(pa.int64())),
    ("question", pa.string()), ("score", pa.float64()), ("score_list", pa.list_(pa.float64())), ("reply", pa.string()),
    ("parsed", pa.bool_()), ("attempt", pa.int64()), ("guessed", pa.bool_()), ("task_type", pa.string()),
    ("language", pa.string())])
SCORE_COLUMNS = SCORE_SCHEMA.names


def case_id(prompt_id: str, seed: int) -> str:
    """``<prompt_id>-s<seed>``: a case (final_samples' sample id without its variant)."""
    return f"{prompt_id}-s{int(seed)}"


def select_samples(samples: pd.DataFrame, *, seeds_per_prompt: int | None, max_prompts: int | None
                   ) -> pd.DataFrame:
    """The samples of the cases scored: seeds ``< seeds_per_prompt`` (``None``: all) of the first
    ``max_prompts`` prompts in ``prompt_id`` order (``None``: all), both variants each, sorted by
    (prompt_id, seed, variant), with a ``case_id`` column.

    Args:
        samples: ``samples.parquet`` rows (:data:`SAMPLE_COLUMNS`).

    Raises:
        ArtifactError: no sample, an unknown variant, a (prompt, seed, variant) twice, or a case
            without both variants.
    """
    df = samples.copy()
    df["prompt_id"] = df["prompt_id"].astype(str)
    df["seed"] = df["seed"].astype(int)
    unknown = sorted(set(df["variant"]) - set(VARIANTS))
    if unknown:
        raise ArtifactError(f"samples: unknown variants {unknown} (final_samples writes {list(VARIANTS)})")
    if df.duplicated(["prompt_id", "seed", "variant"]).any():
        raise ArtifactError("samples: a (prompt_id, seed, variant) appears twice")
    if seeds_per_prompt is not None:
        df = df[df["seed"] < seeds_per_prompt]
    prompts = sorted(df["prompt_id"].unique())
    if max_prompts is not None:
        df = df[df["prompt_id"].isin(prompts[:max_prompts])]
    if df.empty:
        raise ArtifactError("samples: no sample to score (seeds_per_prompt / max_prompts leave none)")
    counts = df.groupby(["prompt_id", "seed"])["variant"].nunique()
    lonely = [case_id(p, s) for (p, s), n in counts.items() if n != len(VARIANTS)]
    if lonely:
        raise ArtifactError(f"samples: cases {lonely[:5]} lack one of the variants {list(VARIANTS)}")
    df["case_id"] = [case_id(p, s) for p, s in zip(df["prompt_id"], df["seed"], strict=True)]
    order = {v: i for i, v in enumerate(VARIANTS)}
    df = df.assign(_v=df["variant"].map(order)).sort_values(["prompt_id", "seed", "_v"]).drop(columns="_v")
    return df.reset_index(drop=True)


def paired(base: Mapping[str, float | None], lora: Mapping[str, float | None]) -> dict[str, Any]:
    """LoRA minus base over the cases both variants scored (``{case_id: value}``, ``None``: not
    scored): :func:`paco.core.statistics.paired_test` (``n``, ``mean_diff``, two-sided ``t_p`` and
    ``wilcoxon_p``; ``None`` p-values when every difference is 0); with fewer than 2 such cases,
    ``mean_diff`` over those (``None`` for none) and no p-values."""
    ids = [c for c in base if c in lora and base[c] is not None and lora[c] is not None]
    a = [float(lora[c]) for c in ids]
    b = [float(base[c]) for c in ids]
    if len(ids) >= 2:
        return paired_test(a, b)
    return {"n": len(ids), "mean_diff": (a[0] - b[0]) if ids else None, "t_p": None, "wilcoxon_p": None}


def ask_in_chunks(method: Callable[[list[Any]], list[Any]], requests: Sequence[Any], *, desc: str,
                  chunk: int, position: int = 0) -> list[Any]:
    """``method`` (an evaluator's batch method) over ``requests`` in chunks of ``chunk``, with a
    tqdm bar ``desc`` (questions); the answers in order."""
    out: list[Any] = []
    with tqdm(total=len(requests), desc=desc, unit="q", position=position, leave=True) as bar:
        for start in range(0, len(requests), max(1, chunk)):
            part = list(requests[start:start + chunk])
            out += method(part)
            bar.update(len(part))
    return out


def score_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """``scores.parquet`` from row dicts (:data:`SCORE_COLUMNS`; a missing key is null); ``score``
    float64 (NaN where unparsed), ``panels`` and ``score_list`` lists or null, ``parsed`` and
    ``guessed`` bool, ``attempt`` int64."""
    df = pd.DataFrame([{c: r.get(c) for c in SCORE_COLUMNS} for r in rows], columns=SCORE_COLUMNS)
    df["score"] = pd.to_numeric(df["score"], errors="raise").astype("float64")
    df["parsed"] = df["parsed"].astype(bool)
    df["guessed"] = df["guessed"].fillna(False).astype(bool)
    df["attempt"] = df["attempt"].fillna(0).astype("int64")
    return df


def finite_or_none(v: Any) -> float | None:
    """``v`` as a float, or ``None`` for ``None`` / NaN (metrics.json holds no NaN)."""
    if v is None:
        return None
    v = float(v)
    return None if math.isnan(v) else v


def monitor_summary(samples: pd.DataFrame, *, seeds_per_prompt: int | None, max_prompts: int | None
                    ) -> dict[str, Any]:
    """The reward-hacking monitors final sampling measured (``samples.parquet``'s
    ``monitor_<name>`` columns, :mod:`paco.grpo.monitors`) over the cases the benchmark scores
    (:func:`select_samples`): per monitor the ``base`` and ``lora`` means (over finite values;
    a monitor is NaN where a panel is too small for it) and ``lora_minus_base`` (:func:`paired`);
    empty for samples without monitor columns (written before the monitors existed).

    Raises:
        ArtifactError: see :func:`select_samples`.
    """
    import numpy as np

    columns = [c for c in samples.columns if c.startswith("monitor_")]
    if not columns:
        return {}
    df = select_samples(samples, seeds_per_prompt=seeds_per_prompt, max_prompts=max_prompts)
    out: dict[str, Any] = {}
    for col in columns:
        per = {v: {c: (float(x) if np.isfinite(x) else None) for c, x in zip(g["case_id"], g[col], strict=True)}
               for v, g in df.groupby("variant")}
        means = {v: [x for x in per.get(v, {}).values() if x is not None] for v in VARIANTS}
        if not all(means.values()):
            continue
        out[col.removeprefix("monitor_")] = {"base": float(np.mean(means["base"])), "lora": float(np.mean(means["lora"])),
                                             "lora_minus_base": paired(per["base"], per["lora"])}
    return out
