"""Group-relative advantages and multi-reward aggregation for PaCo-GRPO.

GRPO (Shao et al. 2024; Flow-GRPO) normalises each sample's reward within its prompt's group of
``G`` trajectories::

    A_i = (r_i - mean(r over i's group)) / max(std, 1e-6)

where ``std`` is the group's (population) standard deviation, or with ``global_std`` that of
all rewards of the epoch (the reference's ``PerPromptStatTracker(global_std=True)``, its
default). Advantages are later clipped to ``+-adv_clip_max`` by the trainer.

Several rewards ``R_k`` (one ``(n,)`` array each, weights ``w_k``) are combined by one of
(:data:`AGGREGATIONS`):

* ``weighted_sum`` -- ``r = sum_k w_k R_k``, then group advantages (the released code's default);
* ``log_tame`` -- PaCo-RL eq. 2-4: for each reward the coefficient of variation over the epoch
  ``h_k = std(R_k) / mean(R_k)``; rewards with ``h_k > delta`` (paper 0.2, or ``"mean"``: the
  mean of the ``h_k``) are replaced by ``log(1 + R_k)`` (:func:`log_tame`); then the weighted
  sum and group advantages;
* ``log_tame_reference`` -- as the released code's ``log_tame_aggregate_fn``: the tamed weighted
  sum is used as the advantage itself, without group normalisation (documented for comparison,
  not a default);
* ``weighted_advantage_sum`` -- group-normalise each reward first, then weight and sum (the
  released ``weighted_advantage_sum_aggregate_fn``);
* ``geometric_mean`` -- ``r = exp(sum_k w_k log R_k / sum_k w_k)`` (:func:`weighted_geometric_mean`),
  then group advantages;
* ``harmonic_mean`` -- ``r = sum_k w_k / sum_k (w_k / R_k)`` (:func:`weighted_harmonic_mean`), then
  group advantages;
* ``geometric_mean_reference`` / ``harmonic_mean_reference`` -- the released
  ``geometric_mean_aggregate_fn`` / ``harmonic_mean_aggregate_fn`` (``PaCo-GRPO/config/grpo.py``):
  the mean itself is the advantage, without group normalisation, because the released
  ``PerPromptStatTracker.compute_advantages`` (``paco_grpo/stat_tracking.py``) uses a custom
  ``aggregate_fn``'s output as the advantages directly (documented for comparison, not a default).

How the released aggregators are defined (checked against X-GenGroup/PaCo-RL): they call
``scipy.stats.gmean`` / ``scipy.stats.hmean`` over the reward axis with **no weights** (the
``reward_fn`` weights are only used when ``aggregate_fn`` is None), **no epsilon** and **no
clipping**: a reward of exactly 0 makes the mean 0, a negative reward makes it NaN (scipy warns).
Here the means are weighted by the reward weights (scipy's ``weights=`` semantics, normalised by
their sum), which is the released behaviour exactly when all weights are equal; a zero weight
leaves its reward out; a 0 reward gives 0 as in scipy; a negative reward (or weight) is an error
(:class:`RewardValueError` / ``ValueError``) instead of a NaN advantage.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

#: Aggregation names accepted by :func:`aggregate`.
AGGREGATIONS = ("weighted_sum", "log_tame", "log_tame_reference", "weighted_advantage_sum",
                "geometric_mean", "geometric_mean_reference", "harmonic_mean", "harmonic_mean_reference")

#: Aggregations that take a weighted power mean of the rewards (non-negative rewards only).
MEAN_AGGREGATIONS = {"geometric_mean": "geometric", "geometric_mean_reference": "geometric",
                     "harmonic_mean": "harmonic", "harmonic_mean_reference": "harmonic"}

#: Floor of the standard deviation in the advantage denominator (reference value).
STD_FLOOR = 1e-6


class RewardValueError(ValueError):
    """A reward array is not finite, or cannot be tamed (``log(1 + R)`` with ``R <= -1``)."""


def _as_rewards(scores: Any, n: int | None, name: str) -> np.ndarray:
    arr = np.asarray(scores, dtype=np.float64)
    if arr.ndim != 1 or (n is not None and arr.shape[0] != n):
        raise ValueError(f"{name}: expected shape ({n if n is not None else 'n'},), got {arr.shape}")
    if not np.isfinite(arr).all():
        bad = np.flatnonzero(~np.isfinite(arr))
        raise RewardValueError(f"{name}: non-finite values at indices {bad[:10].tolist()}")
    return arr


def group_advantages(scores: Sequence[float] | np.ndarray, prompt_ids: Sequence[Hashable],
                     global_std: bool) -> np.ndarray:
    """Per-prompt-group normalised advantages (not clipped).

    Args:
        scores: ``(n,)`` float rewards, finite.
        prompt_ids: ``(n,)`` hashable group keys (samples with equal keys form a group).
        global_std: divide by the std of all ``n`` scores instead of each group's own std.

    Returns:
        ``(n,)`` float64 ``(r - group mean) / max(std, 1e-6)`` (population std, ``ddof=0``). A
        group of one sample, or of equal rewards, gets advantage 0.

    Raises:
        ValueError: length mismatch or wrong shape. RewardValueError: a non-finite score.
    """
    r = _as_rewards(scores, None, "scores")
    keys = list(prompt_ids)
    if len(keys) != r.shape[0]:
        raise ValueError(f"{r.shape[0]} scores but {len(keys)} prompt ids")
    groups: dict[Hashable, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    out = np.empty_like(r)
    denom_global = max(float(r.std()), STD_FLOOR) if r.size else STD_FLOOR
    for idx in groups.values():
        g = r[idx]
        denom = denom_global if global_std else max(float(g.std()), STD_FLOOR)
        out[idx] = (g - g.mean()) / denom
    return out


def coefficient_of_variation(values: np.ndarray) -> float:
    """``h = std(values) / mean(values)`` (population std; paper eq. 2). The released code adds
    1e-6 to the mean; here a mean of exactly 0 gives ``inf`` (always tamed) and a negative mean
    a negative ``h`` (never tamed)."""
    mean = float(np.mean(values))
    std = float(np.std(values))
    if mean == 0.0:
        return float("inf") if std > 0 else 0.0
    return std / mean


def log_tame(rewards: Mapping[str, Sequence[float] | np.ndarray], delta: float | str) -> dict[str, np.ndarray]:
    """Log-taming of high-variance rewards (PaCo-RL eq. 2-3).

    For each reward ``k`` compute ``h_k = std(R_k) / mean(R_k)`` over all its values (the whole
    epoch's samples); if ``h_k > delta`` the reward becomes ``log(1 + R_k)``, else it is kept.

    Args:
        rewards: name -> ``(n,)`` finite values (all the same ``n``).
        delta: the threshold (paper 0.2), or ``"mean"`` for the mean of the ``h_k`` (the released
            code's default) or ``"median"``.

    Returns:
        A new dict with the same keys and ``(n,)`` float64 arrays, each tamed or unchanged.

    Raises:
        ValueError: unequal lengths, an unknown ``delta``. RewardValueError: a non-finite
            reward, or a reward to tame with a value ``<= -1`` (``log(1 + R)`` undefined).
    """
    h = coefficients(rewards)
    threshold = _threshold(h, delta)
    out: dict[str, np.ndarray] = {}
    for name, values in _checked(rewards).items():
        if h[name] > threshold:
            if (values <= -1).any():
                raise RewardValueError(
                    f"reward {name!r}: log-taming needs values > -1, min is {values.min():.4g}"
                )
            out[name] = np.log1p(values)
        else:
            out[name] = values.copy()
    return out


def coefficients(rewards: Mapping[str, Sequence[float] | np.ndarray]) -> dict[str, float]:
    """``h_k`` of :func:`log_tame` per reward name."""
    return {name: coefficient_of_variation(v) for name, v in _checked(rewards).items()}


def _threshold(h: Mapping[str, float], delta: float | str) -> float:
    if isinstance(delta, str):
        finite = [v for v in h.values() if np.isfinite(v)]
        if delta == "mean":
            return float(np.mean(finite)) if finite else float("inf")
        if delta == "median":
            return float(np.median(finite)) if finite else float("inf")
        raise ValueError(f"delta must be a number, 'mean' or 'median', got {delta!r}")
    return float(delta)


def _checked(rewards: Mapping[str, Sequence[float] | np.ndarray]) -> dict[str, np.ndarray]:
    if not rewards:
        raise ValueError("no rewards given")
    out: dict[str, np.ndarray] = {}
    n = None
    for name, v in rewards.items():
        out[name] = _as_rewards(v, n, f"reward {name!r}")
        n = out[name].shape[0]
    return out


def weighted_sum(rewards: Mapping[str, np.ndarray], weights: Mapping[str, float]) -> np.ndarray:
    """``sum_k w_k R_k`` over the rewards present in ``weights``.

    Raises:
        KeyError: a weighted reward is missing from ``rewards``.
    """
    missing = [k for k in weights if k not in rewards]
    if missing:
        raise KeyError(f"rewards {missing} have weights but were not computed")
    total = None
    for name, w in weights.items():
        term = float(w) * np.asarray(rewards[name], dtype=np.float64)
        total = term if total is None else total + term
    if total is None:
        raise ValueError("no reward weights given")
    return total


def _mean_weights(rewards: Mapping[str, np.ndarray], weights: Mapping[str, float], kind: str
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``(stack (K, n), w (K,))`` of the positively weighted rewards, checked for a mean."""
    bad = {k: w for k, w in weights.items() if not (np.isfinite(float(w)) and float(w) >= 0)}
    if bad:
        raise ValueError(f"the {kind} mean needs finite weights >= 0, got {bad}")
    used = [k for k, w in weights.items() if float(w) > 0]
    if not used:
        raise ValueError(f"the {kind} mean needs at least one positive weight, got {dict(weights)}")
    missing = [k for k in used if k not in rewards]
    if missing:
        raise KeyError(f"rewards {missing} have weights but were not computed")
    stack = np.stack(list(_checked({k: rewards[k] for k in used}).values()))
    for k, row in zip(used, stack, strict=True):
        if (row < 0).any():
            raise RewardValueError(f"reward {k!r}: the {kind} mean needs rewards >= 0, min is {row.min():.4g} "
                                   "(the released code would produce NaN advantages)")
    return stack, np.array([float(weights[k]) for k in used])


def weighted_geometric_mean(rewards: Mapping[str, Sequence[float] | np.ndarray],
                            weights: Mapping[str, float]) -> np.ndarray:
    """Per-sample weighted geometric mean ``exp(sum_k w_k log R_k / sum_k w_k)``.

    Equals ``scipy.stats.gmean(stack, axis=0, weights=w)``; with equal weights it is the released
    ``geometric_mean_aggregate_fn`` (``PaCo-GRPO/config/grpo.py``, ``gmean(reward_stack, axis=0)``).

    Args:
        rewards: name -> ``(n,)`` finite values ``>= 0``.
        weights: name -> weight ``>= 0``; rewards with weight 0 are left out.

    Returns:
        ``(n,)`` float64 in ``[min_k R_k, max_k R_k]``; 0 where a weighted reward is 0.

    Raises:
        ValueError: a negative or non-finite weight, no positive weight, unequal lengths.
        KeyError: a weighted reward is missing. RewardValueError: a non-finite or negative reward.
    """
    stack, w = _mean_weights(rewards, weights, "geometric")
    with np.errstate(divide="ignore"):  # log(0) = -inf -> exp(-inf) = 0, as scipy's gmean
        return np.exp((w[:, None] * np.log(stack)).sum(axis=0) / w.sum())


def weighted_harmonic_mean(rewards: Mapping[str, Sequence[float] | np.ndarray],
                           weights: Mapping[str, float]) -> np.ndarray:
    """Per-sample weighted harmonic mean ``sum_k w_k / sum_k (w_k / R_k)``.

    Equals ``scipy.stats.hmean(stack, axis=0, weights=w)``; with equal weights it is the released
    ``harmonic_mean_aggregate_fn`` (``PaCo-GRPO/config/grpo.py``, ``hmean(reward_stack, axis=0)``).

    Args, Raises: as :func:`weighted_geometric_mean`.

    Returns:
        ``(n,)`` float64; 0 where a weighted reward is 0 (as scipy's ``hmean``).
    """
    stack, w = _mean_weights(rewards, weights, "harmonic")
    zero = (stack == 0).any(axis=0)
    safe = np.where(stack == 0, 1.0, stack)
    return np.where(zero, 0.0, w.sum() / (w[:, None] / safe).sum(axis=0))


def aggregate(
    rewards: Mapping[str, Sequence[float] | np.ndarray],
    weights: Mapping[str, float],
    prompt_ids: Sequence[Hashable],
    *,
    method: str = "log_tame",
    delta: float | str = 0.2,
    global_std: bool = True,
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Combine several rewards into one advantage per sample (see the module docstring).

    Args:
        rewards: name -> ``(n,)`` raw rewards of the epoch's samples.
        weights: name -> weight ``w_k``; only these rewards enter the aggregate.
        prompt_ids: ``(n,)`` group keys.
        method: one of :data:`AGGREGATIONS`.
        delta: log-tame threshold (``log_tame*`` only).
        global_std: std of the whole batch in the group normalisation.

    Returns:
        ``(aggregated, advantages, info)``: the aggregated reward ``(n,)`` (for
        ``weighted_advantage_sum``, the weighted sum of raw rewards, for logging; for the mean
        methods, the mean), the advantages ``(n,)`` (not clipped), and ``info`` with ``h``
        (per-reward coefficient of variation), ``threshold`` and ``tamed`` (names) for the
        log-tame methods.

    Raises:
        ValueError: unknown method. RewardValueError / KeyError: see :func:`log_tame`,
            :func:`weighted_sum`, :func:`weighted_geometric_mean` (the mean methods need rewards
            and weights ``>= 0``).
    """
    if method not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {method!r}; expected one of {AGGREGATIONS}")
    missing = [k for k in weights if k not in rewards]
    if missing:
        raise KeyError(f"rewards {missing} have weights but were not computed")
    checked = _checked({k: rewards[k] for k in weights})
    n = next(iter(checked.values())).shape[0]
    if len(prompt_ids) != n:
        raise ValueError(f"{n} rewards per name but {len(prompt_ids)} prompt ids")
    info: dict[str, Any] = {}
    if method in ("log_tame", "log_tame_reference"):
        h = coefficients(checked)
        threshold = _threshold(h, delta)
        tamed = log_tame(checked, delta)
        info = {"h": h, "threshold": threshold, "tamed": sorted(k for k in h if h[k] > threshold)}
        total = weighted_sum(tamed, weights)
        adv = total.copy() if method == "log_tame_reference" else group_advantages(total, prompt_ids, global_std)
        return total, adv, info
    if method in MEAN_AGGREGATIONS:
        mean = weighted_geometric_mean if MEAN_AGGREGATIONS[method] == "geometric" else weighted_harmonic_mean
        total = mean(checked, weights)
        adv = total.copy() if method.endswith("_reference") else group_advantages(total, prompt_ids, global_std)
        return total, adv, info
    total = weighted_sum(checked, weights)
    if method == "weighted_sum":
        return total, group_advantages(total, prompt_ids, global_std), info
    adv = weighted_sum({k: group_advantages(checked[k], prompt_ids, global_std) for k in weights}, weights)
    return total, adv, info
