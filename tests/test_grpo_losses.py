"""PaCo-GRPO's loss (paco.grpo.losses: the clipped surrogate and the KL to the reference, by hand)
and the EMA of the LoRA (paco.grpo.ema: the released code's warm-up and cadence, swapping weights
in and out)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paco.grpo.ema import LoraEMA, swapped_weights
from paco.grpo.losses import clipped_surrogate, gaussian_mean_kl


def test_clipped_surrogate_by_hand():
    ratio = torch.tensor([1.0, 1.5, 0.5, 1.05, 0.97, 0.5, 1.5])
    logp = torch.log(ratio)
    adv = torch.tensor([2.0, 1.0, 1.0, -1.0, -2.0, -1.0, -1.0])
    loss, r = clipped_surrogate(logp, torch.zeros(7), adv, clip_range=0.1)
    torch.testing.assert_close(r, ratio)
    # max(-A r, -A clip(r, 0.9, 1.1)) element by element; the last two hit the lower / upper
    # bound with A < 0 (the clipped branch wins at 0.5, the unclipped one at 1.5)
    expected = torch.tensor([-2.0, max(-1.5, -1.1), max(-0.5, -0.9), max(1.05, 1.05), max(1.94, 1.94),
                             max(0.5, 0.9), max(1.5, 1.1)])
    torch.testing.assert_close(loss, expected)


def test_clipped_surrogate_gradient_vanishes_outside_the_trust_region():
    logp = torch.log(torch.tensor([1.5, 1.0])).requires_grad_(True)
    loss, _ = clipped_surrogate(logp, torch.zeros(2), torch.tensor([1.0, 1.0]), clip_range=0.1)
    loss.sum().backward()
    assert logp.grad[0] == 0  # ratio 1.5 > 1.1 with A > 0: clipped, no gradient
    assert logp.grad[1] == pytest.approx(-1.0)  # ratio 1: d(-A r)/d logp = -A r


def test_gaussian_mean_kl_by_hand():
    mean = torch.tensor([[[1.0, 2.0]], [[0.0, 0.0]]])
    ref = torch.tensor([[[0.0, 0.0]], [[0.5, -0.5]]])
    std = torch.tensor([[[2.0]], [[0.5]]])
    kl = gaussian_mean_kl(mean, ref, std)
    torch.testing.assert_close(kl, torch.tensor([(1 + 4) / 2 / (2 * 4), (0.25 + 0.25) / 2 / (2 * 0.25)]))


def test_ema_follows_the_reference_warmup_and_cadence():
    """``EMAModuleWrapper.step`` of the released code: d_t = min((1 + t) / (10 + t), decay), an
    update after step t when (t + 1) % every == 0; computed here independently in float64."""
    w = {"a": torch.nn.Parameter(torch.tensor([1.0, -2.0]))}
    ema = LoraEMA(w, 0.9, warmup=True, update_every=3)
    ref = np.array([1.0, -2.0])
    updated = []
    for t in range(1, 13):
        with torch.no_grad():
            w["a"].add_(0.5)
        if (t + 1) % 3 == 0:
            d = min((1 + t) / (10 + t), 0.9)
            ref = d * ref + (1 - d) * w["a"].detach().double().numpy()
        updated.append(ema.step(w, t))
    assert updated == [(t + 1) % 3 == 0 for t in range(1, 13)]
    np.testing.assert_allclose(ema.shadow["a"].double().numpy(), ref, rtol=1e-6)
    assert [LoraEMA(w, 0.9, warmup=True).decay_at(t) for t in (0, 1, 80, 1000)] == [0.1, 2 / 11, 0.9, 0.9]
    assert LoraEMA(w, 0.9).decay_at(1) == 0.9  # no warm-up: the fixed decay


def test_swapped_weights_are_live_only_inside_the_block():
    w = {"a": torch.nn.Parameter(torch.tensor([1.0, -2.0]))}
    ema = LoraEMA(w, 0.5)
    with torch.no_grad():
        w["a"].add_(1.0)
    ema.step(w, 1)  # shadow = 0.5 * [1, -2] + 0.5 * [2, -1]
    with ema.swapped_in(w):
        torch.testing.assert_close(w["a"].detach(), torch.tensor([1.5, -1.5]))
    torch.testing.assert_close(w["a"].detach(), torch.tensor([2.0, -1.0]))
    with pytest.raises(RuntimeError), swapped_weights(w, {"a": torch.zeros(2, dtype=torch.float64)}):
        assert w["a"].dtype == torch.float32 and not w["a"].detach().any()
        raise RuntimeError
    torch.testing.assert_close(w["a"].detach(), torch.tensor([2.0, -1.0]))  # restored after an error too
