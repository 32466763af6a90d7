"""Flow-matching sampling steps for Flow-GRPO: the SDE step with its log-prob, and FLUX's
resolution-shifted noise schedule.

Notation (Flow-GRPO, Liu et al. 2025, eq. 9; PaCo-RL §4 uses it unchanged): ``x`` is the latent
at noise level ``sigma`` (``sigma = 1`` is pure noise, ``0`` the clean image), ``v`` the
predicted velocity, ``sigma'`` the next (lower) noise level, ``dt = sigma' - sigma < 0`` and
``a`` the noise level parameter. The reverse-time SDE discretised with Euler-Maruyama gives::

    std_t = a * sqrt(sigma / (1 - sigma))            (sigma = 1 -> sigma_max in the denominator, below)
    mean  = x * (1 + std_t**2 / (2 sigma) * dt) + v * (1 + std_t**2 (1 - sigma) / (2 sigma)) * dt
    x'    = mean + std_t * sqrt(-dt) * eps,  eps ~ N(0, I)

so ``x'`` is Gaussian with mean ``mean`` and standard deviation ``std = std_t * sqrt(-dt)``.
With ``a = 0`` this is exactly the deterministic Euler (ODE) step ``x' = x + v * dt`` that
diffusers' ``FlowMatchEulerDiscreteScheduler.step`` takes.

At ``sigma = 1`` (the first step of FLUX's schedule, which starts at exactly 1) ``1 - sigma`` is
0, so ``sigma_max`` stands in for ``sigma`` there. The released code passes the schedule's second
sigma: ``sigma_max=timesteps[1].item() / 1000`` when sampling (``flux_pipeline`` in
``PaCo-GRPO/paco_grpo/diffusers_patch/flux_pipeline.py``) and ``timestep_max = timesteps[:, 1]``
(divided by 1000) when re-scoring (``compute_log_prob``, same file), into
``denoising_sde_step_with_logprob`` (``sde_denoising_step.py``), whose own default is 0.98
(Flow-GRPO's). ``sigma_max="schedule"`` reproduces that: a step from ``sigma = 1`` is the
schedule's first, so its ``sigma_next`` *is* the second sigma and is used (and 0.98 is never
involved); a number keeps a fixed ``sigma_max``. Only steps from ``sigma = 1`` are affected (with
the paper's ``sde_indices = [1]`` the value is never used). In a one-step schedule (where the
released code fails on ``timesteps[1]``) the second sigma is the final 0, so ``std_t = a``.

The log-prob is the Gaussian log-density of ``x'`` averaged (not summed) over all non-batch
elements, as in the reference implementation (``sde_denoising_step.py`` of X-GenGroup/PaCo-RL,
itself from Flow-GRPO), in float32 whatever the input dtype (bf16 overflows in the mean).

A run's ``a`` and ``sigma_max`` travel together as one :class:`SdeSettings`, made once from the
params (``grpo.<subtask>.rollout``) and recorded on every sampled trajectory, so the log-prob a
transition is re-scored with in training uses the very settings it was sampled with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from paco.core import host_independent

#: ``log(sqrt(2 pi))``, the Gaussian normaliser per element.
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def _check_sigma_max(sigma_max: Any) -> None:
    """Raises ValueError unless ``sigma_max`` is ``"schedule"`` or a number in ``(0, 1)``."""
    if isinstance(sigma_max, str):
        ok = sigma_max == "schedule"
    else:
        ok = not isinstance(sigma_max, bool) and 0.0 < float(sigma_max) < 1.0
    if not ok:
        raise ValueError(f"sigma_max must be 'schedule' or a number in (0, 1), got {sigma_max!r}")


@dataclass(frozen=True)
class SdeSettings:
    """The settings of a run's SDE steps, shared by sampling and by re-scoring a kept transition.

    Attributes:
        noise_level: ``a >= 0`` of the SDE steps (paper 0.7; ``0``: every step is the ODE step).
        sigma_max: what replaces ``sigma`` in ``1 - sigma`` at ``sigma = 1``: ``"schedule"`` (the
            released code: the schedule's second sigma) or a number in ``(0, 1)`` (Flow-GRPO's 0.98);
            see :func:`sde_step`.

    Raises:
        ValueError: a negative noise level or a ``sigma_max`` neither ``"schedule"`` nor in ``(0, 1)``.
    """

    noise_level: float
    sigma_max: float | Literal["schedule"] = "schedule"

    def __post_init__(self) -> None:
        if isinstance(self.noise_level, bool) or not float(self.noise_level) >= 0.0:
            raise ValueError(f"noise_level must be a number >= 0, got {self.noise_level!r}")
        _check_sigma_max(self.sigma_max)


#: deterministic sampling (evaluation, final samples): noise level 0, every step the ODE step
ODE = SdeSettings(noise_level=0.0)


def _per_row(value: Any, like: torch.Tensor, name: str) -> torch.Tensor:
    """A scalar, a ``(batch,)`` tensor or a sequence -> float32 ``(batch, 1, ..., 1)``."""
    t = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if t.ndim == 0:
        t = t.expand(like.shape[0])
    if t.ndim != 1 or t.shape[0] != like.shape[0]:
        raise ValueError(f"{name} must be a scalar or have shape ({like.shape[0]},), got {tuple(t.shape)}")
    return t.reshape(-1, *([1] * (like.ndim - 1)))


def sde_step(
    velocity: torch.Tensor,
    latents: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    noise_level: float | torch.Tensor,
    next_latents: torch.Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    sigma_max: float | Literal["schedule"] = 0.98,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Flow-GRPO SDE step (eq. 9) from ``sigma`` to ``sigma_next``, sampled or scored.

    Args:
        velocity: ``(batch, ...)`` predicted velocity ``v(x, sigma)`` (any float dtype).
        latents: ``(batch, ...)`` the current latent ``x``, same shape as ``velocity``.
        sigma: current noise level in ``(0, 1]``: a scalar or ``(batch,)``.
        sigma_next: next noise level in ``[0, sigma)``: a scalar or ``(batch,)``.
        noise_level: ``a >= 0``, a scalar or ``(batch,)`` (paper: 0.7). ``0`` gives the ODE step.
        next_latents: if given, score this transition (``x'`` is not sampled, the log-prob is of
            ``next_latents``); ``None`` samples ``x'``.
        generator: torch generator(s) for ``eps`` when sampling (a list gives one per row,
            drawn as ``diffusers.utils.torch_utils.randn_tensor`` does).
        sigma_max: replaces ``sigma`` in ``1 - sigma`` where ``sigma == 1``: a number in
            ``(0, 1)`` (Flow-GRPO's default 0.98), or ``"schedule"``: the schedule's second sigma,
            which for a step from ``sigma = 1`` is that row's ``sigma_next`` (the released code's
            ``timesteps[1] / 1000``, see the module docstring).

    Returns:
        ``(next_latents, log_prob, mean, std)``: ``next_latents`` float32 ``(batch, ...)`` (the
        sampled ``x'``, or the given one cast to float32); ``log_prob`` float32 ``(batch,)``, the
        mean over non-batch elements of the Gaussian log-density of ``x'``; ``mean`` float32
        ``(batch, ...)``; ``std`` float32 ``(batch, 1, ..., 1)`` = ``std_t * sqrt(-dt)``.
        Rows with ``std == 0`` (noise level 0) are deterministic: their ``x'`` is ``mean``
        exactly and their ``log_prob`` is 0 (a Dirac step carries no log-prob term; never train
        on it).

    Raises:
        ValueError: shape mismatch, ``sigma`` outside ``(0, 1]``, ``sigma_next`` not in
            ``[0, sigma)``, a negative noise level, ``sigma_max`` neither ``"schedule"`` nor a
            number in ``(0, 1)``, or scoring
            (``next_latents`` given) a row whose ``std`` is 0.
    """
    if velocity.shape != latents.shape:
        raise ValueError(f"velocity {tuple(velocity.shape)} and latents {tuple(latents.shape)} differ")
    if next_latents is not None and next_latents.shape != latents.shape:
        raise ValueError(f"next_latents {tuple(next_latents.shape)} and latents {tuple(latents.shape)} differ")
    _check_sigma_max(sigma_max)
    from_schedule = isinstance(sigma_max, str)
    v = velocity.float()
    x = latents.float()
    s = _per_row(sigma, x, "sigma")
    s_next = _per_row(sigma_next, x, "sigma_next")
    a = _per_row(noise_level, x, "noise_level")
    if bool(((s <= 0) | (s > 1)).any()):
        raise ValueError("sigma must be in (0, 1]")
    if bool(((s_next < 0) | (s_next >= s)).any()):
        raise ValueError("sigma_next must be in [0, sigma)")
    if bool((a < 0).any()):
        raise ValueError("noise_level must be >= 0")

    dt = s_next - s  # negative
    at_one = s_next if from_schedule else torch.full_like(s, float(sigma_max))
    denom = 1 - torch.where(s == 1, at_one, s)
    std_t = host_independent.sqrt(s / denom) * a  # correctly rounded: torch.sqrt's CPU bytes depend on the host
    mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    std = std_t * host_independent.sqrt(-dt)
    deterministic = (std == 0).reshape(-1)

    if next_latents is None:
        if bool(deterministic.all()):
            nxt = mean  # the ODE step; no noise is drawn (generators are not advanced)
        else:
            from diffusers.utils.torch_utils import randn_tensor

            eps = randn_tensor(x.shape, generator=generator, device=x.device, dtype=torch.float32)
            nxt = mean + std * eps
    else:
        if bool(deterministic.any()):
            raise ValueError("cannot score a transition whose std is 0 (noise level 0 is a deterministic step)")
        nxt = next_latents.float()

    safe_std = torch.where(std == 0, torch.ones_like(std), std)
    log_prob = -((nxt.detach() - mean) ** 2) / (2 * safe_std**2) - torch.log(safe_std) - _LOG_SQRT_2PI
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    log_prob = torch.where(deterministic, torch.zeros_like(log_prob), log_prob)
    return nxt, log_prob, mean, std


def calculate_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096,
                    base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """FLUX's resolution-dependent shift ``mu``: linear in the packed image token count, from
    ``base_shift`` at ``base_seq_len`` tokens to ``max_shift`` at ``max_seq_len`` (FLUX.1 config:
    256 -> 0.5, 4096 -> 1.15; a 512 px image is 1024 tokens, 1024 px is 4096)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + base_shift - slope * base_seq_len


def flux_sigmas(scheduler: Any, num_steps: int, image_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The noise schedule FluxPipeline uses, set on ``scheduler`` and returned.

    Sigmas ``linspace(1, 1/N, N)`` are time-shifted by the scheduler with
    ``mu = calculate_shift(image_seq_len, ...)`` from its config (exponential shift:
    ``exp(mu) / (exp(mu) + 1/sigma - 1)``), and a final 0 is appended.

    Args:
        scheduler: a ``FlowMatchEulerDiscreteScheduler`` with ``use_dynamic_shifting`` (FLUX's).
        num_steps: ``N >= 1``.
        image_seq_len: packed image tokens, ``(H / 16) * (W / 16)`` for FLUX.

    Returns:
        ``(sigmas, timesteps)``: float32 ``(N + 1,)`` sigmas from ~1 down to 0 (strictly
        decreasing), and the ``(N,)`` timesteps ``1000 * sigma`` the transformer is conditioned
        on (divided by 1000 again, as FluxPipeline does).
    """
    import numpy as np

    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    cfg = scheduler.config
    mu = calculate_shift(
        image_seq_len,
        cfg.get("base_image_seq_len", 256),
        cfg.get("max_image_seq_len", 4096),
        cfg.get("base_shift", 0.5),
        cfg.get("max_shift", 1.15),
    )
    sigmas = np.linspace(1.0, 1.0 / num_steps, num_steps)
    scheduler.set_timesteps(sigmas=sigmas, mu=mu, device="cpu")
    return scheduler.sigmas.float().clone(), scheduler.timesteps.float().clone()
