"""Pretraining of the embedded default's tiny Qwen-Image-Edit policy.

:func:`build` writes ``<out_root>/qwen_image_edit/``: the ``QwenImageEditPipeline`` directory of
:func:`paco.models.tiny.build_tiny` (same layout, ``model_index.json`` processor patch included)
with two of its modules trained on the shipped photographs, the editing policy's train photographs
only (:func:`train_subjects`: every photograph but the edits stage's test split, so the held-out
edit items stay unseen):

1. **VAE** (``AutoencoderKLQwenImage``): trained as an autoencoder of square random views
   (:func:`paco.pretrain.views.subject_view`) with loss ``|y - x|_1 + |y - x|_2^2``
   (per-element means over ``[-1, 1]`` pixels) plus ``vae_kl_weight`` times the posterior's mean
   per-element KL to N(0, I) (Kingma & Welling 2014; the L1/L2 + small-KL autoencoder of Rombach
   et al. 2022 §3, without its perceptual and adversarial terms). It is fully convolutional, so it
   trains on ``vae_size`` px crops of the photographs at the edit items' scale. Afterwards the
   config's ``latents_mean`` / ``latents_std`` are set per latent channel from the posterior modes
   of fresh views, as Qwen-Image's VAE config holds them (``Qwen/Qwen-Image-Edit``
   ``vae/config.json``); the pipeline normalises ``(z - mean) / std`` before the transformer.
2. **Transformer** (``QwenImageTransformer2DModel``): trained with the rectified-flow objective
   (Liu et al. 2022; Esser et al. 2024, SD3 §2-3): clean latents ``x0`` (the packed, normalised
   latents of the edit's *target*), noise ``n ~ N(0, I)``, ``x_s = (1 - s) x0 + s n``, the
   transformer regresses the velocity ``n - x0`` (mean squared error). ``s`` is logit-normal
   (``sigmoid(N(0, 1))``, SD3 §3.1) time-shifted as the pipeline's scheduler shifts its sigmas
   (``FlowMatchEulerDiscreteScheduler`` exponential shift ``e^mu / (e^mu + 1/s - 1)``, ``mu`` from
   :func:`paco.grpo.sde.calculate_shift` on the scheduler config and the packed sequence length).
   Examples are :func:`paco.pretrain.views.edit_example` (input view -> correct target for
   the 7 operations of :data:`paco.data.edits.OPERATIONS`, ``colour_only`` ones skipped on
   :data:`paco.data.photos.GREYSCALE_SUBJECTS`), conditioned exactly as
   :class:`paco.grpo.policies.QwenImageEditPolicy` conditions (``condition``: the instruction
   encoded with its input image by the frozen text encoder, the input's packed reference latents,
   the grid shapes; ``velocity``: the transformer on ``[x_s, reference]`` at timestep ``1000 s``,
   divided by 1000 inside, its reference prediction dropped). A ``uncond_fraction`` share of
   examples carries the negative prompt ``" "`` (encoded with the image, as the policy encodes
   it) instead of the instruction, so true CFG (guidance 4.0, negative prompt ``" "``) has an
   unconditional branch to contrast (classifier-free guidance, Ho & Salimans 2022). An
   ``identity`` share of the batches' rows are identity examples (the same inputs, target = input,
   instruction :data:`IDENTITY_INSTRUCTION`; ``paco.pretrain.flux``'s Kontext identity bucket), so
   that the transformer learns to copy its reference tokens.

The text encoder (the tiny Qwen2.5-VL), tokenizer, processor and scheduler stay as built. The
default recipe (:data:`PRETRAINED_VAE`, :data:`PRETRAINED_TRANSFORMER`, ``identity`` 0.75) is the
FLUX finding of ``paco.pretrain.flux``: a VAE of 4 latent channels (16 packed channels, within the
tiny transformer's inner width of 32; the transformer's ``in_channels`` / ``out_channels`` follow),
the tiny transformer's width as one head of 32 (finer rotary position) and identity examples. The
held-out edit SSIM to the input after 1500 steps: 0.28 (train 0.34), against 0.12 (0.16) for the
earlier recipe (16 channels, 4 heads x 16, no identity examples, VAE 500 steps at rate 5e-3), at
0.90x the tiny transformer's cost per forward+backward and 0.80x per 6-step rollout (1.9x / 1.0x
before). At rate 5e-3 a 4-channel VAE collapses to the mean colour; at 1e-3 (1000 steps) it
reconstructs as the 16-channel one did (held-out view SSIM 0.48, greys and blurs alike). The
shipped build (``data/raw/pretrained/recipe.yaml``) widens the VAE (``base_dim`` 16: held-out view
SSIM 0.55) and trains it 1,500 steps, the transformer 3,000 steps without unconditional examples,
and samples its figures without true CFG as the embedded default does: held-out edit SSIM 0.319.
Figures (:func:`build`'s return value and ``pretrain.json``): VAE PSNR / SSIM on held-out
views, and the edits' SSIM to their input (:func:`paco.pretrain.quality.edit_ssim`) for
the edits stage's test items (held-out photographs) and its train items, sampled as
``final_samples`` samples them (``paco.grpo.final_samples._generate``: 128 px, 10 ODE steps, true
CFG 4.0 with the recipe's ``negative_prompt``, or none without one, 2 seeds per item) and with the
GRPO rollouts' 6 steps.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pydantic
import torch
from tqdm.auto import tqdm

from paco.pretrain.qwen_image_vae import set_latent_stats, single_frame_convs, train_vae, vae_quality
from paco.pretrain.record import write_record
from paco.pretrain.views import SUBJECT_NAMES, edit_example, subject_view, to_pil

#: the directory :func:`build` writes under ``out_root``
MODEL_NAME = "qwen_image_edit"
#: the embedded default's ``edits.photos`` (params.yaml): subjects, test photographs, seed, size
EDIT_PARAMS = dict(subjects=("astronaut", "cat", "coffee", "rocket", "grace_hopper", "motorcycle"),
                   test_photos=2, seed=0, size=128)
#: the true-CFG negative prompt and scale of ``final_samples.qwen_editing`` / ``grpo.qwen_editing``
NEGATIVE_PROMPT = " "
GUIDANCE_SCALE = 4.0
#: the instruction of the identity examples (target = input), as ``paco.pretrain.flux``'s Kontext ones
IDENTITY_INSTRUCTION = "Keep the photo exactly as it is."
#: Qwen-Image's 2x2 packing of the VAE latent into transformer tokens (``_pack_latents``)
PACKED_CHANNELS_PER_LATENT = 4
#: the tiny VAE's latent channels (:func:`paco.models.tiny._build_qwen_image_edit`)
TINY_Z_DIM = 16
#: the VAE overrides of the pretrained build: 4 latent channels (16 packed, within the transformer's
#: inner width of 32) instead of the tiny's 16 (64 packed), as ``paco.pretrain.flux.PRETRAINED_VAE``
PRETRAINED_VAE: dict[str, Any] = {"z_dim": 4}
#: the transformer overrides of the pretrained build: the tiny's 2 blocks and inner width 32 as one
#: head of 32 with rotary dims 8 + 12 + 12 (frame, height, width; finer position than 2 x 16's
#: 4 + 6 + 6), as ``paco.pretrain.flux.PRETRAINED_TRANSFORMER``
PRETRAINED_TRANSFORMER: dict[str, Any] = {"attention_head_dim": 32, "num_attention_heads": 1,
                                          "axes_dims_rope": [8, 12, 12]}


class QwenImageEditRecipe(pydantic.BaseModel, extra="forbid"):
    """Seeds, step counts, rates, sizes and architecture overrides of :func:`build`.

    ``transformer`` / ``vae``: keys overriding the tiny ``QwenImageTransformer2DModel`` /
    ``AutoencoderKLQwenImage`` arguments (:func:`paco.models.tiny._build_qwen_image_edit`); empty:
    the tiny architecture. The transformer's ``in_channels`` / ``out_channels`` follow the VAE's
    ``z_dim`` (:meth:`overrides`). ``identity``: the share of training batches' rows that are
    identity examples (:func:`make_bank`). ``negative_prompt``: the figures' edits are sampled with
    true CFG 4.0 and this negative prompt (as ``final_samples.qwen_editing.negative_prompt``), or
    without true CFG where ``None`` (the embedded default's params; ``uncond_fraction`` then trains
    a branch no sampler uses).
    """

    seed: int = 0
    transformer: dict[str, Any] = pydantic.Field(default_factory=lambda: dict(PRETRAINED_TRANSFORMER))
    vae: dict[str, Any] = pydantic.Field(default_factory=lambda: dict(PRETRAINED_VAE))
    # VAE
    vae_steps: int = pydantic.Field(1000, ge=0)
    vae_batch: int = pydantic.Field(8, ge=1)
    vae_size: int = pydantic.Field(64, ge=16)
    vae_crop_scale: tuple[float, float] = (0.1, 0.6)
    vae_lr: float = pydantic.Field(1e-3, gt=0)  # 5e-3 collapses a 4-channel VAE to the mean colour
    vae_kl_weight: float = pydantic.Field(1e-4, ge=0)
    vae_stat_views: int = pydantic.Field(64, ge=2)
    vae_eval_views: int = pydantic.Field(16, ge=1)  # per held-out photograph, and as many of train ones
    # transformer
    steps: int = pydantic.Field(1500, ge=0)
    batch: int = pydantic.Field(16, ge=1)
    lr: float = pydantic.Field(2e-3, gt=0)
    examples: int = pydantic.Field(1024, ge=1)
    resolution: int = pydantic.Field(128, ge=16)
    uncond_fraction: float = pydantic.Field(0.1, ge=0, lt=1)
    identity: float = pydantic.Field(0.75, ge=0, lt=1)
    # evaluation (as final_samples.qwen_editing / grpo.qwen_editing.rollout)
    negative_prompt: str | None = NEGATIVE_PROMPT  # the figures' true-CFG negative prompt; None: no true CFG
    eval_seeds: int = pydantic.Field(2, ge=1)
    eval_steps: int = pydantic.Field(10, ge=2)  # Qwen-Image's shift_terminal divides by zero at 1 step
    rollout_steps: int = pydantic.Field(6, ge=2)
    eval_max_items: int | None = pydantic.Field(None, ge=1)  # the first items of each split only (tests)

    @pydantic.model_validator(mode="after")
    def _check(self) -> QwenImageEditRecipe:
        lo, hi = self.vae_crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"vae_crop_scale must satisfy 0 < lo <= hi <= 1, got {self.vae_crop_scale}")
        for name in ("vae_size", "resolution"):
            if getattr(self, name) % 16:
                raise ValueError(f"{name} must be a multiple of 16 (VAE factor 8 x 2x2 packing), got {getattr(self, name)}")
        z_dim = self.vae.get("z_dim", TINY_Z_DIM)
        if not isinstance(z_dim, int) or z_dim < 1:
            raise ValueError(f"vae.z_dim must be a positive integer, got {z_dim!r}")
        for key, want in (("in_channels", PACKED_CHANNELS_PER_LATENT * z_dim), ("out_channels", z_dim)):
            if self.transformer.get(key, want) != want:
                raise ValueError(f"transformer.{key} must be {want} for vae.z_dim {z_dim} (2x2 packing), "
                                 f"got {self.transformer[key]}")
        return self

    def overrides(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(transformer, vae)`` overrides for :func:`paco.models.tiny._build_qwen_image_edit`: with a
        ``vae.z_dim``, the transformer's ``in_channels`` = 4 ``z_dim`` and ``out_channels`` = ``z_dim``
        and the VAE's ``latents_mean`` / ``latents_std`` placeholders ``z_dim`` zeros / ones (set from
        the trained latents by :func:`set_latent_stats`); without one, the recipe's as they are."""
        transformer, vae = dict(self.transformer), dict(self.vae)
        if "z_dim" in vae:
            z_dim = vae["z_dim"]
            transformer.update(in_channels=PACKED_CHANNELS_PER_LATENT * z_dim, out_channels=z_dim)
            vae = {"latents_mean": [0.0] * z_dim, "latents_std": [1.0] * z_dim, **vae}
        return transformer, vae


# -------------------------------------------------------------------------------------------- data


def held_out_subjects() -> set[str]:
    """The photographs of the edits stage's test split under the default params (:data:`EDIT_PARAMS`)."""
    from paco.pretrain.views import train_edit_subjects

    p = EDIT_PARAMS
    return set(p["subjects"]) - set(train_edit_subjects(list(p["subjects"]), p["test_photos"], p["seed"]))


def train_subjects() -> list[str]:
    """Every photograph but :func:`held_out_subjects`, sorted: what the policy is pretrained on."""
    return sorted(set(SUBJECT_NAMES) - held_out_subjects())


def operations_for(subject: str) -> list[str]:
    """The operations of :data:`paco.data.edits.OPERATIONS` that apply to ``subject`` (``colour_only``
    ones are skipped on grey-scale photographs, as the edits stage skips them)."""
    from paco.data.edits import OPERATIONS
    from paco.data.photos import GREYSCALE_SUBJECTS

    return [n for n, op in OPERATIONS.items() if not (op.colour_only and subject in GREYSCALE_SUBJECTS)]


def edit_items(split: str) -> list[Any]:
    """The edits stage's items of ``split`` (``train`` or ``test``) under :data:`EDIT_PARAMS`, as
    :class:`paco.grpo.rewards.SubtaskItem` (instruction, decoded input image), sorted by id, with
    their target images: ``[(item, target PIL image)]``.

    Raises:
        ValueError: another ``split``.
    """
    from paco.core.io import decode_image
    from paco.data.edits import OPERATIONS, photo_edits
    from paco.grpo.rewards import SubtaskItem

    if split not in ("train", "test"):
        raise ValueError(f"split must be train or test, got {split!r}")
    p = EDIT_PARAMS
    table = photo_edits(list(p["subjects"]), list(OPERATIONS), p["size"], p["test_photos"], p["seed"])
    rows = table[table["split"] == split].sort_values("item_id").to_dict("records")
    return [(SubtaskItem.from_edit_row(r), decode_image(r["target_image"])) for r in rows]


# -------------------------------------------------------------------------------------------- transformer


@dataclass
class EditBank:
    """Conditioned editing examples (one row each): the policy's ``condition`` of the example's
    prompt (its instruction, or the negative prompt on the ``uncond`` rows) trimmed to its valid
    tokens, and the packed latents of the input (``reference`` ``(N, seq, C)`` float32) and of the
    target (``target``, encoded as the reference is); ``identity`` marks the identity rows."""

    embeds: list[torch.Tensor]
    uncond: torch.Tensor
    reference: torch.Tensor
    target: torch.Tensor
    img_shapes: torch.Tensor
    identity: torch.Tensor


@torch.no_grad()
def encode_references(policy: Any, images: Sequence[Any]) -> torch.Tensor:
    """:meth:`~paco.grpo.policies.QwenImageEditPolicy.encode_reference` of equal-size images in one
    VAE batch (the same arithmetic: preprocess, posterior mode, ``(z - latents_mean) / latents_std``,
    2x2 packing; every VAE op is per sample): ``(B, seq, C)`` float32."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import retrieve_latents

    pipe, vae = policy.pipe, policy.pipe.vae
    z_dim = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1)
    x = torch.cat([pipe.image_processor.preprocess(im, im.height, im.width) for im in images]).unsqueeze(2)
    z = retrieve_latents(vae.encode(x.to(policy.device, dtype=vae.dtype)), sample_mode="argmax")
    z = (z - mean.to(z)) / std.to(z)
    return pipe._pack_latents(z, len(images), z_dim, z.shape[3], z.shape[4]).float()


@contextlib.contextmanager
def _batched_conditioning(policy: Any) -> Iterator[None]:
    """The policy's ``condition`` with its references encoded in one batch (:func:`encode_references`),
    true CFG off (one text per example), the VAE's convolutions as 2-D ones (:func:`single_frame_convs`)."""
    saved = policy.negative_prompt
    policy.negative_prompt = None
    policy.encode_reference = lambda images: encode_references(policy, images)
    try:
        with single_frame_convs():
            yield
    finally:
        del policy.encode_reference
        policy.negative_prompt = saved


def make_bank(policy: Any, subjects: Sequence[str], count: int, size: int, seed: int, uncond_fraction: float,
              chunk: int = 32, *, identity: bool = False) -> EditBank:
    """``count`` editing examples (:func:`paco.pretrain.views.edit_example`: a random photograph
    of ``subjects`` and one of its operations, drawn from ``default_rng([seed, 2])``) at ``size`` px,
    conditioned by ``policy`` (a :class:`~paco.grpo.policies.QwenImageEditPolicy`: its ``condition``,
    :func:`_batched_conditioning`); a ``uncond_fraction`` share (each example with that probability)
    carries the negative prompt :data:`NEGATIVE_PROMPT` instead of its instruction. With ``identity``
    each example's input also makes an identity row (instruction :data:`IDENTITY_INSTRUCTION`,
    target = input; as ``paco.pretrain.flux``'s Kontext identity bucket), appended after the
    ``count`` edit rows."""
    from paco.grpo.rewards import SubtaskItem

    rng = np.random.default_rng([seed, 2])
    embeds, uncond, refs, targets, same = [], [], [], [], []
    shapes = None
    for start in tqdm(range(0, count, chunk), desc="qwen_image examples", leave=False):
        items, target_images = [], []
        for k in range(start, min(count, start + chunk)):
            subject = subjects[int(rng.integers(len(subjects)))]
            ops = operations_for(subject)
            source, target, instruction = edit_example(subject, ops[int(rng.integers(len(ops)))], size, rng,
                                                       others=subjects)
            uncond.append(bool(rng.random() < uncond_fraction))
            prompt = NEGATIVE_PROMPT if uncond[-1] else instruction
            items.append(SubtaskItem(str(k), prompt, "", 1, 1, (prompt,), to_pil(source)))
            target_images.append(to_pil(target))
        with _batched_conditioning(policy):
            cond = policy.condition(items, size, size)
            targets.append(encode_references(policy, target_images))
            embeds += _trimmed(cond)
            refs.append(cond["image_latents"])
            shapes = cond["img_shapes"]
            if identity:
                same.append(policy.condition([SubtaskItem(f"same-{it.prompt_id}", IDENTITY_INSTRUCTION, "", 1, 1,
                                                          (IDENTITY_INSTRUCTION,), it.reference) for it in items],
                                             size, size))
    for cond in same:
        embeds += _trimmed(cond)
        uncond += [False] * len(cond["image_latents"])
    refs += [c["image_latents"] for c in same]
    rows = torch.zeros(len(embeds), dtype=torch.bool)
    rows[count:] = True
    return EditBank(embeds, torch.tensor(uncond), torch.cat(refs), torch.cat(targets + refs[len(targets):]),
                    shapes, rows)


def _trimmed(cond: dict) -> list[torch.Tensor]:
    """The text embeddings of a ``condition`` trimmed to their valid tokens, one per row."""
    return [cond["prompt_embeds"][i, :int(cond["prompt_mask"][i].sum())].clone() for i in range(len(cond["prompt_mask"]))]


def _batch_condition(bank: EditBank, index: Sequence[int]) -> Any:
    """The :class:`~paco.grpo.policies.Conditioning` of bank rows ``index``, the text right-padded
    with a zero mask as ``Conditioning.cat`` pads it."""
    from paco.grpo.policies import Conditioning

    texts = [bank.embeds[i] for i in index]
    length = max(t.shape[0] for t in texts)
    embeds = torch.zeros(len(texts), length, texts[0].shape[1])
    mask = torch.zeros(len(texts), length, dtype=torch.long)
    for row, t in enumerate(texts):
        embeds[row, :t.shape[0]] = t
        mask[row, :t.shape[0]] = 1
    rows = {"prompt_embeds": embeds, "prompt_mask": mask, "image_latents": bank.reference[list(index)]}
    return Conditioning(rows, {"img_shapes": bank.img_shapes}, pad={"prompt_embeds": 0.0, "prompt_mask": 0})


def shift_mu(scheduler_config: Any, size: int) -> float:
    """The scheduler's resolution-dependent shift ``mu`` for a ``size`` px square: packed sequence
    length ``(size / 16)^2`` (:func:`paco.grpo.sde.calculate_shift` on the config's
    ``base/max_image_seq_len`` and ``base/max_shift``, as ``QwenImageEditPipeline`` computes it)."""
    from paco.grpo.sde import calculate_shift

    c = scheduler_config
    return calculate_shift((size // 16) ** 2, c["base_image_seq_len"], c["max_image_seq_len"],
                           c["base_shift"], c["max_shift"])


def shifted_logit_normal(batch: int, mu: float, generator: torch.Generator) -> torch.Tensor:
    """``(batch,)`` float32 noise levels ``s = e^mu / (e^mu + 1/u - 1)``, ``u = sigmoid(N(0, 1))``
    (logit-normal, Esser et al. 2024 §3.1; the exponential time shift of diffusers'
    ``FlowMatchEulerDiscreteScheduler.time_shift``), clamped to ``[1e-4, 1]``."""
    u = torch.sigmoid(torch.randn(batch, generator=generator))
    return (math.exp(mu) / (math.exp(mu) + 1.0 / u - 1.0)).clamp(1e-4, 1.0)


def flow_loss(policy: Any, bank: EditBank, index: Sequence[int], s: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The rectified-flow loss (module docstring) of bank rows ``index`` at noise levels ``s``
    ``(B,)`` in (0, 1] with noise ``(B, seq, C)``: ``mean((v - (n - x0))^2)``, ``v`` the policy's
    velocity at ``x_s`` and timestep ``1000 s`` (its timestep convention), true CFG off."""
    x0 = bank.target[list(index)]
    xs = (1.0 - s[:, None, None]) * x0 + s[:, None, None] * noise
    saved, policy.negative_prompt = policy.negative_prompt, None  # one conditional pass, no CFG
    try:
        v = policy.velocity(xs, 1000.0 * s, _batch_condition(bank, index))
    finally:
        policy.negative_prompt = saved
    return ((v.float() - (noise - x0)) ** 2).mean()


def train_transformer(policy: Any, bank: EditBank, recipe: QwenImageEditRecipe) -> list[float]:
    """Train the policy's transformer in place: ``recipe.steps`` AdamW steps (no weight decay; the
    rate warmed up linearly over 5% of the steps, then cosine-decayed to 10%; gradient norm clipped
    at 1) of :func:`flow_loss` on random batches of ``bank``, noise levels from :func:`shifted_logit_normal`; all draws from
    ``torch.Generator().manual_seed(seed)``.

    Returns:
        the loss of every step.
    """
    tr = policy.transformer
    tr.requires_grad_(True)
    tr.train()
    gen = torch.Generator().manual_seed(recipe.seed + 3)
    mu = shift_mu(policy.pipe.scheduler.config, recipe.resolution)
    opt = torch.optim.AdamW(tr.parameters(), lr=recipe.lr, weight_decay=0.0)
    warm = max(1, recipe.steps // 20)
    losses = []
    for step in tqdm(range(recipe.steps), desc="qwen_image transformer", leave=False):
        frac = max(0.0, (step - warm) / max(1, recipe.steps - warm))
        scale = min(1.0, (step + 1) / warm) * (0.1 + 0.45 * (1.0 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = recipe.lr * scale
        index = _draw_rows(bank, recipe, gen)
        s = shifted_logit_normal(recipe.batch, mu, gen)
        noise = torch.randn(bank.target[list(index)].shape, generator=gen)
        loss = flow_loss(policy, bank, index, s, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tr.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    tr.requires_grad_(False)
    tr.eval()
    return losses


def _draw_rows(bank: EditBank, recipe: QwenImageEditRecipe, gen: torch.Generator) -> list[int]:
    """``recipe.batch`` bank rows drawn uniformly; with identity rows in ``bank``, each is one of
    them with probability ``recipe.identity`` and an edit row otherwise."""
    if not bank.identity.any():
        return torch.randint(0, len(bank.embeds), (recipe.batch,), generator=gen).tolist()
    edit, same = torch.nonzero(~bank.identity)[:, 0], torch.nonzero(bank.identity)[:, 0]
    pick = torch.rand(recipe.batch, generator=gen) < recipe.identity
    rows = torch.where(pick, same[torch.randint(0, len(same), (recipe.batch,), generator=gen)],
                       edit[torch.randint(0, len(edit), (recipe.batch,), generator=gen)])
    return rows.tolist()


# -------------------------------------------------------------------------------------------- figures


def load_edit_policy(model_dir: Path, *, negative_prompt: str | None = NEGATIVE_PROMPT) -> Any:
    """``model_dir`` loaded with :func:`paco.grpo.policies.load_policy` as ``qwen_image_edit`` (true
    CFG 4.0 with ``negative_prompt``, reference aspect kept; no LoRA), float32 on CPU."""
    from paco.grpo.policies import load_policy

    settings = SimpleNamespace(guidance_scale=GUIDANCE_SCALE, negative_prompt=negative_prompt, reference_aspect="keep")
    return load_policy("qwen_image_edit", model_dir, None, settings)


def sample_edits(policy: Any, items: Sequence[Any], *, steps: int, seeds: int, size: int = 128, seed: int = 0,
                 batch: int = 4) -> list[list[Any]]:
    """ODE samples of ``items`` as ``final_samples`` makes them (``paco.grpo.final_samples._generate``:
    seed ``k`` of an item draws its noise from ``stable_seed(seed, "final", item id, k)``).

    Returns:
        per item, ``seeds`` PIL images of ``size`` px.
    """
    from paco.grpo.final_samples import _generate

    jobs = [(it, k, (size, size)) for it in items for k in range(seeds)]
    images = _generate(policy, jobs, SimpleNamespace(batch_size=batch, seed=seed, num_steps=steps))
    return [images[i * seeds:(i + 1) * seeds] for i in range(len(items))]


def edit_figures(policy: Any, split: str, recipe: QwenImageEditRecipe) -> tuple[dict[str, Any], list[tuple]]:
    """SSIM figures of the edits stage's ``split`` items (:func:`edit_items`) sampled at 128 px with
    ``eval_steps`` and ``rollout_steps`` ODE steps, ``eval_seeds`` seeds each.

    Returns:
        ``(figures, [(input, first edit, target)])``: ``ssim_to_input`` (``eval_steps``; the goal
        figure), ``ssim_to_input_<rollout_steps>_steps``, ``ssim_to_target`` and, for scale,
        ``target_ssim_to_input`` (what the correct edits score) and per operation.
    """
    from paco.pretrain.quality import edit_ssim

    pairs = edit_items(split)[:recipe.eval_max_items]
    items = [it for it, _ in pairs]
    final = sample_edits(policy, items, steps=recipe.eval_steps, seeds=recipe.eval_seeds)
    rollout = sample_edits(policy, items, steps=recipe.rollout_steps, seeds=recipe.eval_seeds)
    per_op: dict[str, list[float]] = {}
    to_input, to_target, quick, target_input, triplets = [], [], [], [], []
    for (it, target), ims, ims_r in zip(pairs, final, rollout, strict=True):
        scores = [edit_ssim(im, it.reference) for im in ims]
        to_input += scores
        per_op.setdefault(it.prompt_id.split("-", 1)[1], []).extend(scores)
        to_target += [edit_ssim(im, target) for im in ims]
        quick += [edit_ssim(im, it.reference) for im in ims_r]
        target_input.append(edit_ssim(target, it.reference))
        triplets.append((it.reference, ims[0], target))
    r = lambda v: round(float(np.mean(v)), 4)  # noqa: E731
    return {"items": len(items), "samples": len(to_input), "ssim_to_input": r(to_input),
            f"ssim_to_input_{recipe.rollout_steps}_steps": r(quick), "ssim_to_target": r(to_target),
            "target_ssim_to_input": r(target_input), "per_operation": {k: r(v) for k, v in sorted(per_op.items())}}, triplets


# -------------------------------------------------------------------------------------------- build


def _build_base(directory: Path, recipe: QwenImageEditRecipe) -> None:
    """The tiny pipeline tree (:func:`paco.models.tiny.build_tiny`; with ``recipe.transformer``
    overrides, the same builder with them)."""
    from paco.models import tiny

    if not recipe.transformer and not recipe.vae:
        tiny.build_tiny(MODEL_NAME, directory, recipe.seed)
        return
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    transformer, vae = recipe.overrides()
    with tiny._quiet():
        tiny._build_qwen_image_edit(directory, recipe.seed, transformer=transformer, vae=vae)


def _save(module: Any, directory: Path) -> None:
    """``module.save_pretrained(directory)`` without the ``_name_or_path`` that loading recorded in
    its config (the tiny build has none; a path would make the bytes depend on the build folder)."""
    from diffusers.configuration_utils import FrozenDict

    module._internal_dict = FrozenDict({k: v for k, v in module._internal_dict.items() if k != "_name_or_path"})
    module.save_pretrained(directory)


def build(out_root: Path, recipe: QwenImageEditRecipe) -> dict:
    """Build, pretrain and save ``out_root/qwen_image_edit/`` (module docstring) and write its
    ``pretrain.json`` (``recipe`` and figures).

    Args:
        out_root: parent directory (created if missing); an existing ``qwen_image_edit`` in it is
            replaced.
        recipe: the :class:`QwenImageEditRecipe`.

    Returns:
        JSON-able figures: ``steps``, ``seconds`` per phase, ``losses`` (first / last 50-step means),
        ``vae`` (PSNR / SSIM on held-out views), ``edits_test`` / ``edits_train``
        (:func:`edit_figures`), the subjects used.
    """
    out = Path(out_root) / MODEL_NAME
    t0 = time.perf_counter()
    subjects, held = train_subjects(), sorted(held_out_subjects())
    _build_base(out, recipe)
    policy = load_edit_policy(out)
    vae = policy.pipe.vae
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        vae_losses = train_vae(vae, subjects, recipe)
    rng = np.random.default_rng([recipe.seed, 4])
    set_latent_stats(vae, [subject_view(subjects[k % len(subjects)], recipe.resolution, recipe.resolution, rng,
                                        crop_scale=(0.5, 1.0), jitter=0.05) for k in range(recipe.vae_stat_views)])
    erng = np.random.default_rng([recipe.seed, 5])
    view = lambda name: subject_view(name, 128, 128, erng, crop_scale=(0.5, 1.0), jitter=0.05)  # noqa: E731
    vae_fig = {"held_out_views": vae_quality(vae, [view(h) for h in held for _ in range(recipe.vae_eval_views)]),
               "train_views": vae_quality(vae, [view(subjects[k % len(subjects)])
                                                for k in range(len(held) * recipe.vae_eval_views)])}
    _save(vae, out / "vae")
    t_vae = time.perf_counter()
    bank = make_bank(policy, subjects, recipe.examples, recipe.resolution, recipe.seed, recipe.uncond_fraction,
                     identity=recipe.identity > 0)
    t_bank = time.perf_counter()
    tr_losses = train_transformer(policy, bank, recipe)
    _save(policy.transformer, out / "transformer")
    t_tr = time.perf_counter()
    policy = load_edit_policy(out, negative_prompt=recipe.negative_prompt)  # what every stage loads
    test, _ = edit_figures(policy, "test", recipe)
    train, _ = edit_figures(policy, "train", recipe)
    mean = lambda v: round(float(np.mean(v)), 5) if len(v) else None  # noqa: E731
    figures = {
        "steps": {"vae": recipe.vae_steps, "transformer": recipe.steps},
        "seconds": {"vae": round(t_vae - t0, 1), "examples": round(t_bank - t_vae, 1),
                    "transformer": round(t_tr - t_bank, 1), "evaluation": round(time.perf_counter() - t_tr, 1)},
        "losses": {"vae_first50": mean(vae_losses[:50]), "vae_last50": mean(vae_losses[-50:]),
                   "flow_first50": mean(tr_losses[:50]), "flow_last50": mean(tr_losses[-50:])},
        "vae": vae_fig, "edits_test": test, "edits_train": train,
        "transformer_parameters": sum(p.numel() for p in policy.transformer.parameters()),
        "train_subjects": subjects, "held_out_subjects": held,
    }
    write_record(out, MODEL_NAME, figures, recipe)
    return figures
