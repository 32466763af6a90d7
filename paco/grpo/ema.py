"""The exponential moving average (EMA) of the trained LoRA weights (``train.ema``), and putting
other weights into the live LoRA for a ``with`` block (evaluating the EMA or kept weights)."""

from __future__ import annotations

import contextlib

import torch


class LoraEMA:
    """Exponential moving average of the trained LoRA weights (float32 copies).

    After optimizer step ``t`` (the count of finished steps, 1-based), if ``(t + 1) %
    update_every == 0``: ``ema = d_t * ema + (1 - d_t) * w`` with ``d_t = decay``, or with
    ``warmup`` ``d_t = min((1 + t) / (10 + t), decay)`` -- the released code's
    ``EMAModuleWrapper.step`` (``paco_grpo/ema.py``; ``train_flux.py`` calls it with
    ``update_step_interval=8`` after each optimizer step). ``swapped_in(parameters)`` puts the EMA
    weights into the trained adapter for a ``with`` block and restores the live ones after.
    """

    def __init__(self, parameters: dict[str, torch.nn.Parameter], decay: float, *, warmup: bool = False,
                 update_every: int = 1):
        self.decay = float(decay)
        self.warmup = bool(warmup)
        self.update_every = int(update_every)
        self.shadow = {n: p.detach().float().clone() for n, p in parameters.items()}

    def decay_at(self, step: int) -> float:
        """``d_t`` of optimizer step ``t`` (see the class docstring)."""
        return min((1.0 + step) / (10.0 + step), self.decay) if self.warmup else self.decay

    @torch.no_grad()
    def step(self, parameters: dict[str, torch.nn.Parameter], step: int) -> bool:
        """The EMA update after optimizer step ``step`` (1-based); returns whether it updated."""
        if (step + 1) % self.update_every != 0:
            return False
        d = self.decay_at(step)
        for n, p in parameters.items():
            self.shadow[n].mul_(d).add_(p.detach().float(), alpha=1.0 - d)
        return True

    def swapped_in(self, parameters: dict[str, torch.nn.Parameter]):
        """:func:`swapped_weights` with the EMA weights."""
        return swapped_weights(parameters, self.shadow)


@contextlib.contextmanager
def swapped_weights(parameters: dict[str, torch.nn.Parameter], weights: dict[str, torch.Tensor]):
    """Put ``weights`` (name -> tensor) into ``parameters`` for a ``with`` block, restoring after."""
    live = {n: p.detach().clone() for n, p in parameters.items()}
    with torch.no_grad():
        for n, p in parameters.items():
            p.copy_(weights[n].to(p.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for n, p in parameters.items():
                p.copy_(live[n])
