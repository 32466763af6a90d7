"""What a PaCo-GRPO run holds and passes between its steps (:mod:`paco.grpo.trainer`): the fixed
parts (:class:`GrpoRun`), the accumulated and checkpointed state (:class:`GrpoState`), an epoch's
advantages (:class:`Advantages`) and what the per-epoch callback gets (:class:`EpochInfo`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paco.core import checkpoints as ckpt
from paco.core.params import GrpoSubtaskParams
from paco.core.run_identity import RunIdentity
from paco.grpo.ema import LoraEMA
from paco.grpo.policies import Conditioning, Policy
from paco.grpo.rewards import RewardContext, SubtaskItem
from paco.grpo.sde import SdeSettings


@dataclass(frozen=True)
class EpochInfo:
    """What the ``callback`` of :func:`paco.grpo.trainer.train_grpo` gets after each epoch (after
    its checkpoint)."""

    epoch: int                  # 1-based count of finished epochs
    epochs: int
    row: dict[str, Any]
    checkpoint: str | None
    policy: Policy


@dataclass
class GrpoRun:
    """What stays fixed through a GRPO run: params, processes, the policy with its adapters, the
    SDE settings of its rollouts, the optimizer, the EMA, the prompts and their sizes, the run
    identity and where state goes."""

    cfg: GrpoSubtaskParams
    ctx: RewardContext
    identity: RunIdentity
    accelerator: Any
    rank: int
    world: int
    device: torch.device
    policy: Policy
    #: ``rollout.noise_level`` and ``rollout.sigma_max``, read once (:func:`paco.grpo.trainer.setup`):
    #: the rollouts sample with them and record them, the update re-scores with the recorded ones
    sde: SdeSettings
    trained: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    ema: LoraEMA | None
    infos: dict[str, SubtaskItem]
    train_ids: list[str]
    train_size: dict[str, tuple[int, int]]
    eval_prompts: list[SubtaskItem]
    eval_sizes: list[tuple[int, int]]
    checkpoints_dir: Path
    plots_dir: Path | None
    #: the training prompts evaluated beside the held-out ones (``eval.train_prompts``) and their sizes
    eval_train_prompts: list[SubtaskItem] = field(default_factory=list)
    eval_train_sizes: list[tuple[int, int]] = field(default_factory=list)
    #: (prompt id, height, width) -> the prompt's conditioning at that size, on the CPU: the
    #: encoders are frozen, so a prompt drawn again in a later epoch reuses it (:meth:`condition`)
    conditions: dict[tuple[str, int, int], Conditioning] = field(default_factory=dict)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def n_traj(self) -> int:
        return self.cfg.prompts_per_epoch * self.cfg.group_size

    @property
    def lora_params(self) -> list[torch.nn.Parameter]:
        """The trained adapter's LoRA tensors (what the optimizer steps), in :attr:`trained` order."""
        return list(self.trained.values())

    def condition(self, prompt_id: str, height: int, width: int) -> Conditioning:
        """The conditioning of a train prompt at ``height x width`` on the policy's device
        (:meth:`paco.grpo.policies.base.Policy.condition`, computed once per run)."""
        key = (prompt_id, int(height), int(width))
        if key not in self.conditions:
            self.conditions[key] = self.policy.condition([self.infos[prompt_id]], height, width).to_device("cpu")
        return self.conditions[key].to_device(self.device)

    def eval_weights(self) -> dict[str, torch.Tensor]:
        """The weights evaluated and saved: the EMA if enabled, else the trained adapter's."""
        if self.ema is not None:
            return {n: v.clone() for n, v in self.ema.shadow.items()}
        return {n: p.detach().float().clone() for n, p in self.trained.items()}


@dataclass
class GrpoState:
    """What a GRPO run accumulates and checkpoints: finished epochs, the training and evaluation
    history (one row per epoch / evaluation; deterministic figures only), every epoch's
    per-trajectory weighted rewards, and this run's bookkeeping (not checkpointed)."""

    epoch: int = 0
    history: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {"train": [], "eval": []})
    per_sample_rewards: list[list[float]] = field(default_factory=list)
    resume: ckpt.Resume | None = None
    epochs_this_run: int = 0
    reevaluated: list[int] = field(default_factory=list)
    first_update_ratio_dev: list[float] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=lambda: {"rollout": 0.0, "reward": 0.0, "train": 0.0, "eval": 0.0})
    epoch_seconds: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Advantages:
    """The epoch's aggregated rewards ``(K * G,)``, clipped advantages ``(K * G,)``, the
    aggregation's diagnostics and the raw weighted reward ``(K * G,)``."""

    aggregated: np.ndarray
    advantages: np.ndarray
    info: dict[str, Any]
    weighted: np.ndarray
