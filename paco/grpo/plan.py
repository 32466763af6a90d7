"""The seeded plan of a PaCo-GRPO run: which prompts an epoch samples, which trajectory belongs to
which prompt, how the epoch's trajectories are cut into mini-batches, the noise generators of a
trajectory, and after which epochs the run evaluates.

Every draw is seeded from ``(seed, epoch, ...)`` alone, so a sample does not depend on batch
size, order, process count or on where a run was resumed (:mod:`paco.grpo.trainer`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from paco.core.seeding import stable_seed


def epoch_prompts(prompt_ids: Sequence[str], k: int, seed: int, epoch: int) -> list[str]:
    """The ``k`` unique prompts of ``epoch``: ``default_rng(seed + epoch).choice`` over
    ``sorted(prompt_ids)`` without replacement, in draw order.

    Raises:
        ValueError: fewer prompts than ``k``.
    """
    ids = sorted(prompt_ids)
    if k > len(ids):
        raise ValueError(f"prompts_per_epoch={k} but only {len(ids)} prompts in the split")
    rng = np.random.default_rng(int(seed) + int(epoch))
    return [ids[i] for i in rng.choice(len(ids), size=k, replace=False)]


def trajectory_prompts(chosen: Sequence[str], group_size: int, n_traj: int) -> list[str]:
    """The prompt id of each of an epoch's ``n_traj`` trajectories: ``rollout`` samples the
    ``chosen`` prompts' groups one after another, ``group_size`` trajectories each."""
    return [chosen[i // group_size] for i in range(n_traj)]


def minibatches(n: int, steps: int, seed: int, epoch: int) -> list[np.ndarray]:
    """The epoch's ``n`` trajectory indices shuffled with ``default_rng([seed + epoch, 1])`` (a
    stream independent of the prompt draw) and cut into ``steps`` near-equal parts, each sorted.

    Raises:
        ValueError: fewer trajectories than steps.
    """
    if n < steps:
        raise ValueError(f"{n} trajectories cannot make {steps} gradient steps")
    rng = np.random.default_rng([int(seed) + int(epoch), 1])
    return [np.sort(part) for part in np.array_split(rng.permutation(n), steps)]


def generators(seed: int, stream: str, epoch: int, prompt_id: str, indices: Sequence[int]) -> list[torch.Generator]:
    """CPU generators seeded with ``stable_seed(seed, stream, epoch, prompt_id, g)``."""
    return [torch.Generator().manual_seed(stable_seed(seed, stream, epoch, prompt_id, int(g))) for g in indices]


def evaluation_epochs(epochs: int, every: int) -> list[int]:
    """The epochs (counts of finished epochs) after which GRPO evaluates: ``0, every, 2 every,
    ...`` below ``epochs``, and ``epochs`` itself."""
    return sorted({e for e in range(0, epochs, every)} | {epochs})
