"""Pretraining of the embedded default's FLUX.1 family: ``flux`` (``FluxPipeline``,
text to image sets) and ``flux_kontext`` (``FluxKontextPipeline``, editing).

:func:`build` writes both directories under ``out_root``:

1. ``flux/``: the tiny pipeline of :func:`paco.models.tiny._build_flux` with the VAE overrides
   :attr:`FluxRecipe.vae` (default :data:`PRETRAINED_VAE`: 4 latent channels, so the packed 2x2
   latent has 16 channels, within the tiny transformer's inner width of 32; the
   transformer's ``in_channels`` follows as ``4 * latent_channels``, FLUX's 2x2 packing) and the
   transformer overrides :attr:`FluxRecipe.transformer` (default :data:`PRETRAINED_TRANSFORMER`:
   the tiny 1 + 1 blocks and width 32 as one head of 32), whose VAE is trained for reconstruction
   (:mod:`paco.pretrain.flux_vae`; latent ``shift_factor`` / ``scaling_factor`` set from
   the latents' mean and std) and whose ``FluxTransformer2DModel`` is trained with the rectified
   flow objective (Liu et al. 2022; Esser et al. 2024, SD3 §2-3): ``x_s = (1 - s) x0 + s n``,
   ``n ~ N(0, I)``, target velocity ``n - x0``, MSE; ``s = shift(sigmoid(N(m, 1)))`` (SD3's
   logit-normal sampling, location ``m = FluxRecipe.t_logit_mean``: 1 puts more steps at the
   noisy end, where the layout and colours of a sample are decided) time-shifted by FLUX's
   resolution-dependent ``mu`` (``exp(mu) / (exp(mu) + 1/s - 1)``,
   :func:`paco.grpo.sde.calculate_shift` of the packed token count, as the FLUX scheduler's
   dynamic shifting). ``x0`` are the packed, shifted and scaled
   VAE latents (posterior mode) of :func:`paco.pretrain.views.layout_grid` composites of
   each T2IS prompt's subject in its layout, at the size the pipeline samples that prompt at
   (:func:`paco.grpo.policies.grid_size` of the prompt's size at each training resolution); the
   condition is the prompt's text through :class:`paco.grpo.policies.FluxPolicy` (frozen,
   random-init CLIP and T5; ``velocity`` at ``timestep = 1000 s``, the sampler's convention).
2. ``flux_kontext/``: the same VAE and text encoders as a ``FluxKontextPipeline``; its
   transformer starts from the trained t2i one (as FLUX.1 Kontext derives from FLUX.1) and is
   trained with the same objective on editing examples
   (:func:`paco.pretrain.views.edit_example`: a 128 px input view -> the operation's
   result, the instruction as the prompt, photographs outside the edits stage's test split),
   conditioned through :class:`paco.grpo.policies.FluxKontextPolicy` (reference latents in the
   sequence), mixed with identity examples (target = the input,
   :attr:`FluxRecipe.kontext_identity`) so that it learns to copy the reference; at a training
   resolution above 128 px the input is resized by the policy (as at sampling) and the target
   by the pipeline's image processor.

Both directories get a ``pretrain.json`` with the figures of :func:`build` and the recipe.
Training is a fixed number of steps, seeded from the recipe (same host and thread count ->
same bytes).
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pydantic
import torch
from PIL import Image
from tqdm.auto import tqdm

from paco.pretrain import flux_vae
from paco.pretrain.record import write_record
from paco.pretrain.views import SUBJECT_NAMES, cell_boxes, edit_example, layout_grid, to_pil

#: repository root (the default prompts file is relative to it)
_ROOT = Path(__file__).resolve().parents[2]
#: the prompts stage's split params (params.yaml ``prompts``) and the edits stage's photos
PROMPTS_TEST_FRACTION = 0.25
PROMPTS_SPLIT_SEED = 0
EDIT_SUBJECTS = ("astronaut", "cat", "coffee", "rocket", "grace_hopper", "motorcycle")
EDIT_TEST_PHOTOS = 2
EDIT_SEED = 0
EDIT_SIZE = 128
#: sampling settings of the pipeline (params.yaml final_samples / grpo)
T2I_GUIDANCE = 3.5
KONTEXT_GUIDANCE = 2.5
#: the instruction of the Kontext identity examples (target = input)
IDENTITY_INSTRUCTION = "Keep the photo exactly as it is."
#: the VAE overrides of the pretrained build: 4 latent channels instead of the tiny's 16. With 16
#: (64 packed channels, above the tiny transformer's inner width of 32) the tiny transformer
#: reached a 0.22 subject match after 600 steps and a grown one (2 + 2 blocks of 2 heads x 32,
#: 3-4x the GRPO step cost) 0.30 after 1400; with 4 (16 packed channels) the tiny one reaches
#: 0.35 after 1400 at the tiny's step cost (8 channels: 0.23), all with a 300-step VAE; with the
#: 900-step VAE (held-out PSNR 22.6 dB vs 19.5, colours kept) 0.44, and 0.50 after 2800 steps
#: with :data:`PRETRAINED_TRANSFORMER` (subject match at 256 px / 10 steps, all prompts).
PRETRAINED_VAE: dict[str, Any] = dict(latent_channels=4)
#: the transformer overrides of the pretrained build: the tiny's inner width 32 as one head of 32
#: with rotary dims 8 + 12 + 12 instead of two heads of 16 with 4 + 6 + 6 (same parameters and
#: step cost). With three rotary frequencies per image axis Kontext could not copy its reference
#: (held-out edit SSIM to the input 0.14 after 500 steps; one head: 0.27).
PRETRAINED_TRANSFORMER: dict[str, Any] = dict(attention_head_dim=32, num_attention_heads=1, axes_dims_rope=[8, 12, 12])
#: FLUX's 2x2 packing of the VAE latent into transformer tokens (``FluxPipeline._pack_latents``)
PACKED_CHANNELS_PER_LATENT = 4
#: the tiny VAE's latent channels (:func:`paco.models.tiny._build_flux`)
TINY_LATENT_CHANNELS = 16


class FluxRecipe(pydantic.BaseModel, extra="forbid"):
    """How the FLUX.1 family is pretrained (module docstring). Steps are optimiser steps; sizes px."""

    seed: int = 0
    #: ``FluxTransformer2DModel`` overrides of the tiny config (empty: the tiny 1 + 1 blocks of
    #: 2 heads x 16); ``in_channels`` follows as 4 x the VAE's latent channels
    transformer: dict[str, Any] = pydantic.Field(default_factory=lambda: dict(PRETRAINED_TRANSFORMER))
    #: ``AutoencoderKL`` overrides of the tiny config (empty: the tiny 16 latent channels)
    vae: dict[str, Any] = pydantic.Field(default_factory=lambda: dict(PRETRAINED_VAE))
    max_sequence_length: int = pydantic.Field(64, ge=8)
    # VAE
    vae_steps: int = pydantic.Field(900, ge=0)
    vae_batch: int = pydantic.Field(16, ge=1)
    vae_size: int = pydantic.Field(64, ge=16)
    vae_lr: float = pydantic.Field(2e-3, gt=0)
    vae_kl_weight: float = pydantic.Field(1e-4, ge=0)
    vae_eval_views: int = pydantic.Field(32, ge=1)
    # text to image transformer
    t2i_steps: int = pydantic.Field(6000, ge=0)
    t2i_batch: int = pydantic.Field(16, ge=1)
    t2i_lr: float = pydantic.Field(6e-3, gt=0)
    #: the training composites' views (:func:`paco.pretrain.views.subject_view`): mild crops, mild
    #: jitter and no flips keep each subject's layout in its conditional mean (flips cost 0.13 of
    #: subject match, and mirror asymmetric subjects into two modes)
    t2i_crop_scale: tuple[float, float] = (0.8, 1.0)
    t2i_jitter: float = pydantic.Field(0.05, ge=0, lt=1)
    t2i_flip: float = pydantic.Field(0.0, ge=0, le=1)
    t2i_resolutions: list[int] = pydantic.Field(default_factory=lambda: [128, 256])
    t2i_resolution_weights: list[float] = pydantic.Field(default_factory=lambda: [0.5, 0.5])
    t2i_views: int = pydantic.Field(12, ge=1)  # composites per prompt and resolution
    t_logit_mean: float = 1.0  # location of the logit-normal timestep density (SD3 §3.1)
    t2i_lr_floor: float = pydantic.Field(0.1, gt=0, le=1)  # final lr / lr of the cosine decay (1: constant)
    prompts_jsonl: str = "data/raw/t2is_prompts.jsonl"
    # Kontext transformer
    kontext_steps: int = pydantic.Field(1000, ge=0)
    kontext_batch: int = pydantic.Field(16, ge=1)
    kontext_lr: float = pydantic.Field(1e-3, gt=0)
    kontext_resolutions: list[int] = pydantic.Field(default_factory=lambda: [128, 192])
    kontext_resolution_weights: list[float] = pydantic.Field(default_factory=lambda: [0.5, 0.5])
    kontext_examples: int = pydantic.Field(128, ge=1)  # editing examples per resolution
    kontext_identity: float = pydantic.Field(0.75, ge=0, lt=1)  # share of identity examples (target = input)
    kontext_lr_floor: float = pydantic.Field(1.0, gt=0, le=1)  # final lr / lr (1: constant)
    # evaluation
    eval_seeds: int = pydantic.Field(2, ge=1)  # samples per T2IS prompt (final_samples: 4; 2 keeps the build short)
    eval_edit_seeds: int = pydantic.Field(2, ge=1)
    evaluate: bool = True  # False: no quality figures (fast tests)

    @pydantic.model_validator(mode="after")
    def _check(self) -> FluxRecipe:
        for name in ("t2i", "kontext"):
            res, weights = getattr(self, f"{name}_resolutions"), getattr(self, f"{name}_resolution_weights")
            if not res or len(res) != len(weights) or any(r < 16 or r % 16 for r in res):
                raise ValueError(f"{name}_resolutions must be multiples of 16 with one weight each, got {res} / {weights}")
            if any(w < 0 for w in weights) or sum(weights) <= 0:
                raise ValueError(f"{name}_resolution_weights must be >= 0 with a positive sum, got {weights}")
        lo, hi = self.t2i_crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"t2i_crop_scale must be area fractions 0 < low <= high <= 1, got {self.t2i_crop_scale}")
        channels = self.vae.get("latent_channels", TINY_LATENT_CHANNELS)
        if not isinstance(channels, int) or channels < 1:
            raise ValueError(f"vae.latent_channels must be a positive integer, got {channels!r}")
        packed = self.transformer.get("in_channels", PACKED_CHANNELS_PER_LATENT * channels)
        if packed != PACKED_CHANNELS_PER_LATENT * channels:
            raise ValueError(f"transformer.in_channels must be {PACKED_CHANNELS_PER_LATENT} x vae.latent_channels "
                             f"(2x2 packing) = {PACKED_CHANNELS_PER_LATENT * channels}, got {packed}")
        return self

    def overrides(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(transformer, vae)`` overrides for :func:`paco.models.tiny._build_flux`: the recipe's,
        the transformer's ``in_channels`` set to 4 x the VAE's latent channels (tiny: 16)."""
        vae = dict(self.vae)
        channels = vae.get("latent_channels", TINY_LATENT_CHANNELS)
        return {**self.transformer, "in_channels": PACKED_CHANNELS_PER_LATENT * channels}, vae


@dataclass
class _Item:
    """What a policy reads of a prompt (``paco.grpo.rewards.SubtaskItem``'s fields it uses)."""

    prompt_id: str
    prompt: str
    reference: Image.Image | None = None


@dataclass
class _Bucket:
    """Training examples of one image size: packed target latents ``x0`` ``(N, seq, C)``, the
    conditioning rows ``cond`` and the row of each example ``rows`` ``(N,)``."""

    height: int
    width: int
    x0: torch.Tensor
    cond: Any
    rows: np.ndarray
    weight: float
    mu: float


# -------------------------------------------------------------------------------------------- helpers


def _settings(guidance: float, recipe: FluxRecipe) -> SimpleNamespace:
    return SimpleNamespace(max_sequence_length=recipe.max_sequence_length, guidance_scale=guidance,
                           reference_aspect="keep")


@torch.no_grad()
def encode_packed(pipe: Any, images: Sequence[np.ndarray], chunk: int = 32) -> torch.Tensor:
    """Packed FLUX latents of equal-size ``(H, W, 3)`` [0, 1] arrays: the VAE posterior's mode,
    ``(z - shift_factor) * scaling_factor``, packed 2x2 (``FluxPipeline._pack_latents``).

    Returns:
        float32 ``(N, (H/16) * (W/16), 4 * latent_channels)``.
    """
    from paco.pretrain.views import to_tensor

    cfg, out = pipe.vae.config, []
    for i in range(0, len(images), chunk):
        z = pipe.vae.encode(to_tensor(images[i:i + chunk])).latent_dist.mode()
        z = (z - cfg.shift_factor) * cfg.scaling_factor
        out.append(pipe._pack_latents(z, z.shape[0], z.shape[1], z.shape[2], z.shape[3]))
    return torch.cat(out).float()


def _cond_rows(policy: Any, items: Sequence[_Item], height: int, width: int, chunk: int = 64) -> Any:
    from paco.grpo.policies import Conditioning

    return Conditioning.cat([policy.condition(items[i:i + chunk], height, width)
                             for i in range(0, len(items), chunk)])


def shifted_logit_normal(u: torch.Tensor, mu: float) -> torch.Tensor:
    """FLUX's time shift of ``u`` in (0, 1): ``exp(mu) / (exp(mu) + 1/u - 1)`` (the scheduler's
    exponential ``time_shift``), clamped to [1e-3, 1]."""
    e = math.exp(mu)
    return (e / (e + 1.0 / u.clamp_min(1e-6) - 1.0)).clamp(1e-3, 1.0)


def _lr_at(step: int, steps: int, lr: float, floor: float = 0.1) -> float:
    """Linear warm-up over 5% of the steps, then cosine decay to ``floor * lr`` (``floor`` 1:
    constant after the warm-up)."""
    warm = max(1, steps // 20)
    if step < warm:
        return lr * (step + 1) / warm
    frac = (step - warm) / max(1, steps - warm)
    return lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * frac)))


def train_velocity(policy: Any, buckets: Sequence[_Bucket], *, steps: int, batch: int, lr: float, seed: int,
                   desc: str, lr_floor: float = 0.1, logit_mean: float = 0.0, callback: Any = None) -> list[float]:
    """Train ``policy.transformer`` in place with the rectified-flow loss (module docstring) for
    ``steps`` AdamW steps (no weight decay, gradient norm clipped at 1, :func:`_lr_at` with
    ``lr_floor``). Each step draws one bucket (probability ``weight``), ``batch`` examples of
    it, the noise and ``s = shift(sigmoid(logit_mean + N(0, 1)))`` (SD3 §3.1's logit-normal
    with location ``logit_mean``; > 0 weights the noisy end, where a sample's layout and colours
    are decided); the velocity is ``policy.velocity(x_s, 1000 s, cond)``.

    Args:
        callback: called as ``callback(step)`` after steps ``1..steps`` (experiments), or None.

    Returns:
        the loss of every step.

    Raises:
        ValueError: no bucket, or weights that do not sum to a positive number.
    """
    weights = np.array([b.weight for b in buckets], dtype=np.float64)
    if not len(buckets) or weights.sum() <= 0:
        raise ValueError("train_velocity needs buckets with a positive total weight")
    weights /= weights.sum()
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    tr = policy.transformer
    tr.requires_grad_(True)
    tr.train()
    params = [p for p in tr.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    losses = []
    for step in tqdm(range(steps), desc=desc, leave=False):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, lr, lr_floor)
        b = buckets[int(rng.choice(len(buckets), p=weights))]
        idx = rng.integers(0, b.x0.shape[0], batch)
        x0 = b.x0[torch.from_numpy(idx)]
        noise = torch.randn(x0.shape, generator=gen)
        s = shifted_logit_normal(torch.sigmoid(logit_mean + torch.randn(batch, generator=gen)), b.mu)
        xs = (1.0 - s[:, None, None]) * x0 + s[:, None, None] * noise
        v = policy.velocity(xs, 1000.0 * s, b.cond.select(b.rows[idx].tolist()))
        loss = torch.nn.functional.mse_loss(v.float(), noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if callback is not None:
            callback(step + 1)
    tr.requires_grad_(False)
    tr.eval()
    return losses


def _mu(policy: Any, height: int, width: int) -> float:
    from paco.grpo.sde import calculate_shift

    h, w = policy.latent_grid(height, width)
    cfg = policy.pipe.scheduler.config
    return float(calculate_shift((h // 2) * (w // 2), cfg.get("base_image_seq_len", 256),
                                 cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                                 cfg.get("max_shift", 1.15)))


# -------------------------------------------------------------------------------------------- data


def t2is_prompts(recipe: FluxRecipe) -> list[dict[str, Any]]:
    """The T2IS prompts (``paco.data.prompts.read_t2is_jsonl`` rows: ``prompt_id``, ``prompt``,
    ``rows``, ``cols``, ``height``, ``width``, ``subject``) with the prompts stage's ``split``
    (:func:`paco.data.prompts.assign_split`, stratified by category, params.yaml's fraction and
    seed)."""
    from paco.data import prompts as P

    path = Path(recipe.prompts_jsonl)
    df = P.read_t2is_jsonl(path if path.is_absolute() else _ROOT / path)
    split = P.assign_split(df["prompt_id"].tolist(), PROMPTS_TEST_FRACTION, PROMPTS_SPLIT_SEED,
                           categories=df["category"].tolist())
    given = df["split"].notna()
    df.loc[~given, "split"] = df.loc[~given, "prompt_id"].map(split)
    return df.to_dict("records")


def t2i_buckets(policy: Any, prompts: Sequence[dict[str, Any]], recipe: FluxRecipe, rng: np.random.Generator
                ) -> list[_Bucket]:
    """One bucket per (training resolution, sampled size): ``recipe.t2i_views`` layout grids of
    each prompt's subject (views per ``recipe.t2i_crop_scale`` / ``t2i_jitter`` / ``t2i_flip``),
    encoded (:func:`encode_packed`), with the prompt's conditioning."""
    from paco.grpo.policies import grid_size

    buckets = []
    for res, rw in zip(recipe.t2i_resolutions, recipe.t2i_resolution_weights, strict=True):
        by_size: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for p in prompts:
            by_size.setdefault(grid_size(int(p["height"]), int(p["width"]), res), []).append(p)
        for (h, w), group in sorted(by_size.items()):
            images, rows = [], []
            for k, p in enumerate(group):
                for _ in range(recipe.t2i_views):
                    images.append(layout_grid(p["subject"], int(p["rows"]), int(p["cols"]), w, h, rng,
                                              crop_scale=recipe.t2i_crop_scale, jitter=recipe.t2i_jitter,
                                              flip=recipe.t2i_flip))
                    rows.append(k)
            cond = _cond_rows(policy, [_Item(p["prompt_id"], p["prompt"]) for p in group], h, w)
            buckets.append(_Bucket(h, w, encode_packed(policy.pipe, images), cond, np.asarray(rows),
                                   rw * len(group) / len(prompts), _mu(policy, h, w)))
    return buckets


def edit_split() -> tuple[list[str], list[str]]:
    """``(train photographs, held-out photographs)``: the Kontext policy trains on every subject
    photograph outside the edits stage's test split (params.yaml ``edits.photos``)."""
    from paco.pretrain.views import train_edit_subjects

    held_out = set(EDIT_SUBJECTS) - set(train_edit_subjects(list(EDIT_SUBJECTS), EDIT_TEST_PHOTOS, EDIT_SEED))
    return sorted(set(SUBJECT_NAMES) - held_out), sorted(held_out)


def edit_operations(subject: str) -> list[str]:
    """The edits stage's operations that apply to ``subject`` (colour-only ones skipped on
    grey-scale photographs), in :data:`paco.data.edits.OPERATIONS` order."""
    from paco.data.edits import OPERATIONS
    from paco.data.photos import GREYSCALE_SUBJECTS

    return [n for n, op in OPERATIONS.items() if not (op.colour_only and subject in GREYSCALE_SUBJECTS)]


def kontext_buckets(policy: Any, recipe: FluxRecipe, rng: np.random.Generator) -> list[_Bucket]:
    """One bucket per Kontext training resolution: ``recipe.kontext_examples`` editing examples
    (random train photograph and operation; 128 px input as the edits stage makes them; at a
    larger resolution the target is resized by the pipeline's image processor, the input by the
    policy's conditioning).

    With ``recipe.kontext_identity > 0`` each resolution also gets an identity bucket (the same
    inputs, the target is the input itself, the instruction :data:`IDENTITY_INSTRUCTION`) drawn
    with that share of the resolution's weight: it teaches the transformer to copy the
    reference tokens, which every operation but ``replace_subject`` mostly keeps."""
    train, _ = edit_split()
    buckets, share = [], recipe.kontext_identity
    for res, rw in zip(recipe.kontext_resolutions, recipe.kontext_resolution_weights, strict=True):
        items, targets, same = [], [], []
        for k in range(recipe.kontext_examples):
            subject = train[int(rng.integers(len(train)))]
            ops = edit_operations(subject)
            src, tgt, text = edit_example(subject, ops[int(rng.integers(len(ops)))], EDIT_SIZE, rng, others=train)
            items.append(_Item(f"edit-{res}-{k}", text, to_pil(src)))
            for image, out in ((tgt, targets), (src, same)):
                image = to_pil(image)
                if res != EDIT_SIZE:
                    image = policy.pipe.image_processor.resize(image, res, res)
                out.append(np.asarray(image, dtype=np.float32) / 255.0)
        cond = _cond_rows(policy, items, res, res)
        buckets.append(_Bucket(res, res, encode_packed(policy.pipe, targets), cond,
                               np.arange(len(items)), rw * (1.0 - share), _mu(policy, res, res)))
        if share > 0:
            ident = [_Item(f"same-{res}-{k}", IDENTITY_INSTRUCTION, it.reference) for k, it in enumerate(items)]
            buckets.append(_Bucket(res, res, encode_packed(policy.pipe, same), _cond_rows(policy, ident, res, res),
                                   np.arange(len(items)), rw * share, _mu(policy, res, res)))
    return [b for b in buckets if b.weight > 0]


# -------------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def sample(policy: Any, items: Sequence[_Item], height: int, width: int, *, num_steps: int, seeds: int,
           seed: int) -> list[list[Image.Image]]:
    """Deterministic ODE samples as ``final_samples`` makes them: per item, ``seeds`` samples of
    ``height x width`` px, seed ``k``'s noise from ``stable_seed(seed, "final", prompt_id, k)``.

    Returns:
        per item, its ``seeds`` RGB images.
    """
    from paco.core.seeding import stable_seed
    from paco.grpo.sde import ODE

    out = []
    for item in items:
        cond = policy.condition([item], height, width)
        gens = [torch.Generator().manual_seed(stable_seed(seed, "final", item.prompt_id, k)) for k in range(seeds)]
        roll = policy.generate(cond.select([0] * seeds), height=height, width=width, num_steps=num_steps,
                               sde=ODE, sde_indices=[], noise_generators=gens)
        out.append(policy.decode(roll.final_latents, height, width))
    return out


def t2i_quality(policy: Any, prompts: Sequence[dict[str, Any]], *, resolution: int, num_steps: int, seeds: int,
                seed: int) -> tuple[dict[str, float], list[Image.Image], list[str]]:
    """The share of generated panels whose nearest subject (:func:`paco.pretrain.quality.nearest_subject`)
    is their prompt's, over the test-split prompts and over all prompts.

    Returns:
        ``({"match_test", "match_all", "match_train"}, test-split images, their labels)``.
    """
    from paco.grpo.policies import grid_size
    from paco.pretrain.quality import nearest_subject

    hits: dict[str, list[bool]] = {"test": [], "train": []}
    sheet, labels = [], []
    for p in prompts:
        h, w = grid_size(int(p["height"]), int(p["width"]), resolution)
        images = sample(policy, [_Item(p["prompt_id"], p["prompt"])], h, w, num_steps=num_steps, seeds=seeds,
                        seed=seed)[0]
        for k, im in enumerate(images):
            for box in cell_boxes(w, h, int(p["rows"]), int(p["cols"])):
                hits[str(p["split"])].append(nearest_subject(im.crop(box)) == p["subject"])
            if p["split"] == "test":
                sheet.append(im)
                labels.append(f"{p['prompt_id']} {p['subject']} s{k}")
    share = {f"match_{k}": float(np.mean(v)) if v else float("nan") for k, v in hits.items()}
    share["match_all"] = float(np.mean(hits["test"] + hits["train"]))
    return share, sheet, labels


def edit_items(split: str) -> list[tuple[_Item, Image.Image]]:
    """The edits stage's items of ``split`` (``paco.data.edits.photo_edits`` with params.yaml's
    ``edits.photos``) as ``(item with its 128 px input, correct target)``."""
    from paco.core.io import decode_image
    from paco.data.edits import OPERATIONS, photo_edits

    df = photo_edits(list(EDIT_SUBJECTS), list(OPERATIONS), EDIT_SIZE, EDIT_TEST_PHOTOS, EDIT_SEED)
    df = df[df["split"] == split]
    return [(_Item(r["item_id"], r["instruction"], decode_image(r["input_image"])), decode_image(r["target_image"]))
            for r in df.to_dict("records")]


def edit_quality(policy: Any, split: str, *, resolution: int, num_steps: int, seeds: int, seed: int
                 ) -> tuple[dict[str, float], list[Image.Image], list[str]]:
    """Mean SSIM (:func:`paco.pretrain.quality.edit_ssim`) of Kontext edits of the edits
    stage's ``split`` items, sampled at ``resolution`` px, to their input and to their correct
    target.

    Returns:
        ``({"ssim_input", "ssim_target"}, input | edit images (first seed), their labels)``.
    """
    from paco.pretrain.quality import edit_ssim

    pairs = edit_items(split)
    to_in, to_tgt, sheet, labels = [], [], [], []
    for (item, target), images in zip(pairs, sample(policy, [p[0] for p in pairs], resolution, resolution,
                                                     num_steps=num_steps, seeds=seeds, seed=seed), strict=True):
        to_in += [edit_ssim(im, item.reference) for im in images]
        to_tgt += [edit_ssim(im, target) for im in images]
        sheet += [item.reference, images[0]]
        labels += [f"{item.prompt_id} input", "edit"]
    return {"ssim_input": float(np.mean(to_in)), "ssim_target": float(np.mean(to_tgt))}, sheet, labels


# -------------------------------------------------------------------------------------------- build


def _pretrain_vae(out: Path, recipe: FluxRecipe) -> dict[str, Any]:
    """Train the VAE of the directory ``out`` (module docstring), set its latent scaling and save it."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(out / "vae")
    t0 = time.perf_counter()
    losses = flux_vae.train_vae(vae, steps=recipe.vae_steps, batch=recipe.vae_batch, size=recipe.vae_size,
                                lr=recipe.vae_lr, kl_weight=recipe.vae_kl_weight, seed=recipe.seed)
    held_out = flux_vae.random_grids(np.random.default_rng([recipe.seed, 1]), recipe.vae_eval_views, EDIT_SIZE)
    q = flux_vae.vae_quality(vae, held_out)
    flux_vae.set_latent_scaling(vae, q["latent_mean"], q["latent_std"])
    vae.save_pretrained(out / "vae")
    return {"steps": recipe.vae_steps, "seconds": round(time.perf_counter() - t0, 1),
            "loss_first": losses[0] if losses else None, "loss_last50": float(np.mean(losses[-50:])) if losses else None,
            "psnr_heldout": round(q["psnr"], 3), "ssim_heldout": round(q["ssim"], 4),
            "shift_factor": vae.config.shift_factor, "scaling_factor": vae.config.scaling_factor}


def _loss_figures(losses: Sequence[float], seconds: float) -> dict[str, Any]:
    return {"steps": len(losses), "seconds": round(seconds, 1),
            "loss_first50": float(np.mean(losses[:50])) if losses else None,
            "loss_last50": float(np.mean(losses[-50:])) if losses else None}


def build(out_root: Path, recipe: FluxRecipe, *, sheet_dir: Path | None = None) -> dict[str, Any]:
    """Pretrain and write ``out_root/flux`` and ``out_root/flux_kontext`` (module docstring),
    each with a ``pretrain.json`` of the figures and the recipe.

    Args:
        sheet_dir: where to save contact sheets of the evaluation samples (None: none).

    Returns:
        ``{"vae": ..., "flux": ..., "flux_kontext": ..., "seconds"}``: steps, seconds, losses and
        the quality figures (VAE PSNR/SSIM on held-out grids; subject match of 256 px / 10-step
        samples on the test-split and all prompts; Kontext edit SSIM at 192 px / 10 steps to the
        input, held-out and train photographs).
    """
    from paco.grpo.final_samples import contact_sheet
    from paco.grpo.policies import load_policy
    from paco.models.tiny import _build_flux

    t_start = time.perf_counter()
    out_root = Path(out_root)
    t2i_dir, kontext_dir = out_root / "flux", out_root / "flux_kontext"
    for d in (t2i_dir, kontext_dir):
        if d.exists():
            shutil.rmtree(d)
    transformer, vae = recipe.overrides()
    _build_flux(t2i_dir, recipe.seed, "FluxPipeline", transformer=transformer, vae=vae)
    figures: dict[str, Any] = {"vae": _pretrain_vae(t2i_dir, recipe)}

    torch.manual_seed(recipe.seed)
    policy = load_policy("flux", t2i_dir, None, _settings(T2I_GUIDANCE, recipe))
    prompts = t2is_prompts(recipe)
    buckets = t2i_buckets(policy, prompts, recipe, np.random.default_rng([recipe.seed, 2]))
    t0 = time.perf_counter()
    losses = train_velocity(policy, buckets, steps=recipe.t2i_steps, batch=recipe.t2i_batch, lr=recipe.t2i_lr,
                            seed=recipe.seed, desc="flux t2i", lr_floor=recipe.t2i_lr_floor,
                            logit_mean=recipe.t_logit_mean)
    fig = _loss_figures(losses, time.perf_counter() - t0)
    policy.transformer.save_pretrained(t2i_dir / "transformer")
    fig["params"] = sum(p.numel() for p in policy.transformer.parameters())
    figures["flux"] = fig
    if recipe.evaluate:
        match, sheet, labels = t2i_quality(policy, prompts, resolution=256, num_steps=10, seeds=recipe.eval_seeds,
                                           seed=recipe.seed)
        fig.update({f"{k}_256px_10steps": round(v, 4) for k, v in match.items()})
    if recipe.evaluate and sheet_dir is not None:
        Path(sheet_dir).mkdir(parents=True, exist_ok=True)
        contact_sheet(sheet, labels, title="flux: test-split prompts, 256 px, 10 steps").save(
            Path(sheet_dir) / "flux_t2is_test.png")
    del policy, buckets

    _build_flux(kontext_dir, recipe.seed, "FluxKontextPipeline", transformer=transformer, vae=vae)
    for part in ("vae", "transformer"):  # the text encoders and tokenizers are the same build
        shutil.rmtree(kontext_dir / part)
        shutil.copytree(t2i_dir / part, kontext_dir / part)
    torch.manual_seed(recipe.seed)
    policy = load_policy("flux_kontext", kontext_dir, None, _settings(KONTEXT_GUIDANCE, recipe))
    buckets = kontext_buckets(policy, recipe, np.random.default_rng([recipe.seed, 3]))
    t0 = time.perf_counter()
    losses = train_velocity(policy, buckets, steps=recipe.kontext_steps, batch=recipe.kontext_batch,
                            lr=recipe.kontext_lr, seed=recipe.seed + 1, desc="flux kontext",
                            lr_floor=recipe.kontext_lr_floor, logit_mean=recipe.t_logit_mean)
    fig = _loss_figures(losses, time.perf_counter() - t0)
    policy.transformer.save_pretrained(kontext_dir / "transformer")
    pages = []
    for split, name in ((("test", "heldout"), ("train", "train")) if recipe.evaluate else ()):
        q, sheet, labels = edit_quality(policy, split, resolution=192, num_steps=10, seeds=recipe.eval_edit_seeds,
                                        seed=recipe.seed)
        fig.update({f"{k}_{name}_192px_10steps": round(v, 4) for k, v in q.items()})
        pages.append((sheet, labels, name))
    figures["flux_kontext"] = fig
    if sheet_dir is not None:
        for sheet, labels, name in pages:
            contact_sheet(sheet, labels, columns=6, title=f"flux_kontext: {name} photographs, input | edit, 192 px").save(
                Path(sheet_dir) / f"flux_kontext_{name}.png")
    figures["seconds"] = round(time.perf_counter() - t_start, 1)
    for name, d in (("flux", t2i_dir), ("flux_kontext", kontext_dir)):
        write_record(d, name, figures, recipe)
    return figures
