"""The PaCo-GRPO rollout: an epoch's ``K x G`` trajectories sampled with the old adapter (SDE
steps at ``rollout.sde_indices``, ODE steps elsewhere), kept for the update with their decoded
images (:mod:`paco.grpo.trainer`, step 2 of an epoch)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from paco.core.params import GrpoSubtaskParams
from paco.grpo.plan import epoch_prompts, generators
from paco.grpo.policies import OLD_ADAPTER, Conditioning, Policy
from paco.grpo.rewards import OverlappedRewards, SubtaskItem
from paco.grpo.run import GrpoRun


@dataclass
class Trajectory:
    """One sampled trajectory kept for training (latents on the CPU; the prompt embeddings are
    the group's, on the policy's device)."""

    index: int                 # global index in the epoch (prompt-major)
    prompt_id: str
    embeds: Conditioning       # one row at the trajectory's size, shared by the prompt's group
    latents: torch.Tensor      # (n_sde, 2, seq, C)
    sigmas: torch.Tensor       # (N + 1,)
    timesteps: torch.Tensor    # (N,)
    sde_indices: tuple[int, ...]
    height: int
    width: int


def sample_group(policy: Policy, prompt: SubtaskItem, embeds: Conditioning, indices: Sequence[int],
                 cfg: GrpoSubtaskParams, epoch: int, height: int, width: int, *, base_index: int
                 ) -> tuple[list[Trajectory], list[Any]]:
    """Sample the trajectories ``indices`` (within the prompt's group) of one prompt with the
    active adapter, in chunks of ``rollout.batch_size``; return them and their decoded images."""
    s = cfg.rollout
    trajs, images = [], []
    for start in range(0, len(indices), s.batch_size):
        chunk = list(indices[start:start + s.batch_size])
        emb = embeds.select([0] * len(chunk))
        roll = policy.generate(
            emb, height=height, width=width, num_steps=s.num_steps, noise_level=s.noise_level,
            sde_indices=s.sde_indices,
            noise_generators=generators(cfg.seed, "noise", epoch, prompt.prompt_id,
                                        [0] * len(chunk) if s.same_initial_noise else chunk),
            sde_generators=generators(cfg.seed, "sde", epoch, prompt.prompt_id, chunk),
            sigma_max=s.sigma_max,
        )
        images += policy.decode(roll.final_latents, height, width)
        for r, g in enumerate(chunk):
            trajs.append(Trajectory(
                index=base_index + g, prompt_id=prompt.prompt_id, embeds=embeds,
                latents=roll.latents[r].cpu(), sigmas=roll.sigmas,
                timesteps=roll.timesteps, sde_indices=roll.sde_indices, height=height, width=width,
            ))
    return trajs, images


@dataclass
class Rollout:
    """One epoch's samples on this process: the chosen prompts (all processes), this process's
    trajectories (global prompt-major indices), their decoded images, and the served rewards
    scored while sampling (reward name -> ``(n,)`` float64 in this process's trajectory order;
    empty without ``overlap_rewards``)."""

    chosen: list[str]
    trajectories: list[Trajectory]
    images: list[Any]
    served: dict[str, np.ndarray] = field(default_factory=dict)
    served_wait_s: float = 0.0  # time spent after sampling waiting for the served rewards


def rollout(run: GrpoRun, epoch: int) -> Rollout:
    """Sample the epoch's ``K x G`` trajectories with the old adapter; trajectory ``i`` (prompt
    major) on process ``i % P`` (:func:`paco.grpo.plan.epoch_prompts`, :func:`sample_group`). With
    ``rollout.overlap_rewards`` the served rewards of each group are scored while the next
    one is sampled (:class:`paco.grpo.rewards.OverlappedRewards`).

    Raises:
        paco.grpo.rewards.RewardError, paco.serving.judge_client.JudgeError: a served reward failed.
    """
    cfg = run.cfg
    chosen = epoch_prompts(run.train_ids, cfg.prompts_per_epoch, cfg.seed, epoch)
    trajs: list[Trajectory] = []
    images: list[Any] = []
    overlap = OverlappedRewards(list(cfg.rewards), run.ctx) if cfg.rollout.overlap_rewards else None
    try:
        with run.policy.using(OLD_ADAPTER):
            for k, pid in enumerate(chosen):
                mine = [g for g in range(cfg.group_size) if (k * cfg.group_size + g) % run.world == run.rank]
                if not mine:
                    continue
                h, w = run.train_size[pid]
                emb = run.condition(pid, h, w)
                tr, ims = sample_group(run.policy, run.infos[pid], emb, mine, cfg, epoch, h, w,
                                       base_index=k * cfg.group_size)
                trajs += tr
                images += ims
                if overlap is not None:
                    overlap.submit(ims, [run.infos[pid]] * len(ims))
        t_wait = time.perf_counter()
        served = overlap.collect() if overlap is not None else {}
        wait = time.perf_counter() - t_wait
    finally:
        if overlap is not None:
            overlap.close()
    return Rollout(chosen, trajs, images, served, wait)
