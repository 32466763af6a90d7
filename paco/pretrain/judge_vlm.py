"""Generic image-pair pretraining of the whole tiny judge (vision tower, merger and language model).

The embedded default's judge base (:func:`paco.models.tiny.build_tiny` ``"qwen2_5_vl"``) is
random-init, and the reward stage trains only a rank-8 LoRA on its frozen random language model.
At paper scale the base is an instruction-tuned VLM that can already compare two
images; here a stand-in for that ability is trained with the generic objective of visual
instruction tuning (LLaVA, Liu et al. 2023, "Visual Instruction Tuning", §4.2: the
auto-regressive cross-entropy of the assistant's answer tokens given the images and the
question, every weight trained) on a binary image-pair matching question in the spirit of
ALBEF's image-text matching task (Li et al. 2021, "Align before Fuse", §3.2: a Yes/No
classification of whether two inputs belong together, half positives, half negatives):

* the judge's own chat layout (:func:`paco.judge.model.encode_sft`: one user turn
  ``[image A, image B, question]``, the assistant answers ``Yes.`` / ``No.``), so the first
  answer token's P(Yes) / (P(Yes) + P(No)) is the score the judge's consumers read;
* a pair is two independent views (:func:`paco.pretrain.views.subject_view`: crop, flip,
  colour jitter) of one photograph (answer ``Yes``) or of two different photographs (``No``),
  each at the size of a random cell of a T2IS layout (as :mod:`paco.pretrain.judge_vision`);
* the question is drawn from :data:`QUESTIONS` ("are these views of the same photograph?"),
  none of which is the judge's ConsistencyRank or editing question, and no composite, drift
  level or reward pair of the pipeline is used: the task-specific notion of consistency (style
  drift, partial replacement) is left to the reward LoRA.

Optionally (``recipe.vision``) the vision tower is first trained with
:mod:`paco.pretrain.judge_vision`'s NT-Xent recipe. The loss here is the token mean over the
answer's tokens (``Yes``/``No``, ``.``, ``<|im_end|>``); ``recipe.answer_only`` restricts it to
the answer token. The output directory loads with ``from_pretrained``
(:func:`paco.models.loading.load_judge`), like the ``qwen2_5_vl`` build.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import torch

from paco.pretrain.judge_vision import JudgeVisionRecipe, _panel_size
from paco.pretrain.record import write_record
from paco.pretrain.views import SUBJECT_NAMES, subject_view, to_pil

#: the directory :func:`build` writes under ``out_root``
MODEL_NAME = "qwen2_5_vl_pairs"

#: generic pair questions about content (drawn uniformly per pair); none is a pipeline question
QUESTIONS: tuple[str, ...] = (
    "Are the two images views of the same photograph? Answer Yes or No.",
    "Do these two pictures show the same scene? Answer Yes or No.",
    "Is the second image taken from the same photo as the first? Answer Yes or No.",
    "Do both images come from one photograph? Answer Yes or No.",
)

#: generic pair questions about appearance (``recipe.style_fraction`` of the pairs)
STYLE_QUESTIONS: tuple[str, ...] = (
    "Do the two images have the same colours and look? Answer Yes or No.",
    "Are the two pictures rendered in the same way? Answer Yes or No.",
    "Is the second image's colouring the same as the first's? Answer Yes or No.",
    "Do these images share one visual treatment? Answer Yes or No.",
)

_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


def _grey(x: np.ndarray, a: float, rng: np.random.Generator) -> np.ndarray:
    return x + a * ((x @ _LUMA)[..., None] - x)


def _hue(x: np.ndarray, a: float, rng: np.random.Generator) -> np.ndarray:
    # rotate the chroma plane of YIQ by an angle of a x (90..180) degrees, random sign
    ang = a * math.pi * rng.uniform(0.5, 1.0) * (1 if rng.random() < 0.5 else -1)
    m = np.array([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]], np.float32)
    c, s = math.cos(ang), math.sin(ang)
    rot = np.array([[1, 0, 0], [0, c, -s], [0, s, c]], np.float32)
    return x @ (np.linalg.inv(m) @ rot @ m).T.astype(np.float32)


def _invert(x: np.ndarray, a: float, rng: np.random.Generator) -> np.ndarray:
    return x + a * (1.0 - 2.0 * x)


def _posterise(x: np.ndarray, a: float, rng: np.random.Generator) -> np.ndarray:
    levels = int(rng.integers(2, 5))
    q = np.round(x * (levels - 1)) / (levels - 1)
    return x + a * (q - x)


def _blur(x: np.ndarray, a: float, rng: np.random.Generator) -> np.ndarray:
    from PIL import ImageFilter

    im = to_pil(x).filter(ImageFilter.GaussianBlur(radius=0.5 + 3.5 * a))
    return np.asarray(im, dtype=np.float32) / 255.0


def _channels(x: np.ndarray, a: float, rng: np.random.Generator) -> np.ndarray:
    perm = [(1, 2, 0), (2, 0, 1), (2, 1, 0), (1, 0, 2), (0, 2, 1)][int(rng.integers(5))]
    return x + a * (x[..., list(perm)] - x)


def _tint(x: np.ndarray, a: float, rng: np.random.Generator) -> np.ndarray:
    colour = rng.uniform(0.2, 1.0, 3).astype(np.float32)
    return x + a * (x.mean(-1, keepdims=True) * colour * 1.5 - x)


def _contrast(x: np.ndarray, a: float, rng: np.random.Generator) -> np.ndarray:
    gamma = 1.0 + 2.0 * a if rng.random() < 0.5 else 1.0 / (1.0 + 2.0 * a)
    return np.clip(x, 0, 1) ** gamma


#: generic photometric transforms ``f(x, strength, rng)`` (torchvision / PIL ImageOps families:
#: grayscale, hue, invert, posterize, gaussian blur, channel shuffle, colour tint, gamma)
TRANSFORMS = (_grey, _hue, _invert, _posterise, _blur, _channels, _tint, _contrast)


def restyle(x: np.ndarray, rng: np.random.Generator, strength: tuple[float, float]) -> np.ndarray:
    """``x`` under a random :data:`TRANSFORMS` member at a strength uniform in ``strength``."""
    f = TRANSFORMS[int(rng.integers(len(TRANSFORMS)))]
    a = float(rng.uniform(*strength))
    return np.clip(f(x, a, rng), 0.0, 1.0).astype(np.float32)


class JudgeVlmRecipe(pydantic.BaseModel, extra="forbid"):
    """How the whole tiny judge is pretrained (every field has the shipped default).

    Attributes:
        seed: ``build_tiny`` seed of the judge, of the training pairs (``numpy.random.default_rng``)
            and of ``torch.manual_seed``.
        eval_seed: seed of the held-out evaluation pairs (never used in training).
        steps: optimizer steps, each on ``batch`` pairs.
        batch: pairs per step (half same-photograph, half different photographs, rounded down).
        learning_rate, weight_decay: AdamW's, on every weight (embeddings and ``lm_head`` too).
        warmup_steps: linear learning-rate warm-up, then cosine decay to ``lr_floor`` x the rate.
        lr_floor: the cosine's final factor.
        max_grad_norm: gradient-norm clipping.
        panel_grid: composite size (px) whose layout cells give the view sizes.
        crop_scale, jitter: :func:`subject_view`'s crop area range and colour jitter.
        answer_only: the loss on the answer token only (else the token mean of the answer,
            ``.`` and ``<|im_end|>``).
        train_vision: also train the vision tower and merger (else only the language model,
            its embeddings and head).
        vision: first run :mod:`paco.pretrain.judge_vision`'s contrastive recipe on the tower
            (its ``seed`` is replaced by this recipe's); ``None``: no such stage.
        eval_pairs: held-out pairs for the figures (half positive).
        style_fraction: fraction of the pairs asked an appearance question (:data:`STYLE_QUESTIONS`)
            instead: two views of one photograph, ``Yes`` when both are plain, ``No`` when one is
            :func:`restyle`\ d (half each).
        style_strength: the restyling strength range.
        photo_restyle: probability that each view of a content-question pair is restyled (the
            content answer does not change: the same scene in another rendering).
    """

    seed: int = 0
    eval_seed: int = 9876
    steps: int = pydantic.Field(400, ge=1)
    batch: int = pydantic.Field(32, ge=2)
    learning_rate: float = pydantic.Field(1e-3, gt=0)
    weight_decay: float = pydantic.Field(0.01, ge=0)
    warmup_steps: int = pydantic.Field(20, ge=0)
    lr_floor: float = pydantic.Field(0.0, ge=0, le=1)
    max_grad_norm: float = pydantic.Field(1.0, gt=0)
    panel_grid: int = pydantic.Field(256, ge=112)
    crop_scale: tuple[float, float] = (0.4, 1.0)
    jitter: float = pydantic.Field(0.1, ge=0, lt=1)
    answer_only: bool = False
    train_vision: bool = True
    vision: JudgeVisionRecipe | None = None
    eval_pairs: int = pydantic.Field(256, ge=4)
    style_fraction: float = pydantic.Field(0.0, ge=0, le=1)
    style_strength: tuple[float, float] = (0.4, 1.0)
    photo_restyle: float = pydantic.Field(0.0, ge=0, le=1)

    @pydantic.field_validator("crop_scale", "style_strength")
    @classmethod
    def _range(cls, v: tuple[float, float], info: pydantic.ValidationInfo) -> tuple[float, float]:
        if not 0 < v[0] <= v[1] <= 1:
            raise ValueError(f"{info.field_name} must satisfy 0 < low <= high <= 1, got {v}")
        return v


def pair_batch(rng: np.random.Generator, n: int, recipe: JudgeVlmRecipe
               ) -> list[tuple[Any, Any, str, bool]]:
    """``n`` pairs ``(image_a, image_b, question, label)`` (8-bit PIL images), half of them
    ``True``. Content pairs: two views of one photograph (``True``) or of two different ones, each
    view restyled with probability ``recipe.photo_restyle``. Appearance pairs (a fraction
    ``recipe.style_fraction``, drawn per pair): two views of one photograph, one of them
    restyled for ``False``. Every random number is drawn from ``rng`` in a fixed order (the
    style and restyle coins only where their probability is positive, so content-only recipes
    draw the same stream as before those options existed)."""
    out = []
    k = len(SUBJECT_NAMES)
    for i in range(n):
        label = i < n // 2
        style = recipe.style_fraction > 0 and bool(rng.random() < recipe.style_fraction)
        a = int(rng.integers(k))
        b = a if (label or style) else (a + 1 + int(rng.integers(k - 1))) % k
        views = []
        for name in (SUBJECT_NAMES[a], SUBJECT_NAMES[b]):
            w, h = _panel_size(rng, recipe.panel_grid)
            views.append(subject_view(name, w, h, rng, crop_scale=recipe.crop_scale, jitter=recipe.jitter))
        if style:
            if not label:
                j = int(rng.integers(2))
                views[j] = restyle(views[j], rng, recipe.style_strength)
            q = STYLE_QUESTIONS[int(rng.integers(len(STYLE_QUESTIONS)))]
        else:
            for j in range(2 if recipe.photo_restyle > 0 else 0):
                if rng.random() < recipe.photo_restyle:
                    views[j] = restyle(views[j], rng, recipe.style_strength)
            q = QUESTIONS[int(rng.integers(len(QUESTIONS)))]
        out.append((to_pil(views[0]), to_pil(views[1]), q, label))
    return out


def _loss(logits: torch.Tensor, labels: torch.Tensor, answer_only: bool) -> torch.Tensor:
    from paco.judge.losses import first_token_weighted_loss

    logits, labels = logits[:, :-1], labels[:, 1:]
    if answer_only:
        return first_token_weighted_loss(logits, labels, 1.0, "paper")
    mask = labels != -100
    n = mask.sum(1).clamp(min=1)
    alpha = (1.0 / n.float()).mean()  # every row has the same answer length: the token mean
    return first_token_weighted_loss(logits, labels, float(alpha), "paper")


def train(model: Any, processor: Any, recipe: JudgeVlmRecipe, *, progress: bool = True) -> list[float]:
    """``recipe.steps`` AdamW steps of the answer cross-entropy on :func:`pair_batch` pairs
    (in place; every weight, or all but the vision tower without ``recipe.train_vision``).

    Returns:
        the loss of every step (nats).
    """
    from paco.judge.model import encode_sft
    from paco.judge.response import format_response
    from paco.pretrain.judge_vision import optimise, vision_tower, warmup_cosine

    torch.manual_seed(recipe.seed)
    rng = np.random.default_rng([recipe.seed, 1])
    tower_ids = {id(p) for p in vision_tower(model).parameters()}
    params = [p for p in model.parameters() if recipe.train_vision or id(p) not in tower_ids]

    def step_loss() -> torch.Tensor:
        pairs = pair_batch(rng, recipe.batch, recipe)
        batch = encode_sft(processor, [(a, b, q, format_response(y, None)) for a, b, q, y in pairs])
        labels = batch.pop("labels")
        return _loss(model(**batch).logits, labels, recipe.answer_only)

    return optimise(model, params, step_loss, steps=recipe.steps, learning_rate=recipe.learning_rate,
                    weight_decay=recipe.weight_decay,
                    lr_factor=warmup_cosine(recipe.steps, recipe.warmup_steps, recipe.lr_floor),
                    max_grad_norm=recipe.max_grad_norm, desc="judge pair pretrain", progress=progress)


def evaluate(model: Any, processor: Any, pairs: list[tuple[Any, Any, str, bool]],
             rank_question: str | None = None) -> dict[str, float]:
    """Held-out figures of the first-token score P(Yes)/(P(Yes)+P(No)) on ``pairs``: accuracy of
    ``score > 0.5``, ROC AUC (same-photograph pairs above different-photograph ones), mean score
    on each side; with ``rank_question``, the AUC of the same pairs asked that question instead
    (a transfer check, not trained on)."""
    from paco.judge.model import Judge

    judge = Judge(model, processor, batch_size=16)
    labels = np.array([y for *_, y in pairs])

    def auc(s: np.ndarray) -> float:
        pos, neg = s[labels], s[~labels]
        return float(((pos[:, None] > neg[None]).mean() + 0.5 * (pos[:, None] == neg[None]).mean()))

    s = np.array(judge.score([(a, b, q) for a, b, q, _ in pairs]))
    out = {"accuracy": float(((s > 0.5) == labels).mean()), "auc": auc(s),
           "p_yes_same": float(s[labels].mean()), "p_yes_other": float(s[~labels].mean())}
    if rank_question is not None:
        r = np.array(judge.score([(a, b, rank_question) for a, b, _, _ in pairs]))
        out |= {"rank_question_auc": auc(r), "rank_question_p_yes_same": float(r[labels].mean()),
                "rank_question_p_yes_other": float(r[~labels].mean())}
    return out


def build(out_root: Path, recipe: JudgeVlmRecipe | None = None, *, progress: bool = True) -> dict[str, Any]:
    """Build the tiny judge base (``build_tiny("qwen2_5_vl", ..., recipe.seed)``), optionally
    pretrain its tower contrastively (``recipe.vision``), pretrain the whole model on the pair
    question (:func:`train`) and save it into ``out_root / MODEL_NAME`` (loadable by
    :func:`paco.models.loading.load_judge`).

    Returns:
        JSON-able figures (also written with ``recipe.model_dump()`` to ``pretrain.json``):
        ``steps``, ``train_seconds`` (the pair stage), ``vision_seconds`` (the contrastive
        stage), ``loss_first`` / ``loss_last`` (mean of the first / last 10 steps),
        ``random_init`` / ``pretrained`` (:func:`evaluate` on held-out content pairs and
        appearance pairs, ``eval_seed``'s draws, whatever the recipe trains on).
    """
    from paco.core.templates import judge_instruction
    from paco.models.loading import load_judge
    from paco.models.tiny import build_tiny
    from paco.pretrain import judge_vision

    recipe = recipe or JudgeVlmRecipe()
    out_dir = Path(out_root) / MODEL_NAME
    build_tiny("qwen2_5_vl", out_dir, recipe.seed)
    config_bytes = (out_dir / "config.json").read_bytes()
    model, processor = load_judge(out_dir)
    rank_q = judge_instruction(None)
    eval_sets = {"content": pair_batch(np.random.default_rng(recipe.eval_seed), recipe.eval_pairs,
                                       recipe.model_copy(update={"style_fraction": 0.0})),
                 "appearance": pair_batch(np.random.default_rng([recipe.eval_seed, 1]), recipe.eval_pairs,
                                          recipe.model_copy(update={"style_fraction": 1.0}))}
    before = {k: evaluate(model, processor, v, rank_q) for k, v in eval_sets.items()}
    vision_seconds = 0.0
    if recipe.vision is not None:
        vr = recipe.vision.model_copy(update={"seed": recipe.seed})
        start = time.perf_counter()
        judge_vision.train(model, processor, vr, progress=progress)
        vision_seconds = time.perf_counter() - start
    start = time.perf_counter()
    losses = train(model, processor, recipe, progress=progress)
    seconds = time.perf_counter() - start
    after = {k: evaluate(model, processor, v, rank_q) for k, v in eval_sets.items()}
    model.save_pretrained(out_dir)
    (out_dir / "config.json").write_bytes(config_bytes)  # the build's (save_pretrained adds "dtype" keys)
    figures = {"model": MODEL_NAME, "steps": recipe.steps, "train_seconds": round(seconds, 1),
               "vision_seconds": round(vision_seconds, 1),
               "loss_first": float(np.mean(losses[:10])), "loss_last": float(np.mean(losses[-10:])),
               "chance_accuracy": 0.5, "random_init": before, "pretrained": after}
    write_record(out_dir, MODEL_NAME, figures, recipe)
    return figures
