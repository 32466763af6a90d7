"""The VAE half of :mod:`paco.pretrain.qwen_image`: reconstruction training of the tiny
``AutoencoderKLQwenImage`` on square random views of the photographs, its held-out quality, and the
per-channel ``latents_mean`` / ``latents_std`` that Qwen-Image's VAE config holds.

Loss ``|y - x|_1 + |y - x|_2^2`` (per-element means over ``[-1, 1]`` pixels) plus ``vae_kl_weight``
times the posterior's mean per-element KL to N(0, I) (Kingma & Welling 2014; the L1/L2 + small-KL
autoencoder of Rombach et al. 2022 §3, without its perceptual and adversarial terms).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from paco.pretrain.views import subject_view, to_tensor


@contextlib.contextmanager
def single_frame_convs() -> Iterator[None]:
    """Run the VAE's causal 3-D convolutions on one-frame inputs as the 2-D convolution they equal.

    ``QwenImageCausalConv3d`` pads ``kt - 1`` zero frames in front of the input (its causal
    padding); on a single frame without a cache (every image here) only the kernel's last time
    slice meets data, so the output is ``conv2d(x, weight[:, :, kt - 1])`` with the same spatial
    padding and stride, and the other slices get zero gradient either way. The same function,
    faster on CPU, as it skips the zero frames (floating-point summation order aside). Other calls are unchanged.
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


def train_vae(vae: torch.nn.Module, subjects: Sequence[str], recipe: Any) -> list[float]:
    """Train ``vae`` (``AutoencoderKLQwenImage``) in place by ``recipe`` (a
    :class:`paco.pretrain.qwen_image.QwenImageEditRecipe`): ``recipe.vae_steps`` AdamW steps (no
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
               recipe: Any, rng: np.random.Generator) -> list[float]:
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
