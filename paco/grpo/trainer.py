"""PaCo-GRPO: Flow-GRPO training of a policy LoRA (any family of :mod:`paco.grpo.policies`: FLUX.1
text to image, FLUX.1 Kontext editing) on multi-reward feedback (PaCo-RL §4, §7).

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
   (:mod:`paco.grpo.rewards`); failures raise. With ``rollout.overlap_rewards`` the served
   rewards (the judge) of each prompt's group are scored on a worker thread while the next
   group is sampled (:class:`paco.grpo.rewards.OverlappedRewards`), with the same results.
4. **Advantages**: :func:`paco.grpo.advantages.aggregate` (``aggregation.method``, ``delta``,
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
   trained adapters are equal, the ratio is exactly 1. The reference policy (adapters off) is
   evaluated only where the KL is used: ``beta > 0``, or ``train.log_kl`` for the log (the
   reference code computes it only at ``beta > 0``). Gradients are clipped to
   ``max_grad_norm``; the EMA of the trained LoRA is updated every ``ema.update_every`` steps.
6. **Refresh** the old adapter := the trained one (the reference's ``decay_type 0``).

Several processes (``accelerate launch``): trajectory ``i`` of the epoch (prompt-major order)
is sampled, rewarded and trained by process ``i % P``; rewards are gathered so advantages see
the whole epoch; each process backpropagates the sum of its transitions' losses divided by the
global transition count of the mini-batch and the gradients are summed over processes, so the
step equals the single-process step up to float summation order.

Checkpoints (every ``save_every`` epochs and after the last): ``epoch-NNNN/`` with the trained,
old and EMA LoRA weights (``lora.safetensors``), the optimizer (``optimizer.pt``), the RNG
states (``rng-<rank>.pt``) and ``trainer_state.json`` (run identity, epoch, history); the
weights of every evaluation are kept in ``eval-weights/``. A rerun resumes from the newest
readable checkpoint written under the same run identity (:mod:`paco.core.run_identity`: every
declared dep, code file and params key except ``epochs``, ``save_every``, ``resources`` and the
evaluation keys, plus the process count and device type) that is not past ``epochs``, else
starts fresh and says why; so raising ``epochs`` continues a finished run, and a change of the
evaluation params (``eval.*`` but ``every``) re-evaluates the kept weights without an optimizer
step. Since every random draw is seeded from ``(seed, epoch, ...)``, a resumed run equals an
uninterrupted one bit for bit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from paco.core import checkpoints as ckpt
from paco.grpo.advantages import aggregate, weighted_sum
from paco.core.seeding import stable_seed
from paco.core.stage import broadcast_from_main
from paco.core.io import write_json
from paco.core.params import GrpoSubtaskParams, ParamsError
from paco.grpo.policies import OLD_ADAPTER, TRAINED_ADAPTER, Conditioning, Policy, grid_size, load_policy
from paco.grpo.rewards import OverlappedRewards, PromptInfo, RewardContext, compute_rewards, subtask_items
from paco.core.run_identity import RunIdentity, launch_parts
from paco.core.statistics import learning_signal

log = logging.getLogger("paco.grpo.trainer")

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


def trajectory_prompts(chosen: Sequence[str], group_size: int, n_traj: int) -> list[str]:
    """The prompt id of each of an epoch's ``n_traj`` trajectories: ``rollout`` samples the
    ``chosen`` prompts' groups one after another, ``group_size`` trajectories each."""
    return [chosen[i // group_size] for i in range(n_traj)]


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
    embeds: Conditioning       # one row at the trajectory's size, shared by the prompt's group
    latents: torch.Tensor      # (n_sde, 2, seq, C)
    sigmas: torch.Tensor       # (N + 1,)
    timesteps: torch.Tensor    # (N,)
    sde_indices: tuple[int, ...]
    height: int
    width: int


def sample_group(policy: Policy, prompt: PromptInfo, embeds: Conditioning, indices: Sequence[int],
                 cfg: GrpoSubtaskParams, epoch: int, height: int, width: int, *, base_index: int
                 ) -> tuple[list[Trajectory], list[Any]]:
    """Sample the trajectories ``indices`` (within the prompt's group) of one prompt with the
    active adapter, in chunks of ``sample.batch_size``; return them and their decoded images."""
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

    After optimizer step ``t`` (the count of finished steps, 1-based), if ``(t + 1) %
    update_every == 0``: ``ema = d_t * ema + (1 - d_t) * w`` with ``d_t = decay``, or with
    ``warmup`` ``d_t = min((1 + t) / (10 + t), decay)`` -- the released code's
    ``EMAModuleWrapper.step`` (``paco_grpo/ema.py``; ``train_flux.py`` calls it with
    ``update_step_interval=8`` after each optimizer step). ``swapped_in(params)`` puts the EMA
    weights into the trained adapter for a ``with`` block and restores the live ones after.
    """

    def __init__(self, params: dict[str, torch.nn.Parameter], decay: float, *, warmup: bool = False,
                 update_every: int = 1):
        self.decay = float(decay)
        self.warmup = bool(warmup)
        self.update_every = int(update_every)
        self.shadow = {n: p.detach().float().clone() for n, p in params.items()}

    def decay_at(self, step: int) -> float:
        """``d_t`` of optimizer step ``t`` (see the class docstring)."""
        return min((1.0 + step) / (10.0 + step), self.decay) if self.warmup else self.decay

    @torch.no_grad()
    def step(self, params: dict[str, torch.nn.Parameter], step: int) -> bool:
        """The EMA update after optimizer step ``step`` (1-based); returns whether it updated."""
        if (step + 1) % self.update_every != 0:
            return False
        d = self.decay_at(step)
        for n, p in params.items():
            self.shadow[n].mul_(d).add_(p.detach().float(), alpha=1.0 - d)
        return True

    def swapped_in(self, params: dict[str, torch.nn.Parameter]):
        return swapped_weights(params, self.shadow)


@contextlib.contextmanager
def swapped_weights(params: dict[str, torch.nn.Parameter], weights: dict[str, torch.Tensor]):
    """Put ``weights`` (name -> tensor) into ``params`` for a ``with`` block, restoring after."""
    live = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(weights[n].to(p.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(live[n])


# --------------------------------------------------------------------------------------------
# distributed helpers (identity for one process)
# --------------------------------------------------------------------------------------------


def _gather(accelerator: Any, obj: list) -> list:
    if accelerator is None or accelerator.num_processes == 1:
        return obj
    from accelerate.utils import gather_object

    return gather_object(obj)


def _barrier(accelerator: Any) -> None:
    if accelerator is not None:
        accelerator.wait_for_everyone()


def _sum_grads(accelerator: Any, params: Sequence[torch.nn.Parameter]) -> None:
    if accelerator is None or accelerator.num_processes == 1:
        return
    import torch.distributed as dist

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


# --------------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(policy: Policy, prompts: Sequence[PromptInfo], sizes: Sequence[tuple[int, int]],
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
    # served rewards of each chunk scored while the next is sampled (as in the rollout)
    overlap = OverlappedRewards(list(cfg.rewards), ctx) if cfg.rollout.overlap_rewards else None
    submitted: list[int] = []
    try:
        for (h, w), idx in by_size.items():
            for start in range(0, len(idx), e.batch_size):
                chunk = idx[start:start + e.batch_size]
                emb = policy.condition([prompts[i] for i in chunk], h, w)
                noise = [generators(cfg.seed, "eval", 0, prompts[i].prompt_id, [0])[0] for i in chunk]
                roll = policy.generate(emb, height=h, width=w, num_steps=e.num_steps, noise_level=0.0,
                                       sde_indices=[], noise_generators=noise)
                images = policy.decode(roll.final_latents, h, w)
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
    local = [(i, {k: float(v[j]) for k, v in rewards.items()}) for j, (i, _) in enumerate(rows)]
    allrows = sorted(_gather(accelerator, local), key=lambda r: r[0])
    table = {k: np.array([r[1][k] for r in allrows]) for k in cfg.rewards}
    total = weighted_sum(table, cfg.rewards)
    out: dict[str, Any] = {"prompts": len(allrows), "reward": float(total.mean()), "reward_std": float(total.std())}
    for k, v in table.items():
        out[f"{k}_mean"] = float(v.mean())
        out[f"{k}_std"] = float(v.std())
    return out


def evaluation_epochs(epochs: int, every: int) -> list[int]:
    """The epochs (counts of finished epochs) after which GRPO evaluates: ``0, every, 2 every,
    ...`` below ``epochs``, and ``epochs`` itself."""
    return sorted({e for e in range(0, epochs, every)} | {epochs})


# --------------------------------------------------------------------------------------------
# the run: setup and state
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EpochInfo:
    """What the ``callback`` of :func:`train_grpo` gets after each epoch (after its checkpoint)."""

    epoch: int                  # 1-based count of finished epochs
    epochs: int
    row: dict[str, Any]
    checkpoint: str | None
    policy: Policy


EVAL_WEIGHTS_DIR = "eval-weights"


@dataclass
class GrpoRun:
    """What stays fixed through a GRPO run: params, processes, the policy with its adapters, the
    optimizer, the EMA, the prompts and their sizes, the run identity and where state goes."""

    cfg: GrpoSubtaskParams
    ctx: RewardContext
    identity: RunIdentity
    accelerator: Any
    rank: int
    world: int
    device: torch.device
    policy: Policy
    trained: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    ema: LoraEMA | None
    infos: dict[str, PromptInfo]
    train_ids: list[str]
    train_size: dict[str, tuple[int, int]]
    eval_prompts: list[PromptInfo]
    eval_sizes: list[tuple[int, int]]
    checkpoints_dir: Path
    plots_dir: Path | None
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
    def params(self) -> list[torch.nn.Parameter]:
        return list(self.trained.values())

    def condition(self, prompt_id: str, height: int, width: int) -> Conditioning:
        """The conditioning of a train prompt at ``height x width`` on the policy's device
        (:meth:`paco.grpo.policies.base.Policy.condition`, computed once per run)."""
        key = (prompt_id, int(height), int(width))
        if key not in self.conditions:
            self.conditions[key] = self.policy.condition([self.infos[prompt_id]], height, width).to_device("cpu")
        return self.conditions[key].to_device(self.device)

    def eval_weights_path(self, epoch: int) -> Path:
        return self.checkpoints_dir / EVAL_WEIGHTS_DIR / f"{CHECKPOINT_PREFIX}{epoch:04d}.safetensors"

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
    policy with its LoRA adapters (trained, old) and build the optimizer and the EMA.

    Raises:
        paco.core.params.ParamsError: a split without prompts, too few prompts for ``prompts_per_epoch`` or too few
            trajectories for the gradient steps.
    """
    from paco.core.stage import cpu_threads_per_process

    rank = accelerator.process_index if accelerator is not None else 0
    world = accelerator.num_processes if accelerator is not None else 1
    device = accelerator.device if accelerator is not None else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_process(int(os.environ.get("LOCAL_WORLD_SIZE", world))))
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
    trained = policy.adapter_parameters(TRAINED_ADAPTER)
    with torch.no_grad():  # LoRA weights stay float32 (bf16 base on GPUs)
        for p in list(trained.values()) + list(policy.adapter_parameters(OLD_ADAPTER).values()):
            p.data = p.data.float()
    t = cfg.train
    optimizer = torch.optim.AdamW(list(trained.values()), lr=t.learning_rate, betas=t.adam_betas, eps=t.adam_eps,
                                  weight_decay=t.weight_decay)
    ema = LoraEMA(trained, t.ema.decay, warmup=t.ema.warmup, update_every=t.ema.update_every) if t.ema.enabled else None
    run = GrpoRun(
        cfg=cfg, ctx=ctx, identity=identity, accelerator=accelerator, rank=rank, world=world, device=device,
        policy=policy, trained=trained, optimizer=optimizer, ema=ema, infos=infos, train_ids=train_ids,
        train_size={pid: grid_size(*size_of[pid], cfg.train.resolution) for pid in train_ids},
        eval_prompts=[infos[p] for p in eval_ids],
        eval_sizes=[grid_size(*size_of[p], cfg.eval.resolution) for p in eval_ids],
        checkpoints_dir=Path(checkpoints_dir),
        plots_dir=Path(plots_dir) if (plots_dir is not None and rank == 0) else None,
    )
    if run.main:
        n_lora = sum(p.numel() for p in run.params)
        log.info("policy %s: LoRA r=%d alpha=%g on %d modules, %d trainable parameters; %d threads on %s",
                 policy_dir, cfg.lora.rank, cfg.lora.alpha, len(run.params) // 2, n_lora, torch.get_num_threads(),
                 device)
        log.info("%d epochs x (%d prompts x %d trajectories) at %dpx, %d SDE step(s) of %d; %d gradient steps/epoch; "
                 "eval on %d prompts at %dpx every %d epochs", cfg.epochs, cfg.prompts_per_epoch, cfg.group_size,
                 cfg.train.resolution, len(cfg.rollout.sde_indices), cfg.rollout.num_steps, t.gradient_steps_per_epoch,
                 len(run.eval_prompts), cfg.eval.resolution, cfg.eval.every)
    return run


# --------------------------------------------------------------------------------------------
# the steps: resume, rollout, reward, advantages, update, evaluate, save
# --------------------------------------------------------------------------------------------


def _load_checkpoint(path: Path, rank: int, with_ema: bool) -> dict[str, Any]:
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


def resume(run: GrpoRun) -> GrpoState:
    """The state to continue from: the newest readable checkpoint written under the same run
    identity (:func:`paco.core.checkpoints.find_resumable`; decided by the main process and broadcast),
    with the adapters, EMA, optimizer and RNG states restored, or a fresh state. A checkpoint past
    ``epochs`` (a longer run's) is not resumed. Evaluations not on this run's schedule
    (:func:`evaluation_epochs`; a shorter run's final one) are dropped."""
    cfg = run.cfg
    ckdir = run.checkpoints_dir
    files = ["lora.safetensors", "optimizer.pt"] + [f"rng-{r}.pt" for r in range(run.world)]
    found = None
    if run.main:
        def load(path: Path, saved: dict[str, Any]) -> dict[str, Any]:
            for r in range(1, run.world):  # every process's RNG state is readable too
                torch.load(path / f"rng-{r}.pt", weights_only=False)
            return _load_checkpoint(path, 0, run.ema is not None)

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
                       if not run.eval_weights_path(int(r["epoch"])).is_file()]
            if missing:
                log.warning("the evaluation params changed but the weights evaluated after epochs %s are missing: "
                            "starting fresh", missing)
                found = ckpt.Resume(None, None, f"evaluation changed and the kept weights of epochs {missing} are "
                                    "missing", skipped_corrupt=found.skipped_corrupt)
        if found.path is None:
            for p in ckpt.list_checkpoints(ckdir, CHECKPOINT_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
            shutil.rmtree(ckdir / EVAL_WEIGHTS_DIR, ignore_errors=True)
    loaded = found.loaded if found is not None else None  # the main process read it already
    found = broadcast_from_main(run.accelerator, found.without_loaded() if found is not None else None)
    state = GrpoState(resume=found)
    if found.path is None:
        if run.main:
            log.info("starting fresh: %s", found.reason)
        return state
    if loaded is None:
        loaded = _load_checkpoint(found.path, run.rank, run.ema is not None)
    with torch.no_grad():
        for tag, adapter in (("trained", TRAINED_ADAPTER), ("old", OLD_ADAPTER)):
            for n, p in run.policy.adapter_parameters(adapter).items():
                p.copy_(loaded["weights"][f"{tag}/{n}"])
        if run.ema is not None:
            for n in run.ema.shadow:
                run.ema.shadow[n].copy_(loaded["weights"][f"ema/{n}"])
    run.optimizer.load_state_dict(loaded["optimizer"])
    _set_rng_state(loaded["rng"])
    saved = found.state
    state.epoch = int(saved["epoch"])
    schedule = set(evaluation_epochs(cfg.epochs, cfg.eval.every))
    state.history = {"train": saved["history"]["train"],
                     "eval": [r for r in saved["history"]["eval"] if r["epoch"] in schedule]}
    state.per_sample_rewards = saved["per_sample_rewards"]
    if run.main:
        log.info("resuming from %s after epoch %d of %d (%s)", found.path, state.epoch, cfg.epochs, found.reason)
    return state


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
    major) on process ``i % P`` (:func:`epoch_prompts`, :func:`sample_group`). With
    ``rollout.overlap_rewards`` the served rewards of each group are scored while the next
    one is sampled (:class:`paco.grpo.rewards.OverlappedRewards`).

    Raises:
        paco.grpo.rewards.RewardError, paco.judge.client.JudgeError: a served reward failed.
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


def reward(run: GrpoRun, roll: Rollout) -> dict[str, np.ndarray]:
    """Every reward of ``rewards`` for this process's samples, gathered over processes:
    reward name -> ``(K * G,)`` float64 in trajectory order. Served rewards already scored
    during the rollout (``roll.served``) are taken from there.

    Raises:
        paco.grpo.rewards.RewardError, paco.judge.client.JudgeError: a reward failed.
        RuntimeError: the gathered rewards do not cover the epoch exactly once.
    """
    cfg = run.cfg
    infos = [run.infos[t.prompt_id] for t in roll.trajectories]
    rest = [n for n in cfg.rewards if n not in roll.served]
    local_rewards = {**compute_rewards(rest, roll.images, infos, run.ctx), **roll.served}
    local = [(t.index, {k: float(v[j]) for k, v in local_rewards.items()}) for j, t in enumerate(roll.trajectories)]
    gathered = sorted(_gather(run.accelerator, local), key=lambda r: r[0])
    if [i for i, _ in gathered] != list(range(run.n_traj)):
        raise RuntimeError("gathered rewards do not cover the epoch's trajectories exactly once")
    return {k: np.array([r[1][k] for r in gathered]) for k in cfg.rewards}


@dataclass
class Advantages:
    """The epoch's aggregated rewards ``(K * G,)``, clipped advantages ``(K * G,)``, the
    aggregation's diagnostics and the raw weighted reward ``(K * G,)``."""

    aggregated: np.ndarray
    advantages: np.ndarray
    info: dict[str, Any]
    weighted: np.ndarray


def advantages(run: GrpoRun, rewards: dict[str, np.ndarray], chosen: Sequence[str]) -> Advantages:
    """Group advantages of the epoch (:func:`paco.grpo.advantages.aggregate`: ``aggregation.method``,
    ``delta``, ``train.global_std``), clipped to ``+-train.adv_clip_max``."""
    cfg, t = run.cfg, run.cfg.train
    group_ids = trajectory_prompts(chosen, cfg.group_size, run.n_traj)
    agg, adv, info = aggregate(rewards, cfg.rewards, group_ids, method=cfg.aggregation.method,
                               delta=cfg.aggregation.delta, global_std=t.global_std)
    return Advantages(np.asarray(agg), np.clip(adv, -t.adv_clip_max, t.adv_clip_max), info,
                      weighted_sum(rewards, cfg.rewards))


def update(run: GrpoRun, roll: Rollout, adv: np.ndarray, epoch: int, state: GrpoState) -> dict[str, float]:
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
                    step = chunk[0].sde_indices[j]
                    x = torch.stack([c.latents[j, 0] for c in chunk]).to(device)
                    x_next = torch.stack([c.latents[j, 1] for c in chunk]).to(device)
                    sig, sig_next = chunk[0].sigmas[step], chunk[0].sigmas[step + 1]
                    ts_ = chunk[0].timesteps[step]
                    args = (x, x_next, sig, sig_next, ts_, emb, cfg.rollout.noise_level, cfg.rollout.sigma_max)
                    with torch.no_grad():
                        with policy.using(OLD_ADAPTER):
                            old_lp, _, _ = policy.transition_log_prob(*args)
                        if with_kl:
                            with policy.using(None):
                                _, ref_mean, _ = policy.transition_log_prob(*args)
                    lp, mean, std = policy.transition_log_prob(*args)
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
        _sum_grads(run.accelerator, run.params)
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(run.params, t.max_grad_norm)))
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        if run.ema is not None:
            run.ema.step(run.trained, epoch * t.gradient_steps_per_epoch + step_no + 1)
    policy.copy_adapter(TRAINED_ADAPTER, OLD_ADAPTER)
    if run.world > 1:
        sums = _gather(run.accelerator, [stats])
        stats = {k: sum(s[k] for s in sums) for k in stats}
    stats["grad_norm"] = float(np.mean(grad_norms))
    return stats


def evaluate_weights(run: GrpoRun, epoch: int, weights: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Evaluate (:func:`evaluate`) ``weights`` (default :meth:`GrpoRun.eval_weights`) in the
    trained adapter; the main process keeps the weights as ``eval-weights/epoch-NNNN.safetensors``
    so that a change of the evaluation params re-evaluates them without retraining."""
    weights = run.eval_weights() if weights is None else weights
    if run.main:
        path = run.eval_weights_path(epoch)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        ckpt.save_safetensors(weights, tmp)
        os.replace(tmp, path)
    with swapped_weights(run.trained, weights), run.policy.using(TRAINED_ADAPTER):
        res = evaluate(run.policy, run.eval_prompts, run.eval_sizes, run.cfg, run.ctx, rank=run.rank,
                       world=run.world, accelerator=run.accelerator)
    if run.main:
        log.info("eval after epoch %d at %dpx: reward %.4f (%s)", epoch, run.cfg.eval.resolution, res["reward"],
                 ", ".join(f"{k} {res[f'{k}_mean']:.4f}" for k in run.cfg.rewards))
    return {"epoch": epoch, **res}


def reevaluate(run: GrpoRun, state: GrpoState) -> None:
    """After a change of the evaluation params only: evaluate again the kept weights of every
    evaluation in the history (``eval-weights/``), replacing its row; no optimizer step.

    Raises:
        FileNotFoundError: the kept weights of an evaluation are missing.
    """
    from safetensors.torch import load_file

    rows = []
    for row in state.history["eval"]:
        path = run.eval_weights_path(int(row["epoch"]))
        if not path.is_file():
            raise FileNotFoundError(f"{path}: the weights evaluated after epoch {row['epoch']} are missing")
        weights = load_file(str(path))
        t0 = time.perf_counter()
        rows.append(evaluate_weights(run, int(row["epoch"]), weights))
        state.timings["eval"] += time.perf_counter() - t0
        state.reevaluated.append(int(row["epoch"]))
    state.history["eval"] = rows


def save(run: GrpoRun, state: GrpoState) -> str:
    """Checkpoint ``epoch-NNNN/`` after ``state.epoch`` epochs: trained, old and EMA LoRA
    weights, the optimizer, every process's RNG state and ``trainer_state.json`` (run identity,
    epoch, history, per-sample rewards); written to a temp directory and renamed; the newest
    :data:`KEEP_CHECKPOINTS` are kept. Also rewrites ``plots/*.csv``."""
    ckdir = run.checkpoints_dir
    name = f"{CHECKPOINT_PREFIX}{state.epoch:04d}"
    tmp = ckdir / f".tmp-{name}"
    if run.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(run.accelerator)
    torch.save(_rng_state(), tmp / f"rng-{run.rank}.pt")
    _barrier(run.accelerator)
    if run.main:
        weights = {f"trained/{n}": p.detach().float() for n, p in run.trained.items()}
        weights.update({f"old/{n}": p.detach().float() for n, p in run.policy.adapter_parameters(OLD_ADAPTER).items()})
        if run.ema is not None:
            weights.update({f"ema/{n}": v for n, v in run.ema.shadow.items()})
        ckpt.save_safetensors(weights, tmp / "lora.safetensors")
        torch.save(run.optimizer.state_dict(), tmp / "optimizer.pt")
        write_json(tmp / STATE_FILE, {**run.identity.to_state(), "epoch": state.epoch, "history": state.history,
                                      "per_sample_rewards": state.per_sample_rewards})
        ckpt.replace_dir(tmp, ckdir / name)
        ckpt.prune(ckdir, CHECKPOINT_PREFIX, KEEP_CHECKPOINTS)
        ckpt.write_plot_csvs(run.plots_dir, state.history)
    _barrier(run.accelerator)
    return str(ckdir / name)


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

    The loop is :func:`setup`, :func:`resume` (:func:`reevaluate` if only the evaluation params
    changed), then per epoch :func:`evaluate_weights` (on the schedule), :func:`rollout`,
    :func:`reward`, :func:`advantages`, :func:`update`, :func:`save` (every ``save_every``
    epochs and after the last).

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
        callback: called after each epoch with an :class:`EpochInfo`; an exception stops training.

    Returns:
        ``{"metrics": headline figures, "report": details}``: ``metrics`` holds deterministic
        figures only (a cached run equals a fresh one bit for bit), ``report`` the timings, the
        resume decision and derived sizes.

    Raises:
        ValueError: an empty split, too few prompts for ``prompts_per_epoch`` or for the
            gradient steps.
        paco.grpo.rewards.RewardError, paco.judge.client.JudgeError: a reward failed.
        FloatingPointError: a non-finite loss.
    """
    t_start = time.perf_counter()
    run = setup(cfg, prompts, policy_dir, ctx, identity, checkpoints_dir=checkpoints_dir, plots_dir=plots_dir,
                accelerator=accelerator)
    state = resume(run)
    _barrier(accelerator)
    if state.resume is not None and state.resume.evaluation_changed:
        if run.main:
            log.info("evaluation params changed (%s): re-evaluating the kept weights of epochs %s",
                     ", ".join(state.resume.evaluation_changed), [r["epoch"] for r in state.history["eval"]])
        reevaluate(run, state)
        if state.epoch >= cfg.epochs:
            save(run, state)
    if state.epoch == cfg.epochs and not any(r["epoch"] == cfg.epochs for r in state.history["eval"]):
        # a longer run's checkpoint at exactly the new (lowered) epochs: its final evaluation
        # was never made there (a scheduled one runs at the start of the next epoch)
        te = time.perf_counter()
        state.history["eval"].append(evaluate_weights(run, state.epoch))
        state.timings["eval"] += time.perf_counter() - te
        save(run, state)
    schedule = set(evaluation_epochs(cfg.epochs, cfg.eval.every))

    for epoch in range(state.epoch, cfg.epochs):
        t_epoch = time.perf_counter()
        if epoch in schedule and not any(r["epoch"] == epoch for r in state.history["eval"]):
            te = time.perf_counter()
            state.history["eval"].append(evaluate_weights(run, epoch))
            state.timings["eval"] += time.perf_counter() - te
        ts = time.perf_counter()
        roll = rollout(run, epoch)
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
            log.info("epoch %d/%d: reward %.4f +- %.4f (%s) | |A| %.3f, clip %.3f, ratio %.5f, kl %s, loss %.4g "
                     "| %.1f s", state.epoch, cfg.epochs, row["reward"], row["reward_std"],
                     ", ".join(f"{k} {row[f'{k}_mean']:.4f}" for k in cfg.rewards), row["advantage_abs_mean"],
                     row["clip_fraction"], row["ratio_mean"], "-" if row["kl"] is None else f"{row['kl']:.3g}",
                     row["loss"], time.perf_counter() - t_epoch)
        if state.epoch == cfg.epochs:
            te = time.perf_counter()
            state.history["eval"].append(evaluate_weights(run, state.epoch))
            state.timings["eval"] += time.perf_counter() - te
        ck = save(run, state) if (state.epoch % cfg.save_every == 0 or state.epoch == cfg.epochs) else None
        state.epoch_seconds.append({"epoch": state.epoch, "seconds": round(time.perf_counter() - t_epoch, 3)})
        if callback is not None:
            callback(EpochInfo(state.epoch, cfg.epochs, row, ck, run.policy))

    _barrier(accelerator)
    if run.main and lora_dir is not None:
        with (run.ema.swapped_in(run.trained) if run.ema is not None else contextlib.nullcontext()):
            save_lora(run.policy, cfg, lora_dir)
    if run.main:
        ckpt.write_plot_csvs(run.plots_dir, state.history)
    _barrier(accelerator)
    return summarise(run, state, time.perf_counter() - t_start)


def summarise(run: GrpoRun, state: GrpoState, wall: float) -> dict[str, Any]:
    """``{"metrics": ..., "report": ...}`` of a finished run (see :func:`train_grpo`)."""
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
    n_lora = sum(p.numel() for p in run.params)
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
        "seconds": {k: round(v, 2) for k, v in state.timings.items()},
        "seconds_per_epoch": (round(sum(state.timings[k] for k in ("rollout", "reward", "train")) /
                                    state.epochs_this_run, 3) if state.epochs_this_run else None),
        "epoch_seconds": state.epoch_seconds,
        "wall_seconds_train_grpo": round(wall, 2),
    }
    return {"metrics": metrics, "report": report}


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
