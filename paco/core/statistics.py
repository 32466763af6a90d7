"""The statistical tests the stages report, in one place (all from ``scipy.stats``).

- :func:`chance_test`, :func:`chance_summary`: one-sample t-test of per-instance values against a
  chance level (the judge's ranking metrics, ``reward_eval``; paired judge-vs-judge differences
  against 0);
- :func:`binomial_test_p`: one-sided binomial test of strict wins (EditReward-Bench accuracy);
- :func:`paired_test`, :func:`paired_t_p`: paired t-test (and Wilcoxon) of aligned samples
  (``paco-compare``; final samples' LoRA - base);
- :func:`welch_test`, :func:`welch_t_p`: unpaired Welch t-test (``paco-compare``'s last-epochs
  rewards; the GRPO report's per-sample comparison);
- :func:`learning_signal`: the GRPO report's paired test of each prompt's first-epochs reward
  against its last-epochs reward.

Every p-value is a float in [0, 1]; inputs are converted to float64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

ALTERNATIVES = ("greater", "less", "two-sided")


# --------------------------------------------------------------------------------------------
# one sample against chance
# --------------------------------------------------------------------------------------------


def _check_chance_args(x: np.ndarray, chance: float, alternative: str, confidence_level: float,
                       ci_method: str) -> None:
    if x.size < 2:
        raise ValueError(f"need at least 2 values, got {x.size}")
    if not np.isfinite(x).all():
        raise ValueError("values must be finite")
    if not math.isfinite(chance):
        raise ValueError(f"chance must be finite, got {chance}")
    if alternative not in ALTERNATIVES:
        raise ValueError(f"unknown alternative {alternative!r}")
    if ci_method not in ("t", "bootstrap"):
        raise ValueError(f"unknown ci_method {ci_method!r}")
    if not 0.0 < confidence_level < 1.0:
        raise ValueError(f"confidence_level must be in (0, 1), got {confidence_level}")


def _constant_sample(mean: float, chance: float, alternative: str) -> tuple[float, float]:
    """The t statistic and p-value of a sample without spread: ``+-inf`` (NaN at chance) and 0 or 1."""
    diff = mean - chance
    statistic = math.nan if diff == 0 else math.copysign(math.inf, diff)
    if alternative == "greater":
        p_value = 0.0 if diff > 0 else 1.0
    elif alternative == "less":
        p_value = 0.0 if diff < 0 else 1.0
    else:
        p_value = 0.0 if diff != 0 else 1.0
    return statistic, p_value


def _mean_interval(x: np.ndarray, mean: float, std: float, confidence_level: float, ci_method: str,
                   n_resamples: int, random_state: int | None) -> tuple[float, float]:
    """The two-sided confidence interval of the mean: t-interval or BCa bootstrap."""
    n = int(x.size)
    if ci_method == "t":
        sem = std / math.sqrt(n)
        ci_low, ci_high = (float(v) for v in stats.t.interval(confidence_level, df=n - 1, loc=mean, scale=sem))
        return ci_low, ci_high
    boot = stats.bootstrap((x,), np.mean, confidence_level=confidence_level, n_resamples=n_resamples,
                           method="BCa", rng=np.random.default_rng(random_state))
    return float(boot.confidence_interval.low), float(boot.confidence_interval.high)


def chance_test(
    values: Sequence[float] | np.ndarray,
    chance: float,
    alternative: str = "greater",
    *,
    confidence_level: float = 0.95,
    ci_method: str = "t",
    n_resamples: int = 9999,
    random_state: int | None = 0,
) -> dict[str, Any]:
    """Test whether the mean of per-instance metric values differs from its chance level.

    Test: one-sample Student t-test of ``H0: E[value] = chance`` (``scipy.stats.ttest_1samp``).
    Rationale: under the null "the predicted order is uniformly random and independent of the
    reference" the per-instance values are i.i.d. with mean exactly ``chance`` (see
    :func:`paco.judge.metrics.chance_levels`) and bounded, so the t-test on the mean is
    asymptotically exact. Sign / Wilcoxon tests are *not* used: they test the median /
    symmetry, and e.g. for accuracy with 4 candidates the null distribution is skewed
    (P(acc < 1/4) = 9/24, P(acc > 1/4) = 7/24), so they would be miscalibrated.

    Caveat: instances that share a prompt or reference image are not independent (the
    pipeline builds 48 per prompt); for a conservative statement pass per-prompt means.

    Args:
        values: per-instance values (e.g. ``per_instance["accuracy"]``), at least 2, finite.
        chance: the chance level (e.g. 0.25 for accuracy with 4 candidates, 0 for tau).
        alternative: ``"greater"`` (default), ``"less"`` or ``"two-sided"``.
        confidence_level: of the (always two-sided) confidence interval of the mean.
        ci_method: ``"t"`` (t-interval, ``mean +- t_{df} * sem``) or ``"bootstrap"``
            (``scipy.stats.bootstrap``, BCa, ``n_resamples`` resamples, seeded by
            ``random_state``).

    Returns:
        dict: ``test`` (str), ``statistic`` (t), ``p_value``, ``df`` (n - 1), ``n``, ``mean``,
        ``std`` (ddof 1), ``chance``, ``alternative``, ``ci_low``, ``ci_high``,
        ``confidence_level``, ``ci_method``. If all values are equal the t statistic is
        ``+-inf`` (or NaN when equal to chance) and the p-value is 0 or 1 accordingly; the
        interval is the single point.

    Raises:
        ValueError: fewer than 2 values, non-finite values, unknown alternative or ci_method,
            confidence_level outside (0, 1).
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    _check_chance_args(x, chance, alternative, confidence_level, ci_method)
    n = int(x.size)
    mean = float(x.mean())
    std = float(x.std(ddof=1))
    if std == 0.0:
        statistic, p_value = _constant_sample(mean, chance, alternative)
        ci_low = ci_high = mean
    else:
        res = stats.ttest_1samp(x, popmean=chance, alternative=alternative)
        statistic, p_value = float(res.statistic), float(res.pvalue)
        ci_low, ci_high = _mean_interval(x, mean, std, confidence_level, ci_method, n_resamples, random_state)
    return {
        "test": "one-sample t-test, H0: mean == chance",
        "statistic": statistic,
        "p_value": p_value,
        "df": n - 1,
        "n": n,
        "mean": mean,
        "std": std,
        "chance": float(chance),
        "alternative": alternative,
        "ci_low": ci_low,
        "ci_high": ci_high,
        "confidence_level": confidence_level,
        "ci_method": ci_method,
    }


def chance_summary(values: np.ndarray, chance: float) -> dict[str, float]:
    """The reported part of :func:`chance_test` (one-sided, ``greater``): ``mean``, ``p_value``,
    ``ci_low``, ``ci_high``, ``n``; only ``n`` for fewer than 2 values (no test)."""
    if len(values) < 2:
        return {"n": len(values)}
    t = chance_test(values, chance)
    return {k: t[k] for k in ("mean", "p_value", "ci_low", "ci_high", "n")}


def binomial_test_p(successes: int, n: int, p: float = 0.5, alternative: str = "greater") -> float:
    """P-value of an exact binomial test of ``successes`` in ``n`` trials against success
    probability ``p`` (``scipy.stats.binomtest``; one-sided ``greater`` by default).

    Raises:
        ValueError: ``successes`` outside [0, n], ``n < 1`` or ``p`` outside [0, 1] (scipy's)."""
    return float(stats.binomtest(int(successes), int(n), p, alternative=alternative).pvalue)


# --------------------------------------------------------------------------------------------
# two samples
# --------------------------------------------------------------------------------------------


def paired_t_p(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray,
               alternative: str = "two-sided") -> float:
    """P-value of the paired t-test of ``a - b`` (``scipy.stats.ttest_rel(a, b)``); NaN when
    every difference is 0 (scipy's).

    Raises:
        ValueError: different lengths (scipy's)."""
    return float(stats.ttest_rel(a, b, alternative=alternative).pvalue)


def welch_t_p(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray,
              alternative: str = "two-sided") -> float:
    """P-value of Welch's unequal-variance t-test of ``mean(a) - mean(b)``
    (``scipy.stats.ttest_ind(a, b, equal_var=False)``)."""
    return float(stats.ttest_ind(a, b, equal_var=False, alternative=alternative).pvalue)


def paired_test(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Paired comparison of ``a - b`` (same units, aligned samples).

    Returns:
        ``n``, ``mean_diff``, ``t_p`` (two-sided ``scipy.stats.ttest_rel``) and ``wilcoxon_p``
        (two-sided ``scipy.stats.wilcoxon``, zero differences dropped: ``zero_method='wilcox'``);
        both p-values are ``None`` when every difference is 0 (identical samples: no test).

    Raises:
        ValueError: different lengths, fewer than 2 pairs or non-finite values."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size < 2:
        raise ValueError(f"paired_test needs two 1-d arrays of the same length >= 2, got {a.shape} and {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("paired_test: non-finite values")
    d = a - b
    out: dict[str, Any] = {"n": int(a.size), "mean_diff": float(d.mean()), "t_p": None, "wilcoxon_p": None}
    if np.any(d != 0):
        out["t_p"] = paired_t_p(a, b)
        out["wilcoxon_p"] = float(stats.wilcoxon(a, b).pvalue)
    return out


def welch_test(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Unpaired comparison ``mean(a) - mean(b)``: two-sided Welch t-test
    (``scipy.stats.ttest_ind(a, b, equal_var=False)``); ``p`` is ``None`` for fewer than 2 values
    in either sample or zero variance in both.

    Raises:
        ValueError: non-finite values."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("welch_test: non-finite values")
    out: dict[str, Any] = {"n_a": int(a.size), "n_b": int(b.size),
                           "mean_diff": float(a.mean() - b.mean()) if a.size and b.size else None, "p": None}
    if a.size >= 2 and b.size >= 2 and (a.var() > 0 or b.var() > 0):
        out["p"] = welch_t_p(a, b)
    return out


# --------------------------------------------------------------------------------------------
# a training run's learning signal
# --------------------------------------------------------------------------------------------


def learning_signal(per_sample: Sequence[np.ndarray], groups: Sequence[Sequence[str]], window: int) -> dict[str, Any]:
    """Whether the training reward rose: the first ``window`` epochs against the last ``window``.

    The same prompts recur every epoch (``prompts_per_epoch`` of the split, all of them in the
    embedded default), and the reward's spread between prompts is far larger than an epoch's
    change (Qwen-Image-Edit: per-sample std 0.28 around a gain of 0.01). So the test pairs each
    prompt with itself: its mean weighted reward over its samples of the first window against
    that of the last window, a one-sided paired t-test over the prompts drawn in both windows
    (``scipy.stats.ttest_rel``, H1: last > first; the design of the final samples' paired test).
    The unpaired one-sided Welch t-test on the per-sample rewards (``scipy.stats.ttest_ind``,
    ``equal_var=False``), which counts the between-prompt spread as noise, is kept as
    ``p_value_welch`` for comparison.

    Args:
        per_sample: one float array per finished epoch, the weighted reward of each trajectory
            (``(n_traj,)``, in [0, 1] for the embedded rewards).
        groups: per epoch, the prompt id of each trajectory (same lengths as ``per_sample``).
        window: epochs per window; at most half the epochs are used (at least 1).

    Returns:
        ``window_epochs``, ``first_epochs_reward`` / ``last_epochs_reward`` (per-sample means),
        ``improvement`` (their difference), ``prompts_paired`` (prompts in both windows),
        ``prompts_improved``, ``p_value`` (the paired test; ``None`` with fewer than 2 paired
        prompts), ``effect_size_dz`` (mean per-prompt difference / its std; ``None`` when that
        std is 0), ``p_value_welch``. Empty inputs give the means as ``None`` and no tests.

    Raises:
        ValueError: ``groups`` and ``per_sample`` differ in epochs or in an epoch's length.
    """
    n = len(per_sample)
    if len(groups) != n or any(len(g) != len(r) for g, r in zip(groups, per_sample)):
        raise ValueError(f"groups ({[len(g) for g in groups]}) must give a prompt id per reward "
                         f"({[len(r) for r in per_sample]})")
    w = max(1, min(window, n // 2))
    first = np.concatenate(per_sample[:w]) if n else np.zeros(0)
    last = np.concatenate(per_sample[n - w:]) if n else np.zeros(0)
    out: dict[str, Any] = {"window_epochs": w, "first_epochs_reward": float(first.mean()) if first.size else None,
                           "last_epochs_reward": float(last.mean()) if last.size else None}
    if first.size < 2 or last.size < 2:
        return out
    out["improvement"] = out["last_epochs_reward"] - out["first_epochs_reward"]

    def prompt_means(epochs: range) -> pd.Series:
        ids = np.concatenate([np.asarray(groups[e], dtype=object) for e in epochs])
        vals = np.concatenate([np.asarray(per_sample[e], dtype=np.float64) for e in epochs])
        return pd.Series(vals).groupby(ids).mean()

    a, b = prompt_means(range(w)), prompt_means(range(n - w, n))
    shared = a.index.intersection(b.index).sort_values()
    diff = (b[shared] - a[shared]).to_numpy()
    out["prompts_paired"] = int(diff.size)
    out["prompts_improved"] = int((diff > 0).sum())
    out["p_value"] = None
    out["effect_size_dz"] = None
    if diff.size >= 2:
        sd = float(diff.std(ddof=1))
        if sd > 0:
            out["p_value"] = paired_t_p(b[shared].to_numpy(), a[shared].to_numpy(), alternative="greater")
            out["effect_size_dz"] = float(diff.mean() / sd)
    out["p_value_welch"] = welch_t_p(last, first, alternative="greater")
    return out
