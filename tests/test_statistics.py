"""paco.core.statistics: every test the stages report, against scipy and computations by hand."""

import math

import numpy as np
import pytest
from scipy import stats

from paco.core.statistics import (binomial_test_p, chance_summary, chance_test, learning_signal, paired_t_p,
                                  paired_test, welch_t_p, welch_test)
from paco.judge import metrics as M

# --------------------------------------------------------------------------------------------
# chance_test
# --------------------------------------------------------------------------------------------


def test_chance_test_t_against_scipy():
    rng = np.random.default_rng(1)
    x = rng.choice([0.0, 0.25, 0.5, 1.0], size=200, p=[0.2, 0.3, 0.3, 0.2])
    r = chance_test(x, 0.25)
    ref = stats.ttest_1samp(x, 0.25, alternative="greater")
    assert r["statistic"] == pytest.approx(ref.statistic)
    assert r["p_value"] == pytest.approx(ref.pvalue)
    assert r["n"] == 200 and r["df"] == 199
    assert r["mean"] == pytest.approx(x.mean())
    sem = x.std(ddof=1) / np.sqrt(200)
    q = stats.t.ppf(0.975, 199)
    assert r["ci_low"] == pytest.approx(x.mean() - q * sem)
    assert r["ci_high"] == pytest.approx(x.mean() + q * sem)
    assert r["p_value"] < 1e-6
    two = chance_test(x, 0.25, alternative="two-sided")
    assert two["p_value"] == pytest.approx(2 * r["p_value"])
    less = chance_test(x, 0.25, alternative="less")
    assert less["p_value"] == pytest.approx(1 - r["p_value"])


def test_chance_test_bootstrap_ci_contains_mean_and_null_is_not_rejected():
    rng = np.random.default_rng(2)
    refs = [rng.permutation(4).tolist() for _ in range(300)]
    preds = [rng.permutation(4).tolist() for _ in range(300)]
    acc = M.consistency_rank_metrics(preds, refs, per_instance=True)["per_instance"]["accuracy"]
    r = chance_test(acc, 0.25, ci_method="bootstrap", n_resamples=2000, random_state=0)
    assert r["ci_low"] < r["mean"] < r["ci_high"]
    assert r["ci_low"] < 0.25 < r["ci_high"]
    assert r["p_value"] > 0.01
    again = chance_test(acc, 0.25, ci_method="bootstrap", n_resamples=2000, random_state=0)
    assert (again["ci_low"], again["ci_high"]) == (r["ci_low"], r["ci_high"])


def test_chance_test_constant_values():
    r = chance_test([1.0, 1.0, 1.0], 0.25)
    assert r["statistic"] == math.inf and r["p_value"] == 0.0
    assert r["ci_low"] == r["ci_high"] == 1.0
    r = chance_test([0.25, 0.25], 0.25)
    assert math.isnan(r["statistic"]) and r["p_value"] == 1.0
    assert chance_test([0.0, 0.0], 0.25)["p_value"] == 1.0
    assert chance_test([0.0, 0.0], 0.25, alternative="less")["p_value"] == 0.0


def test_chance_test_errors():
    with pytest.raises(ValueError, match="at least 2"):
        chance_test([0.5], 0.25)
    with pytest.raises(ValueError, match="finite"):
        chance_test([0.5, float("nan")], 0.25)
    with pytest.raises(ValueError, match="alternative"):
        chance_test([0.5, 0.2], 0.25, alternative="bigger")
    with pytest.raises(ValueError, match="ci_method"):
        chance_test([0.5, 0.2], 0.25, ci_method="wald")


def test_paired_and_welch_tests_against_scipy_and_by_hand():
    rng = np.random.default_rng(1)
    a, b = rng.normal(0.3, 0.1, 16), rng.normal(0.25, 0.1, 16)
    t = paired_test(a, b)
    assert t["mean_diff"] == pytest.approx(np.mean(a - b))
    assert t["t_p"] == pytest.approx(stats.ttest_rel(a, b).pvalue)
    assert t["wilcoxon_p"] == pytest.approx(stats.wilcoxon(a - b).pvalue)
    assert paired_test(a, a)["t_p"] is None  # identical samples: no test
    with pytest.raises(ValueError, match="same length"):
        paired_test(a, b[:3])
    w = welch_test(a[:5], b[:7])
    # Welch by hand: t = d / sqrt(s1^2/n1 + s2^2/n2), Welch-Satterthwaite degrees of freedom
    v1, v2 = a[:5].var(ddof=1) / 5, b[:7].var(ddof=1) / 7
    tt = (a[:5].mean() - b[:7].mean()) / math.sqrt(v1 + v2)
    df = (v1 + v2) ** 2 / (v1 ** 2 / 4 + v2 ** 2 / 6)
    assert w["p"] == pytest.approx(2 * stats.t.sf(abs(tt), df))


def test_learning_signal_pairs_each_prompt_with_itself():
    """A gain far smaller than the spread between prompts: the unpaired Welch test on the samples
    misses it, the paired test over prompts finds it. Every figure is checked against a
    computation by hand (t = mean(d) / (sd(d) / sqrt(n)), one-sided, n - 1 degrees of freedom)."""
    rng = np.random.default_rng(0)
    prompts = [f"p{i}" for i in range(6)]
    level = dict(zip(prompts, [0.1, 0.3, 0.5, 0.7, 0.9, 0.2]))  # prompt difficulty: spread 0.28
    gain = dict(zip(prompts, [0.01, 0.03, 0.02, 0.015, 0.025, 0.0]))
    per_sample, groups = [], []
    for epoch in range(6):  # 6 epochs, window 2; the prompt order changes between epochs
        order = [prompts[i] for i in rng.permutation(6)]
        ids = [p for p in order for _ in range(2)]  # group size 2
        late = epoch >= 4
        per_sample.append(np.array([level[p] + late * gain[p] + rng.normal(0, 0.002) for p in ids]))
        groups.append(ids)
    sig = learning_signal(per_sample, groups, window=2)

    def means(epochs):
        acc = {}
        for e in epochs:
            for p, r in zip(groups[e], per_sample[e]):
                acc.setdefault(p, []).append(r)
        return np.array([np.mean(acc[p]) for p in prompts])

    d = means([4, 5]) - means([0, 1])
    t = d.mean() / (d.std(ddof=1) / np.sqrt(len(d)))
    first, last = np.concatenate(per_sample[:2]), np.concatenate(per_sample[4:])
    assert sig["window_epochs"] == 2 and sig["prompts_paired"] == 6 and sig["prompts_improved"] == int((d > 0).sum())
    assert sig["improvement"] == pytest.approx(last.mean() - first.mean(), abs=1e-12)
    assert sig["p_value"] == pytest.approx(stats.t.sf(t, df=5), rel=1e-9)
    assert sig["effect_size_dz"] == pytest.approx(d.mean() / d.std(ddof=1), rel=1e-9)
    assert sig["p_value"] < 0.01 < 0.2 < sig["p_value_welch"]
    # prompts drawn in only one window are left out of the pairing
    groups2 = [list(g) for g in groups]
    groups2[0] = ["q" if p == "p0" else p for p in groups2[0]]
    groups2[1] = ["q" if p == "p0" else p for p in groups2[1]]
    assert learning_signal(per_sample, groups2, window=2)["prompts_paired"] == 5
    with pytest.raises(ValueError, match="prompt id per reward"):
        learning_signal(per_sample, groups[:-1], window=2)
    assert learning_signal([], [], window=2) == {"window_epochs": 1, "first_epochs_reward": None,
                                                 "last_epochs_reward": None}


def test_small_wrappers_equal_scipy():
    rng = np.random.default_rng(3)
    a, b = rng.normal(0.3, 0.1, 9), rng.normal(0.2, 0.1, 9)
    assert paired_t_p(a, b) == stats.ttest_rel(a, b).pvalue
    assert paired_t_p(a, b, "greater") == stats.ttest_rel(a, b, alternative="greater").pvalue
    assert welch_t_p(a, b[:6], "less") == stats.ttest_ind(a, b[:6], equal_var=False, alternative="less").pvalue
    # 8 wins of 10 against 0.5, one-sided: P(X >= 8) = (45 + 10 + 1) / 1024
    assert binomial_test_p(8, 10) == pytest.approx(56 / 1024, rel=1e-12)
    assert chance_summary(np.array([0.5]), 0.25) == {"n": 1}
    x = rng.uniform(0, 1, 20)
    full = chance_test(x, 0.25)
    assert chance_summary(x, 0.25) == {k: full[k] for k in ("mean", "p_value", "ci_low", "ci_high", "n")}
