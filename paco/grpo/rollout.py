"""The PaCo-GRPO rollout: an epoch's ``K x G`` trajectories sampled with the old adapter (SDE
steps at ``rollout.sde_indices``, ODE steps elsewhere), kept for the update with their decoded
images (:mod:`paco.grpo.trainer`, step 2 of an epoch).

:func:`sample_groups` samples the epoch (a :class:`RolloutBatch` of :class:`Trajectory`), one
prompt's group at a time (:func:`sample_group`); :func:`stack_transitions` gives the update a
chunk's kept SDE step with the settings it was sampled with."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from paco.core.params import GrpoSubtaskParams
from paco.grpo.plan import epoch_prompts, generators
from paco.grpo.policies import OLD_ADAPTER, Conditioning, Policy, Transitions
from paco.grpo.rewards import OverlappedRewards, SubtaskItem
from paco.grpo.run import GrpoRun
from paco.grpo.sde import SdeSettings


@dataclass
class Trajectory:
    """One sampled trajectory kept for training (latents on the CPU; the prompt embeddings are
    the group's, on the policy's device), with the SDE settings it was sampled with."""

    index: int                 # global index in the epoch (prompt-major)
    prompt_id: str
    embeds: Conditioning       # one row at the trajectory's size, shared by the prompt's group
    latents: torch.Tensor      # (n_sde, 2, seq, C)
    log_probs: torch.Tensor    # (n_sde,) float32: each SDE step's log-prob when sampled (old adapter)
    sigmas: torch.Tensor       # (N + 1,)
    timesteps: torch.Tensor    # (N,)
    sde_indices: tuple[int, ...]
    height: int
    width: int
    sde: SdeSettings


def sample_group(policy: Policy, prompt: SubtaskItem, embeds: Conditioning, indices: Sequence[int],
                 cfg: GrpoSubtaskParams, sde: SdeSettings, epoch: int, height: int, width: int, *, base_index: int
                 ) -> tuple[list[Trajectory], list[Any]]:
    """Sample the trajectories ``indices`` (within the prompt's group) of one prompt with the
    active adapter and the SDE settings ``sde``, in chunks of ``rollout.batch_size``; return them
    and their decoded images."""
    s = cfg.rollout
    trajs, images = [], []
    for start in range(0, len(indices), s.batch_size):
        chunk = list(indices[start:start + s.batch_size])
        emb = embeds.select([0] * len(chunk))
        batch = policy.generate(
            emb, height=height, width=width, num_steps=s.num_steps, sde=sde, sde_indices=s.sde_indices,
            noise_generators=generators(cfg.seed, "noise", epoch, prompt.prompt_id,
                                        [0] * len(chunk) if s.same_initial_noise else chunk),
            sde_generators=generators(cfg.seed, "sde", epoch, prompt.prompt_id, chunk),
        )
        images += policy.decode(batch.final_latents, height, width)
        for r, g in enumerate(chunk):
            trajs.append(Trajectory(
                index=base_index + g, prompt_id=prompt.prompt_id, embeds=embeds,
                latents=batch.latents[r].cpu(), log_probs=batch.log_probs[r].cpu(), sigmas=batch.sigmas,
                timesteps=batch.timesteps, sde_indices=batch.sde_indices, height=height, width=width, sde=batch.sde,
            ))
    return trajs, images


@dataclass
class RolloutBatch:
    """One epoch's samples on this process: the chosen prompts (all processes), this process's
    trajectories (global prompt-major indices), their decoded images, and the served rewards
    scored while sampling (reward name -> ``(n,)`` float64 in this process's trajectory order;
    empty without ``overlap_rewards``)."""

    chosen: list[str]
    trajectories: list[Trajectory]
    images: list[Any]
    served: dict[str, np.ndarray] = field(default_factory=dict)
    served_wait_s: float = 0.0  # time spent after sampling waiting for the served rewards


def sample_groups(run: GrpoRun, epoch: int) -> RolloutBatch:
    """Sample the epoch's ``K x G`` trajectories with the old adapter and the run's SDE settings
    (:attr:`paco.grpo.run.GrpoRun.sde`); trajectory ``i`` (prompt major) on process ``i % P``
    (:func:`paco.grpo.plan.epoch_prompts`, :func:`sample_group`). With ``rollout.overlap_rewards``
    the served rewards of each group are scored while the next one is sampled
    (:class:`paco.grpo.rewards.OverlappedRewards`).

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
                tr, ims = sample_group(run.policy, run.infos[pid], emb, mine, cfg, run.sde, epoch, h, w,
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
    return RolloutBatch(chosen, trajs, images, served, wait)


def stack_transitions(chunk: Sequence[Trajectory], j: int, device: torch.device | str) -> Transitions:
    """The ``j``-th kept SDE step of the trajectories ``chunk`` (``0 <= j < n_sde``) stacked on
    ``device``: ``x``, ``x_next`` ``(len(chunk), seq, C)``, the step's sigmas and timestep, and the
    SDE settings the chunk was sampled with.

    Raises:
        ValueError: the trajectories differ in SDE settings, SDE steps, image size or schedule (one
            chunk is one re-scoring call, so it must share all of them).
    """
    first = chunk[0]
    for c in chunk[1:]:
        if (c.sde != first.sde or c.sde_indices != first.sde_indices
                or (c.height, c.width) != (first.height, first.width)
                or not torch.equal(c.sigmas, first.sigmas) or not torch.equal(c.timesteps, first.timesteps)):
            raise ValueError(f"trajectories {first.index} and {c.index} were sampled with different SDE settings, "
                             "steps, sizes or schedules and cannot be re-scored together")
    step = first.sde_indices[j]
    x = torch.stack([c.latents[j, 0] for c in chunk]).to(device)
    x_next = torch.stack([c.latents[j, 1] for c in chunk]).to(device)
    return Transitions(x, x_next, first.sigmas[step], first.sigmas[step + 1], first.timesteps[step], first.sde)
