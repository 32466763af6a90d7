"""Group advantages and multi-reward aggregation (paper eq. 2-4) against hand computations."""

from __future__ import annotations

import numpy as np
import pytest

from paco.grpo.advantages import (
    RewardValueError,
    aggregate,
    coefficient_of_variation,
    group_advantages,
    log_tame,
    weighted_geometric_mean,
    weighted_harmonic_mean,
)


def test_group_advantages_per_group_std():
    scores = [1.0, 3.0, 10.0, 10.0, 0.0, 6.0]
    ids = ["a", "a", "b", "b", "c", "c"]
    adv = group_advantages(scores, ids, global_std=False)
    # a: mean 2, std 1 -> -1, 1; b: equal -> 0, 0 (std floored at 1e-6); c: mean 3, std 3 -> -1, 1
    np.testing.assert_allclose(adv, [-1, 1, 0, 0, -1, 1])


def test_group_advantages_global_std_and_interleaved_groups():
    scores = np.array([1.0, 10.0, 3.0, 14.0])
    ids = [("p", 1), ("q", 2), ("p", 1), ("q", 2)]  # any hashable, groups need not be contiguous
    adv = group_advantages(scores, ids, global_std=True)
    std = scores.std()
    np.testing.assert_allclose(adv, [(1 - 2) / std, (10 - 12) / std, (3 - 2) / std, (14 - 12) / std])


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="prompt ids"):
        group_advantages([1.0, 2.0], ["a"], global_std=True)
    with pytest.raises(RewardValueError, match="non-finite"):
        group_advantages([1.0, float("nan")], ["a", "a"], global_std=True)


def test_log_tame_thresholds_on_the_coefficient_of_variation():
    calm = np.array([1.0, 1.1, 0.9, 1.0])           # h = std/mean ~ 0.07
    wild = np.array([0.1, 2.0, 0.5, 5.0])           # h ~ 1.1
    out = log_tame({"calm": calm, "wild": wild}, delta=0.2)
    np.testing.assert_array_equal(out["calm"], calm)
    np.testing.assert_allclose(out["wild"], np.log(1 + wild))
    assert coefficient_of_variation(wild) == pytest.approx(wild.std() / wild.mean())
    # delta "mean": the mean of the two h values lies between them -> only `wild` is tamed
    out = log_tame({"calm": calm, "wild": wild}, delta="mean")
    np.testing.assert_array_equal(out["calm"], calm)
    np.testing.assert_allclose(out["wild"], np.log1p(wild))
    # a high delta tames nothing
    out = log_tame({"calm": calm, "wild": wild}, delta=5.0)
    np.testing.assert_array_equal(out["wild"], wild)


def test_log_tame_refuses_values_at_or_below_minus_one():
    with pytest.raises(RewardValueError, match="> -1"):
        log_tame({"r": np.array([-1.0, 3.0, 0.0, 10.0])}, delta=0.2)


def test_aggregations_by_hand():
    r1 = np.array([0.2, 0.9, 0.1, 0.3])   # h ~ 0.77 -> tamed at delta 0.2
    r2 = np.array([1.0, 1.1, 0.9, 1.0])   # h ~ 0.07 -> kept
    w = {"r1": 0.5, "r2": 2.0}
    ids = ["a", "a", "b", "b"]
    rewards = {"r1": r1, "r2": r2}

    total, adv, info = aggregate(rewards, w, ids, method="weighted_sum", global_std=False)
    np.testing.assert_allclose(total, 0.5 * r1 + 2 * r2)
    np.testing.assert_allclose(adv, group_advantages(total, ids, global_std=False))

    total, adv, info = aggregate(rewards, w, ids, method="log_tame", delta=0.2, global_std=True)
    tamed = 0.5 * np.log1p(r1) + 2 * r2
    np.testing.assert_allclose(total, tamed)
    np.testing.assert_allclose(adv, group_advantages(tamed, ids, global_std=True))
    assert info["tamed"] == ["r1"] and info["threshold"] == 0.2

    total, adv, _ = aggregate(rewards, w, ids, method="log_tame_reference", delta=0.2)
    np.testing.assert_allclose(adv, tamed)  # the released code: the tamed sum is the advantage

    total, adv, _ = aggregate(rewards, w, ids, method="weighted_advantage_sum", global_std=False)
    expected = 0.5 * group_advantages(r1, ids, False) + 2 * group_advantages(r2, ids, False)
    np.testing.assert_allclose(adv, expected)


def test_aggregate_errors():
    with pytest.raises(KeyError, match="r3"):
        aggregate({"r1": [1.0, 2.0]}, {"r1": 1.0, "r3": 1.0}, ["a", "a"])
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate({"r1": [1.0, 2.0]}, {"r1": 1.0}, ["a", "a"], method="max")
    with pytest.raises(RewardValueError, match="non-finite"):
        aggregate({"r1": [1.0, float("inf")]}, {"r1": 1.0}, ["a", "a"])


def test_geometric_and_harmonic_means_by_hand():
    r1 = np.array([0.25, 1.0, 0.5, 0.0])
    r2 = np.array([1.0, 4.0, 0.5, 3.0])
    ids = ["a", "a", "b", "b"]
    rewards = {"r1": r1, "r2": r2}
    # equal weights: the released geometric_mean_aggregate_fn / harmonic_mean_aggregate_fn
    # (scipy gmean / hmean over the reward axis): sqrt(0.25 * 1), sqrt(1 * 4), 0.5, 0
    total, adv, info = aggregate(rewards, {"r1": 1.0, "r2": 1.0}, ids, method="geometric_mean_reference")
    np.testing.assert_allclose(total, [0.5, 2.0, 0.5, 0.0], rtol=1e-15)
    np.testing.assert_array_equal(adv, total)  # released: the mean is the advantage itself
    assert info == {}
    # 2 / (1/0.25 + 1/1) = 0.4, 2 / (1 + 1/4) = 1.6, 0.5, 0 (a zero reward gives 0, as scipy's hmean)
    total, adv, _ = aggregate(rewards, {"r1": 2.0, "r2": 2.0}, ids, method="harmonic_mean_reference")
    np.testing.assert_allclose(total, [0.4, 1.6, 0.5, 0.0], rtol=1e-15)
    np.testing.assert_array_equal(adv, total)
    # the group-normalised variants
    total, adv, _ = aggregate(rewards, {"r1": 1.0, "r2": 1.0}, ids, method="geometric_mean", global_std=False)
    np.testing.assert_allclose(adv, group_advantages([0.5, 2.0, 0.5, 0.0], ids, global_std=False))
    total, adv, _ = aggregate(rewards, {"r1": 1.0, "r2": 1.0}, ids, method="harmonic_mean", global_std=True)
    np.testing.assert_allclose(adv, group_advantages([0.4, 1.6, 0.5, 0.0], ids, global_std=True))
    # weights 1 : 3 -> r1**0.25 * r2**0.75 and 4 / (1/r1 + 3/r2); weight 0 leaves a reward out
    w = {"r1": 1.0, "r2": 3.0, "r3": 0.0}
    rewards["r3"] = np.array([-5.0, 0.0, 2.0, 1.0])
    np.testing.assert_allclose(weighted_geometric_mean(rewards, w)[:3], r1[:3] ** 0.25 * r2[:3] ** 0.75, rtol=1e-14)
    np.testing.assert_allclose(weighted_harmonic_mean(rewards, w)[:3], 4 / (1 / r1[:3] + 3 / r2[:3]), rtol=1e-14)


def test_means_equal_scipy_with_weights():
    from scipy.stats import gmean, hmean

    rng = np.random.default_rng(0)
    stack = rng.uniform(0.01, 3.0, size=(3, 7))
    w = np.array([0.2, 1.0, 1.0])  # the reference t2is reward weights
    wb = np.broadcast_to(w[:, None], stack.shape)
    rewards = {f"r{k}": stack[k] for k in range(3)}
    weights = {f"r{k}": float(w[k]) for k in range(3)}
    np.testing.assert_allclose(weighted_geometric_mean(rewards, weights), gmean(stack, axis=0, weights=wb), rtol=1e-13)
    np.testing.assert_allclose(weighted_harmonic_mean(rewards, weights), hmean(stack, axis=0, weights=wb), rtol=1e-13)
    equal = {k: 1.0 for k in weights}
    np.testing.assert_allclose(weighted_geometric_mean(rewards, equal), gmean(stack, axis=0), rtol=1e-13)
    np.testing.assert_allclose(weighted_harmonic_mean(rewards, equal), hmean(stack, axis=0), rtol=1e-13)


@pytest.mark.parametrize("method", ["geometric_mean", "harmonic_mean", "geometric_mean_reference"])
def test_means_refuse_negative_rewards_and_weights(method):
    ids = ["a", "a"]
    with pytest.raises(RewardValueError, match="'r2'.*rewards >= 0"):
        aggregate({"r1": [0.5, 1.0], "r2": [0.3, -0.1]}, {"r1": 1.0, "r2": 1.0}, ids, method=method)
    with pytest.raises(ValueError, match="weights >= 0"):
        aggregate({"r1": [0.5, 1.0], "r2": [0.3, 0.1]}, {"r1": 1.0, "r2": -1.0}, ids, method=method)
    with pytest.raises(ValueError, match="positive weight"):
        aggregate({"r1": [0.5, 1.0]}, {"r1": 0.0}, ids, method=method)
    with pytest.raises(ValueError, match="prompt ids"):
        aggregate({"r1": [0.5, 1.0]}, {"r1": 1.0}, ["a"], method=method)
