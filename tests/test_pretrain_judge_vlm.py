"""Generic image-pair pretraining of the whole tiny judge (paco.pretrain.judge_vlm): recipe,
pairs, determinism, a loss that falls, a directory that loads as a judge; and the optional
LoRA on the judge's vision tower (paco.judge.lora, ``lora.vision_target_modules``)."""

from __future__ import annotations

import json

import numpy as np
import pydantic
import pytest
import torch

from paco.core.templates import EDIT_PF, EDIT_SC, judge_instruction
from paco.pretrain import judge_vlm as pjv


@pytest.mark.parametrize("bad", [{"stepz": 3}, {"steps": 0}, {"batch": 1}, {"crop_scale": (0.9, 0.5)},
                                 {"learning_rate": 0}, {"style_fraction": 1.5}, {"style_strength": (0.0, 0.5)},
                                 {"lr_floor": 2.0}, {"eval_pairs": 2}])
def test_recipe_refuses_bad_fields(bad):
    with pytest.raises(pydantic.ValidationError):
        pjv.JudgeVlmRecipe(**bad)


@pytest.mark.parametrize("field", ["crop_scale", "style_strength"])
def test_a_bad_range_names_its_field(field):
    with pytest.raises(pydantic.ValidationError, match=f"{field} must satisfy"):
        pjv.JudgeVlmRecipe(**{field: (0.9, 0.5)})


def test_no_pretraining_question_is_a_pipeline_question():
    pipeline = [judge_instruction(None), EDIT_SC.text, EDIT_PF.text]
    for q in pjv.QUESTIONS + pjv.STYLE_QUESTIONS:
        assert not any(q in t or t in q for t in pipeline) and "consisten" not in q.lower()


@pytest.mark.parametrize("style", [0.0, 0.5])
def test_pairs_are_balanced_and_seeded(style):
    recipe = pjv.JudgeVlmRecipe(style_fraction=style, photo_restyle=0.3)
    a = pjv.pair_batch(np.random.default_rng(3), 10, recipe)
    b = pjv.pair_batch(np.random.default_rng(3), 10, recipe)
    assert [y for *_, y in a] == [True] * 5 + [False] * 5
    for (a1, a2, qa, ya), (b1, b2, qb, yb) in zip(a, b, strict=True):
        assert qa == qb and ya == yb and a1.tobytes() == b1.tobytes() and a2.tobytes() == b2.tobytes()
    if style == 0.0:
        assert all(q in pjv.QUESTIONS for _, _, q, _ in a)


def test_restyle_keeps_shape_and_range():
    rng = np.random.default_rng(0)
    x = rng.random((40, 30, 3), dtype=np.float32)
    for f in pjv.TRANSFORMS:
        y = np.clip(f(x, 1.0, rng), 0, 1)
        assert y.shape == x.shape and y.dtype == np.float32 and not np.allclose(y, x)


def test_a_short_build_loads_as_a_judge(tmp_path):
    from paco.judge.model import Judge

    recipe = pjv.JudgeVlmRecipe(steps=6, batch=4, eval_pairs=4, warmup_steps=2)
    torch.set_num_threads(1)
    figures = pjv.build(tmp_path, recipe, progress=False)
    out = tmp_path / pjv.MODEL_NAME
    assert np.isfinite(figures["loss_first"]) and figures["steps"] == 6
    assert json.loads((out / "pretrain.json").read_text())["recipe"] == recipe.model_dump(mode="json")
    judge = Judge.from_pretrained(out)
    im = pjv.pair_batch(np.random.default_rng(0), 2, recipe)[0]
    s = judge.score([(im[0], im[1], judge_instruction(None))])
    assert 0.0 <= s[0] <= 1.0


def test_pair_training_lowers_the_loss_on_a_fixed_batch(tmp_path):
    from paco.models.loading import load_judge
    from paco.models.tiny import build_tiny

    build_tiny("qwen2_5_vl", tmp_path / "j", 0)
    model, processor = load_judge(tmp_path / "j")
    recipe = pjv.JudgeVlmRecipe(steps=12, batch=4, warmup_steps=0, learning_rate=3e-3)
    losses = pjv.train(model, processor, recipe, progress=False)
    assert np.mean(losses[-3:]) < np.mean(losses[:3])


def test_vision_lora_targets_only_named_tower_layers(tmp_path):
    from paco.core.params import LoraParams
    from paco.judge.lora import apply_lora
    from paco.models.loading import load_judge
    from paco.models.tiny import build_tiny

    build_tiny("qwen2_5_vl", tmp_path / "j", 0)
    model, _ = load_judge(tmp_path / "j")
    peft = apply_lora(model, LoraParams(vision_target_modules=["qkv", "mlp.0"]))
    adapted = {n.split(".lora_")[0] for n, p in peft.named_parameters() if p.requires_grad}
    vision = sorted(n for n in adapted if ".visual." in n)
    assert vision == sorted(["base_model.model.model.visual.blocks.0.attn.qkv",
                             "base_model.model.model.visual.blocks.1.attn.qkv",
                             "base_model.model.model.visual.merger.mlp.0"])
    assert any(".language_model." in n for n in adapted)
    model, _ = load_judge(tmp_path / "j")
    with pytest.raises(ValueError, match="vision_target_modules"):
        apply_lora(model, LoraParams(vision_target_modules=["no_such_layer"]))
    model, _ = load_judge(tmp_path / "j")
    assert not any(".visual." in n for n, p in apply_lora(model, LoraParams()).named_parameters() if p.requires_grad)
