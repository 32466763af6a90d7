"""Pretraining of the tiny Qwen-Image-Edit policy (paco.pretrain.qwen_image): the exact
VAE shortcuts, the flow objective, the saved directory, determinism and recipe validation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pydantic
import pytest
import torch

from paco.pretrain import qwen_image as Q

TINY = dict(vae_steps=2, vae_batch=2, vae_size=32, vae_stat_views=4, vae_eval_views=1, steps=3, batch=4,
            examples=6, eval_seeds=1, eval_steps=2, rollout_steps=2, eval_max_items=2)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    from paco.models.tiny import build_tiny

    return build_tiny("qwen_image_edit", tmp_path_factory.mktemp("qwen") / "base", 0)


@pytest.fixture(scope="module")
def policy(base_dir):
    torch.set_num_threads(1)
    return Q.load_edit_policy(base_dir)


def test_recipe_refuses_bad_fields():
    with pytest.raises(pydantic.ValidationError):
        Q.QwenImageEditRecipe(bogus=1)
    with pytest.raises(pydantic.ValidationError):
        Q.QwenImageEditRecipe(resolution=120)
    with pytest.raises(pydantic.ValidationError):
        Q.QwenImageEditRecipe(vae_crop_scale=(0.8, 0.2))
    with pytest.raises(pydantic.ValidationError):
        Q.QwenImageEditRecipe(uncond_fraction=1.0)
    with pytest.raises(pydantic.ValidationError):
        Q.QwenImageEditRecipe(identity=1.0)
    with pytest.raises(pydantic.ValidationError, match="z_dim"):
        Q.QwenImageEditRecipe(vae={"z_dim": 0})
    with pytest.raises(pydantic.ValidationError, match="in_channels must be 16"):
        Q.QwenImageEditRecipe(vae={"z_dim": 4}, transformer={"in_channels": 64})
    with pytest.raises(pydantic.ValidationError, match="out_channels must be 16"):
        Q.QwenImageEditRecipe(vae={}, transformer={"out_channels": 4})


def test_overrides_follow_the_latent_channels():
    transformer, vae = Q.QwenImageEditRecipe(vae={"z_dim": 4}, transformer={"num_layers": 1}).overrides()
    assert transformer == {"num_layers": 1, "in_channels": 16, "out_channels": 4}
    assert vae == {"z_dim": 4, "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4}
    assert Q.QwenImageEditRecipe(vae={}, transformer={"num_layers": 1}).overrides() == ({"num_layers": 1}, {})


def test_held_out_split():
    assert Q.held_out_subjects() == {"coffee", "grace_hopper"}
    assert not set(Q.train_subjects()) & Q.held_out_subjects()
    assert "greyscale" not in Q.operations_for("moon") and len(Q.operations_for("cat")) == 7


def test_single_frame_convs_is_the_same_vae(policy):
    vae = policy.pipe.vae
    x = torch.rand(2, 3, 1, 32, 32) * 2 - 1
    with torch.no_grad():
        ref = vae.decode(vae.encode(x).latent_dist.mode()).sample
        with Q.single_frame_convs():
            fast = vae.decode(vae.encode(x).latent_dist.mode()).sample
    assert torch.allclose(ref, fast, atol=1e-5)


def test_batched_references_match_the_policy(policy):
    from paco.pretrain.views import subject_view, to_pil

    rng = np.random.default_rng(0)
    images = [to_pil(subject_view("cat", 32, 32, rng)) for _ in range(3)]
    assert torch.allclose(Q.encode_references(policy, images), policy.encode_reference(images), atol=1e-5)


def test_shifted_timesteps():
    gen = torch.Generator().manual_seed(0)
    s = Q.shifted_logit_normal(4096, 0.5, gen)
    assert s.min() > 0 and s.max() <= 1 and s.mean() > 0.5  # e^mu > 1 shifts toward noise


def test_flow_loss_decreases_on_a_fixed_batch(policy):
    bank = Q.make_bank(policy, Q.train_subjects(), 4, 32, 0, 0.5, chunk=4)
    assert len(bank.embeds) == 4 and bank.target.shape == bank.reference.shape == (4, 4, 64)
    tr = policy.transformer
    state = {k: v.clone() for k, v in tr.state_dict().items()}
    tr.requires_grad_(True)
    gen = torch.Generator().manual_seed(0)
    s = Q.shifted_logit_normal(4, 0.5, gen)
    noise = torch.randn(bank.target.shape, generator=gen)
    opt = torch.optim.Adam(tr.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = Q.flow_loss(policy, bank, [0, 1, 2, 3], s, noise)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    tr.requires_grad_(False)
    tr.load_state_dict(state)
    assert losses[-1] < 0.8 * losses[0]
    assert policy.negative_prompt == Q.NEGATIVE_PROMPT  # restored after the conditional pass


def test_identity_rows_copy_their_input(policy):
    bank = Q.make_bank(policy, Q.train_subjects(), 3, 32, 0, 0.0, chunk=2, identity=True)
    plain = Q.make_bank(policy, Q.train_subjects(), 3, 32, 0, 0.0, chunk=2)
    assert bank.identity.tolist() == [False] * 3 + [True] * 3 and not plain.identity.any()
    assert torch.equal(bank.reference[:3], plain.reference) and torch.equal(bank.target[:3], plain.target)
    assert torch.equal(bank.reference[3:], plain.reference) and torch.equal(bank.target[3:], plain.reference)
    from paco.grpo.rewards import SubtaskItem
    from paco.pretrain.views import to_pil

    grey = to_pil(np.full((32, 32, 3), 0.5, dtype=np.float32))
    same = policy.condition([SubtaskItem("x", Q.IDENTITY_INSTRUCTION, "", 1, 1, (Q.IDENTITY_INSTRUCTION,), grey)], 32, 32)
    # the identity instruction's valid tokens (the 32 px image's tokens are as many for any photograph)
    assert [e.shape[0] for e in bank.embeds[3:]] == [int(same["prompt_mask"][0].sum())] * 3
    recipe = Q.QwenImageEditRecipe(batch=4000, identity=0.75)
    rows = torch.tensor(Q._draw_rows(bank, recipe, torch.Generator().manual_seed(0)))
    assert abs(float((rows >= 3).float().mean()) - 0.75) < 0.03 and rows.min() >= 0 and rows.max() <= 5
    gen = torch.Generator().manual_seed(0)
    assert Q._draw_rows(plain, recipe, gen) == torch.randint(0, 3, (4000,), generator=torch.Generator().manual_seed(0)).tolist()


def test_build_layout_loads_and_is_deterministic(tmp_path, base_dir):
    recipe = Q.QwenImageEditRecipe(**TINY)
    figures = Q.build(tmp_path / "a", recipe)
    out = tmp_path / "a" / Q.MODEL_NAME
    files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert files == {p.relative_to(base_dir).as_posix() for p in base_dir.rglob("*") if p.is_file()} | {"pretrain.json"}
    index = json.loads((out / "model_index.json").read_text())
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    vae_config = json.loads((out / "vae" / "config.json").read_text())
    # the default recipe's 4-channel VAE under the one-head transformer (Q.PRETRAINED_*)
    assert vae_config["z_dim"] == 4 and len(vae_config["latents_mean"]) == len(vae_config["latents_std"]) == 4
    assert vae_config["latents_std"] != [1.0] * 4  # set from the trained latents, not the placeholders
    tr = json.loads((out / "transformer" / "config.json").read_text())
    assert (tr["in_channels"], tr["out_channels"], tr["num_attention_heads"], tr["axes_dims_rope"]) == (16, 4, 1, [8, 12, 12])
    info = json.loads((out / "pretrain.json").read_text())
    assert info["recipe"]["steps"] == 3 and 0 < info["figures"]["edits_test"]["ssim_to_input"] <= 1
    assert figures["edits_test"]["items"] == 2 and figures["vae"]["held_out_views"]["psnr"] > 0
    policy = Q.load_edit_policy(out)  # the project loader takes it
    assert policy.initial_latents(1, 128, 128, [torch.Generator().manual_seed(0)]).shape == (1, 64, 16)
    Q.build(tmp_path / "b", recipe)
    for name in ("vae/diffusion_pytorch_model.safetensors", "transformer/diffusion_pytorch_model.safetensors",
                 "vae/config.json"):
        assert (out / name).read_bytes() == (tmp_path / "b" / Q.MODEL_NAME / name).read_bytes(), name



def test_the_figures_sample_as_the_recipe_says(tmp_path, monkeypatch):
    """``negative_prompt``: the figures' edits are sampled as ``final_samples.qwen_editing`` samples
    with that negative prompt (None: no true CFG, the embedded default's params): the build's
    figures equal those of the saved model loaded that way, and differ from true CFG's."""
    loads = []
    real = Q.load_edit_policy

    def spy(model_dir, **kw):
        loads.append(kw.get("negative_prompt", Q.NEGATIVE_PROMPT))
        return real(model_dir, **kw)

    monkeypatch.setattr(Q, "load_edit_policy", spy)
    recipe = Q.QwenImageEditRecipe(**TINY, negative_prompt=None)
    figures = Q.build(tmp_path, recipe)
    assert loads == [Q.NEGATIVE_PROMPT, None]  # trained with its unconditional branch, sampled without CFG
    out = tmp_path / Q.MODEL_NAME
    assert json.loads((out / "pretrain.json").read_text())["recipe"]["negative_prompt"] is None
    plain = real(out, negative_prompt=None)
    without, _ = Q.edit_figures(plain, "test", recipe)
    assert figures["edits_test"] == without
    # the switch reaches the sampler: true CFG gives other pixels (the figures round to 4 places)
    item = [Q.edit_items("test")[0][0]]
    a = np.asarray(Q.sample_edits(plain, item, steps=2, seeds=1)[0][0], dtype=np.int16)
    b = np.asarray(Q.sample_edits(real(out), item, steps=2, seeds=1)[0][0], dtype=np.int16)
    assert np.abs(a - b).max() > 0
