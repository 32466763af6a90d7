"""Flow-GRPO SDE step (eq. 9) and FLUX's shifted schedule, against independent computations."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from paco.grpo.sde import ODE, SdeSettings, calculate_shift, flux_sigmas, sde_step


def _reference(v, x, sigma, sigma_next, a, x_next, sigma_max=0.98):
    """Eq. 9 in float64 numpy, written out from the issue's formulas."""
    v, x, x_next = (np.asarray(t, dtype=np.float64) for t in (v, x, x_next))
    dt = sigma_next - sigma
    s_den = sigma_max if sigma == 1 else sigma
    std_t = a * math.sqrt(sigma / (1 - s_den))
    mean = x * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    std = std_t * math.sqrt(-dt)
    logp = -((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return mean, std, logp.reshape(logp.shape[0], -1).mean(axis=1)


@pytest.mark.parametrize("sigma,sigma_next,a", [(0.8, 0.6, 0.7), (1.0, 0.9, 0.7), (0.3, 0.0, 1.0), (0.5, 0.45, 0.2)])
def test_mean_std_and_log_prob_match_eq9(sigma, sigma_next, a):
    g = torch.Generator().manual_seed(0)
    v = torch.randn(3, 5, 4, generator=g)
    x = torch.randn(3, 5, 4, generator=g)
    x_next = torch.randn(3, 5, 4, generator=g)
    nxt, logp, mean, std = sde_step(v, x, sigma, sigma_next, a, next_latents=x_next)
    ref_mean, ref_std, ref_logp = _reference(v.numpy(), x.numpy(), sigma, sigma_next, a, x_next.numpy())
    assert torch.equal(nxt, x_next)
    assert logp.shape == (3,) and logp.dtype == torch.float32
    assert std.shape == (3, 1, 1)
    # float32 arithmetic: terms of size ~|x| * std_t**2 |dt| / (2 sigma) cancel at sigma = 1
    np.testing.assert_allclose(mean.numpy(), ref_mean, rtol=1e-5, atol=5e-6)
    np.testing.assert_allclose(std.flatten().numpy(), ref_std, rtol=1e-6)
    np.testing.assert_allclose(logp.numpy(), ref_logp, rtol=1e-5, atol=1e-5)


def test_sampled_next_latents_have_the_stated_distribution():
    x = torch.zeros(4000, 8)
    v = torch.ones(4000, 8)
    nxt, _, mean, std = sde_step(v, x, 0.7, 0.5, 0.7, generator=torch.Generator().manual_seed(1))
    resid = (nxt - mean) / std
    assert abs(float(resid.mean())) < 0.01
    assert abs(float(resid.std()) - 1.0) < 0.01


def test_log_prob_of_sampled_step_equals_rescoring_it():
    g = torch.Generator().manual_seed(2)
    v, x = torch.randn(2, 6, 3, generator=g), torch.randn(2, 6, 3, generator=g)
    nxt, logp, _, _ = sde_step(v, x, 0.6, 0.4, 0.7, generator=torch.Generator().manual_seed(3))
    _, logp2, _, _ = sde_step(v, x, 0.6, 0.4, 0.7, next_latents=nxt)
    torch.testing.assert_close(logp, logp2, rtol=0, atol=0)


def test_noise_level_zero_is_exactly_the_euler_ode_step():
    from diffusers import FlowMatchEulerDiscreteScheduler

    g = torch.Generator().manual_seed(4)
    v, x = torch.randn(2, 16, 8, generator=g), torch.randn(2, 16, 8, generator=g)
    sched = FlowMatchEulerDiscreteScheduler()
    sigmas, _ = flux_sigmas(FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), 6, 256)
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    flux_sigmas(sched, 6, 256)
    for i in range(6):
        ode = sched.step(v, sched.timesteps[i], x, return_dict=False)[0]
        nxt, logp, _, std = sde_step(v, x, sigmas[i], sigmas[i + 1], 0.0, generator=torch.Generator().manual_seed(0))
        assert torch.equal(nxt, ode), i
        assert torch.all(std == 0) and torch.all(logp == 0)
        x = ode


def test_per_row_noise_levels_and_deterministic_rows_cannot_be_scored():
    x = torch.zeros(2, 4)
    v = torch.ones(2, 4)
    nxt, logp, mean, std = sde_step(v, x, 0.5, 0.3, torch.tensor([0.0, 0.7]), generator=torch.Generator().manual_seed(0))
    assert float(std[0]) == 0 and float(std[1]) > 0
    assert torch.equal(nxt[0], mean[0]) and float(logp[0]) == 0
    with pytest.raises(ValueError, match="std is 0"):
        sde_step(v, x, 0.5, 0.3, torch.tensor([0.0, 0.7]), next_latents=nxt)


def test_sigma_max_schedule_is_the_schedules_second_sigma():
    """The released flux_pipeline / compute_log_prob pass sigma_max = timesteps[1] / 1000: at the
    first step (sigma = 1) std_t = a * sqrt(1 / (1 - sigma_1))."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    g = torch.Generator().manual_seed(5)
    v, x, x_next = (torch.randn(2, 6, 4, generator=g) for _ in range(3))
    sigmas, timesteps = flux_sigmas(FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), 10, 1024)
    assert float(sigmas[0]) == 1.0
    s1 = float(sigmas[1])
    assert float(torch.tensor(float(timesteps[1]) / 1000, dtype=torch.float32)) == pytest.approx(s1, rel=1e-7)
    _, logp, mean, std = sde_step(v, x, sigmas[0], sigmas[1], 0.7, next_latents=x_next, sigma_max="schedule")
    ref_mean, ref_std, ref_logp = _reference(v.numpy(), x.numpy(), 1.0, s1, 0.7, x_next.numpy(), sigma_max=s1)
    np.testing.assert_allclose(std.flatten().numpy(), ref_std, rtol=1e-6)
    assert float(std[0]) == pytest.approx(0.7 * math.sqrt(1 / (1 - s1)) * math.sqrt(1 - s1), rel=1e-6)
    np.testing.assert_allclose(mean.numpy(), ref_mean, rtol=1e-5, atol=5e-6)
    np.testing.assert_allclose(logp.numpy(), ref_logp, rtol=1e-5, atol=1e-5)
    # identical to passing the second sigma as a fixed number, and different from 0.98
    fixed = sde_step(v, x, sigmas[0], sigmas[1], 0.7, next_latents=x_next, sigma_max=s1)
    assert torch.equal(fixed[1], logp) and torch.equal(fixed[3], std)
    assert not torch.equal(sde_step(v, x, sigmas[0], sigmas[1], 0.7, next_latents=x_next)[3], std)
    # below sigma = 1 sigma_max is not used at all
    later = [sde_step(v, x, sigmas[2], sigmas[3], 0.7, next_latents=x_next, sigma_max=m)[1] for m in ("schedule", 0.5)]
    assert torch.equal(*later)
    # per-row sigmas: only the row at sigma = 1 uses its own sigma_next
    _, _, _, rows = sde_step(v, x, torch.tensor([1.0, 0.8]), torch.tensor([0.9, 0.6]), 0.7, next_latents=x_next,
                             sigma_max="schedule")
    assert float(rows[0]) == pytest.approx(0.7 * math.sqrt(1 / 0.1) * math.sqrt(0.1), rel=1e-6)
    assert float(rows[1]) == pytest.approx(0.7 * math.sqrt(0.8 / 0.2) * math.sqrt(0.2), rel=1e-6)


@pytest.mark.parametrize("sigma_max", ["sched", 1.0, 0.0, True, -0.5])
def test_bad_sigma_max_raises(sigma_max):
    with pytest.raises(ValueError, match="sigma_max must be 'schedule' or a number"):
        sde_step(torch.zeros(1, 2), torch.zeros(1, 2), 1.0, 0.9, 0.7, sigma_max=sigma_max)


@pytest.mark.parametrize("kw,match", [
    (dict(noise_level=-0.1), "noise_level must be a number >= 0"),
    (dict(noise_level=True), "noise_level must be a number >= 0"),
    (dict(noise_level=float("nan")), "noise_level must be a number >= 0"),
    (dict(noise_level=0.7, sigma_max=1.0), "sigma_max must be 'schedule' or a number"),
    (dict(noise_level=0.7, sigma_max="sched"), "sigma_max must be 'schedule' or a number"),
])
def test_sde_settings_are_checked_when_made(kw, match):
    """A run's SDE settings are checked once, where the params become one value, not at every step."""
    with pytest.raises(ValueError, match=match):
        SdeSettings(**kw)


def test_sde_settings_are_one_frozen_value_and_ode_is_noise_level_zero():
    assert ODE == SdeSettings(0.0, "schedule") and SdeSettings(0.7) == SdeSettings(0.7, "schedule")
    assert SdeSettings(0.7, 0.98) != SdeSettings(0.7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ODE.noise_level = 0.7  # type: ignore[misc]
    # sampling with ODE is the deterministic Euler step
    g = torch.Generator().manual_seed(0)
    v, x = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    nxt, logp, _, _ = sde_step(v, x, 0.8, 0.5, ODE.noise_level, sigma_max=ODE.sigma_max)
    assert torch.equal(nxt, x + v * (0.5 - 0.8)) and torch.equal(logp, torch.zeros(2))


@pytest.mark.parametrize("kw,match", [
    (dict(sigma=0.5, sigma_next=0.6), "sigma_next"),
    (dict(sigma=1.2, sigma_next=0.6), "sigma must"),
    (dict(sigma=0.5, sigma_next=0.3, noise_level=-1.0), "noise_level"),
])
def test_bad_arguments_raise(kw, match):
    args = dict(noise_level=0.7) | kw
    with pytest.raises(ValueError, match=match):
        sde_step(torch.zeros(1, 2), torch.zeros(1, 2), **args)


def test_flux_shift_interpolates_mu_and_shifts_sigmas():
    from diffusers import FlowMatchEulerDiscreteScheduler

    assert calculate_shift(256) == pytest.approx(0.5)
    assert calculate_shift(4096) == pytest.approx(1.15)
    assert calculate_shift(1024) == pytest.approx(0.5 + 0.65 * 768 / 3840)
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                            base_image_seq_len=256, max_image_seq_len=4096)
    n, seq = 10, 1024
    sigmas, timesteps = flux_sigmas(sched, n, seq)
    mu = calculate_shift(seq)
    base = np.linspace(1.0, 1.0 / n, n)
    expected = math.exp(mu) / (math.exp(mu) + (1 / base - 1))  # exponential time shift
    np.testing.assert_allclose(sigmas[:-1].numpy(), expected, rtol=1e-6)
    assert float(sigmas[-1]) == 0.0 and sigmas.shape == (n + 1,)
    assert torch.all(sigmas[1:] < sigmas[:-1])
    np.testing.assert_allclose(timesteps.numpy(), 1000 * sigmas[:-1].numpy(), rtol=1e-6)


def test_the_standard_deviation_is_the_correctly_rounded_float32_computation():
    """std = sqrt(s / (1 - s)) * a * sqrt(-dt), each operation rounded once to float32 as IEEE 754
    prescribes (replayed in numpy float32): the same bytes on every host. ``torch.sqrt`` of a
    float32 CPU tensor (MKL's vector math) is one unit in the last place off for about 1 in 6
    inputs and rounds differently on other CPUs (paco.core.host_independent)."""
    rng = np.random.default_rng(3)
    n = 512
    sigma = rng.uniform(0.05, 0.95, n).astype(np.float32)
    sigma_next = (sigma * rng.uniform(0.0, 0.95, n)).astype(np.float32)
    a = rng.uniform(0.1, 1.0, n).astype(np.float32)
    z = torch.zeros(n, 2, 3)
    _, _, _, std = sde_step(z, z, torch.from_numpy(sigma), torch.from_numpy(sigma_next), torch.from_numpy(a),
                            next_latents=z)
    f = np.float32
    dt = sigma_next - sigma
    std_t = np.sqrt(sigma / (f(1) - sigma)) * a
    want = std_t * np.sqrt(-dt)
    assert want.dtype == np.float32
    assert np.array_equal(std.flatten().numpy().view(np.uint32), want.view(np.uint32))
