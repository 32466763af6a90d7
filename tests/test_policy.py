"""The policy families: ODE sampling equals each diffusers pipeline, SDE transitions re-score
exactly, adapters, Kontext's sequence layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from paco.core.params import PolicyLoraParams
from paco.grpo.policies import (
    OLD_ADAPTER,
    TRAINED_ADAPTER,
    Conditioning,
    FluxKontextPolicy,
    FluxPolicy,
    grid_size,
    load_policy,
    policy_class,
)
from paco.grpo.rewards import SubtaskItem
from paco.grpo.sde import ODE, SdeSettings
from paco.models.loading import load_flux_pipeline, load_pipeline

PROMPTS = ["a tabby cat on a cushion", "two red kites over a beach"]


def _infos(texts, refs=None) -> list[SubtaskItem]:
    refs = refs or [None] * len(texts)
    return [SubtaskItem(f"p{i}", t, "", 1, 1, (t,), r) for i, (t, r) in enumerate(zip(texts, refs))]


def _photo(seed: int, size=(80, 64)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def policy(tiny_model_dirs) -> FluxPolicy:
    pipe = load_flux_pipeline(tiny_model_dirs["policy_t2is"])
    return FluxPolicy(pipe, PolicyLoraParams(rank=4, alpha=8), max_sequence_length=32, seed=0)


@pytest.fixture(scope="module")
def kontext(tiny_model_dirs) -> FluxKontextPolicy:
    pipe = load_pipeline(tiny_model_dirs["policy_kontext"], "FluxKontextPipeline", FluxKontextPolicy.components)
    return FluxKontextPolicy(pipe, PolicyLoraParams(rank=4, alpha=8), max_sequence_length=32, guidance_scale=2.5,
                             seed=0)


def _gens(n: int, offset: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(offset + i) for i in range(n)]


def test_noise_level_zero_reproduces_flux_pipeline_exactly(tiny_model_dirs, policy):
    pipe = load_flux_pipeline(tiny_model_dirs["policy_t2is"])
    ref = pipe(prompt=PROMPTS, height=64, width=96, num_inference_steps=5, guidance_scale=3.5, max_sequence_length=32,
               generator=_gens(2), output_type="latent").images
    # LoRA B starts at zero, so the trained adapter is the base model; SDE steps with a = 0
    roll = policy.generate(policy.condition(_infos(PROMPTS), 64, 96), height=64, width=96, num_steps=5,
                           sde=ODE, sde_indices=[1, 3], noise_generators=_gens(2))
    assert torch.equal(roll.final_latents, ref.float())


def test_noise_level_zero_reproduces_flux_kontext_pipeline_exactly(tiny_model_dirs, kontext):
    from diffusers import FluxKontextPipeline

    refs = [_photo(0, (96, 64)), _photo(1, (96, 64))]  # at the output size: neither side resizes
    pipe = FluxKontextPipeline.from_pretrained(str(tiny_model_dirs["policy_kontext"]), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(image=refs, prompt=PROMPTS, height=64, width=96,
               num_inference_steps=5, guidance_scale=2.5, max_sequence_length=32, generator=_gens(2),
               output_type="latent", _auto_resize=False, max_area=64 * 96).images
    roll = kontext.generate(kontext.condition(_infos(PROMPTS, refs), 64, 96), height=64, width=96, num_steps=5,
                            sde=ODE, sde_indices=[1], noise_generators=_gens(2))
    assert torch.equal(roll.final_latents, ref.float())


def test_kontext_sequence_layout(kontext):
    """Reference latents follow the noise in the sequence with position axis 0 = 1; the
    prediction covers the noise part only (computed here from the transformer by hand)."""
    refs = [_photo(3, (64, 64))]
    cond = kontext.condition(_infos(PROMPTS[:1], refs), 64, 64)
    seq = (64 // 16) ** 2
    assert cond["image_latents"].shape == (1, seq, 64) and cond["img_ids"].shape == (2 * seq, 3)
    assert torch.equal(cond["img_ids"][:seq, 0], torch.zeros(seq)) and torch.equal(cond["img_ids"][seq:, 0],
                                                                                     torch.ones(seq))
    assert torch.equal(cond["img_ids"][:seq, 1:], cond["img_ids"][seq:, 1:])  # same spatial grid
    # the reference latents are the VAE's mode of the image, shifted and scaled like the noise
    pipe = kontext.pipe
    x = pipe.image_processor.preprocess(refs[0], 64, 64)
    z = (pipe.vae.encode(x).latent_dist.mode() - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
    torch.testing.assert_close(cond["image_latents"], pipe._pack_latents(z, 1, 16, 8, 8), rtol=0, atol=0)
    noise = torch.randn(1, seq, 64, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([700.0])
    with torch.no_grad():
        v = kontext.velocity(noise, t, cond)
        full = kontext.transformer(hidden_states=torch.cat([noise, cond["image_latents"]], 1), timestep=t / 1000,
                                   guidance=torch.tensor([2.5]), pooled_projections=cond["pooled"],
                                   encoder_hidden_states=cond["prompt_embeds"], txt_ids=cond["text_ids"],
                                   img_ids=cond["img_ids"], return_dict=False)[0]
        other = kontext.velocity(noise, t, kontext.condition(_infos(PROMPTS[:1], [_photo(4, (64, 64))]), 64, 64))
    assert full.shape == (1, 2 * seq, 64) and v.shape == (1, seq, 64)
    assert torch.equal(v, full[:, :seq])
    assert not torch.allclose(v, other)  # the reference is attended to


def test_kontext_reference_aspect_switch(kontext):
    wide = _photo(5, (128, 64))
    keep = kontext.condition(_infos(["x"], [wide]), 32, 64)
    assert keep["image_latents"].shape[1] == (32 // 16) * (64 // 16)
    kontext.reference_aspect = "square"  # the released trainer: squashed to min(h, w) square
    try:
        square = kontext.condition(_infos(["x"], [wide]), 32, 64)
    finally:
        kontext.reference_aspect = "keep"
    assert square["image_latents"].shape[1] == (32 // 16) ** 2
    assert square["img_ids"].shape[0] == 8 + 4


def test_an_editing_family_refuses_a_prompt_without_reference(kontext):
    with pytest.raises(ValueError, match="no reference"):
        kontext.condition(_infos(["x"]), 32, 32)


def test_sde_transitions_rescore_to_the_sampled_log_prob(policy, kontext):
    for pol, refs in ((policy, None), (kontext, [_photo(6, (64, 64)), _photo(7, (64, 64))])):
        emb = pol.condition(_infos(PROMPTS, refs), 64, 64)
        roll = pol.generate(emb, height=64, width=64, num_steps=4, sde=SdeSettings(0.7), sde_indices=[0, 2],
                            noise_generators=_gens(2), sde_generators=_gens(2, 10))
        assert roll.latents.shape[:3] == (2, 2, 2) and roll.log_probs.shape == (2, 2)
        assert roll.sde == SdeSettings(0.7)  # recorded: the re-scoring takes it from here
        for j in range(len(roll.sde_indices)):
            lp, mean, std = pol.transition_log_prob(roll.transitions(j), emb)
            assert torch.equal(lp, roll.log_probs[:, j])  # the same computation: ratio exactly 1
            assert std.shape == (2, 1, 1) and torch.all(std > 0)
        # a row's sample depends only on its own generators, not on the batch
        solo = pol.generate(emb.select([1]), height=64, width=64, num_steps=4, sde=SdeSettings(0.7), sde_indices=[0, 2],
                            noise_generators=_gens(1, 1), sde_generators=_gens(1, 11))
        torch.testing.assert_close(solo.final_latents[0], roll.final_latents[1], rtol=0, atol=1e-5)


def test_adapters_old_trained_and_reference(policy):
    trained = policy.adapter_parameters(TRAINED_ADAPTER)
    old = policy.adapter_parameters(OLD_ADAPTER)
    assert len(trained) == len(old) > 0
    assert all(p.requires_grad for p in trained.values()) and not any(p.requires_grad for p in old.values())
    emb = policy.condition(_infos(PROMPTS[:1]), 64, 64)
    x = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([800.0])
    with torch.no_grad():
        base = policy.velocity(x, t, emb)
        b_params = [p for n, p in trained.items() if "lora_B" in n]
        saved = [p.clone() for p in b_params]
        for p in b_params:
            p.add_(0.5)
        moved = policy.velocity(x, t, emb)
        with policy.using(OLD_ADAPTER):
            old_v = policy.velocity(x, t, emb)
        with policy.using(None):
            ref_v = policy.velocity(x, t, emb)
        for p, s in zip(b_params, saved):
            p.copy_(s)
    assert not torch.allclose(moved, base)
    assert torch.equal(old_v, base) and torch.equal(ref_v, base)  # old and reference untouched
    assert all(p.requires_grad for p in trained.values())  # trained adapter active again


def test_conditionings_of_different_sizes_do_not_concatenate(policy):
    a = policy.condition(_infos(PROMPTS[:1]), 64, 64)
    b = policy.condition(_infos(PROMPTS[1:]), 64, 96)
    assert Conditioning.cat([a, a]).batch == 2
    with pytest.raises(ValueError, match="different layouts or sizes"):
        Conditioning.cat([a, b])


def test_lora_targets_must_exist(tiny_model_dirs):
    pipe = load_flux_pipeline(tiny_model_dirs["policy_t2is"])
    with pytest.raises(ValueError, match="no_such_proj"):
        FluxPolicy(pipe, PolicyLoraParams(rank=2, alpha=2, target_modules=["attn.to_q", "no_such_proj"]))


def test_families_by_name_and_their_options(tiny_model_dirs):
    from types import SimpleNamespace

    assert policy_class("flux_kontext") is FluxKontextPolicy
    with pytest.raises(ValueError, match="unknown policy family 'sd3'"):
        policy_class("sd3")
    with pytest.raises(ValueError, match="needs the settings \\['reference_aspect'\\]"):
        load_policy("flux_kontext", tiny_model_dirs["policy_kontext"], None,
                    SimpleNamespace(max_sequence_length=32, guidance_scale=2.5))
    # the released Kontext config loads FLUX.1-dev: a FluxPipeline directory runs as Kontext
    pol = load_policy("flux_kontext", tiny_model_dirs["policy_t2is"], None,
                      SimpleNamespace(max_sequence_length=32, guidance_scale=2.5, reference_aspect="keep"))
    assert type(pol.pipe).__name__ == "FluxKontextPipeline" and pol.edits


@pytest.mark.parametrize("h,w,res,expected", [(1024, 1024, 512, (512, 512)), (512, 1536, 512, (288, 880)),
                                              (1024, 1536, 128, (112, 160)), (1024, 1024, 8, (16, 16))])
def test_grid_size_keeps_aspect_and_area(h, w, res, expected):
    assert grid_size(h, w, res) == expected


# --------------------------------------------------------------------------------------------
# Qwen-Image-Edit
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_edit(tiny_model_dirs):
    from types import SimpleNamespace

    settings = SimpleNamespace(guidance_scale=4.0, negative_prompt=" ", reference_aspect="keep")
    lora = PolicyLoraParams(rank=4, alpha=8, target_modules=QWEN_TARGETS)
    return load_policy("qwen_image_edit", tiny_model_dirs["policy_qwen_edit"], lora, settings, seed=0)


#: attention and feed-forward projections of a Qwen-Image block (the FLUX names of the released
#: config match only the attention ones: see test_released_qwen_targets_match_attention_only)
QWEN_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                "txt_mlp.net.2"]


def test_released_qwen_targets_match_attention_only(tiny_model_dirs):
    """The released Qwen-Image-Edit trainer lists FLUX's feed-forward names, which peft silently
    skips; here an unmatched target is an error naming it."""
    from types import SimpleNamespace

    released = PolicyLoraParams(rank=2, alpha=2)  # the FLUX list (the released config's)
    with pytest.raises(ValueError, match="ff.net.0.proj"):
        load_policy("qwen_image_edit", tiny_model_dirs["policy_qwen_edit"], released,
                    SimpleNamespace(guidance_scale=4.0, negative_prompt=" ", reference_aspect="keep"))


@pytest.mark.parametrize("negative", [" ", None])
def test_noise_level_zero_reproduces_qwen_image_edit_pipeline_exactly(tiny_model_dirs, qwen_edit, monkeypatch,
                                                                      negative):
    """With and without true CFG (no negative prompt: guidance off, as in the released trainer)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as qie

    refs = [_photo(0, (48, 32))]
    # the pipeline encodes the input at ~1 megapixel (calculate_dimensions); the policy at the
    # output size: make the pipeline's size the output size for the comparison
    monkeypatch.setattr(qie, "calculate_dimensions", lambda area, ratio: (48, 32, None))
    pipe = qwen_edit.pipe
    with qwen_edit.using(None):  # the base model (LoRA B is zero anyway)
        ref = pipe(image=refs[0], prompt=PROMPTS[0], negative_prompt=negative, true_cfg_scale=4.0, height=32,
                   width=48, num_inference_steps=4, generator=_gens(1), output_type="latent").images
        qwen_edit.negative_prompt = negative
        try:
            roll = qwen_edit.generate(qwen_edit.condition(_infos(PROMPTS[:1], refs), 32, 48), height=32, width=48,
                                      num_steps=4, sde=ODE, sde_indices=[1], noise_generators=_gens(1))
        finally:
            qwen_edit.negative_prompt = " "
    assert torch.equal(roll.final_latents, ref.float())


def test_qwen_true_cfg_by_hand(qwen_edit):
    """velocity = (neg + s (cond - neg)) * |cond| / |combined| per token, from two transformer calls."""
    cond = qwen_edit.condition(_infos(PROMPTS[:1], [_photo(2, (32, 32))]), 32, 32)
    assert {"negative_embeds", "negative_mask"} <= set(cond.rows)
    x = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([600.0])
    shapes = [[(1, 2, 2), (1, 2, 2)]]
    with torch.no_grad():
        v = qwen_edit.velocity(x, t, cond)
        hidden = torch.cat([x, cond["image_latents"]], 1)
        c = qwen_edit._transformer(hidden, t, cond["prompt_embeds"], cond["prompt_mask"], shapes)[:, :4]
        n = qwen_edit._transformer(hidden, t, cond["negative_embeds"], cond["negative_mask"], shapes)[:, :4]
        comb = n + 4.0 * (c - n)
        expected = comb * (c.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))
        qwen_edit.negative_prompt = None
        try:
            plain = qwen_edit.velocity(x, t, qwen_edit.condition(_infos(PROMPTS[:1], [_photo(2, (32, 32))]), 32, 32))
        finally:
            qwen_edit.negative_prompt = " "
    torch.testing.assert_close(v, expected, rtol=0, atol=0)
    torch.testing.assert_close(plain, c, rtol=0, atol=0)
    assert not torch.allclose(v, c)


def test_qwen_text_of_different_lengths_concatenates_padded(qwen_edit):
    short = qwen_edit.condition(_infos(["grey"], [_photo(3, (32, 32))]), 32, 32)
    long = qwen_edit.condition(_infos(["turn the whole photo into a warm evening scene with soft light"],
                                      [_photo(3, (32, 32))]), 32, 32)
    assert short["prompt_embeds"].shape[1] < long["prompt_embeds"].shape[1]
    both = Conditioning.cat([short, long])
    assert both["prompt_embeds"].shape[1] == long["prompt_embeds"].shape[1]
    n = short["prompt_mask"].shape[1]
    assert both["prompt_mask"][0, n:].sum() == 0 and torch.equal(both["prompt_mask"][0, :n], short["prompt_mask"][0])
    x = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        alone = qwen_edit.velocity(x, torch.tensor([500.0]), short)
        padded = qwen_edit.velocity(torch.cat([x, x]), torch.tensor([500.0, 500.0]), both)[:1]
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)  # masked padding changes nothing


def test_qwen_sde_transitions_rescore(qwen_edit):
    emb = qwen_edit.condition(_infos(PROMPTS, [_photo(6, (32, 32)), _photo(7, (32, 32))]), 32, 32)
    roll = qwen_edit.generate(emb, height=32, width=32, num_steps=3, sde=SdeSettings(1.0), sde_indices=[1],
                              noise_generators=_gens(2), sde_generators=_gens(2, 10))
    lp, _, _ = qwen_edit.transition_log_prob(roll.transitions(0), emb)
    torch.testing.assert_close(lp, roll.log_probs[:, 0], rtol=0, atol=1e-5)
    images = qwen_edit.decode(roll.final_latents, 32, 32)
    assert len(images) == 2 and images[0].size == (32, 32)


# --------------------------------------------------------------------------------------------
# gradient checkpointing (grpo.<k>.train.gradient_checkpointing)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["flux", "qwen_image_edit"])
def test_gradient_checkpointing_recomputes_the_blocks_with_the_same_loss_and_gradients(tiny_model_dirs, family):
    """``Policy.enable_gradient_checkpointing`` trades memory for compute only: sampling (no
    gradients) runs each block once as before, a forward with gradients runs it once more in the
    backward (counted at the first block's attention), and the log-prob and every LoRA gradient
    are bit for bit those without it (CPU, float32). Qwen-Image-Edit with true CFG: two forwards."""
    from types import SimpleNamespace

    settings = SimpleNamespace(max_sequence_length=32, guidance_scale=4.0, negative_prompt=" ",
                               reference_aspect="keep")
    role = {"flux": "policy_t2is", "qwen_image_edit": "policy_qwen_edit"}[family]
    lora = PolicyLoraParams(rank=4, alpha=8, **({"target_modules": QWEN_TARGETS} if family == "qwen_image_edit"
                                                else {}))
    refs = [_photo(8, (32, 32)), _photo(9, (32, 32))] if family == "qwen_image_edit" else None
    forwards = 2 if family == "qwen_image_edit" else 1
    out = {}
    for ckpt in (False, True):
        pol = load_policy(family, tiny_model_dirs[role], lora, settings, seed=0)
        if ckpt:
            pol.enable_gradient_checkpointing()
        assert pol.transformer.gradient_checkpointing is ckpt
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # a non-zero B, so that A gets a gradient too
            for name, p in pol.adapter_parameters(TRAINED_ADAPTER).items():
                if "lora_B" in name:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
        calls = []
        pol.transformer.transformer_blocks[0].attn.register_forward_pre_hook(lambda *_: calls.append(1))
        emb = pol.condition(_infos(PROMPTS, refs), 32, 32)
        roll = pol.generate(emb, height=32, width=32, num_steps=3, sde=SdeSettings(0.7), sde_indices=[1],
                            noise_generators=_gens(2), sde_generators=_gens(2, 10))
        assert len(calls) == 3 * forwards  # sampling: no recomputation
        calls.clear()
        lp, _, _ = pol.transition_log_prob(roll.transitions(0), emb)
        lp.sum().backward()
        assert len(calls) == (2 if ckpt else 1) * forwards
        # (Qwen-Image's last block: its text-stream output is unused, so some of its LoRA get no or zero gradients)
        grads = {n: p.grad.clone() for n, p in pol.adapter_parameters(TRAINED_ADAPTER).items() if p.grad is not None}
        assert sum(bool(gr.abs().sum() > 0) for gr in grads.values()) > len(pol.adapter_parameters()) // 2
        out[ckpt] = (roll.final_latents, lp.detach(), grads)
    (lat0, lp0, g0), (lat1, lp1, g1) = out[False], out[True]
    assert torch.equal(lat0, lat1) and torch.equal(lp0, lp1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)
