"""PaCo-GRPO: Flow-GRPO training of a FLUX.1 LoRA on multi-reward feedback (PaCo-RL §4).

One epoch (the reference trainer's loop, ``train_flux.py`` of X-GenGroup/PaCo-RL):

1. **Evaluate** (every ``eval.every`` epochs and after the last): deterministic ODE sampling of
   the test prompts at ``eval.resolution`` with ``eval.num_steps`` steps, with the EMA weights
   if enabled, and the same rewards -- resolution-decoupled training (§4.2): cheap low-resolution
   rollouts for training, the target resolution for evaluation.
2. **Sample** with the old policy: ``K = prompts_per_epoch`` unique train prompts drawn with
   ``numpy.random.default_rng(seed + epoch)``, ``G = group_size`` trajectories each at
   ``train.resolution`` (same aspect ratio as the prompt, area ``resolution**2``), SDE steps at
   ``sample.sde_indices`` (noise level ``a``), ODE steps elsewhere. Trajectory ``g`` of prompt
   ``p`` draws its initial noise and its SDE noise from generators seeded with
   ``stable_seed(seed, "noise"|"sde", epoch, p, g)``, so a sample does not depend on batch size,
   order or process count. With ``sample.same_initial_noise`` (the reference's ``same_latent``)
   the ``G`` trajectories of a prompt share their initial noise (``g = 0``) and differ only by the
   SDE noise: the group's reward differences then come from the trained steps alone.
3. **Reward**: every reward of ``rewards`` (name -> weight) for every decoded grid
   (:mod:`paco.rewards`); failures raise.
4. **Advantages**: :func:`paco.advantages.aggregate` (``aggregation.method``, ``delta``,
   ``train.global_std``), clipped to ``+-train.adv_clip_max``.
5. **Update**: the epoch's trajectories are shuffled (``default_rng([seed + epoch, 1])``) and cut into
   ``train.gradient_steps_per_epoch`` equal mini-batches; each gives one AdamW step on the mean
   over its transitions (each trajectory's SDE steps) of the clipped surrogate plus ``beta``
   times the KL to the reference::

       ratio = exp(logp_theta - logp_old)
       loss  = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)) + beta * KL
       KL    = mean over elements of (mu_theta - mu_ref)**2 / (2 std**2)

   (``std`` is the transition's std ``std_t * sqrt(-dt)``, so this is the exact KL between the
   two Gaussians per element; the reference divides by ``2 std_t**2 + 1e-7`` instead, a
   ``-dt`` times smaller value, which only rescales ``beta``). ``logp_old`` is recomputed with
   the old adapter on the same inputs, so on the first update of an epoch, where old and
   trained adapters are equal, the ratio is exactly 1. Gradients are clipped to
   ``max_grad_norm``; the EMA of the trained LoRA is updated every ``ema.update_every`` steps.
6. **Refresh** the old adapter := the trained one (the reference's ``decay_type 0``).

Several processes (``accelerate launch``): trajectory ``i`` of the epoch (prompt-major order)
is sampled, rewarded and trained by process ``i % P``; rewards are gathered so advantages see
the whole epoch; each process backpropagates the sum of its transitions' losses divided by the
global transition count of the mini-batch and the gradients are summed over processes, so the
step equals the single-process step up to float summation order.

Checkpoints (every ``save_every`` epochs and after the last): ``epoch-NNNN/`` with the trained,
old and EMA LoRA weights (``lora.safetensors``), the optimizer (``optimizer.pt``), the RNG
states (``rng-<rank>.pt``) and ``trainer_state.json`` (epoch, history, fingerprint). A rerun resumes
from the newest checkpoint whose fingerprint (params except ``save_every``/``eval``/``epochs``,
process count, prompts, policy model) matches and that is not past ``epochs``, else starts
fresh (so raising ``epochs`` continues a finished run). Since every random draw is seeded
from ``(seed, epoch, ...)``, a resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from paco import checkpoints as ckpt
from paco.advantages import aggregate, weighted_sum
from paco.composites import stable_seed
from paco.io import write_json
from paco.params import GrpoSubtaskParams
from paco.policy import OLD_ADAPTER, TRAINED_ADAPTER, FluxPolicy, PromptEmbeds, grid_size
from paco.rewards import PromptInfo, RewardContext, compute_rewards

log = logging.getLogger("paco.grpo")

STATE_FILE = ckpt.STATE_FILE
CHECKPOINT_PREFIX = "epoch-"
KEEP_CHECKPOINTS = 2


# --------------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# rollouts
# --------------------------------------------------------------------------------------------


@dataclass
class Trajectory:
    """One sampled trajectory kept for training (latents on the CPU; the prompt embeddings are
    the group's, on the policy's device)."""

    index: int                 # global index in the epoch (prompt-major)
    prompt_id: str
    embeds: PromptEmbeds       # one row, shared by the prompt's group
    latents: torch.Tensor      # (n_sde, 2, seq, C)
    sigmas: torch.Tensor       # (N + 1,)
    timesteps: torch.Tensor    # (N,)
    sde_indices: tuple[int, ...]
    height: int
    width: int


def sample_group(policy: FluxPolicy, prompt: PromptInfo, embeds: PromptEmbeds, indices: Sequence[int],
                 cfg: GrpoSubtaskParams, epoch: int, height: int, width: int, *, base_index: int
                 ) -> tuple[list[Trajectory], list[Any]]:
    """Sample the trajectories ``indices`` (within the prompt's group) of one prompt with the
    active adapter, in chunks of ``sample.batch_size``; return them and their decoded images."""
    s = cfg.sample
    trajs, images = [], []
    for start in range(0, len(indices), s.batch_size):
        chunk = list(indices[start:start + s.batch_size])
        emb = embeds.select([0] * len(chunk))
        roll = policy.sample(
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


# --------------------------------------------------------------------------------------------
# loss
# --------------------------------------------------------------------------------------------


def clipped_surrogate(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                      clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample PPO/GRPO clipped surrogate (Flow-GRPO eq. 7, reference ``compute_ppo_loss``).

    Args:
        log_prob: ``(B,)`` log-probs under the trained policy (with grad).
        old_log_prob: ``(B,)`` under the sampling policy (no grad).
        advantages: ``(B,)`` already clipped.
        clip_range: ``eps``.

    Returns:
        ``(loss (B,), ratio (B,))`` with ``loss = max(-A * r, -A * clip(r, 1 - eps, 1 + eps))``.
    """
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped), ratio


def gaussian_mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``(B,)`` KL between ``N(mean, std^2)`` and ``N(ref_mean, std^2)`` per element, averaged over
    non-batch elements: ``mean((mean - ref_mean)**2) / (2 std**2)`` (``std`` ``(B, 1, ...)``)."""
    dims = tuple(range(1, mean.ndim))
    return ((mean - ref_mean) ** 2 / (2 * std**2)).mean(dim=dims)


# --------------------------------------------------------------------------------------------
# EMA
# --------------------------------------------------------------------------------------------


class LoraEMA:
    """Exponential moving average of the trained LoRA weights (float32 copies).

    ``update``: ``ema = decay * ema + (1 - decay) * w``. ``swapped_in(policy)`` puts the EMA
    weights into the trained adapter for a ``with`` block and restores the live ones after.
    """

    def __init__(self, params: dict[str, torch.nn.Parameter], decay: float):
        self.decay = float(decay)
        self.shadow = {n: p.detach().float().clone() for n, p in params.items()}

    @torch.no_grad()
    def update(self, params: dict[str, torch.nn.Parameter]) -> None:
        for n, p in params.items():
            self.shadow[n].mul_(self.decay).add_(p.detach().float(), alpha=1.0 - self.decay)

    def swapped_in(self, params: dict[str, torch.nn.Parameter]):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            live = {n: p.detach().clone() for n, p in params.items()}
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(self.shadow[n].to(p.dtype))
            try:
                yield
            finally:
                with torch.no_grad():
                    for n, p in params.items():
                        p.copy_(live[n])

        return ctx()


# --------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------


def fingerprint_parts(cfg: GrpoSubtaskParams, *, prompts_digest: str, policy_digest: str,
                      num_processes: int) -> dict[str, str]:
    """What a checkpoint must match to be resumed: the params (except ``save_every`` and
    ``eval``, which do not change the trained weights, ``resources``, and ``epochs``: no
    schedule depends on it, so a longer run continues a shorter one's checkpoints), the process
    count, the prompt rows and the policy model files."""
    params = json.dumps(cfg.model_dump(mode="json", exclude={"save_every", "eval", "resources", "epochs"}),
                        sort_keys=True)
    return {"params": hashlib.sha256(params.encode()).hexdigest(), "num_processes": str(int(num_processes)),
            "prompts": prompts_digest, "policy": policy_digest}


def list_checkpoints(checkpoints_dir: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints (``epoch-N`` directories with ``trainer_state.json``), oldest first."""
    return ckpt.list_checkpoints(checkpoints_dir, CHECKPOINT_PREFIX)


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


# --------------------------------------------------------------------------------------------
# distributed helpers (identity for one process)
# --------------------------------------------------------------------------------------------


def _gather(accelerator: Any, obj: list) -> list:
    if accelerator is None or accelerator.num_processes == 1:
        return obj
    from accelerate.utils import gather_object

    return gather_object(obj)


def _sum_grads(accelerator: Any, params: Sequence[torch.nn.Parameter]) -> None:
    if accelerator is None or accelerator.num_processes == 1:
        return
    import torch.distributed as dist

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


# --------------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(policy: FluxPolicy, prompts: Sequence[PromptInfo], sizes: Sequence[tuple[int, int]],
             cfg: GrpoSubtaskParams, ctx: RewardContext, *, rank: int = 0, world: int = 1,
             accelerator: Any = None) -> dict[str, Any]:
    """ODE samples of ``prompts`` (one each, initial noise from
    ``stable_seed(seed, "eval", 0, prompt_id, 0)``) at ``sizes`` with the active weights, in
    batches of up to ``eval.batch_size`` prompts of one size; mean and std of every reward and of
    their weighted sum."""
    e = cfg.eval
    rows = []
    mine = list(range(rank, len(prompts), world))
    by_size: dict[tuple[int, int], list[int]] = {}
    for i in mine:
        by_size.setdefault(tuple(sizes[i]), []).append(i)
    for (h, w), idx in by_size.items():
        for start in range(0, len(idx), e.batch_size):
            chunk = idx[start:start + e.batch_size]
            emb = policy.encode_prompts([prompts[i].prompt for i in chunk])
            noise = [generators(cfg.seed, "eval", 0, prompts[i].prompt_id, [0])[0] for i in chunk]
            roll = policy.sample(emb, height=h, width=w, num_steps=e.num_steps, noise_level=0.0,
                                 sde_indices=[], noise_generators=noise)
            rows += zip(chunk, policy.decode(roll.final_latents, h, w), strict=True)
    rows.sort(key=lambda r: r[0])
    rewards = compute_rewards(list(cfg.rewards), [im for _, im in rows], [prompts[i] for i, _ in rows], ctx)
    local = [(i, {k: float(v[j]) for k, v in rewards.items()}) for j, (i, _) in enumerate(rows)]
    allrows = sorted(_gather(accelerator, local), key=lambda r: r[0])
    table = {k: np.array([r[1][k] for r in allrows]) for k in cfg.rewards}
    total = weighted_sum(table, cfg.rewards)
    out: dict[str, Any] = {"prompts": len(allrows), "reward": float(total.mean()), "reward_std": float(total.std())}
    for k, v in table.items():
        out[f"{k}_mean"] = float(v.mean())
        out[f"{k}_std"] = float(v.std())
    return out


# --------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EpochInfo:
    """What the ``callback`` of :func:`train_grpo` gets after each epoch (after its checkpoint)."""

    epoch: int                  # 1-based count of finished epochs
    epochs: int
    row: dict[str, Any]
    checkpoint: str | None
    policy: FluxPolicy


#: the ``prompts.parquet`` columns GRPO and final sampling read
PROMPT_COLUMNS = ["prompt_id", "split", "prompt", "global_prompt", "rows", "cols", "height", "width", "panel_prompts"]


def prompts_digest(prompts: pd.DataFrame) -> str:
    """sha256 of the prompt rows GRPO reads (:data:`PROMPT_COLUMNS`)."""
    h = hashlib.sha256()
    for rec in prompts.sort_values("prompt_id")[PROMPT_COLUMNS].to_dict("records"):
        h.update(json.dumps({k: (list(v) if not isinstance(v, (str, int, float)) else v) for k, v in rec.items()},
                            sort_keys=True, default=str).encode())
    return h.hexdigest()


def learning_signal(history: Sequence[dict[str, Any]], per_sample: Sequence[np.ndarray], window: int) -> dict[str, Any]:
    """Mean weighted training reward of the first and last ``window`` epochs and a one-sided
    Welch t-test on their per-sample rewards (H1: last > first; ``scipy.stats.ttest_ind``)."""
    from scipy import stats

    n = len(history)
    w = max(1, min(window, n // 2))
    first = np.concatenate(per_sample[:w]) if n else np.zeros(0)
    last = np.concatenate(per_sample[n - w:]) if n else np.zeros(0)
    out = {"window_epochs": w, "first_epochs_reward": float(first.mean()) if first.size else None,
           "last_epochs_reward": float(last.mean()) if last.size else None}
    if first.size > 1 and last.size > 1:
        out["improvement"] = out["last_epochs_reward"] - out["first_epochs_reward"]
        res = stats.ttest_ind(last, first, equal_var=False, alternative="greater")
        out["p_value"] = float(res.pvalue)
        pooled = np.sqrt((first.var(ddof=1) + last.var(ddof=1)) / 2)
        out["effect_size_d"] = float(out["improvement"] / pooled) if pooled > 0 else None
    return out


def train_grpo(
    cfg: GrpoSubtaskParams,
    prompts: pd.DataFrame,
    policy_dir: str | os.PathLike[str],
    ctx: RewardContext,
    *,
    lora_dir: str | os.PathLike[str] | None,
    checkpoints_dir: str | os.PathLike[str],
    plots_dir: str | os.PathLike[str] | None = None,
    accelerator: Any = None,
    callback: Callable[[EpochInfo], None] | None = None,
) -> dict[str, Any]:
    """Run PaCo-GRPO (see the module docstring) and save the LoRA.

    Args:
        cfg: ``grpo.<subtask>`` params.
        prompts: ``prompts.parquet`` rows (``split`` selects train / eval prompts).
        policy_dir: the FLUX pipeline directory (``models`` stage).
        ctx: reward models (judge client, CLIP, instruction, grid splitting).
        lora_dir: the final LoRA (EMA weights if enabled) in diffusers' format
            (``pytorch_lora_weights.safetensors``, loadable with ``FluxPipeline.load_lora_weights``)
            plus ``lora_config.json``; ``None``: not saved.
        checkpoints_dir: resumable checkpoints (persisted between runs).
        plots_dir: ``train.csv`` and ``eval.csv`` (main process; ``None``: not written).
        accelerator: an ``accelerate.Accelerator`` (``None``: one process on CPU).
        callback: called after each epoch with an :class:`EpochInfo`; an exception stops training.

    Returns:
        The metrics dict (history, final evaluation, learning signal, timings, derived sizes).

    Raises:
        ValueError: too few prompts for ``prompts_per_epoch`` or for the gradient steps.
        paco.rewards.RewardError, paco.judge_client.JudgeError: a reward failed.
        FloatingPointError: a non-finite loss.
    """
    from paco.models.loading import load_flux_pipeline
    from paco.stage import cpu_threads_per_process

    rank = accelerator.process_index if accelerator is not None else 0
    world = accelerator.num_processes if accelerator is not None else 1
    main = rank == 0
    device = accelerator.device if accelerator is not None else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_process(int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    t_start = time.perf_counter()

    # ---------------- data
    infos = {str(r["prompt_id"]): PromptInfo.from_row(r) for r in prompts.to_dict("records")}
    split = prompts["split"].astype(str)
    train_ids = sorted(prompts.loc[split == cfg.split, "prompt_id"].astype(str))
    eval_ids = sorted(prompts.loc[split == cfg.eval.split, "prompt_id"].astype(str))
    if cfg.eval.max_prompts:
        eval_ids = eval_ids[: cfg.eval.max_prompts]
    if cfg.prompts_per_epoch > len(train_ids):
        raise ValueError(f"prompts_per_epoch={cfg.prompts_per_epoch} but split {cfg.split!r} has "
                         f"{len(train_ids)} prompts")
    n_traj = cfg.prompts_per_epoch * cfg.group_size
    if n_traj < cfg.train.gradient_steps_per_epoch:
        raise ValueError(f"{n_traj} trajectories per epoch cannot make {cfg.train.gradient_steps_per_epoch} steps")
    size_of = {pid: (int(r["height"]), int(r["width"])) for pid, r in
               prompts.set_index(prompts["prompt_id"].astype(str))[["height", "width"]].iterrows()}
    train_size = {pid: grid_size(*size_of[pid], cfg.train.resolution) for pid in train_ids}
    eval_prompts = [infos[p] for p in eval_ids]
    eval_sizes = [grid_size(*size_of[p], cfg.eval.resolution) for p in eval_ids]

    # ---------------- policy and optimizer
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if (cfg.dtype == "bfloat16" and on_gpu) else torch.float32
    pipe = load_flux_pipeline(policy_dir, dtype=dtype)
    pipe.to(device)
    policy = FluxPolicy(pipe, cfg.lora, max_sequence_length=cfg.sample.max_sequence_length,
                        guidance_scale=cfg.sample.guidance_scale, seed=stable_seed(cfg.seed, "lora"))
    trained = policy.adapter_parameters(TRAINED_ADAPTER)
    with torch.no_grad():  # LoRA weights stay float32 (bf16 base on GPUs)
        for p in list(trained.values()) + list(policy.adapter_parameters(OLD_ADAPTER).values()):
            p.data = p.data.float()
    params = list(trained.values())
    t = cfg.train
    optimizer = torch.optim.AdamW(params, lr=t.learning_rate, betas=t.adam_betas, eps=t.adam_eps,
                                  weight_decay=t.weight_decay)
    ema = LoraEMA(trained, t.ema.decay) if t.ema.enabled else None
    n_lora = sum(p.numel() for p in params)
    if main:
        log.info("policy %s: LoRA r=%d alpha=%g on %d modules, %d trainable parameters; %d threads on %s",
                 policy_dir, cfg.lora.rank, cfg.lora.alpha, len(params) // 2, n_lora, torch.get_num_threads(), device)
        log.info("%d epochs x (%d prompts x %d trajectories) at %dpx, %d SDE step(s) of %d; %d gradient steps/epoch; "
                 "eval on %d prompts at %dpx every %d epochs", cfg.epochs, cfg.prompts_per_epoch, cfg.group_size,
                 cfg.train.resolution, len(cfg.sample.sde_indices), cfg.sample.num_steps, t.gradient_steps_per_epoch,
                 len(eval_prompts), cfg.eval.resolution, cfg.eval.every)

    # ---------------- resume
    parts = fingerprint_parts(cfg, prompts_digest=prompts_digest(prompts), policy_digest=ckpt.model_digest(policy_dir),
                              num_processes=world)
    fp = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    ckdir = Path(checkpoints_dir)
    history: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    per_sample_rewards: list[list[float]] = []
    start_epoch, resumed_from = 0, None
    found = ckpt.resumable(ckdir, CHECKPOINT_PREFIX, fp, parts, main=main, log=log)
    if found is not None and int(found[1]["epoch"]) > cfg.epochs:
        # a longer run's checkpoint: its weights went past this run's end, start fresh
        if main:
            log.warning("checkpoint %s is after epoch %d > epochs %d: starting fresh, removing the checkpoints",
                        found[0], int(found[1]["epoch"]), cfg.epochs)
            for old in list_checkpoints(ckdir):
                shutil.rmtree(old, ignore_errors=True)
        found = None
    if found is not None:
        from safetensors.torch import load_file

        latest, state = found
        weights = load_file(str(latest / "lora.safetensors"))
        with torch.no_grad():
            for tag, adapter in (("trained", TRAINED_ADAPTER), ("old", OLD_ADAPTER)):
                for n, p in policy.adapter_parameters(adapter).items():
                    p.copy_(weights[f"{tag}/{n}"])
            if ema is not None:
                for n in ema.shadow:
                    ema.shadow[n].copy_(weights[f"ema/{n}"])
        optimizer.load_state_dict(torch.load(latest / "optimizer.pt", weights_only=False))
        _set_rng_state(torch.load(latest / f"rng-{rank}.pt", weights_only=False))
        history = state["history"]
        per_sample_rewards = state["per_sample_rewards"]
        start_epoch, resumed_from = int(state["epoch"]), latest.name
        if main:
            log.info("resuming from %s after epoch %d of %d", latest, start_epoch, cfg.epochs)
    if accelerator is not None:
        accelerator.wait_for_everyone()
    plots = Path(plots_dir) if (plots_dir is not None and main) else None

    def save_checkpoint(epoch: int) -> str:
        from safetensors.torch import save_file

        name = f"{CHECKPOINT_PREFIX}{epoch:04d}"
        tmp = ckdir / f".tmp-{name}"
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if accelerator is not None:
            accelerator.wait_for_everyone()
        torch.save(_rng_state(), tmp / f"rng-{rank}.pt")
        if accelerator is not None:
            accelerator.wait_for_everyone()
        if main:
            weights = {f"trained/{n}": p.detach().float().cpu().contiguous() for n, p in trained.items()}
            weights.update({f"old/{n}": p.detach().float().cpu().contiguous()
                            for n, p in policy.adapter_parameters(OLD_ADAPTER).items()})
            if ema is not None:
                weights.update({f"ema/{n}": v.cpu().contiguous() for n, v in ema.shadow.items()})
            save_file(weights, str(tmp / "lora.safetensors"))
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
            write_json(tmp / STATE_FILE, {"fingerprint": fp, "fingerprint_parts": parts, "epoch": epoch,
                                          "history": history, "per_sample_rewards": per_sample_rewards})
            ckpt.replace_dir(tmp, ckdir / name)
            ckpt.prune(ckdir, CHECKPOINT_PREFIX, KEEP_CHECKPOINTS)
            ckpt.write_plot_csvs(plots, history)
        if accelerator is not None:
            accelerator.wait_for_everyone()
        return str(ckdir / name)

    def run_eval(epoch: int) -> None:
        t0 = time.perf_counter()
        weights_ctx = ema.swapped_in(trained) if ema is not None else contextlib.nullcontext()
        with weights_ctx, policy.using(TRAINED_ADAPTER):
            res = evaluate(policy, eval_prompts, eval_sizes, cfg, ctx, rank=rank, world=world, accelerator=accelerator)
        res = {"epoch": epoch, **res, "seconds": round(time.perf_counter() - t0, 3)}
        history["eval"].append(res)
        if main:
            log.info("eval after epoch %d at %dpx: reward %.4f (%s)", epoch, cfg.eval.resolution, res["reward"],
                     ", ".join(f"{k} {res[f'{k}_mean']:.4f}" for k in cfg.rewards))

    # ---------------- loop
    timings = {"sample": 0.0, "reward": 0.0, "train": 0.0, "eval": 0.0}
    epochs_this_run = 0
    first_update_ratio_dev: list[float] = []
    for epoch in range(start_epoch, cfg.epochs):
        t_epoch = time.perf_counter()
        if epoch % cfg.eval.every == 0 and not any(r["epoch"] == epoch for r in history["eval"]):
            te = time.perf_counter()
            run_eval(epoch)
            timings["eval"] += time.perf_counter() - te

        # ---- sample with the old policy
        ts = time.perf_counter()
        chosen = epoch_prompts(train_ids, cfg.prompts_per_epoch, cfg.seed, epoch)
        trajs: list[Trajectory] = []
        images: list[Any] = []
        with policy.using(OLD_ADAPTER):
            for k, pid in enumerate(chosen):
                mine = [g for g in range(cfg.group_size) if (k * cfg.group_size + g) % world == rank]
                if not mine:
                    continue
                emb = policy.encode_prompts([infos[pid].prompt])
                h, w = train_size[pid]
                tr, ims = sample_group(policy, infos[pid], emb, mine, cfg, epoch, h, w, base_index=k * cfg.group_size)
                trajs += tr
                images += ims
        timings["sample"] += time.perf_counter() - ts

        # ---- rewards (all of the epoch's samples, gathered)
        tr0 = time.perf_counter()
        rewards_local = compute_rewards(list(cfg.rewards), images, [infos[tj.prompt_id] for tj in trajs], ctx)
        local = [(tj.index, {k: float(v[j]) for k, v in rewards_local.items()}) for j, tj in enumerate(trajs)]
        gathered = sorted(_gather(accelerator, local), key=lambda r: r[0])
        if [i for i, _ in gathered] != list(range(n_traj)):
            raise RuntimeError("gathered rewards do not cover the epoch's trajectories exactly once")
        rewards = {k: np.array([r[1][k] for r in gathered]) for k in cfg.rewards}
        group_ids = [chosen[i // cfg.group_size] for i in range(n_traj)]
        agg, adv, agg_info = aggregate(rewards, cfg.rewards, group_ids, method=cfg.aggregation.method,
                                       delta=cfg.aggregation.delta, global_std=t.global_std)
        adv_clipped = np.clip(adv, -t.adv_clip_max, t.adv_clip_max)
        raw_total = weighted_sum(rewards, cfg.rewards)
        timings["reward"] += time.perf_counter() - tr0

        # ---- policy update
        tt = time.perf_counter()
        by_index = {tj.index: tj for tj in trajs}
        n_sde = len(cfg.sample.sde_indices)
        stats = {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0, "ratio": 0.0, "clipped": 0.0, "n": 0.0}
        grad_norms = []
        for step_no, mb in enumerate(minibatches(n_traj, t.gradient_steps_per_epoch, cfg.seed, epoch)):
            denom = float(len(mb) * n_sde)
            local_idx = [int(i) for i in mb if int(i) in by_index]
            shapes: dict[tuple[int, int], list[int]] = {}
            for i in local_idx:
                shapes.setdefault((by_index[i].height, by_index[i].width), []).append(i)
            optimizer.zero_grad(set_to_none=True)
            for (h, w), idx in sorted(shapes.items()):
                for c0 in range(0, len(idx), t.batch_size):
                    chunk = [by_index[i] for i in idx[c0:c0 + t.batch_size]]
                    emb = PromptEmbeds.cat([c.embeds for c in chunk]).to_device(device)
                    a = torch.tensor([adv_clipped[c.index] for c in chunk], dtype=torch.float32, device=device)
                    for j in range(n_sde):
                        step = chunk[0].sde_indices[j]
                        x = torch.stack([c.latents[j, 0] for c in chunk]).to(device)
                        x_next = torch.stack([c.latents[j, 1] for c in chunk]).to(device)
                        sig, sig_next = chunk[0].sigmas[step], chunk[0].sigmas[step + 1]
                        ts_ = chunk[0].timesteps[step]
                        args = (x, x_next, sig, sig_next, ts_, emb, h, w, cfg.sample.noise_level, cfg.sample.sigma_max)
                        with torch.no_grad():
                            with policy.using(OLD_ADAPTER):
                                old_lp, _, _ = policy.transition_log_prob(*args)
                            with policy.using(None):
                                _, ref_mean, _ = policy.transition_log_prob(*args)
                        lp, mean, std = policy.transition_log_prob(*args)
                        pl, ratio = clipped_surrogate(lp, old_lp, a, t.clip_range)
                        kl = gaussian_mean_kl(mean, ref_mean, std)
                        per = pl + t.beta * kl
                        loss = per.sum() / denom
                        if not torch.isfinite(loss):
                            raise FloatingPointError(f"non-finite GRPO loss at epoch {epoch + 1}, step {step_no + 1}")
                        loss.backward()
                        with torch.no_grad():
                            if step_no == 0:
                                first_update_ratio_dev.append(float((ratio - 1).abs().max()))
                            stats["loss"] += float(per.sum())
                            stats["policy_loss"] += float(pl.sum())
                            stats["kl"] += float(kl.sum())
                            stats["ratio"] += float(ratio.sum())
                            stats["clipped"] += float(((ratio - 1).abs() > t.clip_range).float().sum())
                            stats["n"] += len(chunk)
            _sum_grads(accelerator, params)
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            global_step = epoch * t.gradient_steps_per_epoch + step_no + 1
            if ema is not None and global_step % t.ema.update_every == 0:
                ema.update(trained)
        policy.copy_adapter(TRAINED_ADAPTER, OLD_ADAPTER)
        timings["train"] += time.perf_counter() - tt
        if world > 1:
            sums = _gather(accelerator, [stats])
            stats = {k: sum(s[k] for s in sums) for k in stats}

        # ---- log
        groups = np.array(agg).reshape(cfg.prompts_per_epoch, cfg.group_size)
        row: dict[str, Any] = {
            "epoch": epoch + 1,
            "reward": float(raw_total.mean()),
            "reward_std": float(raw_total.std()),
            "reward_aggregated": float(np.mean(agg)),
        }
        for k, v in rewards.items():
            row[f"{k}_mean"] = float(v.mean())
            row[f"{k}_std"] = float(v.std())
        if "h" in agg_info:
            for k, hk in agg_info["h"].items():
                row[f"{k}_h"] = float(hk) if np.isfinite(hk) else None
            row["tamed"] = "+".join(agg_info["tamed"])
        n = max(stats["n"], 1.0)
        row.update({
            "advantage_abs_mean": float(np.abs(adv_clipped).mean()),
            "zero_std_group_fraction": float((groups.std(axis=1) < 1e-6).mean()),
            "clip_fraction": stats["clipped"] / n,
            "ratio_mean": stats["ratio"] / n,
            "loss": stats["loss"] / n,
            "policy_loss": stats["policy_loss"] / n,
            "kl": stats["kl"] / n,
            "grad_norm": float(np.mean(grad_norms)),
            "seconds": round(time.perf_counter() - t_epoch, 3),
        })
        history["train"].append(row)
        per_sample_rewards.append(raw_total.tolist())
        epochs_this_run += 1
        if main:
            log.info("epoch %d/%d: reward %.4f +- %.4f (%s) | |A| %.3f, clip %.3f, ratio %.5f, kl %.3g, loss %.4g "
                     "| %.1f s", epoch + 1, cfg.epochs, row["reward"], row["reward_std"],
                     ", ".join(f"{k} {row[f'{k}_mean']:.4f}" for k in cfg.rewards), row["advantage_abs_mean"],
                     row["clip_fraction"], row["ratio_mean"], row["kl"], row["loss"], row["seconds"])
        done = epoch + 1
        if done == cfg.epochs:
            te = time.perf_counter()
            run_eval(done)
            timings["eval"] += time.perf_counter() - te
        ck = save_checkpoint(done) if (done % cfg.save_every == 0 or done == cfg.epochs) else None
        if callback is not None:
            callback(EpochInfo(done, cfg.epochs, row, ck, policy))

    # ---------------- the LoRA
    if accelerator is not None:
        accelerator.wait_for_everyone()
    if main and lora_dir is not None:
        weights_ctx = ema.swapped_in(trained) if ema is not None else contextlib.nullcontext()
        with weights_ctx:
            save_lora(policy, cfg, lora_dir)
    if main:
        ckpt.write_plot_csvs(plots, history)
    if accelerator is not None:
        accelerator.wait_for_everyone()

    window = max(1, min(5, cfg.epochs // 3))
    signal = learning_signal(history["train"], [np.asarray(r) for r in per_sample_rewards], window)
    wall = time.perf_counter() - t_start
    return {
        "subtask_policy": cfg.policy,
        "epochs": cfg.epochs,
        "epochs_this_run": epochs_this_run,
        "resumed_from": resumed_from,
        "processes": world,
        "device": device.type,
        "torch_threads_per_process": torch.get_num_threads(),
        "trajectories_per_epoch": n_traj,
        "transitions_per_epoch": n_traj * len(cfg.sample.sde_indices),
        "optimizer_steps": cfg.epochs * t.gradient_steps_per_epoch,
        "lora_parameters": n_lora,
        "train_resolution": cfg.train.resolution,
        "eval_resolution": cfg.eval.resolution,
        "train_prompts": len(train_ids),
        "eval_prompts": len(eval_prompts),
        "first_update_ratio_max_abs_deviation": max(first_update_ratio_dev) if first_update_ratio_dev else None,
        "learning_signal": signal,
        "train_final": history["train"][-1] if history["train"] else {},
        "eval_first": history["eval"][0] if history["eval"] else {},
        "eval_final": history["eval"][-1] if history["eval"] else {},
        "seconds": {k: round(v, 2) for k, v in timings.items()},
        "seconds_per_epoch": round(sum(timings.values()) / epochs_this_run, 3) if epochs_this_run else None,
        "wall_seconds_train_grpo": round(wall, 2),
    }


def save_lora(policy: FluxPolicy, cfg: GrpoSubtaskParams, lora_dir: str | os.PathLike[str]) -> None:
    """Write the trained adapter's current weights as a diffusers FLUX LoRA (atomically)."""
    from diffusers import FluxPipeline

    target = Path(lora_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    meta = {"r": cfg.lora.rank, "lora_alpha": cfg.lora.alpha, "target_modules": list(cfg.lora.target_modules)}
    FluxPipeline.save_lora_weights(str(tmp), transformer_lora_layers=policy.lora_state_dict(TRAINED_ADAPTER),
                                   transformer_lora_adapter_metadata=meta)
    write_json(tmp / "lora_config.json", {**meta, "lora_dropout": cfg.lora.dropout, "base_policy": cfg.policy})
    for f in tmp.iterdir():
        f.chmod(0o644)
    ckpt.replace_dir(tmp, target)
    log.info("LoRA saved to %s", target)
