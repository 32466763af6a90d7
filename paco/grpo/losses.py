"""The PaCo-GRPO policy loss: the PPO/GRPO clipped surrogate and the KL of a transition to the
reference policy (Flow-GRPO eq. 7; PaCo-RL §4).

Per transition (one SDE step of one trajectory)::

    ratio = exp(logp_theta - logp_old)
    loss  = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)) + beta * KL
    KL    = mean over elements of (mu_theta - mu_ref)**2 / (2 std**2)

``std`` is the transition's std ``std_t * sqrt(-dt)`` (:mod:`paco.grpo.sde`), so ``KL`` is the
exact KL between the two Gaussians per element; the reference code (``compute_ppo_loss`` of
X-GenGroup/PaCo-RL's ``train_flux.py``) divides by ``2 std_t**2 + 1e-7`` instead, a ``-dt`` times
smaller value, which only rescales ``beta``.
"""

from __future__ import annotations

import torch


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
