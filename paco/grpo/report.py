"""What a PaCo-GRPO run reports: each epoch's ``plots/train.csv`` row (:func:`epoch_row`) and the
finished run's headline metrics and detailed report (:func:`summarise`; the ``metrics.json`` and
``report.json`` of stage ``grpo@<subtask>``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from paco.core.statistics import learning_signal
from paco.grpo.checkpointing import selected_epoch
from paco.grpo.monitors import MONITORS
from paco.grpo.plan import epoch_prompts, trajectory_prompts
from paco.grpo.run import Advantages, GrpoRun, GrpoState


def epoch_row(run: GrpoRun, epoch: int, rewards: dict[str, np.ndarray], adv: Advantages,
              stats: dict[str, float]) -> dict[str, Any]:
    """The epoch's ``plots/train.csv`` row: reward means and stds, log-tame diagnostics,
    advantage and update statistics (deterministic figures only, no timings)."""
    cfg = run.cfg
    groups = adv.aggregated.reshape(cfg.prompts_per_epoch, cfg.group_size)
    row: dict[str, Any] = {"epoch": epoch + 1, "reward": float(adv.weighted.mean()),
                           "reward_std": float(adv.weighted.std()), "reward_aggregated": float(np.mean(adv.aggregated))}
    for k, v in rewards.items():
        row[f"{k}_mean"] = float(v.mean())
        row[f"{k}_std"] = float(v.std())
    if "h" in adv.info:
        for k, hk in adv.info["h"].items():
            row[f"{k}_h"] = float(hk) if np.isfinite(hk) else None
        row["tamed"] = "+".join(adv.info["tamed"])
    n = max(stats["n"], 1.0)
    row.update({
        "advantage_abs_mean": float(np.abs(adv.advantages).mean()),
        "zero_std_group_fraction": float((groups.std(axis=1) < 1e-6).mean()),
        "clip_fraction": stats["clipped"] / n,
        "ratio_mean": stats["ratio"] / n,
        "loss": stats["loss"] / n,
        "policy_loss": stats["policy_loss"] / n,
        "kl": stats["kl"] / n if np.isfinite(stats["kl"]) else None,  # None: not computed (train.log_kl)
        "grad_norm": stats["grad_norm"],
    })
    return row


def summarise(run: GrpoRun, state: GrpoState, wall: float) -> dict[str, Any]:
    """``{"metrics": ..., "report": ...}`` of a finished run (see :func:`paco.grpo.trainer.train_grpo`)."""
    cfg = run.cfg
    window = max(1, min(5, cfg.epochs // 3))
    groups = [trajectory_prompts(epoch_prompts(run.train_ids, cfg.prompts_per_epoch, cfg.seed, e), cfg.group_size,
                                 len(r)) for e, r in enumerate(state.per_sample_rewards)]
    signal = learning_signal([np.asarray(r) for r in state.per_sample_rewards], groups, window)
    evals = state.history["eval"]
    first, final = (evals[0] if evals else {}), (evals[-1] if evals else {})
    # the headline a user compares across runs (a few short keys, so `dvc exp show --only-changed`
    # of a GRPO experiment fits a terminal); every other figure is in the report
    metrics = {
        "train_gain": signal.get("improvement"),    # last minus first epochs' mean training reward
        "train_gain_p": signal.get("p_value"),      # one-sided paired t-test of that gain over the prompts
        "eval_reward": final.get("reward"),         # weighted reward of the final ODE evaluation
    }
    # the reward-hacking monitors: final minus first evaluation (paco.grpo.monitors)
    metrics.update({f"{m}_change": final[m] - first[m] for m in MONITORS if m in final and m in first})
    metrics["lora_epoch"] = selected_epoch(run, state)  # whose weights the LoRA is (checkpoint_selection)
    if "reward" in final and "reward" in first:  # held-out against training prompts, final minus first evaluation
        metrics["eval_gain"] = final["reward"] - first["reward"]
    if "train_reward" in final and "train_reward" in first:
        metrics["eval_train_gain"] = final["train_reward"] - first["train_reward"]
    n_lora = sum(p.numel() for p in run.lora_params)
    report = {
        "run_identity": {"digest": run.identity.digest, "evaluation": run.identity.evaluation_digest,
                         **(state.resume.to_report() if state.resume else {}),
                         "reevaluated_epochs": state.reevaluated},
        "subtask_policy": cfg.policy,
        "epochs": cfg.epochs,
        "epochs_this_run": state.epochs_this_run,
        "processes": run.world,
        "device": run.device.type,
        "torch_threads_per_process": torch.get_num_threads(),
        "trajectories_per_epoch": run.n_traj,
        "transitions_per_epoch": run.n_traj * len(cfg.rollout.sde_indices),
        "trained_transitions_per_epoch": run.n_traj * len(cfg.train.trained_sde_steps or cfg.rollout.sde_indices),
        "optimizer_steps": cfg.epochs * cfg.train.gradient_steps_per_epoch,
        "lora_parameters": n_lora,
        "train_resolution": cfg.train.resolution,
        "eval_resolution": cfg.eval.resolution,
        "train_prompts": len(run.train_ids),
        "eval_prompts": len(run.eval_prompts),
        "first_update_ratio_max_abs_deviation": (max(state.first_update_ratio_dev)
                                                 if state.first_update_ratio_dev else None),
        "learning_signal": signal,
        "train_final": state.history["train"][-1] if state.history["train"] else {},
        "eval_first": first,
        "eval_final": final,
        "lora_epoch": metrics["lora_epoch"],
        "seconds": {k: round(v, 2) for k, v in state.timings.items()},
        "seconds_per_epoch": (round(sum(state.timings[k] for k in ("rollout", "reward", "train")) /
                                    state.epochs_this_run, 3) if state.epochs_this_run else None),
        "epoch_seconds": state.epoch_seconds,
        "wall_seconds_train_grpo": round(wall, 2),
    }
    return {"metrics": metrics, "report": report}
