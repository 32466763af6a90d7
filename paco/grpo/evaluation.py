"""PaCo-GRPO evaluation (every ``eval.every`` epochs and after the last): deterministic ODE
sampling of the test prompts at ``eval.resolution`` with ``eval.num_steps`` steps, with the EMA
weights if enabled, scored with the training rewards -- resolution-decoupled training (PaCo-RL
§4.2): cheap low-resolution rollouts for training, the target resolution for evaluation. The
evaluated weights are kept, so that a change of the evaluation params re-evaluates them
(:func:`reevaluate`) without retraining."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from paco.core.distributed import gather_objects
from paco.core.params import GrpoSubtaskParams
from paco.grpo.advantages import weighted_sum
from paco.grpo.checkpointing import eval_weights_path, keep_eval_weights
from paco.grpo.ema import swapped_weights
from paco.grpo.plan import generators
from paco.grpo.policies import TRAINED_ADAPTER, Policy
from paco.grpo.monitors import MONITORS, monitor_warnings, sample_monitors
from paco.grpo.rewards import OverlappedRewards, RewardContext, SubtaskItem, compute_rewards
from paco.grpo.run import GrpoRun, GrpoState
from paco.grpo.sde import ODE

log = logging.getLogger("paco.grpo.evaluation")


@torch.no_grad()
def evaluate(policy: Policy, prompts: Sequence[SubtaskItem], sizes: Sequence[tuple[int, int]],
             cfg: GrpoSubtaskParams, ctx: RewardContext, *, rank: int = 0, world: int = 1,
             accelerator: Any = None) -> dict[str, Any]:
    """ODE samples of ``prompts`` (one each, initial noise from
    ``stable_seed(seed, "eval", 0, prompt_id, 0)``) at ``sizes`` with the active weights, in
    batches of up to ``eval.batch_size`` prompts of one size; mean and std of every reward and of
    their weighted sum (``reward``), and the mean of every reward-hacking monitor that applies
    (:func:`paco.grpo.monitors.sample_monitors` at the policy's latent patch period: e.g.
    ``grid_artifact``, ``input_ssim``)."""
    e = cfg.eval
    rows = []
    mine = list(range(rank, len(prompts), world))
    by_size: dict[tuple[int, int], list[int]] = {}
    for i in mine:
        by_size.setdefault(tuple(sizes[i]), []).append(i)
    # served rewards of each chunk scored while the next is sampled (as in the rollout)
    overlap = OverlappedRewards(list(cfg.rewards), ctx) if cfg.rollout.overlap_rewards else None
    submitted: list[int] = []
    try:
        for (h, w), idx in by_size.items():
            for start in range(0, len(idx), e.batch_size):
                chunk = idx[start:start + e.batch_size]
                emb = policy.condition([prompts[i] for i in chunk], h, w)
                noise = [generators(cfg.seed, "eval", 0, prompts[i].prompt_id, [0])[0] for i in chunk]
                batch = policy.generate(emb, height=h, width=w, num_steps=e.num_steps, sde=ODE,
                                        sde_indices=[], noise_generators=noise)
                images = policy.decode(batch.final_latents, h, w)
                rows += zip(chunk, images, strict=True)
                if overlap is not None:
                    overlap.submit(images, [prompts[i] for i in chunk])
                    submitted += chunk
        served = overlap.collect() if overlap is not None else {}
    finally:
        if overlap is not None:
            overlap.close()
    rows.sort(key=lambda r: r[0])
    order = {i: j for j, i in enumerate(submitted)}
    rewards = compute_rewards([n for n in cfg.rewards if n not in served], [im for _, im in rows],
                              [prompts[i] for i, _ in rows], ctx)
    rewards.update({n: np.array([v[order[i]] for i, _ in rows]) for n, v in served.items()})
    if rows:  # the reward-hacking monitors of the same samples
        rewards.update(sample_monitors([im for _, im in rows], [prompts[i] for i, _ in rows], ctx,
                                       period=policy.size_multiple))
    local = [(i, {k: float(v[j]) for k, v in rewards.items()}) for j, (i, _) in enumerate(rows)]
    allrows = sorted(gather_objects(accelerator, local), key=lambda r: r[0])
    table = {k: np.array([r[1][k] for r in allrows]) for k in cfg.rewards}
    total = weighted_sum(table, cfg.rewards)
    out: dict[str, Any] = {"prompts": len(allrows), "reward": float(total.mean()), "reward_std": float(total.std())}
    for k, v in table.items():
        out[f"{k}_mean"] = float(v.mean())
        out[f"{k}_std"] = float(v.std())
    for m in MONITORS:  # the mean over the samples it measures (NaN: a sample too small for it)
        values = np.array([r[1][m] for r in allrows if m in r[1]])
        if np.isfinite(values).any():
            out[m] = float(np.nanmean(values))
    return out


def evaluate_weights(run: GrpoRun, epoch: int, weights: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Evaluate (:func:`evaluate`) ``weights`` (default :meth:`paco.grpo.run.GrpoRun.eval_weights`) in the
    trained adapter on the evaluation split's prompts, and on the first ``eval.train_prompts`` training
    prompts (``train_reward``, ``train_<reward>_mean``; their samples draw their noise as the held-out
    prompts do, by prompt id); the main process keeps the weights as ``eval-weights/epoch-NNNN.safetensors``
    so that a change of the evaluation params re-evaluates them without retraining."""
    weights = run.eval_weights() if weights is None else weights
    if run.main:
        keep_eval_weights(eval_weights_path(run.checkpoints_dir, epoch), weights)
    with swapped_weights(run.trained, weights), run.policy.using(TRAINED_ADAPTER):
        res = evaluate(run.policy, run.eval_prompts, run.eval_sizes, run.cfg, run.ctx, rank=run.rank,
                       world=run.world, accelerator=run.accelerator)
        if run.eval_train_prompts:  # the training prompts beside them: training against held-out reward
            seen = evaluate(run.policy, run.eval_train_prompts, run.eval_train_sizes, run.cfg, run.ctx,
                            rank=run.rank, world=run.world, accelerator=run.accelerator)
            res.update({"train_prompts": seen["prompts"], "train_reward": seen["reward"],
                        **{f"train_{k}_mean": seen[f"{k}_mean"] for k in run.cfg.rewards}})
    if run.main:
        log.info("eval after epoch %d at %dpx: reward %.4f (%s)%s", epoch, run.cfg.eval.resolution, res["reward"],
                 ", ".join(f"{k} {res[f'{k}_mean']:.4f}" for k in run.cfg.rewards),
                 f"; training prompts {res['train_reward']:.4f}" if "train_reward" in res else "")
    return {"epoch": epoch, **res}


def record_evaluation(run: GrpoRun, state: GrpoState, epoch: int) -> None:
    """:func:`evaluate_weights` of the current weights after ``epoch`` epochs, appended to the
    evaluation history, its time added to ``state.timings["eval"]``; a log warning names every
    monitor that moved past its bound from the first evaluation
    (:func:`paco.grpo.monitors.monitor_warnings`)."""
    te = time.perf_counter()
    row = evaluate_weights(run, epoch)
    state.history["eval"].append(row)
    state.timings["eval"] += time.perf_counter() - te
    first = state.history["eval"][0]
    if run.main and row is not first:
        for line in monitor_warnings(row, first, where=f"evaluation after epoch {epoch} vs after epoch {first['epoch']}"):
            log.warning("%s", line)


def reevaluate(run: GrpoRun, state: GrpoState) -> None:
    """After a change of the evaluation params only: evaluate again the kept weights of every
    evaluation in the history (``eval-weights/``), replacing its row; no optimizer step.

    Raises:
        FileNotFoundError: the kept weights of an evaluation are missing.
    """
    from safetensors.torch import load_file

    rows = []
    for row in state.history["eval"]:
        path = eval_weights_path(run.checkpoints_dir, int(row["epoch"]))
        if not path.is_file():
            raise FileNotFoundError(f"{path}: the weights evaluated after epoch {row['epoch']} are missing")
        weights = load_file(str(path))
        t0 = time.perf_counter()
        rows.append(evaluate_weights(run, int(row["epoch"]), weights))
        state.timings["eval"] += time.perf_counter() - t0
        state.reevaluated.append(int(row["epoch"]))
    state.history["eval"] = rows
