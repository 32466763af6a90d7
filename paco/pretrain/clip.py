"""Contrastive pretraining of the embedded default's tiny CLIP on the 16 subject photographs.

The tiny CLIP (:func:`paco.models.tiny.build_tiny` ``"clip"``: ``CLIPModel``, 32 px images,
projection 64) is the ``clip`` role (CLIP-T reward, CLIP-I baseline) and the ``pickscore`` role
(same files) of the embedded default. Random-init, it cannot tell a photograph of the prompt's
subject from any other image, so its rewards carry no signal. Here it is trained with
CLIP's objective on image/text pairs that name the same subject, preprocessed exactly as the
rewards use it:

* **panels** (what ``clip_t`` scores, :func:`paco.grpo.rewards.clip_t`): a single view of a
  photograph (:func:`paco.pretrain.views.subject_view`) at the size of one cell of a T2IS
  prompt's layout at a sampling resolution, paired with one of that subject's short texts: a
  panel prompt (:func:`paco.data.panel_prompts.parse_panel_prompts`, what ``clip_t`` compares a
  panel to) or a prompt's global description;
* **composites** (what ``pickscore`` scores, the whole grid against the whole prompt): a
  :func:`~paco.pretrain.views.layout_grid` of the subject in a prompt's layout at that
  prompt's aspect (:func:`paco.grpo.policies.grid_size`), paired with the whole prompt.

Images go through the model's own ``CLIPProcessor`` as 8-bit PIL images (resize of the shortest
edge to 32 px + centre crop, as :class:`paco.models.clip.ClipScorer` does); texts through its
tokenizer padded to the batch's longest and truncated to 77 tokens with an attention mask (as
``ClipScorer.text_embeddings`` does).

Objective: CLIP's symmetric InfoNCE (Radford et al. 2021, "Learning Transferable Visual Models
From Natural Language Supervision", Fig. 3): cross-entropy of ``exp(t) * cos(image_i, text_j)``
over texts and over images with the matching pair as target, ``t`` the learnable
``logit_scale``, clipped so that ``exp(t) <= 100`` (ibid. §2.5); ``transformers``'
``CLIPModel(..., return_loss=True)`` computes it. Each step has one panel batch and one composite
batch of one item per subject (16 distinct subjects, so no pair is a false negative); the loss is
their mean.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import torch

from paco.pretrain.record import contrastive_figures, write_record
from paco.pretrain.views import (
    SUBJECT_NAMES,
    cell_boxes,
    layout_grid,
    load_t2is_prompts,
    parse_layout,
    subject_view,
    to_pil,
)

#: the directory :func:`build` writes under ``out_root``
MODEL_NAME = "clip"

#: CLIP's cap on the learned temperature: ``exp(logit_scale) <= 100`` (Radford et al. 2021 §2.5)
MAX_LOGIT_SCALE = math.log(100.0)


class ClipRecipe(pydantic.BaseModel, extra="forbid"):
    """How the tiny CLIP is pretrained (every field has the shipped default).

    Attributes:
        seed: ``build_tiny`` seed of the initial weights, and the seed of the training views
            (``numpy.random.default_rng``) and of ``torch.manual_seed``.
        eval_seed: seed of the held-out evaluation views and composites (never used in training).
        steps: optimizer steps (each: one panel batch and one composite batch of 16 items).
        learning_rate, weight_decay: AdamW's.
        warmup_steps: linear learning-rate warm-up, then cosine decay to 0.
        resolutions: sampling resolutions (px, :func:`paco.grpo.policies.grid_size`: the
            composite's area is ``resolution**2`` at its prompt's aspect); one is drawn per item.
        eval_items: held-out views and held-out composites per subject for the figures.
        prompts_path: the T2IS prompts file (jsonl with ``prompt``, ``layout``, ``subject``,
            ``height``, ``width``).
    """

    seed: int = 0
    eval_seed: int = 1234
    steps: int = pydantic.Field(200, ge=1)
    learning_rate: float = pydantic.Field(1e-3, gt=0)
    weight_decay: float = pydantic.Field(0.01, ge=0)
    warmup_steps: int = pydantic.Field(20, ge=0)
    resolutions: tuple[int, ...] = (128, 256)
    eval_items: int = pydantic.Field(8, ge=2)
    prompts_path: str = "data/raw/t2is_prompts.jsonl"

    @pydantic.field_validator("resolutions")
    @classmethod
    def _sizes(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or any(r < 32 for r in v):
            raise ValueError(f"resolutions must be a non-empty tuple of ints >= 32 px, got {v}")
        return v


class SubjectTexts:
    """The T2IS prompts grouped by subject: for each of :data:`SUBJECT_NAMES` its prompt rows
    (dicts of :func:`load_t2is_prompts` plus ``rows``/``cols``) and its short texts (the panel
    prompts and global descriptions of its prompts, de-duplicated, in file order).

    Raises:
        ValueError: a subject without a prompt, or a prompt whose panel tags do not fit its layout
            (:class:`paco.data.panel_prompts.PromptFormatError`).
    """

    def __init__(self, path: str | Path):
        from paco.data.panel_prompts import parse_panel_prompts

        self.rows: dict[str, list[dict[str, Any]]] = {n: [] for n in SUBJECT_NAMES}
        self.short: dict[str, list[str]] = {n: [] for n in SUBJECT_NAMES}
        for row in load_t2is_prompts(path):
            rows, cols = parse_layout(row["layout"])
            row = dict(row, rows=rows, cols=cols)
            self.rows[row["subject"]].append(row)
            global_prompt, panels = parse_panel_prompts(row["prompt"], rows, cols)
            for text in [global_prompt, *panels]:
                if text and text not in self.short[row["subject"]]:
                    self.short[row["subject"]].append(text)
        missing = [n for n, r in self.rows.items() if not r]
        if missing:
            raise ValueError(f"{path}: no T2IS prompt for subjects {missing}")


def _composite_size(row: dict[str, Any], resolution: int) -> tuple[int, int]:
    """``(height, width)`` of ``row``'s composite sampled at ``resolution``."""
    from paco.grpo.policies import grid_size

    return grid_size(int(row["height"]), int(row["width"]), resolution)


def _panel_item(texts: SubjectTexts, subject: str, rng: np.random.Generator,
                resolutions: tuple[int, ...]) -> tuple[np.ndarray, str]:
    """A single view of ``subject`` at the size of a random cell of one of its prompts' layouts,
    with one of its short texts."""
    row = texts.rows[subject][int(rng.integers(len(texts.rows[subject])))]
    h, w = _composite_size(row, resolutions[int(rng.integers(len(resolutions)))])
    boxes = cell_boxes(w, h, row["rows"], row["cols"])
    x0, y0, x1, y1 = boxes[int(rng.integers(len(boxes)))]
    view = subject_view(subject, x1 - x0, y1 - y0, rng)
    return view, texts.short[subject][int(rng.integers(len(texts.short[subject])))]


def _composite_item(texts: SubjectTexts, subject: str, rng: np.random.Generator,
                    resolutions: tuple[int, ...]) -> tuple[np.ndarray, str]:
    """A composite of ``subject`` in one of its prompts' layouts and aspect, with that prompt."""
    row = texts.rows[subject][int(rng.integers(len(texts.rows[subject])))]
    h, w = _composite_size(row, resolutions[int(rng.integers(len(resolutions)))])
    return layout_grid(subject, row["rows"], row["cols"], w, h, rng), row["prompt"]


def _encode_images(processor: Any, arrays: list[np.ndarray]) -> torch.Tensor:
    """``(B, 3, 32, 32)`` float32 pixel values: 8-bit PIL images through the CLIP processor."""
    return processor(images=[to_pil(a) for a in arrays], return_tensors="pt")["pixel_values"]


def _encode_texts(processor: Any, texts: list[str], max_length: int) -> dict[str, torch.Tensor]:
    """Token ids and attention mask as :meth:`paco.models.clip.ClipScorer.text_embeddings` makes them."""
    enc = processor.tokenizer(list(texts), padding=True, truncation=True, max_length=max_length,
                              return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def clip_loss(model: Any, processor: Any, arrays: list[np.ndarray], texts: list[str]) -> torch.Tensor:
    """CLIP's symmetric InfoNCE (Radford et al. 2021, Fig. 3) of ``B`` matching image/text pairs
    (pair ``i`` is the positive of row and column ``i``): a scalar float32 tensor with grad.

    Raises:
        ValueError: ``len(arrays) != len(texts)`` or fewer than 2 pairs.
    """
    if len(arrays) != len(texts) or len(texts) < 2:
        raise ValueError(f"clip_loss needs >= 2 matching pairs, got {len(arrays)} images and {len(texts)} texts")
    enc = _encode_texts(processor, texts, int(model.config.text_config.max_position_embeddings))
    out = model(pixel_values=_encode_images(processor, arrays), return_loss=True, **enc)
    return out.loss


def _batch(texts: SubjectTexts, rng: np.random.Generator, resolutions: tuple[int, ...],
           kind: str) -> tuple[list[np.ndarray], list[str]]:
    """One item of ``kind`` (``panel`` | ``composite``) per subject, in :data:`SUBJECT_NAMES` order."""
    make = _panel_item if kind == "panel" else _composite_item
    items = [make(texts, s, rng, resolutions) for s in SUBJECT_NAMES]
    return [a for a, _ in items], [t for _, t in items]


def _embed(model: Any, processor: Any, arrays: list[np.ndarray] | None = None,
           texts: list[str] | None = None) -> torch.Tensor:
    """L2-normalised ``(n, d)`` float32 embeddings of images or texts (eval mode, no grad)."""
    from paco.models.clip import _features

    with torch.no_grad():
        if arrays is not None:
            out = model.get_image_features(pixel_values=_encode_images(processor, arrays))
        else:
            enc = _encode_texts(processor, texts, int(model.config.text_config.max_position_embeddings))
            out = model.get_text_features(**enc)
    return torch.nn.functional.normalize(_features(out).float(), dim=-1)


def evaluation_set(texts: SubjectTexts, seed: int, per_subject: int) -> dict[str, Any]:
    """Held-out images for :func:`evaluate`, drawn from ``default_rng(seed)``: per subject
    ``per_subject`` panel views (cells of its prompts' layouts at 128 px) and as many composites
    (its prompts' layouts at 128 px), with labels (index in :data:`SUBJECT_NAMES`)."""
    rng = np.random.default_rng(seed)
    views, composites, labels = [], [], []
    for k, s in enumerate(SUBJECT_NAMES):
        for _ in range(per_subject):
            views.append(_panel_item(texts, s, rng, (128,))[0])
            composites.append(_composite_item(texts, s, rng, (128,))[0])
            labels.append(k)
    return {"views": views, "composites": composites, "labels": torch.tensor(labels)}


def evaluate(model: Any, processor: Any, texts: SubjectTexts, eval_set: dict[str, Any]) -> dict[str, float]:
    """Figures of a CLIP on :func:`evaluation_set`'s held-out images (all in [0, 1] unless named):

    * ``clip_t_acc_views`` / ``clip_t_acc_composites``: how often the highest cosine among the
      16 candidate texts (each subject's first T2IS prompt, whole, truncated to 77 tokens) is the
      image's own subject's (chance 1/16);
    * ``clip_t_panel_margin``: mean cosine of a view with its own subject's short texts minus
      the mean with other subjects' (what ``clip_t`` rewards; in [-2, 2]);
    * ``clip_i_nn_acc``: leave-one-out nearest neighbour (cosine of image embeddings) of each view
      among the other views is of the same subject;
    * ``pickscore_scale``: ``exp(logit_scale)`` (the PickScore reward's factor; 100 for trained CLIP).
    """
    was_training = model.training
    model.eval()
    labels = eval_set["labels"]
    cand = _embed(model, processor, texts=[texts.rows[s][0]["prompt"] for s in SUBJECT_NAMES])
    views = _embed(model, processor, arrays=eval_set["views"])
    comps = _embed(model, processor, arrays=eval_set["composites"])
    flat = [(k, t) for k, s in enumerate(SUBJECT_NAMES) for t in texts.short[s]]
    short = _embed(model, processor, texts=[t for _, t in flat])
    same = labels[:, None] == torch.tensor([k for k, _ in flat])[None]
    cos = views @ short.T
    margin = (cos[same].mean() - cos[~same].mean()).item()
    sim = views @ views.T
    sim.fill_diagonal_(-2.0)
    model.train(was_training)
    return {
        "clip_t_acc_views": float(((views @ cand.T).argmax(1) == labels).float().mean()),
        "clip_t_acc_composites": float(((comps @ cand.T).argmax(1) == labels).float().mean()),
        "clip_t_panel_margin": float(margin),
        "clip_i_nn_acc": float((labels[sim.argmax(1)] == labels).float().mean()),
        "pickscore_scale": float(model.logit_scale.detach().exp()),
    }


def train(model: Any, processor: Any, texts: SubjectTexts, recipe: ClipRecipe, *,
          progress: bool = True) -> list[float]:
    """Run ``recipe.steps`` AdamW steps of :func:`clip_loss` (mean of a panel and a composite
    batch) on ``model`` in place, clipping ``logit_scale`` to :data:`MAX_LOGIT_SCALE` after each.

    Returns:
        the loss of every step (floats, nats; ``log(16)`` ~ 2.77 at chance).
    """
    from tqdm.auto import tqdm

    torch.manual_seed(recipe.seed)
    rng = np.random.default_rng(recipe.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=recipe.weight_decay)

    def lr_factor(step: int) -> float:  # linear warm-up, then cosine decay to 0
        if step < recipe.warmup_steps:
            return (step + 1) / recipe.warmup_steps
        span = max(1, recipe.steps - recipe.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * (step - recipe.warmup_steps) / span))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    model.train()
    losses = []
    bar = tqdm(range(recipe.steps), desc="clip pretrain", disable=not progress)
    for _ in bar:
        loss = 0.5 * sum(clip_loss(model, processor, *_batch(texts, rng, recipe.resolutions, kind))
                         for kind in ("panel", "composite"))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            model.logit_scale.clamp_(max=MAX_LOGIT_SCALE)
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


def build(out_root: Path, recipe: ClipRecipe | None = None, *, progress: bool = True) -> dict[str, Any]:
    """Build the tiny CLIP (``build_tiny("clip", ..., recipe.seed)``), pretrain it (:func:`train`)
    and save it into ``out_root / "clip"`` (``config.json``, ``model.safetensors``, tokenizer and
    ``CLIPImageProcessorPil`` files; loadable by :func:`paco.models.loading.load_clip`; the
    ``pickscore`` role uses the same files).

    Returns:
        JSON-able figures (also written with ``recipe.model_dump()`` to ``pretrain.json`` in that
        directory): ``steps``, ``seconds`` (training wall time), ``loss_first`` / ``loss_last``
        (mean of the first / last 10 steps), ``random_init`` and ``pretrained`` (:func:`evaluate`).

    Raises:
        ValueError: a prompts file without a prompt for every subject (:class:`SubjectTexts`).
    """
    from paco.models.loading import load_clip
    from paco.models.tiny import build_tiny

    recipe = recipe or ClipRecipe()
    out_dir = Path(out_root) / MODEL_NAME
    texts = SubjectTexts(recipe.prompts_path)
    build_tiny("clip", out_dir, recipe.seed)
    config_bytes = (out_dir / "config.json").read_bytes()
    model, processor = load_clip(out_dir)
    eval_set = evaluation_set(texts, recipe.eval_seed, recipe.eval_items)
    before = evaluate(model, processor, texts, eval_set)
    start = time.perf_counter()
    losses = train(model, processor, texts, recipe, progress=progress)
    seconds = time.perf_counter() - start
    after = evaluate(model, processor, texts, eval_set)
    model.save_pretrained(out_dir)
    (out_dir / "config.json").write_bytes(config_bytes)  # the build's (save_pretrained may add "dtype" keys)
    figures = contrastive_figures(MODEL_NAME, recipe.steps, seconds, losses, before, after)
    write_record(out_dir, MODEL_NAME, figures, recipe)
    return figures
