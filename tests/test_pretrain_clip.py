"""Pretraining of the tiny CLIP (paco.pretrain.clip) and of the tiny judge's vision tower
(paco.pretrain.judge_vision): recipes, losses, saved directories, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pydantic
import pytest
import torch

from paco.pretrain import clip as pclip
from paco.pretrain import judge_vision as pjv

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = str(ROOT / "data" / "raw" / "t2is_prompts.jsonl")


@pytest.fixture(scope="module")
def texts() -> pclip.SubjectTexts:
    return pclip.SubjectTexts(PROMPTS)


# --------------------------------------------------------------------------------------------
# recipes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [{"stepz": 3}, {"steps": 0}, {"resolutions": ()}, {"resolutions": (16,)},
                                 {"learning_rate": 0}, {"eval_items": 1}])
def test_clip_recipe_refuses_bad_fields(bad):
    with pytest.raises(pydantic.ValidationError):
        pclip.ClipRecipe(**bad)


@pytest.mark.parametrize("bad", [{"seeds": 1}, {"steps": -1}, {"crop_scale": (0.9, 0.5)}, {"temperature": 0},
                                 {"jitter": 1.5}, {"panel_grid": 64}])
def test_judge_vision_recipe_refuses_bad_fields(bad):
    with pytest.raises(pydantic.ValidationError):
        pjv.JudgeVisionRecipe(**bad)


# --------------------------------------------------------------------------------------------
# CLIP
# --------------------------------------------------------------------------------------------


def test_subject_texts_cover_every_subject(texts):
    assert set(texts.rows) == set(pclip.SUBJECT_NAMES)
    assert all(texts.rows[s] and texts.short[s] for s in pclip.SUBJECT_NAMES)
    # the panel prompts clip_t compares panels with are among the short texts
    assert "The tabby sleeps curled into a tight ball on a cushion, nose tucked under its tail, one ear turned back." \
        in texts.short["cat"]


def test_subject_texts_refuse_missing_subject(tmp_path):
    row = json.loads(Path(PROMPTS).read_text().splitlines()[0])
    (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="no T2IS prompt for subjects"):
        pclip.SubjectTexts(tmp_path / "p.jsonl")


def test_clip_loss_decreases_on_fixed_batch(tmp_path, texts):
    from paco.models.loading import load_clip
    from paco.models.tiny import build_tiny

    build_tiny("clip", tmp_path / "clip", 0)
    model, processor = load_clip(tmp_path / "clip")
    rng = np.random.default_rng(0)
    arrays, prompts = pclip._batch(texts, rng, (128,), "composite")
    assert len(arrays) == len(prompts) == 16
    torch.manual_seed(0)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(8):
        loss = pclip.clip_loss(model, processor, arrays, prompts)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(np.log(16), abs=0.5)
    assert losses[-1] < losses[0] - 0.5
    with pytest.raises(ValueError, match="matching pairs"):
        pclip.clip_loss(model, processor, arrays[:3], prompts[:2])


def test_clip_build_loads_and_is_deterministic(tmp_path):
    from paco.models.clip import ClipScorer

    recipe = pclip.ClipRecipe(steps=3, warmup_steps=1, eval_items=2, prompts_path=PROMPTS)
    figures = pclip.build(tmp_path / "a", recipe, progress=False)
    pclip.build(tmp_path / "b", recipe, progress=False)
    out = tmp_path / "a" / "clip"
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "b" / "clip" / "model.safetensors").read_bytes()
    saved = json.loads((out / "pretrain.json").read_text())
    assert saved["recipe"] == recipe.model_dump(mode="json")
    assert saved["figures"]["steps"] == 3 and np.isfinite(saved["figures"]["loss_last"])
    for key in ("clip_t_acc_views", "clip_t_acc_composites", "clip_i_nn_acc"):
        assert 0.0 <= figures["pretrained"][key] <= 1.0
    scorer = ClipScorer(out)  # the project's loader (weights checked)
    emb = scorer.image_embeddings([pclip.to_pil(np.full((64, 64, 3), 0.5, np.float32))])
    assert emb.shape == (1, 64)
    assert scorer.logit_scale <= 100.0 + 1e-3


def test_clip_build_changes_with_seed(tmp_path):
    a = pclip.ClipRecipe(steps=1, warmup_steps=0, eval_items=2, prompts_path=PROMPTS)
    pclip.build(tmp_path / "a", a, progress=False)
    pclip.build(tmp_path / "b", a.model_copy(update={"seed": 1}), progress=False)
    assert (tmp_path / "a" / "clip" / "model.safetensors").read_bytes() != \
        (tmp_path / "b" / "clip" / "model.safetensors").read_bytes()


# --------------------------------------------------------------------------------------------
# judge vision tower
# --------------------------------------------------------------------------------------------


def test_nt_xent_prefers_aligned_views():
    torch.manual_seed(0)
    z = torch.randn(8, 16)
    aligned = pjv.nt_xent(torch.cat([z, z + 0.01 * torch.randn_like(z)]), 0.2)
    shuffled = pjv.nt_xent(torch.cat([z, torch.randn_like(z)]), 0.2)
    assert aligned < 0.5 * shuffled
    assert pjv.nt_xent(torch.cat([z, z]), 0.05) < 1e-3  # identical views, sharp temperature
    with pytest.raises(ValueError, match="even number"):
        pjv.nt_xent(torch.randn(5, 4), 0.2)


def test_judge_vision_loss_decreases_on_fixed_batch(tmp_path):
    from paco.models.loading import load_judge
    from paco.models.tiny import build_tiny

    build_tiny("qwen2_5_vl", tmp_path / "j", 0)
    model, processor = load_judge(tmp_path / "j")
    recipe = pjv.JudgeVisionRecipe()
    batch = pjv._pair_batch(np.random.default_rng(0), recipe)
    torch.manual_seed(0)
    head = pjv.projection_head(128, 32)
    tower = pjv.vision_tower(model)
    opt = torch.optim.Adam(list(tower.parameters()) + list(head.parameters()), lr=1e-3)
    model.train()
    losses = []
    for _ in range(6):
        loss = pjv.nt_xent(head(pjv.pooled_features(model, processor, batch)), 0.2)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3


def test_judge_vision_build_keeps_language_model(tmp_path):
    from safetensors.torch import load_file

    from paco.models.loading import load_judge
    from paco.models.tiny import build_tiny

    recipe = pjv.JudgeVisionRecipe(steps=2, warmup_steps=1, eval_views=2)
    figures = pjv.build(tmp_path / "a", recipe, progress=False)
    pjv.build(tmp_path / "b", recipe, progress=False)
    out = tmp_path / "a" / "qwen2_5_vl"
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "b" / "qwen2_5_vl" / "model.safetensors").read_bytes()
    base = build_tiny("qwen2_5_vl", tmp_path / "base", recipe.seed)
    assert (out / "config.json").read_bytes() == (base / "config.json").read_bytes()
    old, new = load_file(str(base / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(old) == set(new)
    tower = [k for k in old if "visual." in k]
    assert tower and figures["unchanged_tensors"] == len(old) - len(tower)
    assert all(torch.equal(old[k], new[k]) for k in old if k not in tower)
    assert any(not torch.equal(old[k], new[k]) for k in tower)
    saved = json.loads((out / "pretrain.json").read_text())
    assert saved["recipe"] == recipe.model_dump(mode="json")
    assert saved["figures"]["pretrained"]["token_norm"] == pytest.approx(
        saved["figures"]["random_init"]["token_norm"], rel=0.5)
    model, processor = load_judge(out)  # the project's loader (weights checked)
    feats = pjv.pooled_features(model, processor, [np.full((128, 128, 3), 0.5, np.float32)])
    assert feats.shape == (1, 128) and torch.isfinite(feats).all()


def test_check_unchanged_names_a_changed_tensor(tmp_path):
    from safetensors.torch import save_file

    before = {"visual.w": torch.zeros(2), "lm_head.weight": torch.zeros(2)}
    save_file({"visual.w": torch.ones(2), "lm_head.weight": torch.zeros(2)}, str(tmp_path / "ok.safetensors"))
    assert pjv._check_unchanged(before, tmp_path / "ok.safetensors", ("visual.",)) == 1
    save_file({"visual.w": torch.zeros(2), "lm_head.weight": torch.ones(2)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(pjv.PretrainedWeightsError, match="lm_head.weight"):
        pjv._check_unchanged(before, tmp_path / "bad.safetensors", ("visual.",))


# --------------------------------------------------------------------------------------------
# the shipped builds
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", [pclip, pjv])
def test_shipped_build_matches_default_recipe(module):
    out = ROOT / "data" / "raw" / "pretrained" / module.MODEL_NAME
    recipe_cls = pclip.ClipRecipe if module is pclip else pjv.JudgeVisionRecipe
    saved = json.loads((out / "pretrain.json").read_text())
    assert saved["recipe"] == recipe_cls().model_dump(mode="json")
    if module is pclip:
        from paco.models.loading import load_clip

        load_clip(out)
        assert saved["figures"]["pretrained"]["clip_t_acc_views"] >= 0.5
    else:
        from paco.models.loading import load_judge

        load_judge(out)
        assert saved["figures"]["pretrained"]["nn_subject_acc"] >= saved["figures"]["random_init"]["nn_subject_acc"]
