"""What a judge training run holds and passes between its steps (:mod:`paco.judge.training`,
:mod:`paco.judge.checkpointing`): the fixed parts (:class:`RewardRun`), where it is
(:class:`RewardState`, checkpointed) and what the per-step callback receives (:class:`StepInfo`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from paco.core import checkpoints as ckpt
from paco.core.params import RewardTrainParams
from paco.core.run_identity import RunIdentity
from paco.judge.model import AnswerTokens
from paco.judge.sft_data import SftRow


@dataclass(frozen=True)
class StepInfo:
    """What the per-step ``callback`` of :func:`train_reward` receives (after any checkpoint).

    ``epoch`` is 1-based; ``step_in_epoch`` counts the steps done in that epoch (1 ..
    ``steps_per_epoch``); ``checkpoint`` is the directory written after this step, if any.
    """

    global_step: int
    epoch: int
    step_in_epoch: int
    steps_per_epoch: int
    total_steps: int
    loss: float
    checkpoint: str | None


@dataclass
class RewardRun:
    """What stays fixed through a judge training run: its params section, the accelerator, the data split,
    the LoRA-wrapped model (prepared) with its optimizer and scheduler, the answer tokens, the
    run identity and where state goes."""

    cfg: RewardTrainParams
    accelerator: Any
    identity: RunIdentity
    model: Any
    processor: Any
    optimizer: Any
    scheduler: Any
    lora_params: list[torch.nn.Parameter]
    answer: AnswerTokens
    train_rows: list[SftRow]
    train_available: int
    test_rows: list[SftRow]
    counts: dict[str, int]
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    checkpoints_dir: Path
    plots_dir: Path | None
    hooks: list[Any]

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def global_batch(self) -> int:
        return self.cfg.batch_size * self.world * self.cfg.gradient_accumulation_steps


@dataclass
class RewardState:
    """Where a judge training run is (checkpointed): the epoch (0-based) and the optimizer steps
    done in it, the global step, the logged history; and this run's bookkeeping."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    history: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {"train": [], "eval": []})
    resume: ckpt.Resume | None = None
    steps_this_run: int = 0
    train_seconds: float = 0.0
