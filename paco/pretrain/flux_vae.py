"""Reconstruction pretraining of the tiny FLUX.1 VAE (``AutoencoderKL``) on views of the subject
photographs, for :mod:`paco.pretrain.flux`.

The VAE is trained as an autoencoder of views and layout grids of the 16 photographs
(:func:`paco.pretrain.views.layout_grid`): loss ``|y - x|_1 + |y - x|_2^2`` (per-element
means over ``[-1, 1]`` pixels) plus ``kl_weight`` times the posterior's KL to N(0, I) per image
element (Kingma & Welling 2014; the L1/L2 + small-KL recipe of the latent-diffusion autoencoders,
Rombach et al. 2022 §3, without their perceptual and adversarial terms). Afterwards the config's
``shift_factor`` / ``scaling_factor`` are set to the mean and ``1 / std`` of the latents (the
posterior's mode) of held-out views, as FLUX.1's VAE config does (diffusers
``AutoencoderKL`` docs: ``z = (z - shift_factor) * scaling_factor`` before the transformer).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from paco.pretrain.views import SUBJECT_NAMES, layout_grid, to_tensor

#: layouts (rows, cols) the VAE's training grids are drawn from: a single view and the T2IS ones
VAE_LAYOUTS: tuple[tuple[int, int], ...] = ((1, 1), (2, 2), (1, 3), (3, 1), (2, 3))


def random_grids(rng: np.random.Generator, count: int, size: int) -> list[np.ndarray]:
    """``count`` square ``size`` px grids, each of one random photograph in a random layout of
    :data:`VAE_LAYOUTS`.

    Returns:
        float32 ``(size, size, 3)`` arrays in [0, 1].
    """
    out = []
    for _ in range(int(count)):
        name = SUBJECT_NAMES[int(rng.integers(len(SUBJECT_NAMES)))]
        rows, cols = VAE_LAYOUTS[int(rng.integers(len(VAE_LAYOUTS)))]
        out.append(layout_grid(name, rows, cols, size, size, rng))
    return out


def train_vae(vae: torch.nn.Module, *, steps: int, batch: int, size: int, lr: float, kl_weight: float,
              seed: int) -> list[float]:
    """Train ``vae`` (an ``AutoencoderKL``) in place for ``steps`` AdamW steps on fresh random
    grids (:func:`random_grids`, drawn from ``default_rng(seed)``), loss as in the module
    docstring, gradient norm clipped at 1.

    Args:
        steps: optimiser steps (>= 0).
        batch: images per step (>= 1).
        size: side (px) of the training images, a multiple of the VAE's scale factor.
        lr: AdamW learning rate (no weight decay), linearly warmed up over the first 5% of steps.
        kl_weight: weight of the per-element KL term.
        seed: seeds torch (posterior samples) and numpy (views).

    Returns:
        the loss of every step (floats).

    Raises:
        ValueError: non-positive ``batch``/``size`` or negative ``steps``.
    """
    if steps < 0 or batch < 1 or size < 8:
        raise ValueError(f"train_vae: need steps >= 0, batch >= 1, size >= 8; got {steps}, {batch}, {size}")
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    vae.requires_grad_(True)
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    warm = max(1, steps // 20)
    losses = []
    for step in tqdm(range(steps), desc="vae", leave=False):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warm)
        x = to_tensor(random_grids(rng, batch, size))
        post = vae.encode(x).latent_dist
        y = vae.decode(post.sample()).sample
        rec = (y - x).abs().mean() + ((y - x) ** 2).mean()
        loss = rec + kl_weight * post.kl().mean() / x[0].numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    vae.requires_grad_(False)
    vae.eval()
    return losses


@torch.no_grad()
def reconstruct(vae: torch.nn.Module, images: Sequence[np.ndarray], chunk: int = 16) -> tuple[np.ndarray, torch.Tensor]:
    """Encode (posterior mode) and decode ``images`` (equal-size ``(H, W, 3)`` [0, 1] arrays).

    Returns:
        ``(reconstructions float32 (N, H, W, 3) in [0, 1], raw latents (N, C, h, w))``.
    """
    recs, lats = [], []
    for i in range(0, len(images), chunk):
        z = vae.encode(to_tensor(images[i:i + chunk])).latent_dist.mode()
        y = vae.decode(z).sample
        recs.append(((y.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1).numpy())
        lats.append(z)
    return np.concatenate(recs), torch.cat(lats)


def vae_quality(vae: torch.nn.Module, images: Sequence[np.ndarray]) -> dict[str, float]:
    """Reconstruction PSNR (dB) and SSIM (RGB, data range 1; ``skimage.metrics``) of ``images``,
    the mean over images, and the latents' mean and std.

    Returns:
        ``{"psnr", "ssim", "latent_mean", "latent_std"}``.
    """
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    recs, lats = reconstruct(vae, images)
    psnr = [peak_signal_noise_ratio(a.astype(np.float64), b.astype(np.float64), data_range=1.0)
            for a, b in zip(images, recs, strict=True)]
    ssim = [structural_similarity(a.astype(np.float64), b.astype(np.float64), data_range=1.0, channel_axis=2)
            for a, b in zip(images, recs, strict=True)]
    return {"psnr": float(np.mean(psnr)), "ssim": float(np.mean(ssim)),
            "latent_mean": float(lats.mean()), "latent_std": float(lats.std())}


def set_latent_scaling(vae: torch.nn.Module, mean: float, std: float) -> None:
    """Write ``shift_factor = mean`` and ``scaling_factor = 1 / std`` into the VAE's config (as
    FLUX.1's VAE config holds them), rounded to 4 decimals.

    Raises:
        ValueError: a non-positive or non-finite ``std``.
    """
    if not np.isfinite(std) or std <= 0:
        raise ValueError(f"latent std must be positive and finite, got {std}")
    vae.register_to_config(shift_factor=round(float(mean), 4), scaling_factor=round(1.0 / float(std), 4))
