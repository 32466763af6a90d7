"""Pretraining of the embedded default's tiny Qwen-Image-Edit policy (issue 30).

:func:`build` writes ``<out_root>/qwen_image_edit/``: the ``QwenImageEditPipeline`` directory of
:func:`paco.models.tiny.build_tiny` (same layout, ``model_index.json`` processor patch included)
with two of its modules trained on the shipped photographs, the editing policy's train photographs
only (:func:`train_subjects`: every photograph but the edits stage's test split, so the held-out
edit items stay unseen):

1. **VAE** (``AutoencoderKLQwenImage``): trained as an autoencoder of square random views
   (:func:`paco.pretrain.views.subject_view`) with loss ``|y - x|_1 + |y - x|_2^2``
   (per-element means over ``[-1, 1]`` pixels) plus ``vae_kl_weight`` times the posterior's mean
   per-element KL to N(0, I) (Kingma & Welling 2014; the L1/L2 + small-KL autoencoder of Rombach
   et al. 2022 §3, without its perceptual and adversarial terms). It is fully convolutional, so it
   trains on ``vae_size`` px crops of the photographs at the edit items' scale. Afterwards the
   config's ``latents_mean`` / ``latents_std`` are set per latent channel from the posterior modes
   of fresh views, as Qwen-Image's VAE config holds them (``Qwen/Qwen-Image-Edit``
   ``vae/config.json``); the pipeline normalises ``(z - mean) / std`` before the transformer.
2. **Transformer** (``QwenImageTransformer2DModel``): trained with the rectified-flow objective
   (Liu et al. 2022; Esser et al. 2024, SD3 §2-3): clean latents ``x0`` (the packed, normalised
   latents of the edit's *target*), noise ``n ~ N(0, I)``, ``x_s = (1 - s) x0 + s n``, the
   transformer regresses the velocity ``n - x0`` (mean squared error). ``s`` is logit-normal
   (``sigmoid(N(0, 1))``, SD3 §3.1) time-shifted as the pipeline's scheduler shifts its sigmas
   (``FlowMatchEulerDiscreteScheduler`` exponential shift ``e^mu / (e^mu + 1/s - 1)``, ``mu`` from
   :func:`paco.grpo.sde.calculate_shift` on the scheduler config and the packed sequence length).
   Examples are :func:`paco.pretrain.views.edit_example` (input view -> correct target for
   the 7 operations of :data:`paco.data.edits.OPERATIONS`, ``colour_only`` ones skipped on
   :data:`paco.data.photos.GREYSCALE_SUBJECTS`), conditioned exactly as
   :class:`paco.grpo.policies.QwenImageEditPolicy` conditions (``condition``: the instruction
   encoded with its input image by the frozen text encoder, the input's packed reference latents,
   the grid shapes; ``velocity``: the transformer on ``[x_s, reference]`` at timestep ``1000 s``,
   divided by 1000 inside, its reference prediction dropped). A ``uncond_fraction`` share of
   examples carries the negative prompt ``" "`` (encoded with the image, as the policy encodes
   it) instead of the instruction, so true CFG (guidance 4.0, negative prompt ``" "``) has an
   unconditional branch to contrast (classifier-free guidance, Ho & Salimans 2022).

The text encoder (the tiny Qwen2.5-VL), tokenizer, processor and scheduler stay as built. The
default recipe grows the transformer to 4 heads x 16 (inner width 64, ``transformer`` override):
the tiny 2 x 16 maps the 64-channel packed tokens through 32 dims, so its velocity cannot reach
half of the latent directions (their initial noise is never removed); it stalls near flow loss
0.83 where the grown one reaches 0.37 in the same 1500 steps, at about 1.9x the transformer's
cost per forward+backward and per 6-step rollout.
Figures (:func:`build`'s return value and ``pretrain.json``): VAE PSNR / SSIM on held-out
views, and the edits' SSIM to their input (:func:`paco.pretrain.quality.edit_ssim`) for
the edits stage's test items (held-out photographs) and its train items, sampled as
``final_samples`` samples them (``paco.grpo.final_samples._generate``: 128 px, 10 ODE steps, true
CFG 4.0, 2 seeds per item) and with the GRPO rollouts' 6 steps.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pydantic
import torch
from tqdm.auto import tqdm

from paco.pretrain.record import write_record
from paco.pretrain.views import SUBJECT_NAMES, edit_example, subject_view, to_pil, to_tensor

#: the directory :func:`build` writes under ``out_root``
MODEL_NAME = "qwen_image_edit"
#: the embedded default's ``edits.photos`` (params.yaml): subjects, test photographs, seed, size
EDIT_PARAMS = dict(subjects=("astronaut", "cat", "coffee", "rocket", "grace_hopper", "motorcycle"),
                   test_photos=2, seed=0, size=128)
#: the true-CFG negative prompt and scale of ``final_samples.qwen_editing`` / ``grpo.qwen_editing``
NEGATIVE_PROMPT = " "
GUIDANCE_SCALE = 4.0


class QwenImageEditRecipe(pydantic.BaseModel, extra="forbid"):
    """Seeds, step counts, rates, sizes and architecture overrides of :func:`build`.

    ``transformer``: keys overriding the tiny ``QwenImageTransformer2DModel`` arguments
    (:func:`paco.models.tiny._build_qwen_image_edit`); empty: the tiny architecture.
    """

    seed: int = 0
    transformer: dict[str, Any] = pydantic.Field(default_factory=lambda: {"num_attention_heads": 4})
    # VAE
    vae_steps: int = pydantic.Field(500, ge=0)
    vae_batch: int = pydantic.Field(8, ge=1)
    vae_size: int = pydantic.Field(64, ge=16)
    vae_crop_scale: tuple[float, float] = (0.1, 0.6)
    vae_lr: float = pydantic.Field(5e-3, gt=0)
    vae_kl_weight: float = pydantic.Field(1e-3, ge=0)
    vae_stat_views: int = pydantic.Field(64, ge=2)
    vae_eval_views: int = pydantic.Field(16, ge=1)  # per held-out photograph, and as many of train ones
    # transformer
    steps: int = pydantic.Field(1500, ge=0)
    batch: int = pydantic.Field(16, ge=1)
    lr: float = pydantic.Field(2e-3, gt=0)
    examples: int = pydantic.Field(1024, ge=1)
    resolution: int = pydantic.Field(128, ge=16)
    uncond_fraction: float = pydantic.Field(0.1, ge=0, lt=1)
    # evaluation (as final_samples.qwen_editing / grpo.qwen_editing.rollout)
    eval_seeds: int = pydantic.Field(2, ge=1)
    eval_steps: int = pydantic.Field(10, ge=2)  # Qwen-Image's shift_terminal divides by zero at 1 step
    rollout_steps: int = pydantic.Field(6, ge=2)
    eval_max_items: int | None = pydantic.Field(None, ge=1)  # the first items of each split only (tests)

    @pydantic.model_validator(mode="after")
    def _check(self) -> QwenImageEditRecipe:
        lo, hi = self.vae_crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"vae_crop_scale must satisfy 0 < lo <= hi <= 1, got {self.vae_crop_scale}")
        for name in ("vae_size", "resolution"):
            if getattr(self, name) % 16:
                raise ValueError(f"{name} must be a multiple of 16 (VAE factor 8 x 2x2 packing), got {getattr(self, name)}")
        return self


# -------------------------------------------------------------------------------------------- data


def held_out_subjects() -> set[str]:
    """The photographs of the edits stage's test split under the default params (:data:`EDIT_PARAMS`)."""
    from paco.pretrain.views import train_edit_subjects

    p = EDIT_PARAMS
    return set(p["subjects"]) - set(train_edit_subjects(list(p["subjects"]), p["test_photos"], p["seed"]))


def train_subjects() -> list[str]:
    """Every photograph but :func:`held_out_subjects`, sorted: what the policy is pretrained on."""
    return sorted(set(SUBJECT_NAMES) - held_out_subjects())


def operations_for(subject: str) -> list[str]:
    """The operations of :data:`paco.data.edits.OPERATIONS` that apply to ``subject`` (``colour_only``
    ones are skipped on grey-scale photographs, as the edits stage skips them)."""
    from paco.data.edits import OPERATIONS
    from paco.data.photos import GREYSCALE_SUBJECTS

    return [n for n, op in OPERATIONS.items() if not (op.colour_only and subject in GREYSCALE_SUBJECTS)]


def edit_items(split: str) -> list[Any]:
    """The edits stage's items of ``split`` (``train`` or ``test``) under :data:`EDIT_PARAMS`, as
    :class:`paco.grpo.rewards.SubtaskItem` (instruction, decoded input image), sorted by id, with
    their target images: ``[(item, target PIL image)]``.

    Raises:
        ValueError: another ``split``.
    """
    from paco.core.io import decode_image
    from paco.data.edits import OPERATIONS, photo_edits
    from paco.grpo.rewards import SubtaskItem

    if split not in ("train", "test"):
        raise ValueError(f"split must be train or test, got {split!r}")
    p = EDIT_PARAMS
    table = photo_edits(list(p["subjects"]), list(OPERATIONS), p["size"], p["test_photos"], p["seed"])
    rows = table[table["split"] == split].sort_values("item_id").to_dict("records")
    return [(SubtaskItem.from_edit_row(r), decode_image(r["target_image"])) for r in rows]


# -------------------------------------------------------------------------------------------- VAE


@contextlib.contextmanager
def single_frame_convs() -> Iterator[None]:
    """Run the VAE's causal 3-D convolutions on one-frame inputs as the 2-D convolution they equal.

    ``QwenImageCausalConv3d`` pads ``kt - 1`` zero frames in front of the input (its causal
    padding); on a single frame without a cache (every image here) only the kernel's last time
    slice meets data, so the output is ``conv2d(x, weight[:, :, kt - 1])`` with the same spatial
    padding and stride, and the other slices get zero gradient either way. The same function,
    about 1.7x faster on CPU (floating-point summation order aside). Other calls are unchanged.
    """
    import torch.nn.functional as F
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d

    original = QwenImageCausalConv3d.forward

    def forward(self: Any, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        kt = self.kernel_size[0]
        if cache_x is None and x.shape[2] == 1 and self.stride[0] == 1 and self._padding[4] == kt - 1:
            y = F.conv2d(x[:, :, 0], self.weight[:, :, kt - 1], self.bias, self.stride[1:],
                         (self._padding[2], self._padding[0]))
            return y.unsqueeze(2)
        return original(self, x, cache_x)

    QwenImageCausalConv3d.forward = forward
    try:
        yield
    finally:
        QwenImageCausalConv3d.forward = original


def train_vae(vae: torch.nn.Module, subjects: Sequence[str], recipe: QwenImageEditRecipe) -> list[float]:
    """Train ``vae`` (``AutoencoderKLQwenImage``) in place: ``recipe.vae_steps`` AdamW steps (no
    weight decay, linear warm-up over the first 5%, gradient norm clipped at 1) on fresh square
    ``vae_size`` px views of ``subjects`` (crop area ``vae_crop_scale``, flips, colour jitter 0.1,
    drawn from ``default_rng(seed)``); loss as in the module docstring. Torch is seeded with
    ``recipe.seed`` by the caller (posterior samples).

    Returns:
        the loss of every step.
    """
    rng = np.random.default_rng([recipe.seed, 1])
    vae.requires_grad_(True)
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=recipe.vae_lr, weight_decay=0.0)
    with single_frame_convs():
        losses = _vae_steps(vae, opt, subjects, recipe, rng)
    vae.requires_grad_(False)
    vae.eval()
    return losses


def _vae_steps(vae: torch.nn.Module, opt: torch.optim.Optimizer, subjects: Sequence[str],
               recipe: QwenImageEditRecipe, rng: np.random.Generator) -> list[float]:
    warm = max(1, recipe.vae_steps // 20)
    losses = []
    for step in tqdm(range(recipe.vae_steps), desc="qwen_image vae", leave=False):
        for group in opt.param_groups:
            group["lr"] = recipe.vae_lr * min(1.0, (step + 1) / warm)
        views = [subject_view(subjects[int(rng.integers(len(subjects)))], recipe.vae_size, recipe.vae_size, rng,
                              crop_scale=recipe.vae_crop_scale) for _ in range(recipe.vae_batch)]
        x = to_tensor(views).unsqueeze(2)  # (B, 3, T=1, H, W)
        post = vae.encode(x).latent_dist
        y = vae.decode(post.sample()).sample
        kl = 0.5 * (post.mean ** 2 + post.var - 1.0 - post.logvar).mean()
        loss = (y - x).abs().mean() + ((y - x) ** 2).mean() + recipe.vae_kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@torch.no_grad()
def reconstruct(vae: torch.nn.Module, images: Sequence[np.ndarray], chunk: int = 16) -> tuple[np.ndarray, torch.Tensor]:
    """Encode (posterior mode) and decode equal-size ``(H, W, 3)`` [0, 1] arrays.

    Returns:
        ``(reconstructions float32 (N, H, W, 3) in [0, 1], raw latents (N, z_dim, 1, h, w))``.
    """
    recs, lats = [], []
    with single_frame_convs():
        for i in range(0, len(images), chunk):
            recs_i, z = _reconstruct_chunk(vae, images[i:i + chunk])
            recs.append(recs_i)
            lats.append(z)
    return np.concatenate(recs), torch.cat(lats)


def _reconstruct_chunk(vae: torch.nn.Module, images: Sequence[np.ndarray]) -> tuple[np.ndarray, torch.Tensor]:
    z = vae.encode(to_tensor(images).unsqueeze(2)).latent_dist.mode()
    y = vae.decode(z).sample[:, :, 0]
    return ((y.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1).numpy(), z


def vae_quality(vae: torch.nn.Module, images: Sequence[np.ndarray]) -> dict[str, float]:
    """Mean reconstruction PSNR (dB) and SSIM (RGB, data range 1; ``skimage.metrics``) of ``images``."""
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    recs, _ = reconstruct(vae, images)
    pairs = [(a.astype(np.float64), b.astype(np.float64)) for a, b in zip(images, recs, strict=True)]
    return {"psnr": round(float(np.mean([peak_signal_noise_ratio(a, b, data_range=1.0) for a, b in pairs])), 3),
            "ssim": round(float(np.mean([structural_similarity(a, b, data_range=1.0, channel_axis=2)
                                         for a, b in pairs])), 4)}


def set_latent_stats(vae: torch.nn.Module, images: Sequence[np.ndarray]) -> None:
    """Write the per-channel mean and std of the posterior modes of ``images`` into the VAE config's
    ``latents_mean`` / ``latents_std`` (``z_dim`` floats each, 4 decimals, as Qwen-Image's config).

    Raises:
        ValueError: a non-positive or non-finite std.
    """
    _, z = reconstruct(vae, images)
    mean = z.mean(dim=(0, 2, 3, 4))
    std = z.std(dim=(0, 2, 3, 4))
    if not torch.isfinite(std).all() or (std <= 0).any():
        raise ValueError(f"latent std must be positive and finite, got {std.tolist()}")
    vae.register_to_config(latents_mean=[round(float(v), 4) for v in mean],
                           latents_std=[round(float(v), 4) for v in std])


# -------------------------------------------------------------------------------------------- transformer


@dataclass
class EditBank:
    """Conditioned editing examples (one row each): the policy's ``condition`` of the example's
    prompt (its instruction, or the negative prompt on the ``uncond`` rows) trimmed to its valid
    tokens, and the packed latents of the input (``reference`` ``(N, seq, C)`` float32) and of the
    target (``target``, encoded as the reference is)."""

    embeds: list[torch.Tensor]
    uncond: torch.Tensor
    reference: torch.Tensor
    target: torch.Tensor
    img_shapes: torch.Tensor


@torch.no_grad()
def encode_references(policy: Any, images: Sequence[Any]) -> torch.Tensor:
    """:meth:`~paco.grpo.policies.QwenImageEditPolicy.encode_reference` of equal-size images in one
    VAE batch (the same arithmetic: preprocess, posterior mode, ``(z - latents_mean) / latents_std``,
    2x2 packing; every VAE op is per sample): ``(B, seq, C)`` float32."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import retrieve_latents

    pipe, vae = policy.pipe, policy.pipe.vae
    z_dim = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1)
    x = torch.cat([pipe.image_processor.preprocess(im, im.height, im.width) for im in images]).unsqueeze(2)
    z = retrieve_latents(vae.encode(x.to(policy.device, dtype=vae.dtype)), sample_mode="argmax")
    z = (z - mean.to(z)) / std.to(z)
    return pipe._pack_latents(z, len(images), z_dim, z.shape[3], z.shape[4]).float()


@contextlib.contextmanager
def _batched_conditioning(policy: Any) -> Iterator[None]:
    """The policy's ``condition`` with its references encoded in one batch (:func:`encode_references`),
    true CFG off (one text per example), the VAE's convolutions as 2-D ones (:func:`single_frame_convs`)."""
    saved = policy.negative_prompt
    policy.negative_prompt = None
    policy.encode_reference = lambda images: encode_references(policy, images)
    try:
        with single_frame_convs():
            yield
    finally:
        del policy.encode_reference
        policy.negative_prompt = saved


def make_bank(policy: Any, subjects: Sequence[str], count: int, size: int, seed: int, uncond_fraction: float,
              chunk: int = 32) -> EditBank:
    """``count`` editing examples (:func:`paco.pretrain.views.edit_example`: a random photograph
    of ``subjects`` and one of its operations, drawn from ``default_rng([seed, 2])``) at ``size`` px,
    conditioned by ``policy`` (a :class:`~paco.grpo.policies.QwenImageEditPolicy`: its ``condition``,
    :func:`_batched_conditioning`); a ``uncond_fraction`` share (each example with that probability)
    carries the negative prompt :data:`NEGATIVE_PROMPT` instead of its instruction."""
    from paco.grpo.rewards import SubtaskItem

    rng = np.random.default_rng([seed, 2])
    embeds, uncond, refs, targets = [], [], [], []
    shapes = None
    for start in tqdm(range(0, count, chunk), desc="qwen_image examples", leave=False):
        items, target_images = [], []
        for k in range(start, min(count, start + chunk)):
            subject = subjects[int(rng.integers(len(subjects)))]
            ops = operations_for(subject)
            source, target, instruction = edit_example(subject, ops[int(rng.integers(len(ops)))], size, rng,
                                                       others=subjects)
            uncond.append(bool(rng.random() < uncond_fraction))
            prompt = NEGATIVE_PROMPT if uncond[-1] else instruction
            items.append(SubtaskItem(str(k), prompt, "", 1, 1, (prompt,), to_pil(source)))
            target_images.append(to_pil(target))
        with _batched_conditioning(policy):
            cond = policy.condition(items, size, size)
            targets.append(encode_references(policy, target_images))
        embeds += [cond["prompt_embeds"][i, :int(cond["prompt_mask"][i].sum())].clone() for i in range(len(items))]
        refs.append(cond["image_latents"])
        shapes = cond["img_shapes"]
    return EditBank(embeds, torch.tensor(uncond), torch.cat(refs), torch.cat(targets), shapes)


def _batch_condition(bank: EditBank, index: Sequence[int]) -> Any:
    """The :class:`~paco.grpo.policies.Conditioning` of bank rows ``index``, the text right-padded
    with a zero mask as ``Conditioning.cat`` pads it."""
    from paco.grpo.policies import Conditioning

    texts = [bank.embeds[i] for i in index]
    length = max(t.shape[0] for t in texts)
    embeds = torch.zeros(len(texts), length, texts[0].shape[1])
    mask = torch.zeros(len(texts), length, dtype=torch.long)
    for row, t in enumerate(texts):
        embeds[row, :t.shape[0]] = t
        mask[row, :t.shape[0]] = 1
    rows = {"prompt_embeds": embeds, "prompt_mask": mask, "image_latents": bank.reference[list(index)]}
    return Conditioning(rows, {"img_shapes": bank.img_shapes}, pad={"prompt_embeds": 0.0, "prompt_mask": 0})


def shift_mu(scheduler_config: Any, size: int) -> float:
    """The scheduler's resolution-dependent shift ``mu`` for a ``size`` px square: packed sequence
    length ``(size / 16)^2`` (:func:`paco.grpo.sde.calculate_shift` on the config's
    ``base/max_image_seq_len`` and ``base/max_shift``, as ``QwenImageEditPipeline`` computes it)."""
    from paco.grpo.sde import calculate_shift

    c = scheduler_config
    return calculate_shift((size // 16) ** 2, c["base_image_seq_len"], c["max_image_seq_len"],
                           c["base_shift"], c["max_shift"])


def shifted_logit_normal(batch: int, mu: float, generator: torch.Generator) -> torch.Tensor:
    """``(batch,)`` float32 noise levels ``s = e^mu / (e^mu + 1/u - 1)``, ``u = sigmoid(N(0, 1))``
    (logit-normal, Esser et al. 2024 §3.1; the exponential time shift of diffusers'
    ``FlowMatchEulerDiscreteScheduler.time_shift``), clamped to ``[1e-4, 1]``."""
    u = torch.sigmoid(torch.randn(batch, generator=generator))
    return (math.exp(mu) / (math.exp(mu) + 1.0 / u - 1.0)).clamp(1e-4, 1.0)


def flow_loss(policy: Any, bank: EditBank, index: Sequence[int], s: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The rectified-flow loss (module docstring) of bank rows ``index`` at noise levels ``s``
    ``(B,)`` in (0, 1] with noise ``(B, seq, C)``: ``mean((v - (n - x0))^2)``, ``v`` the policy's
    velocity at ``x_s`` and timestep ``1000 s`` (its timestep convention), true CFG off."""
    x0 = bank.target[list(index)]
    xs = (1.0 - s[:, None, None]) * x0 + s[:, None, None] * noise
    saved, policy.negative_prompt = policy.negative_prompt, None  # one conditional pass, no CFG
    try:
        v = policy.velocity(xs, 1000.0 * s, _batch_condition(bank, index))
    finally:
        policy.negative_prompt = saved
    return ((v.float() - (noise - x0)) ** 2).mean()


def train_transformer(policy: Any, bank: EditBank, recipe: QwenImageEditRecipe) -> list[float]:
    """Train the policy's transformer in place: ``recipe.steps`` AdamW steps (no weight decay; the
    rate warmed up linearly over 5% of the steps, then cosine-decayed to 10%; gradient norm clipped
    at 1) of :func:`flow_loss` on random batches of ``bank``, noise levels from :func:`shifted_logit_normal`; all draws from
    ``torch.Generator().manual_seed(seed)``.

    Returns:
        the loss of every step.
    """
    tr = policy.transformer
    tr.requires_grad_(True)
    tr.train()
    gen = torch.Generator().manual_seed(recipe.seed + 3)
    mu = shift_mu(policy.pipe.scheduler.config, recipe.resolution)
    opt = torch.optim.AdamW(tr.parameters(), lr=recipe.lr, weight_decay=0.0)
    n, warm = len(bank.embeds), max(1, recipe.steps // 20)
    losses = []
    for step in tqdm(range(recipe.steps), desc="qwen_image transformer", leave=False):
        frac = max(0.0, (step - warm) / max(1, recipe.steps - warm))
        scale = min(1.0, (step + 1) / warm) * (0.1 + 0.45 * (1.0 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = recipe.lr * scale
        index = torch.randint(0, n, (recipe.batch,), generator=gen).tolist()
        s = shifted_logit_normal(recipe.batch, mu, gen)
        noise = torch.randn(bank.target[list(index)].shape, generator=gen)
        loss = flow_loss(policy, bank, index, s, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tr.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    tr.requires_grad_(False)
    tr.eval()
    return losses


# -------------------------------------------------------------------------------------------- figures


def load_edit_policy(model_dir: Path, *, negative_prompt: str | None = NEGATIVE_PROMPT) -> Any:
    """``model_dir`` loaded with :func:`paco.grpo.policies.load_policy` as ``qwen_image_edit`` (true
    CFG 4.0 with ``negative_prompt``, reference aspect kept; no LoRA), float32 on CPU."""
    from paco.grpo.policies import load_policy

    settings = SimpleNamespace(guidance_scale=GUIDANCE_SCALE, negative_prompt=negative_prompt, reference_aspect="keep")
    return load_policy("qwen_image_edit", model_dir, None, settings)


def sample_edits(policy: Any, items: Sequence[Any], *, steps: int, seeds: int, size: int = 128, seed: int = 0,
                 batch: int = 4) -> list[list[Any]]:
    """ODE samples of ``items`` as ``final_samples`` makes them (``paco.grpo.final_samples._generate``:
    seed ``k`` of an item draws its noise from ``stable_seed(seed, "final", item id, k)``).

    Returns:
        per item, ``seeds`` PIL images of ``size`` px.
    """
    from paco.grpo.final_samples import _generate

    jobs = [(it, k, (size, size)) for it in items for k in range(seeds)]
    images = _generate(policy, jobs, SimpleNamespace(batch_size=batch, seed=seed, num_steps=steps))
    return [images[i * seeds:(i + 1) * seeds] for i in range(len(items))]


def edit_figures(policy: Any, split: str, recipe: QwenImageEditRecipe) -> tuple[dict[str, Any], list[tuple]]:
    """SSIM figures of the edits stage's ``split`` items (:func:`edit_items`) sampled at 128 px with
    ``eval_steps`` and ``rollout_steps`` ODE steps, ``eval_seeds`` seeds each.

    Returns:
        ``(figures, [(input, first edit, target)])``: ``ssim_to_input`` (``eval_steps``; the goal
        figure), ``ssim_to_input_<rollout_steps>_steps``, ``ssim_to_target`` and, for scale,
        ``target_ssim_to_input`` (what the correct edits score) and per operation.
    """
    from paco.pretrain.quality import edit_ssim

    pairs = edit_items(split)[:recipe.eval_max_items]
    items = [it for it, _ in pairs]
    final = sample_edits(policy, items, steps=recipe.eval_steps, seeds=recipe.eval_seeds)
    rollout = sample_edits(policy, items, steps=recipe.rollout_steps, seeds=recipe.eval_seeds)
    per_op: dict[str, list[float]] = {}
    to_input, to_target, quick, target_input, triplets = [], [], [], [], []
    for (it, target), ims, ims_r in zip(pairs, final, rollout, strict=True):
        scores = [edit_ssim(im, it.reference) for im in ims]
        to_input += scores
        per_op.setdefault(it.prompt_id.split("-", 1)[1], []).extend(scores)
        to_target += [edit_ssim(im, target) for im in ims]
        quick += [edit_ssim(im, it.reference) for im in ims_r]
        target_input.append(edit_ssim(target, it.reference))
        triplets.append((it.reference, ims[0], target))
    r = lambda v: round(float(np.mean(v)), 4)  # noqa: E731
    return {"items": len(items), "samples": len(to_input), "ssim_to_input": r(to_input),
            f"ssim_to_input_{recipe.rollout_steps}_steps": r(quick), "ssim_to_target": r(to_target),
            "target_ssim_to_input": r(target_input), "per_operation": {k: r(v) for k, v in sorted(per_op.items())}}, triplets


# -------------------------------------------------------------------------------------------- build


def _build_base(directory: Path, recipe: QwenImageEditRecipe) -> None:
    """The tiny pipeline tree (:func:`paco.models.tiny.build_tiny`; with ``recipe.transformer``
    overrides, the same builder with them)."""
    from paco.models import tiny

    if not recipe.transformer:
        tiny.build_tiny(MODEL_NAME, directory, recipe.seed)
        return
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    with tiny._quiet():
        tiny._build_qwen_image_edit(directory, recipe.seed, transformer=dict(recipe.transformer))


def _save(module: Any, directory: Path) -> None:
    """``module.save_pretrained(directory)`` without the ``_name_or_path`` that loading recorded in
    its config (the tiny build has none; a path would make the bytes depend on the build folder)."""
    from diffusers.configuration_utils import FrozenDict

    module._internal_dict = FrozenDict({k: v for k, v in module._internal_dict.items() if k != "_name_or_path"})
    module.save_pretrained(directory)


def build(out_root: Path, recipe: QwenImageEditRecipe) -> dict:
    """Build, pretrain and save ``out_root/qwen_image_edit/`` (module docstring) and write its
    ``pretrain.json`` (``recipe`` and figures).

    Args:
        out_root: parent directory (created if missing); an existing ``qwen_image_edit`` in it is
            replaced.
        recipe: the :class:`QwenImageEditRecipe`.

    Returns:
        JSON-able figures: ``steps``, ``seconds`` per phase, ``losses`` (first / last 50-step means),
        ``vae`` (PSNR / SSIM on held-out views), ``edits_test`` / ``edits_train``
        (:func:`edit_figures`), the subjects used.
    """
    out = Path(out_root) / MODEL_NAME
    t0 = time.perf_counter()
    subjects, held = train_subjects(), sorted(held_out_subjects())
    _build_base(out, recipe)
    policy = load_edit_policy(out)
    vae = policy.pipe.vae
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        vae_losses = train_vae(vae, subjects, recipe)
    rng = np.random.default_rng([recipe.seed, 4])
    set_latent_stats(vae, [subject_view(subjects[k % len(subjects)], recipe.resolution, recipe.resolution, rng,
                                        crop_scale=(0.5, 1.0), jitter=0.05) for k in range(recipe.vae_stat_views)])
    erng = np.random.default_rng([recipe.seed, 5])
    view = lambda name: subject_view(name, 128, 128, erng, crop_scale=(0.5, 1.0), jitter=0.05)  # noqa: E731
    vae_fig = {"held_out_views": vae_quality(vae, [view(h) for h in held for _ in range(recipe.vae_eval_views)]),
               "train_views": vae_quality(vae, [view(subjects[k % len(subjects)])
                                                for k in range(len(held) * recipe.vae_eval_views)])}
    _save(vae, out / "vae")
    t_vae = time.perf_counter()
    bank = make_bank(policy, subjects, recipe.examples, recipe.resolution, recipe.seed, recipe.uncond_fraction)
    t_bank = time.perf_counter()
    tr_losses = train_transformer(policy, bank, recipe)
    _save(policy.transformer, out / "transformer")
    t_tr = time.perf_counter()
    policy = load_edit_policy(out)  # what every stage loads
    test, _ = edit_figures(policy, "test", recipe)
    train, _ = edit_figures(policy, "train", recipe)
    mean = lambda v: round(float(np.mean(v)), 5) if len(v) else None  # noqa: E731
    figures = {
        "steps": {"vae": recipe.vae_steps, "transformer": recipe.steps},
        "seconds": {"vae": round(t_vae - t0, 1), "examples": round(t_bank - t_vae, 1),
                    "transformer": round(t_tr - t_bank, 1), "evaluation": round(time.perf_counter() - t_tr, 1)},
        "losses": {"vae_first50": mean(vae_losses[:50]), "vae_last50": mean(vae_losses[-50:]),
                   "flow_first50": mean(tr_losses[:50]), "flow_last50": mean(tr_losses[-50:])},
        "vae": vae_fig, "edits_test": test, "edits_train": train,
        "transformer_parameters": sum(p.numel() for p in policy.transformer.parameters()),
        "train_subjects": subjects, "held_out_subjects": held,
    }
    write_record(out, MODEL_NAME, figures, recipe)
    return figures
