"""PaCo-GRPO: Flow-GRPO training of a policy LoRA (any family of :mod:`paco.grpo.policies`: FLUX.1
text to image, FLUX.1 Kontext editing) on multi-reward feedback (PaCo-RL §4, §7).

One epoch (the reference trainer's loop, ``train_flux.py`` of X-GenGroup/PaCo-RL):

1. **Evaluate** (every ``eval.every`` epochs and after the last; :mod:`paco.grpo.evaluation`):
   deterministic ODE sampling of the test prompts at ``eval.resolution`` with ``eval.num_steps``
   steps, with the EMA weights if enabled, and the same rewards -- resolution-decoupled training
   (§4.2): cheap low-resolution rollouts for training, the target resolution for evaluation.
2. **Sample** with the old policy (:mod:`paco.grpo.rollout`; the seeded plan:
   :mod:`paco.grpo.plan`): ``K = prompts_per_epoch`` unique train prompts drawn with
   ``numpy.random.default_rng(seed + epoch)``, ``G = group_size`` trajectories each at
   ``train.resolution`` (same aspect ratio as the prompt, area ``resolution**2``), SDE steps at
   ``rollout.sde_indices`` (noise level ``a``), ODE steps elsewhere. Trajectory ``g`` of prompt
   ``p`` draws its initial noise and its SDE noise from generators seeded with
   ``stable_seed(seed, "noise"|"sde", epoch, p, g)``, so a sample does not depend on batch size,
   order or process count. With ``rollout.same_initial_noise`` (the reference's ``same_latent``)
   the ``G`` trajectories of a prompt share their initial noise (``g = 0``) and differ only by the
   SDE noise: the group's reward differences then come from the trained steps alone.
3. **Reward**: every reward of ``rewards`` (name -> weight) for every decoded grid
   (:mod:`paco.grpo.rewards`); failures raise. With ``rollout.overlap_rewards`` the served
   rewards (the judge) of each prompt's group are scored on a worker thread while the next
   group is sampled (:class:`paco.grpo.rewards.OverlappedRewards`), with the same results.
4. **Advantages**: :func:`paco.grpo.advantages.aggregate` (``aggregation.method``, ``delta``,
   ``train.global_std``), clipped to ``+-train.adv_clip_max``.
5. **Update**: the epoch's trajectories are shuffled (``default_rng([seed + epoch, 1])``) and cut into
   ``train.gradient_steps_per_epoch`` equal mini-batches; each gives one AdamW step on the mean
   over its transitions (each trajectory's SDE steps) of the clipped surrogate plus ``beta``
   times the KL to the reference (:mod:`paco.grpo.losses`)::

       ratio = exp(logp_theta - logp_old)
       loss  = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)) + beta * KL
       KL    = mean over elements of (mu_theta - mu_ref)**2 / (2 std**2)

   (``std`` is the transition's std ``std_t * sqrt(-dt)``, so this is the exact KL between the
   two Gaussians per element; the reference divides by ``2 std_t**2 + 1e-7`` instead, a
   ``-dt`` times smaller value, which only rescales ``beta``). ``logp_old`` is recomputed with
   the old adapter on the same inputs, with the SDE settings each trajectory recorded when it
   was sampled (one :class:`paco.grpo.sde.SdeSettings` per run, made in :func:`setup`), so on the
   first update of an epoch, where old and trained adapters are equal, the ratio is exactly 1. The reference policy (adapters off) is
   evaluated only where the KL is used: ``beta > 0``, or ``train.log_kl`` for the log (the
   reference code computes it only at ``beta > 0``). Gradients are clipped to
   ``max_grad_norm``; the EMA of the trained LoRA is updated every ``ema.update_every`` steps
   (:mod:`paco.grpo.ema`).
6. **Refresh** the old adapter := the trained one (the reference's ``decay_type 0``).

Several processes (``accelerate launch``): trajectory ``i`` of the epoch (prompt-major order)
is sampled, rewarded and trained by process ``i % P``; rewards are gathered so advantages see
the whole epoch; each process backpropagates the sum of its transitions' losses divided by the
global transition count of the mini-batch and the gradients are summed over processes, so the
step equals the single-process step up to float summation order.

Checkpoints (every ``save_every`` epochs and after the last; :mod:`paco.grpo.checkpointing`):
``epoch-NNNN/`` with the trained, old and EMA LoRA weights (``lora.safetensors``), the optimizer
(``optimizer.pt``), the RNG states (``rng-<rank>.pt``) and ``trainer_state.json`` (run identity, epoch, history); the
weights of every evaluation are kept in ``eval-weights/``. A rerun resumes from the newest
readable checkpoint written under the same run identity (:mod:`paco.core.run_identity`: every
declared dep, code file and params key except ``epochs``, ``save_every``, ``resources`` and the
evaluation keys, plus the process count and device type) that is not past ``epochs``, else
starts fresh and says why; so raising ``epochs`` continues a finished run, and a change of the
evaluation params (``eval.*`` but ``every``) re-evaluates the kept weights without an optimizer
step. Since every random draw is seeded from ``(seed, epoch, ...)``, a resumed run equals an
uninterrupted one bit for bit.

This module holds the loop (:func:`train_grpo`, :func:`train_epoch`) and the steps that change
the policy (:func:`setup`, :func:`reward`, :func:`advantages`, :func:`update`); what a run holds
is in :mod:`paco.grpo.run`, its metrics and report in :mod:`paco.grpo.report`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from paco.core import host_independent
from paco.core.distributed import gather_objects, sum_gradients, wait_for_everyone
from paco.core.numerics import set_torch_cpu_threads
from paco.core.params import GrpoSubtaskParams, ParamsError
from paco.core.run_identity import RunIdentity, launch_parts
from paco.core.seeding import stable_seed
from paco.grpo.advantages import aggregate, weighted_sum
from paco.grpo.checkpointing import resume, save, save_final
from paco.grpo.ema import LoraEMA
from paco.grpo.evaluation import record_evaluation, reevaluate
from paco.grpo.losses import clipped_surrogate, gaussian_mean_kl
from paco.grpo.plan import evaluation_epochs, minibatches, trajectory_prompts
from paco.grpo.policies import OLD_ADAPTER, TRAINED_ADAPTER, Conditioning, grid_size, load_policy
from paco.grpo.report import epoch_row, summarise
from paco.grpo.rewards import RewardContext, compute_rewards, subtask_items
from paco.grpo.rollout import RolloutBatch, sample_groups, stack_transitions
from paco.grpo.run import Advantages, EpochInfo, GrpoRun, GrpoState
from paco.grpo.sde import SdeSettings

log = logging.getLogger("paco.grpo.trainer")


# --------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------


def train_grpo(
    cfg: GrpoSubtaskParams,
    prompts: pd.DataFrame,
    policy_dir: str | os.PathLike[str],
    ctx: RewardContext,
    *,
    identity: RunIdentity,
    lora_dir: str | os.PathLike[str] | None,
    checkpoints_dir: str | os.PathLike[str],
    plots_dir: str | os.PathLike[str] | None = None,
    accelerator: Any = None,
    callback: Callable[[EpochInfo], None] | None = None,
) -> dict[str, Any]:
    """Run PaCo-GRPO (see the module docstring) and save the LoRA.

    The loop is :func:`setup`, :func:`paco.grpo.checkpointing.resume` (then
    :func:`catch_up_evaluations`), :func:`train_epoch` for every remaining epoch,
    :func:`paco.grpo.checkpointing.save_final` and :func:`paco.grpo.report.summarise`.

    Args:
        cfg: ``grpo.<subtask>`` params.
        prompts: the subtask's items: ``prompts.parquet`` or, for an editing family
            (``cfg.dataset`` ``edits``), ``edits.parquet`` rows (``split`` selects train / eval
            items; :func:`paco.grpo.rewards.subtask_items`).
        policy_dir: the policy's pipeline directory (``models`` stage), loaded as ``cfg.family``.
        ctx: reward models (judge client, CLIP, instruction, grid splitting).
        identity: the stage's run identity (:func:`paco.core.run_identity.stage_identity`); the
            process count, the device type and the CPU settings are added here
            (:func:`paco.core.run_identity.launch_parts`).
        lora_dir: the final LoRA (EMA weights if enabled) in diffusers' format
            (``pytorch_lora_weights.safetensors``, loadable with the family's pipeline's ``load_lora_weights``)
            plus ``lora_config.json``; ``None``: not saved.
        checkpoints_dir: resumable checkpoints and kept evaluation weights (persisted).
        plots_dir: ``train.csv`` and ``eval.csv`` (main process; ``None``: not written).
        accelerator: an ``accelerate.Accelerator`` (``None``: one process on CPU).
        callback: called after each epoch with an :class:`paco.grpo.run.EpochInfo`; an exception
            stops training.

    Returns:
        ``{"metrics": headline figures, "report": details}``: ``metrics`` holds deterministic
        figures only (a cached run equals a fresh one bit for bit), ``report`` the timings, the
        resume decision and derived sizes.

    Raises:
        ValueError: an empty split, too few prompts for ``prompts_per_epoch`` or for the
            gradient steps.
        paco.grpo.rewards.RewardError, paco.serving.judge_client.JudgeError: a reward failed.
        FloatingPointError: a non-finite loss.
    """
    t_start = time.perf_counter()
    run = setup(cfg, prompts, policy_dir, ctx, identity, checkpoints_dir=checkpoints_dir, plots_dir=plots_dir,
                accelerator=accelerator)
    state = resume(run)
    wait_for_everyone(accelerator)
    catch_up_evaluations(run, state)
    for epoch in range(state.epoch, cfg.epochs):
        train_epoch(run, state, epoch, callback)
    wait_for_everyone(accelerator)
    save_final(run, state, lora_dir)
    wait_for_everyone(accelerator)
    return summarise(run, state, time.perf_counter() - t_start)


def _evaluated(state: GrpoState, epoch: int) -> bool:
    """Whether the history holds the evaluation after ``epoch`` epochs."""
    return any(r["epoch"] == epoch for r in state.history["eval"])


def catch_up_evaluations(run: GrpoRun, state: GrpoState) -> None:
    """The evaluations a resumed run owes before training on: after a change of the evaluation
    params only, :func:`paco.grpo.evaluation.reevaluate` (checkpointed if the run is finished);
    and the final evaluation of a longer run's checkpoint at exactly the new (lowered) ``epochs``
    (a scheduled evaluation runs at the start of the next epoch, so it was never made there)."""
    cfg = run.cfg
    if state.resume is not None and state.resume.evaluation_changed:
        if run.main:
            log.info("evaluation params changed (%s): re-evaluating the kept weights of epochs %s",
                     ", ".join(state.resume.evaluation_changed), [r["epoch"] for r in state.history["eval"]])
        reevaluate(run, state)
        if state.epoch >= cfg.epochs:
            save(run, state)
    if state.epoch == cfg.epochs and not _evaluated(state, cfg.epochs):
        record_evaluation(run, state, state.epoch)
        save(run, state)


def train_epoch(run: GrpoRun, state: GrpoState, epoch: int,
                callback: Callable[[EpochInfo], None] | None = None) -> None:
    """One epoch (0-based ``epoch``; the module docstring's steps): evaluate if it is on the
    schedule and not yet in the history, :func:`paco.grpo.rollout.sample_groups`, :func:`reward`,
    :func:`advantages`, :func:`update`, record the epoch's row, evaluate after the last epoch,
    checkpoint (every ``save_every`` epochs and after the last), then ``callback``."""
    cfg = run.cfg
    t_epoch = time.perf_counter()
    if epoch in evaluation_epochs(cfg.epochs, cfg.eval.every) and not _evaluated(state, epoch):
        record_evaluation(run, state, epoch)
    ts = time.perf_counter()
    roll = sample_groups(run, epoch)
    tr = time.perf_counter()
    rewards = reward(run, roll)
    adv = advantages(run, rewards, roll.chosen)
    tt = time.perf_counter()
    stats = update(run, roll, adv.advantages, epoch, state)
    te = time.perf_counter()
    # the wait for overlapped served rewards after the last group counts as reward time
    state.timings["rollout"] += tr - ts - roll.served_wait_s
    state.timings["reward"] += tt - tr + roll.served_wait_s
    state.timings["train"] += te - tt
    row = epoch_row(run, epoch, rewards, adv, stats)
    state.history["train"].append(row)
    state.per_sample_rewards.append(adv.weighted.tolist())
    state.epoch = epoch + 1
    state.epochs_this_run += 1
    if run.main:
        _log_epoch(run, state, row, time.perf_counter() - t_epoch)
    if state.epoch == cfg.epochs:
        record_evaluation(run, state, state.epoch)
    ck = save(run, state) if (state.epoch % cfg.save_every == 0 or state.epoch == cfg.epochs) else None
    state.epoch_seconds.append({"epoch": state.epoch, "seconds": round(time.perf_counter() - t_epoch, 3)})
    if callback is not None:
        callback(EpochInfo(state.epoch, cfg.epochs, row, ck, run.policy))


def _log_epoch(run: GrpoRun, state: GrpoState, row: dict[str, Any], seconds: float) -> None:
    """The epoch's log line (``paco.compare`` reads its ``epoch i/n: reward ... | t s`` form)."""
    cfg = run.cfg
    log.info("epoch %d/%d: reward %.4f +- %.4f (%s) | |A| %.3f, clip %.3f, ratio %.5f, kl %s, loss %.4g "
             "| %.1f s", state.epoch, cfg.epochs, row["reward"], row["reward_std"],
             ", ".join(f"{k} {row[f'{k}_mean']:.4f}" for k in cfg.rewards), row["advantage_abs_mean"],
             row["clip_fraction"], row["ratio_mean"], "-" if row["kl"] is None else f"{row['kl']:.3g}",
             row["loss"], seconds)


# --------------------------------------------------------------------------------------------
# setup
# --------------------------------------------------------------------------------------------


def check_splits(cfg: GrpoSubtaskParams, prompts: pd.DataFrame, section: str = "grpo.<subtask>") -> None:
    """Fail early (before models load or the judge starts) if ``split`` or ``eval.split`` names
    no prompt.

    Raises:
        paco.core.params.ParamsError: naming the key, the value and the splits there are.
    """
    splits = sorted(set(prompts["split"].astype(str)))
    for key, name in (("split", cfg.split), ("eval.split", cfg.eval.split)):
        if name not in splits:
            raise ParamsError(f"{section}.{key} {name!r} has no prompts (the prompts' splits: {splits})")


def setup(cfg: GrpoSubtaskParams, prompts: pd.DataFrame, policy_dir: str | os.PathLike[str], ctx: RewardContext,
          identity: RunIdentity, *, checkpoints_dir: str | os.PathLike[str], plots_dir: str | os.PathLike[str] | None,
          accelerator: Any) -> GrpoRun:
    """Set the CPU threads, add the launch to the run identity
    (:func:`paco.core.run_identity.launch_parts`), check the prompts against the params, load the
    policy with its LoRA adapters (trained, old; with ``train.gradient_checkpointing``, gradient
    checkpointing on its transformer), read the SDE settings (``rollout.noise_level``,
    ``rollout.sigma_max``: the one :class:`paco.grpo.sde.SdeSettings` of the run) and build the
    optimizer and the EMA.

    Raises:
        paco.core.params.ParamsError: a split without prompts, too few prompts for ``prompts_per_epoch`` or too few
            trajectories for the gradient steps.
    """
    rank = accelerator.process_index if accelerator is not None else 0
    world = accelerator.num_processes if accelerator is not None else 1
    device = accelerator.device if accelerator is not None else torch.device("cpu")
    if device.type == "cpu":
        set_torch_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    identity = identity.extended(**launch_parts(world, device.type))

    prompts, infos = subtask_items(prompts, cfg.dataset)
    check_splits(cfg, prompts)
    split = prompts["split"].astype(str)
    train_ids = sorted(prompts.loc[split == cfg.split, "prompt_id"].astype(str))
    eval_ids = sorted(prompts.loc[split == cfg.eval.split, "prompt_id"].astype(str))
    if cfg.eval.max_prompts:
        eval_ids = eval_ids[: cfg.eval.max_prompts]
    if cfg.prompts_per_epoch > len(train_ids):
        raise ParamsError(f"prompts_per_epoch={cfg.prompts_per_epoch} but split {cfg.split!r} has "
                         f"{len(train_ids)} prompts")
    n_traj = cfg.prompts_per_epoch * cfg.group_size
    if n_traj < cfg.train.gradient_steps_per_epoch:
        raise ParamsError(f"{n_traj} trajectories per epoch cannot make {cfg.train.gradient_steps_per_epoch} steps")
    size_of = {pid: (int(r["height"]), int(r["width"])) for pid, r in
               prompts.set_index(prompts["prompt_id"].astype(str))[["height", "width"]].iterrows()}

    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if (cfg.dtype == "bfloat16" and on_gpu) else torch.float32
    policy = load_policy(cfg.family, policy_dir, cfg.lora, cfg.rollout, seed=stable_seed(cfg.seed, "lora"),
                         dtype=dtype, device=device)
    ctx.connect()  # a pending judge (make_reward_context(connect=False)): its server started while the policy loaded
    ctx.latent_period = policy.size_multiple  # what the grid_free reward measures
    trained = policy.adapter_parameters(TRAINED_ADAPTER)
    with torch.no_grad():  # LoRA weights stay float32 (bf16 base on GPUs)
        for p in list(trained.values()) + list(policy.adapter_parameters(OLD_ADAPTER).values()):
            p.data = p.data.float()
    t = cfg.train
    if t.gradient_checkpointing:  # memory for compute: the block activations are recomputed in the backward
        policy.enable_gradient_checkpointing()
    optimizer = host_independent.adamw(list(trained.values()), lr=t.learning_rate, betas=t.adam_betas,
                                       eps=t.adam_eps, weight_decay=t.weight_decay)
    ema = LoraEMA(trained, t.ema.decay, warmup=t.ema.warmup, update_every=t.ema.update_every) if t.ema.enabled else None
    run = GrpoRun(
        cfg=cfg, ctx=ctx, identity=identity, accelerator=accelerator, rank=rank, world=world, device=device,
        policy=policy, sde=SdeSettings(cfg.rollout.noise_level, cfg.rollout.sigma_max),
        trained=trained, optimizer=optimizer, ema=ema, infos=infos, train_ids=train_ids,
        train_size={pid: grid_size(*size_of[pid], cfg.train.resolution) for pid in train_ids},
        eval_prompts=[infos[p] for p in eval_ids],
        eval_sizes=[grid_size(*size_of[p], cfg.eval.resolution) for p in eval_ids],
        checkpoints_dir=Path(checkpoints_dir),
        plots_dir=Path(plots_dir) if (plots_dir is not None and rank == 0) else None,
        eval_train_prompts=[infos[p] for p in train_ids[:cfg.eval.train_prompts]],
        eval_train_sizes=[grid_size(*size_of[p], cfg.eval.resolution) for p in train_ids[:cfg.eval.train_prompts]],
    )
    if run.main:
        n_lora = sum(p.numel() for p in run.lora_params)
        log.info("policy %s: LoRA r=%d alpha=%g on %d modules, %d trainable parameters; gradient checkpointing %s; "
                 "%d threads on %s", policy_dir, cfg.lora.rank, cfg.lora.alpha, len(run.lora_params) // 2, n_lora,
                 "on" if t.gradient_checkpointing else "off", torch.get_num_threads(), device)
        log.info("%d epochs x (%d prompts x %d trajectories) at %dpx, %d SDE step(s) of %d; %d gradient steps/epoch; "
                 "eval on %d prompts at %dpx every %d epochs", cfg.epochs, cfg.prompts_per_epoch, cfg.group_size,
                 cfg.train.resolution, len(cfg.rollout.sde_indices), cfg.rollout.num_steps, t.gradient_steps_per_epoch,
                 len(run.eval_prompts), cfg.eval.resolution, cfg.eval.every)
    return run


# --------------------------------------------------------------------------------------------
# the steps that change the policy: reward, advantages, update
# --------------------------------------------------------------------------------------------


def reward(run: GrpoRun, roll: RolloutBatch) -> dict[str, np.ndarray]:
    """Every reward of ``rewards`` for this process's samples, gathered over processes:
    reward name -> ``(K * G,)`` float64 in trajectory order. Served rewards already scored
    during the rollout (``roll.served``) are taken from there.

    Raises:
        paco.grpo.rewards.RewardError, paco.serving.judge_client.JudgeError: a reward failed.
        RuntimeError: the gathered rewards do not cover the epoch exactly once.
    """
    cfg = run.cfg
    infos = [run.infos[t.prompt_id] for t in roll.trajectories]
    rest = [n for n in cfg.rewards if n not in roll.served]
    local_rewards = {**compute_rewards(rest, roll.images, infos, run.ctx), **roll.served}
    local = [(t.index, {k: float(v[j]) for k, v in local_rewards.items()}) for j, t in enumerate(roll.trajectories)]
    gathered = sorted(gather_objects(run.accelerator, local), key=lambda r: r[0])
    if [i for i, _ in gathered] != list(range(run.n_traj)):
        raise RuntimeError("gathered rewards do not cover the epoch's trajectories exactly once")
    return {k: np.array([r[1][k] for r in gathered]) for k in cfg.rewards}


def advantages(run: GrpoRun, rewards: dict[str, np.ndarray], chosen: Sequence[str]) -> Advantages:
    """Group advantages of the epoch (:func:`paco.grpo.advantages.aggregate`: ``aggregation.method``,
    ``delta``, ``train.global_std``), clipped to ``+-train.adv_clip_max``."""
    cfg, t = run.cfg, run.cfg.train
    group_ids = trajectory_prompts(chosen, cfg.group_size, run.n_traj)
    agg, adv, info = aggregate(rewards, cfg.rewards, group_ids, method=cfg.aggregation.method,
                               delta=cfg.aggregation.delta, global_std=t.global_std)
    return Advantages(np.asarray(agg), np.clip(adv, -t.adv_clip_max, t.adv_clip_max), info,
                      weighted_sum(rewards, cfg.rewards))


def update(run: GrpoRun, roll: RolloutBatch, adv: np.ndarray, epoch: int, state: GrpoState) -> dict[str, float]:
    """The epoch's policy update (module docstring, step 5), then the old adapter := trained.

    Returns the summed statistics over processes (``loss``, ``policy_loss``, ``kl`` (NaN where
    not computed: ``beta`` 0 and ``log_kl`` false), ``ratio``, ``clipped``, ``n`` transitions) and
    ``grad_norm`` (mean pre-clip norm over steps).

    Raises:
        FloatingPointError: a non-finite loss.
    """
    cfg, t, policy, device = run.cfg, run.cfg.train, run.policy, run.device
    by_index = {tj.index: tj for tj in roll.trajectories}
    trained_steps = [j for j, step in enumerate(sorted(cfg.rollout.sde_indices))
                     if t.trained_sde_steps is None or step in t.trained_sde_steps]
    with_kl = t.beta > 0 or t.log_kl  # the reference policy's forward only where the KL is used
    stats = {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0 if with_kl else float("nan"), "ratio": 0.0, "clipped": 0.0,
             "n": 0.0}
    grad_norms = []
    for step_no, mb in enumerate(minibatches(run.n_traj, t.gradient_steps_per_epoch, cfg.seed, epoch)):
        denom = float(len(mb) * len(trained_steps))
        local_idx = [int(i) for i in mb if int(i) in by_index]
        shapes: dict[tuple[int, int], list[int]] = {}
        for i in local_idx:
            shapes.setdefault((by_index[i].height, by_index[i].width), []).append(i)
        run.optimizer.zero_grad(set_to_none=True)
        for (h, w), idx in sorted(shapes.items()):
            for c0 in range(0, len(idx), t.batch_size):
                chunk = [by_index[i] for i in idx[c0:c0 + t.batch_size]]
                emb = Conditioning.cat([c.embeds for c in chunk]).to_device(device)
                a = torch.tensor([adv[c.index] for c in chunk], dtype=torch.float32, device=device)
                for j in trained_steps:
                    steps = stack_transitions(chunk, j, device)  # with the SDE settings they were sampled with
                    with torch.no_grad():
                        with policy.using(OLD_ADAPTER):
                            old_lp, _, _ = policy.transition_log_prob(steps, emb)
                        if with_kl:
                            with policy.using(None):
                                _, ref_mean, _ = policy.transition_log_prob(steps, emb)
                    lp, mean, std = policy.transition_log_prob(steps, emb)
                    pl, ratio = clipped_surrogate(lp, old_lp, a, t.clip_range)
                    kl = gaussian_mean_kl(mean, ref_mean, std) if with_kl else None
                    per = pl + t.beta * kl if t.beta > 0 else pl
                    loss = per.sum() / denom
                    if not torch.isfinite(loss):
                        raise FloatingPointError(f"non-finite GRPO loss at epoch {epoch + 1}, step {step_no + 1}")
                    loss.backward()
                    with torch.no_grad():
                        if step_no == 0:
                            state.first_update_ratio_dev.append(float((ratio - 1).abs().max()))
                        stats["loss"] += float(per.sum())
                        stats["policy_loss"] += float(pl.sum())
                        if with_kl:
                            stats["kl"] += float(kl.sum())
                        stats["ratio"] += float(ratio.sum())
                        stats["clipped"] += float(((ratio - 1).abs() > t.clip_range).float().sum())
                        stats["n"] += len(chunk)
        sum_gradients(run.accelerator, run.lora_params)
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(run.lora_params, t.max_grad_norm)))
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        if run.ema is not None:
            run.ema.step(run.trained, epoch * t.gradient_steps_per_epoch + step_no + 1)
    policy.copy_adapter(TRAINED_ADAPTER, OLD_ADAPTER)
    if run.world > 1:
        sums = gather_objects(run.accelerator, [stats])
        stats = {k: sum(s[k] for s in sums) for k in stats}
    stats["grad_norm"] = float(np.mean(grad_norms))
    return stats
