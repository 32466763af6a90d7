"""Group advantages and multi-reward aggregation (paper eq. 2-4) against hand computations."""

from __future__ import annotations

import numpy as np
import pytest

from paco.advantages import RewardValueError, aggregate, coefficient_of_variation, group_advantages, log_tame


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
