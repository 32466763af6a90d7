"""The FLUX policy: ODE sampling equals FluxPipeline, SDE transitions re-score exactly, adapters."""

from __future__ import annotations

import pytest
import torch

from paco.models.loading import load_flux_pipeline
from paco.core.params import PolicyLoraParams
from paco.grpo.policy import OLD_ADAPTER, TRAINED_ADAPTER, FluxPolicy, grid_size

PROMPTS = ["a tabby cat on a cushion", "two red kites over a beach"]


@pytest.fixture(scope="module")
def policy(tiny_model_dirs) -> FluxPolicy:
    pipe = load_flux_pipeline(tiny_model_dirs["policy_t2is"])
    return FluxPolicy(pipe, PolicyLoraParams(rank=4, alpha=8), max_sequence_length=32, seed=0)


def _gens(n: int, offset: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(offset + i) for i in range(n)]


def test_noise_level_zero_reproduces_flux_pipeline_exactly(tiny_model_dirs, policy):
    pipe = load_flux_pipeline(tiny_model_dirs["policy_t2is"])
    ref = pipe(prompt=PROMPTS, height=64, width=96, num_inference_steps=5, guidance_scale=3.5, max_sequence_length=32,
               generator=_gens(2), output_type="latent").images
    # LoRA B starts at zero, so the trained adapter is the base model; SDE steps with a = 0
    roll = policy.generate(policy.encode_prompts(PROMPTS), height=64, width=96, num_steps=5, noise_level=0.0,
                         sde_indices=[1, 3], noise_generators=_gens(2))
    assert torch.equal(roll.final_latents, ref.float())


def test_sde_transitions_rescore_to_the_sampled_log_prob(policy):
    emb = policy.encode_prompts(PROMPTS)
    roll = policy.generate(emb, height=64, width=64, num_steps=4, noise_level=0.7, sde_indices=[0, 2],
                         noise_generators=_gens(2), sde_generators=_gens(2, 10))
    assert roll.latents.shape[:3] == (2, 2, 2) and roll.log_probs.shape == (2, 2)
    for j, step in enumerate(roll.sde_indices):
        lp, mean, std = policy.transition_log_prob(roll.latents[:, j, 0], roll.latents[:, j, 1], roll.sigmas[step],
                                                   roll.sigmas[step + 1], roll.timesteps[step], emb, 64, 64, 0.7)
        torch.testing.assert_close(lp, roll.log_probs[:, j], rtol=0, atol=1e-6)
        assert std.shape == (2, 1, 1) and torch.all(std > 0)
    # a row's sample depends only on its own generators, not on the batch
    solo = policy.generate(emb.select([1]), height=64, width=64, num_steps=4, noise_level=0.7, sde_indices=[0, 2],
                         noise_generators=_gens(1, 1), sde_generators=_gens(1, 11))
    torch.testing.assert_close(solo.final_latents[0], roll.final_latents[1], rtol=0, atol=1e-5)


def test_adapters_old_trained_and_reference(policy):
    trained = policy.adapter_parameters(TRAINED_ADAPTER)
    old = policy.adapter_parameters(OLD_ADAPTER)
    assert len(trained) == len(old) > 0
    assert all(p.requires_grad for p in trained.values()) and not any(p.requires_grad for p in old.values())
    emb = policy.encode_prompts(PROMPTS[:1])
    x = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(0))
    ids = policy.latent_ids(1, 64, 64)
    t = torch.tensor([800.0])
    with torch.no_grad():
        base = policy.velocity(x, t, emb, ids)
        b_params = [p for n, p in trained.items() if "lora_B" in n]
        saved = [p.clone() for p in b_params]
        for p in b_params:
            p.add_(0.5)
        moved = policy.velocity(x, t, emb, ids)
        with policy.using(OLD_ADAPTER):
            old_v = policy.velocity(x, t, emb, ids)
        with policy.using(None):
            ref_v = policy.velocity(x, t, emb, ids)
        for p, s in zip(b_params, saved):
            p.copy_(s)
    assert not torch.allclose(moved, base)
    assert torch.equal(old_v, base) and torch.equal(ref_v, base)  # old and reference untouched
    assert all(p.requires_grad for p in trained.values())  # trained adapter active again


def test_lora_targets_must_exist(tiny_model_dirs):
    pipe = load_flux_pipeline(tiny_model_dirs["policy_t2is"])
    with pytest.raises(ValueError, match="no_such_proj"):
        FluxPolicy(pipe, PolicyLoraParams(rank=2, alpha=2, target_modules=["attn.to_q", "no_such_proj"]))


@pytest.mark.parametrize("h,w,res,expected", [(1024, 1024, 512, (512, 512)), (512, 1536, 512, (288, 880)),
                                              (1024, 1536, 128, (112, 160)), (1024, 1024, 8, (16, 16))])
def test_grid_size_keeps_aspect_and_area(h, w, res, expected):
    assert grid_size(h, w, res) == expected
