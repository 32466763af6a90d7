"""PaCo-GRPO checkpoint and LoRA I/O: resumable checkpoints, the kept evaluation weights and the
final diffusers LoRA.

Checkpoints (every ``save_every`` epochs and after the last): ``epoch-NNNN/`` with the trained,
old and EMA LoRA weights (``lora.safetensors``), the optimizer (``optimizer.pt``), the RNG
states (``rng-<rank>.pt``) and ``trainer_state.json`` (run identity, epoch, history); the newest
:data:`KEEP_CHECKPOINTS` are kept. The weights of every evaluation are kept in
``eval-weights/epoch-NNNN.safetensors``. :func:`resume` continues from the newest readable
checkpoint written under the same run identity (:mod:`paco.core.run_identity`) that is not past
``epochs``, else starts fresh and says why (:mod:`paco.grpo.trainer`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from paco.core import checkpoints as ckpt
from paco.core.distributed import broadcast_from_main, get_rng_state, set_rng_state
from paco.core.io import write_json
from paco.core.params import GrpoSubtaskParams
from paco.grpo.ema import swapped_weights
from paco.grpo.monitors import select_evaluation
from paco.grpo.plan import evaluation_epochs
from paco.grpo.policies import OLD_ADAPTER, TRAINED_ADAPTER, Policy
from paco.grpo.run import GrpoRun, GrpoState

log = logging.getLogger("paco.grpo.checkpointing")

STATE_FILE = ckpt.STATE_FILE
CHECKPOINT_PREFIX = "epoch-"
KEEP_CHECKPOINTS = 2
EVAL_WEIGHTS_DIR = "eval-weights"


def eval_weights_path(checkpoints_dir: Path, epoch: int) -> Path:
    """Where the weights evaluated after ``epoch`` epochs are kept:
    ``<checkpoints_dir>/eval-weights/epoch-NNNN.safetensors``."""
    return checkpoints_dir / EVAL_WEIGHTS_DIR / f"{CHECKPOINT_PREFIX}{epoch:04d}.safetensors"


def keep_eval_weights(path: Path, weights: dict[str, torch.Tensor]) -> None:
    """Write ``weights`` to ``path`` atomically (a temp file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    ckpt.save_safetensors(weights, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, rank: int, with_ema: bool) -> dict[str, Any]:
    """Read a checkpoint's files into memory (nothing is applied yet).

    Raises:
        Exception: a file is missing or corrupt (``OSError``, ``SafetensorError``, an unpickling
            error, ``KeyError`` for missing EMA weights).
    """
    from safetensors.torch import load_file

    weights = load_file(str(path / "lora.safetensors"))
    if with_ema and not any(k.startswith("ema/") for k in weights):
        raise KeyError("no EMA weights")
    return {"weights": weights, "optimizer": torch.load(path / "optimizer.pt", weights_only=False),
            "rng": torch.load(path / f"rng-{rank}.pt", weights_only=False)}


def _find_checkpoint(run: GrpoRun) -> ckpt.Resume:
    """The main process's resume decision (:func:`paco.core.checkpoints.find_resumable`), with
    the checkpoint's files read (``loaded``); a checkpoint past ``epochs``, or one whose
    evaluation params changed while kept evaluation weights are missing, is not resumed. Starting
    fresh removes the old checkpoints and kept weights."""
    cfg, ckdir = run.cfg, run.checkpoints_dir
    files = ["lora.safetensors", "optimizer.pt"] + [f"rng-{r}.pt" for r in range(run.world)]

    def load(path: Path, saved: dict[str, Any]) -> dict[str, Any]:
        for r in range(1, run.world):  # every process's RNG state is readable too
            torch.load(path / f"rng-{r}.pt", weights_only=False)
        return load_checkpoint(path, 0, run.ema is not None)

    found = ckpt.find_resumable(ckdir, CHECKPOINT_PREFIX, run.identity, main=True, log=log, required_files=files,
                                load=load)
    if found.path is not None and int(found.state["epoch"]) > cfg.epochs:
        log.warning("checkpoint %s is after epoch %d > epochs %d: starting fresh", found.path,
                    int(found.state["epoch"]), cfg.epochs)
        found = ckpt.Resume(None, None, f"{found.path.name} is past epochs {cfg.epochs}",
                            skipped_corrupt=found.skipped_corrupt)
    if found.path is not None and found.evaluation_changed:
        # re-evaluation needs the kept weights of every evaluation in the history
        missing = [r["epoch"] for r in found.state["history"]["eval"]
                   if not eval_weights_path(ckdir, int(r["epoch"])).is_file()]
        if missing:
            log.warning("the evaluation params changed but the weights evaluated after epochs %s are missing: "
                        "starting fresh", missing)
            found = ckpt.Resume(None, None, f"evaluation changed and the kept weights of epochs {missing} are "
                                "missing", skipped_corrupt=found.skipped_corrupt)
    if found.path is None:
        for p in ckpt.list_checkpoints(ckdir, CHECKPOINT_PREFIX):
            shutil.rmtree(p, ignore_errors=True)
        shutil.rmtree(ckdir / EVAL_WEIGHTS_DIR, ignore_errors=True)
    return found


def resume(run: GrpoRun) -> GrpoState:
    """The state to continue from: the newest readable checkpoint written under the same run
    identity (:func:`paco.core.checkpoints.find_resumable`; decided by the main process and broadcast),
    with the adapters, EMA, optimizer and RNG states restored, or a fresh state. A checkpoint past
    ``epochs`` (a longer run's) is not resumed. Evaluations not on this run's schedule
    (:func:`paco.grpo.plan.evaluation_epochs`; a shorter run's final one) are dropped."""
    cfg = run.cfg
    found = _find_checkpoint(run) if run.main else None
    loaded = found.loaded if found is not None else None  # the main process read it already
    found = broadcast_from_main(run.accelerator, found.without_loaded() if found is not None else None)
    state = GrpoState(resume=found)
    if found.path is None:
        if run.main:
            log.info("starting fresh: %s", found.reason)
        return state
    if loaded is None:
        loaded = load_checkpoint(found.path, run.rank, run.ema is not None)
    with torch.no_grad():
        for tag, adapter in (("trained", TRAINED_ADAPTER), ("old", OLD_ADAPTER)):
            for n, p in run.policy.adapter_parameters(adapter).items():
                p.copy_(loaded["weights"][f"{tag}/{n}"])
        if run.ema is not None:
            for n in run.ema.shadow:
                run.ema.shadow[n].copy_(loaded["weights"][f"ema/{n}"])
    run.optimizer.load_state_dict(loaded["optimizer"])
    set_rng_state(loaded["rng"])
    saved = found.state
    state.epoch = int(saved["epoch"])
    schedule = set(evaluation_epochs(cfg.epochs, cfg.eval.every))
    state.history = {"train": saved["history"]["train"],
                     "eval": [r for r in saved["history"]["eval"] if r["epoch"] in schedule]}
    state.per_sample_rewards = saved["per_sample_rewards"]
    if run.main:
        log.info("resuming from %s after epoch %d of %d (%s)", found.path, state.epoch, cfg.epochs, found.reason)
    return state


def save(run: GrpoRun, state: GrpoState) -> str:
    """Checkpoint ``epoch-NNNN/`` after ``state.epoch`` epochs
    (:func:`paco.core.checkpoints.write_checkpoint`: a temp directory renamed into place, the
    newest :data:`KEEP_CHECKPOINTS` kept, ``plots/*.csv`` rewritten): every process's RNG state,
    then from the main process the trained, old and EMA LoRA weights, the optimizer and
    ``trainer_state.json`` (run identity, epoch, history, per-sample rewards)."""

    def write_weights(tmp: Path) -> None:
        weights = {f"trained/{n}": p.detach().float() for n, p in run.trained.items()}
        weights.update({f"old/{n}": p.detach().float() for n, p in run.policy.adapter_parameters(OLD_ADAPTER).items()})
        if run.ema is not None:
            weights.update({f"ema/{n}": v for n, v in run.ema.shadow.items()})
        ckpt.save_safetensors(weights, tmp / "lora.safetensors")
        torch.save(run.optimizer.state_dict(), tmp / "optimizer.pt")

    def write_rng(tmp: Path) -> None:
        torch.save(get_rng_state(), tmp / f"rng-{run.rank}.pt")

    saved = {**run.identity.to_state(), "epoch": state.epoch, "history": state.history,
             "per_sample_rewards": state.per_sample_rewards}
    path = ckpt.write_checkpoint(run.checkpoints_dir, f"{CHECKPOINT_PREFIX}{state.epoch:04d}", saved,
                                 prefix=CHECKPOINT_PREFIX, keep=KEEP_CHECKPOINTS, accelerator=run.accelerator,
                                 main=run.main, write_each=write_rng, write_main=write_weights,
                                 plots_dir=run.plots_dir)
    return str(path)


def selected_epoch(run: GrpoRun, state: GrpoState) -> int:
    """The epoch whose weights become the LoRA: the last one (``checkpoint_selection: last``), or the
    evaluation :func:`paco.grpo.monitors.select_evaluation` picks (``monitors``)."""
    evals = state.history["eval"]
    if run.cfg.checkpoint_selection == "last" or not evals:
        return state.epoch
    return int(evals[select_evaluation(evals)]["epoch"])


def save_final(run: GrpoRun, state: GrpoState, lora_dir: str | os.PathLike[str] | None) -> None:
    """On the main process: the LoRA in ``lora_dir`` (:func:`save_lora`; ``None``: not saved) and
    ``plots/*.csv``. The LoRA is the final weights (the EMA weights if enabled), or with
    ``checkpoint_selection: monitors`` the kept weights of the evaluation :func:`selected_epoch`
    picks (``eval-weights/``, the weights that evaluation scored).

    Raises:
        FileNotFoundError: the selected evaluation's kept weights are missing."""
    if run.main and lora_dir is not None:
        epoch = selected_epoch(run, state)
        if epoch != state.epoch:
            from safetensors.torch import load_file

            path = eval_weights_path(run.checkpoints_dir, epoch)
            if not path.is_file():
                raise FileNotFoundError(f"{path}: the weights evaluated after epoch {epoch}, selected as the LoRA, "
                                        "are missing")
            log.info("checkpoint selection on the monitors: the LoRA is the weights evaluated after epoch %d "
                     "(of %d)", epoch, state.epoch)
            with swapped_weights(run.trained, load_file(str(path))):
                save_lora(run.policy, run.cfg, lora_dir)
        else:
            with (run.ema.swapped_in(run.trained) if run.ema is not None else contextlib.nullcontext()):
                save_lora(run.policy, run.cfg, lora_dir)
    if run.main:
        ckpt.write_plot_csvs(run.plots_dir, state.history)


def save_lora(policy: Policy, cfg: GrpoSubtaskParams, lora_dir: str | os.PathLike[str]) -> None:
    """Write the trained adapter's current weights as a diffusers LoRA of the policy's pipeline
    class (atomically, with deterministic bytes: :func:`paco.core.checkpoints.canonicalise_safetensors`)."""
    target = Path(lora_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    meta = {"r": cfg.lora.rank, "lora_alpha": cfg.lora.alpha, "target_modules": list(cfg.lora.target_modules)}
    policy.save_lora(tmp, policy.lora_state_dict(TRAINED_ADAPTER), metadata=meta)
    for f in tmp.glob("*.safetensors"):
        ckpt.canonicalise_safetensors(f)
    write_json(tmp / "lora_config.json", {**meta, "lora_dropout": cfg.lora.dropout, "base_policy": cfg.policy,
                                           "family": cfg.family, "pipeline_class": policy.pipeline_class})
    for f in tmp.iterdir():
        f.chmod(0o644)
    ckpt.replace_dir(tmp, target)
    log.info("LoRA saved to %s", target)
