"""Checkpoints and the adapter of judge training (:mod:`paco.judge.training`).

Every ``checkpoint_every`` optimizer steps and at each epoch end, ``accelerator.save_state``
writes ``<checkpoints>/step-NNNNNNN/`` (LoRA weights only via a save hook, optimizer,
scheduler, RNG states of every process) plus ``trainer_state.json`` (run identity, epoch,
steps done in that epoch, global step, the logged history). It is written to a hidden temp
directory and renamed, and only the last two are kept. At start the newest readable checkpoint
is resumed if it was written under the same run identity (:mod:`paco.core.run_identity`: the sft
table, the base model, every code file the stage runs, the ``reward_train`` params except
``checkpoint_every``, the process count and device type; ``epochs`` is part of it, since the
learning-rate schedule spans all epochs); otherwise the checkpoints are removed and training
starts fresh, with the reason logged and reported.

The checkpoint of a run holds only its trainable weights (:class:`LoraStateHooks`); the final
PEFT adapter is :func:`save_adapter`'s.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from paco.core import checkpoints as ckpt
from paco.core.distributed import broadcast_from_main
from paco.judge.run import RewardRun, RewardState

# the judge training's logger (its checkpoint lines read as the training's)
log = logging.getLogger("paco.judge.training")

STATE_FILE = ckpt.STATE_FILE
LORA_STATE_FILE = "lora_trainable.safetensors"
CHECKPOINT_PREFIX = "step-"
KEEP_CHECKPOINTS = 2


class LoraStateHooks:
    """accelerate save/load pre-hooks that checkpoint only the trainable (LoRA) weights, not the
    frozen base model (``accelerator.save_state`` would otherwise write all of it)."""

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator

    def trainable(self, model: Any) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.accelerator.unwrap_model(model).named_parameters() if p.requires_grad}

    def save(self, models: list, weights: list, output_dir: str) -> None:
        from safetensors.torch import save_file

        for i in range(len(weights)):  # empty under FSDP / DeepSpeed: they save their own way
            if self.accelerator.is_main_process:
                name = LORA_STATE_FILE if i == 0 else f"{i}_{LORA_STATE_FILE}"
                state = {n: p.detach().cpu().contiguous() for n, p in self.trainable(models[i]).items()}
                save_file(state, os.path.join(output_dir, name))
        del weights[:]

    def load(self, models: list, input_dir: str) -> None:
        from safetensors.torch import load_file

        for i, m in enumerate(list(models)):
            name = LORA_STATE_FILE if i == 0 else f"{i}_{LORA_STATE_FILE}"
            state = load_file(os.path.join(input_dir, name))
            own = self.trainable(m)
            if set(state) != set(own):
                raise RuntimeError(f"checkpoint {input_dir}: its LoRA parameter names differ from the model's")
            with torch.no_grad():
                for n, p in own.items():
                    p.copy_(state[n].to(p.device, p.dtype))
        del models[:]


def _check_readable(path: Path) -> None:
    """Read every file ``accelerator.save_state`` wrote into a checkpoint (safetensors and
    pickles; the sharded directories of FSDP / DeepSpeed are left to them).

    Raises:
        Exception: a file is truncated or corrupt.
    """
    from safetensors.torch import load_file

    for f in sorted(path.iterdir()):
        if f.suffix == ".safetensors":
            load_file(str(f))
        elif f.suffix in (".bin", ".pkl", ".pt"):
            torch.load(f, weights_only=False, map_location="cpu")


def resume(run: RewardRun, state: RewardState) -> RewardState:
    """Fill the fresh ``state`` from the newest readable checkpoint written under the same run
    identity (decided by the main process, :func:`paco.core.checkpoints.find_resumable`, and
    broadcast), loaded into the model, optimizer, scheduler and RNGs (``accelerator.load_state``);
    without one ``state`` stays fresh. Its ``resume`` records the decision. Returns ``state``."""
    found = None
    if run.main:
        required = ["custom_checkpoint_0.pkl"] + [f"random_states_{r}.pkl" for r in range(run.world)]
        found = ckpt.find_resumable(run.checkpoints_dir, CHECKPOINT_PREFIX, run.identity, main=True, log=log,
                                    required_files=required, load=lambda path, saved: _check_readable(path))
        if found.path is None:
            log.info("starting fresh: %s", found.reason)
    found = broadcast_from_main(run.accelerator, found)
    state.resume = found
    if found.path is not None:
        run.accelerator.load_state(str(found.path))
        saved = found.state
        state.history = saved["history"]
        state.epoch, state.step_in_epoch, state.global_step = saved["epoch"], saved["step_in_epoch"], saved["global_step"]
        if run.main:
            log.info("resuming from %s: epoch %d, %d/%d steps of it done, global step %d",
                     found.path, state.epoch + 1, state.step_in_epoch, run.steps_per_epoch, state.global_step)
    run.accelerator.wait_for_everyone()
    return state


def save_checkpoint(run: RewardRun, state: RewardState) -> str:
    """``step-NNNNNNN/`` (:func:`paco.core.checkpoints.write_checkpoint`: a temp directory renamed
    into place, the newest :data:`KEEP_CHECKPOINTS` kept, ``plots/*.csv`` rewritten):
    ``accelerator.save_state`` on every process (LoRA weights via the hook, optimizer, scheduler,
    every process's RNG state) plus ``trainer_state.json`` (run identity, position, history)."""
    saved = {**run.identity.to_state(), "epoch": state.epoch, "step_in_epoch": state.step_in_epoch,
             "steps_per_epoch": run.steps_per_epoch, "global_step": state.global_step, "history": state.history}
    path = ckpt.write_checkpoint(run.checkpoints_dir, f"{CHECKPOINT_PREFIX}{state.global_step:07d}", saved,
                                 prefix=CHECKPOINT_PREFIX, keep=KEEP_CHECKPOINTS, accelerator=run.accelerator,
                                 main=run.main, write_each=lambda tmp: run.accelerator.save_state(str(tmp)),
                                 plots_dir=run.plots_dir)
    return str(path)


def save_adapter(run: RewardRun, adapter_dir: str | os.PathLike[str] | None) -> None:
    """The PEFT adapter (``adapter_config.json``, ``adapter_model.safetensors``, canonical
    bytes) written by the main process via a temp directory and a rename; ``get_state_dict`` is a
    collective under FSDP / ZeRO-3, so every process calls this."""
    acc = run.accelerator
    acc.wait_for_everyone()
    unwrapped = acc.unwrap_model(run.model)
    state_dict = acc.get_state_dict(run.model)
    if run.main and adapter_dir is not None:
        target = Path(adapter_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped.save_pretrained(str(tmp), state_dict=state_dict, safe_serialization=True,
                                  save_embedding_layers=False)
        ckpt.canonicalise_adapter_dir(tmp)
        for f in tmp.iterdir():  # safetensors creates its file 0600; keep the usual permissions
            f.chmod(0o644)
        ckpt.replace_dir(tmp, target)
        log.info("adapter saved to %s", target)
