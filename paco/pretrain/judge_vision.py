"""Contrastive pretraining of the tiny judge's vision tower on the 16 subject photographs.

The embedded default's judge base (:func:`paco.models.tiny.build_tiny` ``"qwen2_5_vl"``:
``Qwen2_5_VLForConditionalGeneration``, vision tower 2 blocks x 64, images of at most 112 x 112
px -> 16 merged visual tokens of width 128) is random-init, so its visual tokens say little
about what a panel shows and the reward model cannot learn to read content. Here only
its vision tower (``model.model.visual``, or ``model.visual`` in older ``transformers``: patch
embedding, blocks and patch merger) is trained, with SimCLR's NT-Xent (Chen et al. 2020, "A
Simple Framework for Contrastive Learning of Visual Representations", eq. 1): each step draws two
independent views (:func:`paco.pretrain.views.subject_view`) of each of the 16
photographs, at the size of a panel of a T2IS prompt's layout in a composite of
``panel_grid`` px; the feature of a view is the mean of its merged visual tokens (what the
language model reads), L2-normalised; the other view of the same photograph is the positive, the
30 views of the other photographs are the negatives, at temperature ``recipe.temperature``.
By default the loss is on these pooled features themselves; ``recipe.projection_head`` puts
SimCLR's projection head (Linear-ReLU-Linear, ibid. §2.1, used only here and discarded) in
between, which leaves the pooled features of different photographs less apart (a smaller
cosine gap between same-photo and other-photo views).

After training, the patch merger's output layer is rescaled so the merged tokens keep their
random-init mean norm (``recipe.match_token_norm``): contrastive training grows it several-fold,
and the frozen language model was built for the initial scale.

Images reach the tower exactly as in the judge (:func:`paco.judge.model.encode_prompts`): 8-bit
PIL images through the directory's own image processor (``Qwen2VLImageProcessorPil``,
:func:`paco.models.loading.load_qwen_vl_processor`: resize into [56*56, 112*112] px at the
image's aspect, 14 px patches, 2 frames) and ``model.get_image_features(pixel_values,
image_grid_thw)``.

The language model, its embeddings and ``lm_head`` are frozen and saved unchanged: :func:`build`
checks that every tensor outside the vision tower has the same bytes as ``build_tiny``'s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import torch

from paco.pretrain.record import contrastive_figures, write_record
from paco.pretrain.views import SUBJECT_NAMES, cell_boxes, subject_view, to_pil

#: the directory :func:`build` writes under ``out_root``
MODEL_NAME = "qwen2_5_vl"

#: the composite layouts of the T2IS prompts (rows, cols): a panel's size is one of their cells
LAYOUTS: tuple[tuple[int, int], ...] = ((2, 2), (1, 3), (3, 1), (2, 3))


#: drift styles of :mod:`paco.data.photos` that need no per-prompt parameters (evaluation only)
STYLES: tuple[str, ...] = ("mono_posterise", "sepia", "blur", "sketch")


class PretrainedWeightsError(RuntimeError):
    """A tensor that pretraining must leave unchanged (outside the vision tower) differs from the
    random-init build's."""


class JudgeVisionRecipe(pydantic.BaseModel, extra="forbid"):
    """How the tiny judge's vision tower is pretrained (every field has the shipped default).

    Attributes:
        seed: ``build_tiny`` seed of the judge, of the training views (``numpy.random.default_rng``)
            and of ``torch.manual_seed`` (projection head init).
        eval_seed: seed of the held-out evaluation views (never used in training).
        steps: optimizer steps, each on 2 views of each of the 16 photographs.
        learning_rate, weight_decay: AdamW's (vision tower and projection head).
        warmup_steps: linear learning-rate warm-up, then cosine decay to 0.
        temperature: NT-Xent temperature (SimCLR: 0.1-0.5).
        projection_dim: output width of the discarded projection head.
        projection_head: ``False``: the loss is on the pooled features themselves (no head).
        panel_grid: composite size (px) whose layout cells give the panel sizes (the ``photos``
            composites are 256 px: 128 px panels in a 2x2 grid).
        crop_scale, jitter: :func:`subject_view`'s crop area range and colour jitter of the views.
        eval_views: held-out views per photograph for the figures.
        match_token_norm: after training, scale the patch merger's output layer so the mean norm
            of the merged visual tokens on the first training batch is the random-init one
            (:func:`match_token_norm`; cosines and neighbours are unchanged, the language model
            keeps reading visual tokens of the scale it was built with).
    """

    seed: int = 0
    eval_seed: int = 4321
    steps: int = pydantic.Field(300, ge=1)
    learning_rate: float = pydantic.Field(1e-3, gt=0)
    weight_decay: float = pydantic.Field(0.01, ge=0)
    warmup_steps: int = pydantic.Field(20, ge=0)
    temperature: float = pydantic.Field(0.2, gt=0)
    projection_dim: int = pydantic.Field(64, ge=1)
    projection_head: bool = False
    panel_grid: int = pydantic.Field(256, ge=112)
    crop_scale: tuple[float, float] = (0.4, 1.0)
    jitter: float = pydantic.Field(0.1, ge=0, lt=1)
    eval_views: int = pydantic.Field(8, ge=2)
    match_token_norm: bool = True

    @pydantic.field_validator("crop_scale")
    @classmethod
    def _crop(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0 < v[0] <= v[1] <= 1:
            raise ValueError(f"crop_scale must satisfy 0 < low <= high <= 1, got {v}")
        return v


def vision_tower(model: Any) -> torch.nn.Module:
    """The Qwen2.5-VL vision tower: ``model.model.visual`` (transformers >= 4.52) or ``model.visual``.

    Raises:
        AttributeError: ``model`` has neither.
    """
    inner = getattr(model, "model", None)
    tower = getattr(inner, "visual", None) if inner is not None else None
    tower = tower if tower is not None else getattr(model, "visual", None)
    if tower is None:
        raise AttributeError(f"{type(model).__name__} has no vision tower (model.model.visual / model.visual)")
    return tower


def pooled_features(model: Any, processor: Any, arrays: list[np.ndarray]) -> torch.Tensor:
    """Mean of each image's merged visual tokens: ``(B, hidden)`` float32 (hidden 128 for the
    tiny judge), with grad if enabled. ``arrays``: ``(H, W, 3)`` [0, 1] float32 images, encoded as
    8-bit PIL images by the judge's image processor."""
    enc = processor.image_processor(images=[to_pil(a) for a in arrays], return_tensors="pt")
    out = model.get_image_features(enc["pixel_values"], enc["image_grid_thw"], return_dict=True)
    tokens = out.pooler_output
    if isinstance(tokens, torch.Tensor):  # older transformers: all images' tokens concatenated
        sizes = (enc["image_grid_thw"].prod(-1) // processor.image_processor.merge_size ** 2).tolist()
        tokens = torch.split(tokens, sizes)
    return torch.stack([t.float().mean(0) for t in tokens])


def nt_xent(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's NT-Xent loss (Chen et al. 2020, eq. 1) of ``2N`` projections ``z`` ``(2N, d)``
    where rows ``i`` and ``i + N`` are the two views of one image: the mean over all ``2N``
    anchors of the cross-entropy of the positive among the other ``2N - 1`` rows, cosine
    similarities over ``temperature``. Scalar float32.

    Raises:
        ValueError: an odd number of rows or fewer than 4.
    """
    n2 = z.shape[0]
    if n2 % 2 or n2 < 4:
        raise ValueError(f"nt_xent needs an even number >= 4 of rows (two views each), got {n2}")
    z = torch.nn.functional.normalize(z.float(), dim=-1)
    sim = z @ z.T / temperature
    sim = sim.masked_fill(torch.eye(n2, dtype=torch.bool), float("-inf"))
    target = (torch.arange(n2) + n2 // 2) % n2
    return torch.nn.functional.cross_entropy(sim, target)


def _panel_size(rng: np.random.Generator, grid: int) -> tuple[int, int]:
    """``(width, height)`` of a random cell of a random :data:`LAYOUTS` layout of a ``grid`` px square."""
    rows, cols = LAYOUTS[int(rng.integers(len(LAYOUTS)))]
    x0, y0, x1, y1 = cell_boxes(grid, grid, rows, cols)[0]
    return x1 - x0, y1 - y0


def _pair_batch(rng: np.random.Generator, recipe: JudgeVisionRecipe) -> list[np.ndarray]:
    """Two views of each photograph (both at one panel size per photograph): rows ``k`` and
    ``k + 16`` are photograph ``k``'s."""
    first, second = [], []
    for name in SUBJECT_NAMES:
        w, h = _panel_size(rng, recipe.panel_grid)
        for out in (first, second):
            out.append(subject_view(name, w, h, rng, crop_scale=recipe.crop_scale, jitter=recipe.jitter))
    return first + second


def projection_head(hidden: int, out: int) -> torch.nn.Module:
    """SimCLR's projection head ``g`` (Chen et al. 2020 §2.1): Linear-ReLU-Linear, ``hidden -> hidden -> out``."""
    return torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, out))


def warmup_cosine(steps: int, warmup_steps: int, floor: float = 0.0) -> Callable[[int], float]:
    """The learning-rate factor of step ``step`` (0-based): linear warm-up ``(step + 1) /
    warmup_steps`` over the first ``warmup_steps``, then a cosine from 1 down to ``floor`` at
    step ``steps`` (SGDR's annealing, Loshchilov & Hutter 2017, eq. 5, one cycle)."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, steps - warmup_steps)
        return floor + (1.0 - floor) * (0.5 * (1.0 + math.cos(math.pi * (step - warmup_steps) / span)))
    return factor


def optimise(model: torch.nn.Module, params: list[torch.nn.Parameter], step_loss: Callable[[], torch.Tensor], *,
             steps: int, learning_rate: float, weight_decay: float, lr_factor: Callable[[int], float],
             max_grad_norm: float | None = None, desc: str, progress: bool = True) -> list[float]:
    """``steps`` AdamW steps of ``step_loss()`` (a fresh batch's scalar loss each call) on
    ``params``, the learning rate scaled by ``lr_factor(step)``, gradients clipped to
    ``max_grad_norm`` (``None``: not clipped). Every parameter of ``model`` not in ``params`` is
    frozen meanwhile (``requires_grad`` restored after, also on an error); ``params`` may hold
    parameters outside ``model`` (a projection head). The model is in train mode during, eval
    mode after.

    Returns:
        the loss of every step (nats).
    """
    from tqdm.auto import tqdm

    saved = {id(p): p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    model.train()
    losses: list[float] = []
    try:
        bar = tqdm(range(steps), desc=desc, disable=not progress)
        for _ in bar:
            loss = step_loss()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    finally:
        for p in model.parameters():
            p.requires_grad_(saved[id(p)])
        model.eval()
    return losses


def train(model: Any, processor: Any, recipe: JudgeVisionRecipe, *, progress: bool = True) -> list[float]:
    """``recipe.steps`` AdamW steps of :func:`nt_xent` on the vision tower (in place) and a fresh
    projection head; every other parameter of ``model`` is frozen (``requires_grad`` restored
    after).

    Returns:
        the loss of every step (nats; ``log(31)`` ~ 3.43 at chance).
    """
    torch.manual_seed(recipe.seed)
    rng = np.random.default_rng(recipe.seed)
    tower = vision_tower(model)
    hidden = int(model.config.vision_config.out_hidden_size)
    head = projection_head(hidden, recipe.projection_dim) if recipe.projection_head else torch.nn.Identity()
    return optimise(model, list(tower.parameters()) + list(head.parameters()),
                    lambda: nt_xent(head(pooled_features(model, processor, _pair_batch(rng, recipe))),
                                    recipe.temperature),
                    steps=recipe.steps, learning_rate=recipe.learning_rate, weight_decay=recipe.weight_decay,
                    lr_factor=warmup_cosine(recipe.steps, recipe.warmup_steps), desc="judge vision pretrain",
                    progress=progress)


def evaluation_views(seed: int, per_subject: int, grid: int = 256) -> tuple[list[np.ndarray], torch.Tensor]:
    """Held-out 128 px panels (a 2x2 cell of a ``grid`` px composite, the ``photos`` composites'
    crop and jitter) drawn from ``default_rng(seed)``: ``per_subject`` per photograph, and their
    labels (index in :data:`SUBJECT_NAMES`, int64)."""
    rng = np.random.default_rng(seed)
    arrays, labels = [], []
    for k, name in enumerate(SUBJECT_NAMES):
        for _ in range(per_subject):
            arrays.append(subject_view(name, grid // 2, grid // 2, rng, crop_scale=(0.6, 0.9), jitter=0.08))
            labels.append(k)
    return arrays, torch.tensor(labels)


def evaluate(model: Any, processor: Any, arrays: list[np.ndarray], labels: torch.Tensor) -> dict[str, float]:
    """Figures of the pooled visual features (:func:`pooled_features`) of held-out views:

    * ``nn_subject_acc``: leave-one-out nearest neighbour (cosine) is a view of the same photograph
      (chance about 1/16);
    * ``cos_same_photo`` / ``cos_other_photo``: mean cosine of a view with the other views of its
      photograph / with the views of the other photographs (the drift sensitivity: a panel
      replaced by another subject should move away), and ``cos_gap`` their difference;
    * ``cos_styled_same_view``: mean cosine of a view with itself in a drift style at full
      strength (:data:`STYLES`, cycled; the ``photos`` composites' other kind of drift);
    * ``token_norm``: mean L2 norm of the merged visual tokens the language model reads (a scale
      check: pretraining should not blow it up).
    """
    from paco.data.photos import _STYLE_FUNCS

    model.eval()
    styled = [np.clip(_STYLE_FUNCS[STYLES[i % len(STYLES)]](a, 1.0, {}), 0.0, 1.0).astype(np.float32)
              for i, a in enumerate(arrays)]
    with torch.no_grad():
        feats = pooled_features(model, processor, arrays)
        styled_feats = pooled_features(model, processor, styled)
    cos_styled = torch.nn.functional.cosine_similarity(feats, styled_feats, dim=-1).mean().item()
    z = torch.nn.functional.normalize(feats, dim=-1)
    sim = z @ z.T
    same = labels[:, None] == labels[None]
    off_diag = ~torch.eye(len(labels), dtype=torch.bool)
    cos_same = sim[same & off_diag].mean().item()
    cos_other = sim[~same].mean().item()
    nn = sim.masked_fill(~off_diag, -2.0).argmax(1)
    return {
        "nn_subject_acc": float((labels[nn] == labels).float().mean()),
        "cos_same_photo": float(cos_same),
        "cos_other_photo": float(cos_other),
        "cos_gap": float(cos_same - cos_other),
        "cos_styled_same_view": float(cos_styled),
        "token_norm": token_norm(model, processor, arrays),
    }


def token_norm(model: Any, processor: Any, arrays: list[np.ndarray]) -> float:
    """Mean L2 norm of the merged visual tokens of ``arrays`` (no grad)."""
    enc = processor.image_processor(images=[to_pil(a) for a in arrays], return_tensors="pt")
    with torch.no_grad():
        tokens = model.get_image_features(enc["pixel_values"], enc["image_grid_thw"], return_dict=True).pooler_output
    tokens = torch.cat(list(tokens)) if isinstance(tokens, (tuple, list)) else tokens
    return float(tokens.float().norm(dim=-1).mean())


def match_token_norm(model: Any, processor: Any, arrays: list[np.ndarray], target: float) -> float:
    """Scale the patch merger's last linear layer (weight and bias, so every merged token is
    multiplied by one factor) so that :func:`token_norm` of ``arrays`` is ``target``; returns the
    factor.

    Raises:
        TypeError: the merger's last module is not a ``torch.nn.Linear``.
        ValueError: the current norm is not positive and finite.
    """
    last = vision_tower(model).merger.mlp[-1]
    if not isinstance(last, torch.nn.Linear):
        raise TypeError(f"the patch merger ends in {type(last).__name__}, not Linear")
    current = token_norm(model, processor, arrays)
    if not (math.isfinite(current) and current > 0):
        raise ValueError(f"merged visual tokens have mean norm {current}")
    factor = float(target) / current
    with torch.no_grad():
        last.weight.mul_(factor)
        if last.bias is not None:
            last.bias.mul_(factor)
    return factor


def _check_unchanged(before: dict[str, torch.Tensor], after_file: Path, tower_prefixes: tuple[str, ...]) -> int:
    """Raise :class:`PretrainedWeightsError` unless every tensor of ``before`` outside the vision
    tower has the same dtype, shape and bytes in ``after_file``; returns how many were checked."""
    from safetensors.torch import load_file

    after = load_file(str(after_file))
    checked = 0
    for name, tensor in before.items():
        if name.startswith(tower_prefixes):
            continue
        other = after.get(name)
        if other is None or other.dtype != tensor.dtype or other.shape != tensor.shape or not torch.equal(other, tensor):
            raise PretrainedWeightsError(f"tensor {name} outside the vision tower changed in {after_file}")
        checked += 1
    if set(after) != set(before):
        raise PretrainedWeightsError(f"{after_file}: tensor names differ from the random-init build's")
    return checked


def build(out_root: Path, recipe: JudgeVisionRecipe | None = None, *, progress: bool = True) -> dict[str, Any]:
    """Build the tiny judge base (``build_tiny("qwen2_5_vl", ..., recipe.seed)``), pretrain its
    vision tower (:func:`train`) and save it into ``out_root / "qwen2_5_vl"`` (config, weights,
    processor and tokenizer files; loadable by :func:`paco.models.loading.load_judge`).

    Returns:
        JSON-able figures (also written with ``recipe.model_dump()`` to ``pretrain.json`` in that
        directory): ``steps``, ``seconds``, ``loss_first`` / ``loss_last`` (mean of the first /
        last 10 steps), ``random_init`` / ``pretrained`` (:func:`evaluate` on held-out views) and
        ``unchanged_tensors`` (tensors outside the vision tower checked byte-identical).

    Raises:
        PretrainedWeightsError: a tensor outside the vision tower changed.
    """
    from safetensors.torch import load_file

    from paco.models.loading import load_judge
    from paco.models.tiny import build_tiny

    recipe = recipe or JudgeVisionRecipe()
    out_dir = Path(out_root) / MODEL_NAME
    build_tiny("qwen2_5_vl", out_dir, recipe.seed)
    initial = load_file(str(out_dir / "model.safetensors"))
    prefixes = tuple(sorted({n.split("visual.")[0] + "visual." for n in initial if "visual." in n}))
    config_bytes = (out_dir / "config.json").read_bytes()
    model, processor = load_judge(out_dir)
    arrays, labels = evaluation_views(recipe.eval_seed, recipe.eval_views, recipe.panel_grid)
    before = evaluate(model, processor, arrays, labels)
    calibration = _pair_batch(np.random.default_rng(recipe.seed), recipe)
    initial_norm = token_norm(model, processor, calibration)
    start = time.perf_counter()
    losses = train(model, processor, recipe, progress=progress)
    seconds = time.perf_counter() - start
    trained_norm = token_norm(model, processor, calibration)
    if recipe.match_token_norm:
        match_token_norm(model, processor, calibration, initial_norm)
    after = evaluate(model, processor, arrays, labels)
    model.save_pretrained(out_dir)
    (out_dir / "config.json").write_bytes(config_bytes)  # the build's (save_pretrained adds "dtype" keys)
    checked = _check_unchanged(initial, out_dir / "model.safetensors", prefixes)
    figures = contrastive_figures(MODEL_NAME, recipe.steps, seconds, losses, before, after) | {
        "token_norm_initial": initial_norm,
        "token_norm_trained": trained_norm,
        "unchanged_tensors": checked,
        "vision_tower_prefixes": list(prefixes),
    }
    write_record(out_dir, MODEL_NAME, figures, recipe)
    return figures
