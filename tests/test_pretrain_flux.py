"""The FLUX.1 family's pretraining (paco.pretrain.flux): recipe checks, the time shift, a
loss that falls, and a tiny build that loads with the project's policy loader and repeats
byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pydantic
import pytest
import torch

from paco.pretrain import flux as F

TINY = dict(vae_steps=2, vae_batch=2, vae_size=32, vae_eval_views=2, t2i_steps=2, t2i_batch=2, t2i_views=1,
            t2i_resolutions=[32], t2i_resolution_weights=[1.0], kontext_steps=2, kontext_batch=2,
            kontext_examples=2, kontext_resolutions=[32], kontext_resolution_weights=[1.0], kontext_identity=0.5,
            evaluate=False)


def test_recipe_refuses_bad_fields():
    with pytest.raises(pydantic.ValidationError):
        F.FluxRecipe(t2i_stepz=3)
    with pytest.raises(pydantic.ValidationError, match="multiples of 16"):
        F.FluxRecipe(t2i_resolutions=[100], t2i_resolution_weights=[1.0])
    with pytest.raises(pydantic.ValidationError, match="one weight each"):
        F.FluxRecipe(kontext_resolutions=[128, 192], kontext_resolution_weights=[1.0])
    with pytest.raises(pydantic.ValidationError):
        F.FluxRecipe(t2i_steps=-1)
    with pytest.raises(pydantic.ValidationError):
        F.FluxRecipe(kontext_identity=1.0)
    with pytest.raises(pydantic.ValidationError):
        F.FluxRecipe(t2i_lr_floor=0.0)
    with pytest.raises(pydantic.ValidationError, match="in_channels must be 4 x"):
        F.FluxRecipe(vae={"latent_channels": 4}, transformer={"in_channels": 64})
    with pytest.raises(pydantic.ValidationError, match="latent_channels must be a positive integer"):
        F.FluxRecipe(vae={"latent_channels": 0})


def test_transformer_input_follows_the_vae_latent():
    # FLUX packs 2x2 latent pixels into one token: in_channels = 4 x latent_channels
    assert F.FluxRecipe(vae={}, transformer={}).overrides() == ({"in_channels": 64}, {})
    transformer, vae = F.FluxRecipe(vae={"latent_channels": 8}, transformer={"num_layers": 2}).overrides()
    assert transformer == {"num_layers": 2, "in_channels": 32} and vae == {"latent_channels": 8}
    assert F.FluxRecipe(transformer={}).overrides() == ({"in_channels": 16}, {"latent_channels": 4})


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    lrs = [F._lr_at(k, 100, 1.0, 0.1) for k in range(100)]
    assert lrs[0] == pytest.approx(0.2) and max(lrs) == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(F._lr_at(k, 100, 1.0, 1.0) == pytest.approx(1.0) for k in range(5, 100))


def test_time_shift_matches_flux_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    from paco.models.tiny import FLUX_SCHEDULER_CONFIG

    u = torch.tensor([0.1, 0.5, 0.9])
    assert torch.allclose(F.shifted_logit_normal(u, 0.0), u)
    sched = FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER_CONFIG)
    mu = 0.7
    want = torch.tensor([sched.time_shift(mu, 1.0, float(x)) for x in u], dtype=torch.float32)
    assert torch.allclose(F.shifted_logit_normal(u, mu), want, atol=1e-6)


def test_splits_match_the_stages():
    train, held_out = F.edit_split()
    assert held_out == ["coffee", "grace_hopper"] and not set(train) & set(held_out) and len(train) == 14
    prompts = F.t2is_prompts(F.FluxRecipe())
    assert len(prompts) == 30 and sum(p["split"] == "test" for p in prompts) == 8
    assert "greyscale" not in F.edit_operations("moon") and len(F.edit_operations("cat")) == 7


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    out = tmp_path_factory.mktemp("pretrained")
    figures = F.build(out, F.FluxRecipe(**TINY))
    return out, figures


def _weights(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*.safetensors"))}


def test_build_writes_loadable_directories(tiny_build):
    from paco.grpo.policies import load_policy

    out, figures = tiny_build
    for name, cls in (("flux", "FluxPipeline"), ("flux_kontext", "FluxKontextPipeline")):
        d = out / name
        assert json.loads((d / "model_index.json").read_text())["_class_name"] == cls
        meta = json.loads((d / "pretrain.json").read_text())
        assert meta["recipe"]["t2i_steps"] == 2 and meta["figures"]["flux"]["steps"] == 2
    assert (out / "flux" / "vae" / "diffusion_pytorch_model.safetensors").read_bytes() == (
        out / "flux_kontext" / "vae" / "diffusion_pytorch_model.safetensors").read_bytes()
    assert figures["vae"]["steps"] == 2 and figures["flux_kontext"]["steps"] == 2
    settings = F._settings(3.5, F.FluxRecipe())
    policy = load_policy("flux_kontext", out / "flux_kontext", None, settings)
    cfg = policy.pipe.vae.config
    assert cfg.scaling_factor == figures["vae"]["scaling_factor"] and cfg.shift_factor == figures["vae"]["shift_factor"]
    assert cfg.latent_channels == 4 and policy.transformer.config.in_channels == 16
    t2i = load_policy("flux", out / "flux", None, settings)  # 4 latent channels end to end: sample and decode
    images = F.sample(t2i, [F._Item("p", "a photo of a cat")], 32, 48, num_steps=2, seeds=2, seed=0)[0]
    assert [im.size for im in images] == [(48, 32)] * 2 and images[0].tobytes() != images[1].tobytes()


def test_same_recipe_same_bytes(tiny_build, tmp_path):
    out, _ = tiny_build
    F.build(tmp_path, F.FluxRecipe(**TINY))
    for name in ("flux", "flux_kontext"):
        assert _weights(tmp_path / name) == _weights(out / name)


def test_velocity_loss_falls_on_a_fixed_batch(tiny_build):
    from paco.grpo.policies import load_policy

    out, _ = tiny_build
    policy = load_policy("flux", out / "flux", None, F._settings(3.5, F.FluxRecipe()))
    prompts = F.t2is_prompts(F.FluxRecipe())[:2]
    recipe = F.FluxRecipe(t2i_views=2, t2i_resolutions=[32], t2i_resolution_weights=[1.0])
    buckets = F.t2i_buckets(policy, prompts, recipe, np.random.default_rng(0))
    losses = F.train_velocity(policy, buckets, steps=60, batch=4, lr=3e-3, seed=0, desc="test")
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10])
    assert not any(p.requires_grad for p in policy.transformer.parameters())


def test_kontext_identity_bucket_targets_the_input(tiny_build):
    from paco.grpo.policies import load_policy

    out, _ = tiny_build
    recipe = F.FluxRecipe(**TINY)
    policy = load_policy("flux_kontext", out / "flux_kontext", None, F._settings(2.5, recipe))
    edit, same = F.kontext_buckets(policy, recipe, np.random.default_rng(0))
    assert edit.weight == pytest.approx(0.5) and same.weight == pytest.approx(0.5)
    assert same.x0.shape == edit.x0.shape and not torch.allclose(same.x0, edit.x0)
    assert len(F.kontext_buckets(policy, F.FluxRecipe(**{**TINY, "kontext_identity": 0.0}),
                                 np.random.default_rng(0))) == 1


def test_t2i_composites_take_the_recipes_view_settings(tiny_build, monkeypatch):
    from paco.grpo.policies import load_policy
    from paco.pretrain import views

    out, _ = tiny_build
    policy = load_policy("flux", out / "flux", None, F._settings(3.5, F.FluxRecipe()))
    seen = []

    def recording(*args, **kw):
        seen.append(kw)
        return views.layout_grid(*args, **kw)

    monkeypatch.setattr(F, "layout_grid", recording)
    recipe = F.FluxRecipe(t2i_views=1, t2i_resolutions=[32], t2i_resolution_weights=[1.0],
                          t2i_crop_scale=(0.5, 0.6), t2i_jitter=0.2, t2i_flip=0.25)
    F.t2i_buckets(policy, F.t2is_prompts(recipe)[:2], recipe, np.random.default_rng(0))
    assert seen == [dict(crop_scale=(0.5, 0.6), jitter=0.2, flip=0.25)] * 2
    default = F.FluxRecipe()  # the shipped recipe: mild crops and jitter, no flips
    assert (default.t2i_crop_scale, default.t2i_jitter, default.t2i_flip) == ((0.8, 1.0), 0.05, 0.0)
    with pytest.raises(pydantic.ValidationError, match="t2i_crop_scale"):
        F.FluxRecipe(t2i_crop_scale=(0.9, 0.5))
    with pytest.raises(pydantic.ValidationError):
        F.FluxRecipe(t2i_flip=1.5)


def test_a_views_flip_probability_keeps_the_random_stream():
    from paco.pretrain.views import subject_view

    kept, flipped = np.random.default_rng(3), np.random.default_rng(3)
    a = subject_view("horse", 40, 24, kept, flip=0.0)
    b = subject_view("horse", 40, 24, flipped, flip=1.0)
    np.testing.assert_allclose(b, a[:, ::-1], atol=1e-6)  # the same crop and jitter, mirrored
    assert kept.random() == flipped.random()  # one draw for the flip either way
    # the default (probability 1/2) is the stream the other builders were trained with
    np.testing.assert_array_equal(subject_view("horse", 40, 24, np.random.default_rng(3)),
                                  a if np.random.default_rng(3).random() >= 0.5 else a[:, ::-1])
