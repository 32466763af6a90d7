"""The reward ratio of a GRPO run: standardised growth per reward of ``plots/train.csv`` and the
ratio of the largest to the smallest (definitions: :mod:`paco.compare`)."""
from __future__ import annotations

import math
from typing import Mapping

import pandas as pd

from paco.compare.errors import MissingMetricError


def reward_names(train: pd.DataFrame) -> list[str]:
    """The reward names of a ``plots/train.csv`` (columns ``<k>_mean`` with a ``<k>_std``)."""
    return sorted(c[:-5] for c in train.columns
                  if c.endswith("_mean") and f"{c[:-5]}_std" in train.columns and c != "advantage_abs_mean")


def standardised_growth(train: pd.DataFrame, window: int) -> dict[str, float]:
    """``g_k`` of the :mod:`paco.compare` docstring per reward of a ``plots/train.csv`` (epochs sorted).

    Raises:
        MissingMetricError: no reward columns. ValueError: fewer than ``2 * window`` epochs,
            ``window < 1`` or a zero first-epoch std."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    t = train.sort_values("epoch")
    if len(t) < 2 * window:
        raise ValueError(f"reward ratio: {len(t)} epochs, need >= 2 x window = {2 * window}")
    names = reward_names(t)
    if not names:
        raise MissingMetricError(f"train.csv: no <reward>_mean / <reward>_std columns (has {list(t.columns)})")
    out = {}
    for k in names:
        sd = float(t[f"{k}_std"].iloc[0])
        if not sd > 0:
            raise ValueError(f"reward ratio: {k}_std of the first epoch is {sd}; cannot standardise")
        out[k] = (float(t[f"{k}_mean"].iloc[-window:].mean()) - float(t[f"{k}_mean"].iloc[:window].mean())) / sd
    return out


def reward_ratio(growth: Mapping[str, float]) -> float:
    """``max_k |g_k| / min_k |g_k|`` (``inf`` when a reward did not move at all).

    Raises:
        ValueError: fewer than 2 rewards."""
    if len(growth) < 2:
        raise ValueError(f"reward ratio needs >= 2 rewards, got {sorted(growth)}")
    mags = [abs(v) for v in growth.values()]
    return math.inf if min(mags) == 0 else max(mags) / min(mags)
