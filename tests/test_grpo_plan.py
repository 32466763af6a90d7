"""PaCo-GRPO's seeded plan (paco.grpo.plan): the prompts of an epoch, its mini-batches and the
evaluation schedule."""

from __future__ import annotations

import numpy as np
import pytest

from paco.grpo.plan import epoch_prompts, evaluation_epochs, minibatches, trajectory_prompts


def test_epoch_plan_is_seeded_unique_and_partitions():
    ids = [f"p{i}" for i in range(10)]
    a = epoch_prompts(ids, 4, seed=3, epoch=5)
    assert a == epoch_prompts(list(reversed(ids)), 4, seed=3, epoch=5) and len(set(a)) == 4
    assert a == epoch_prompts(ids, 4, seed=4, epoch=4)  # seeded by seed + epoch
    assert a != epoch_prompts(ids, 4, seed=3, epoch=6)
    with pytest.raises(ValueError, match="only 10"):
        epoch_prompts(ids, 11, seed=0, epoch=0)
    parts = minibatches(10, 3, seed=0, epoch=1)
    assert sorted(np.concatenate(parts).tolist()) == list(range(10)) and [len(p) for p in parts] == [4, 3, 3]


def test_trajectories_follow_their_prompts_groups():
    assert trajectory_prompts(["b", "a"], 3, 6) == ["b", "b", "b", "a", "a", "a"]


def test_evaluation_schedule():
    assert evaluation_epochs(16, 8) == [0, 8, 16]
    assert evaluation_epochs(3, 2) == [0, 2, 3]
    assert evaluation_epochs(4, 100) == [0, 4]
