"""Real-width random-init models for the GPU smoke run (``benchmarks/gpu_smoke.py``), built offline.

The paper's models at their real *widths* but a few blocks deep, so one run exercises the
paper-scale kernels, memory and dtypes of every stage without hub downloads. They reuse the
tiny builders of :mod:`paco.models.tiny` (same tokenizers from :mod:`paco.models.tokenizers`,
same seeding, same ``save_pretrained`` layouts) with config overrides:

=============  ===============================================================================
role           what :func:`build_smoke_models` writes (``width_scale = 1``)
=============  ===============================================================================
judge_base     ``Qwen2_5_VLForConditionalGeneration`` at Qwen2.5-VL-7B's text width (hidden
               3584, 28 heads x 128, 4 KV heads, intermediate 18944, mrope 16/24/24, rope theta
               1e6) with 2 layers; vision tower at its real width (1280, 16 heads, intermediate
               3420, patch 14, merge 2, window 112) with 2 blocks; image budget
               ``judge_max_pixels`` (default 512 x 512 px: 324 visual tokens per 512 px panel);
               the random output head scaled to the tiny judge's logit spread
policy_t2is    ``FluxPipeline``: transformer at FLUX.1-dev's width (3072 = 24 heads x 128, rope
               axes 16/56/56, joint_attention_dim 4096, pooled 768, guidance embeds) with 2
               double + 2 single blocks; FLUX.1's VAE config (channels 128/256/512/512, 2
               layers per block, 32 groups, 16 latent channels, scaling 0.3611, shift 0.1159);
               CLIP text (hidden 768, 12 heads, 2 layers) and T5 encoder (d_model 4096, 64 heads
               x 64, d_ff 10240, gated-gelu, 2 layers) at their real output widths
clip           the tiny CLIP of :func:`paco.models.tiny.build_tiny` (the CLIP-T / PickScore
               reward model is not part of the smoke's widths)
=============  ===============================================================================

``width_scale`` (0 < s <= 1) shrinks every width for a CPU check of the same code path: head
*counts* and feed-forward / VAE widths are multiplied by ``s`` (rounded, at least one head;
FLUX and judge head dims stay 128), depths are unchanged. Vocabularies are the offline
tokenizers' (about 1k tokens), so embedding matrices are small at any width.

Weights are float32 (cast to bfloat16 by the loaders on CUDA), drawn from ``seed`` in a fixed
order: the same ``(seed, width_scale, judge_max_pixels)`` gives byte-identical files.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

from paco.models import tiny

#: roles written by :func:`build_smoke_models`
SMOKE_ROLES = ("judge_base", "policy_t2is", "clip")

#: the judge's image budget of the real-width build: 512 x 512 px (18 x 18 merged tokens)
SMOKE_JUDGE_MAX_PIXELS = 512 * 512


def _scaled(n: int, scale: float, multiple: int) -> int:
    """``n * scale`` rounded to a multiple of ``multiple`` (at least ``multiple``)."""
    return max(multiple, multiple * round(n * scale / multiple))


def _heads(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def mrope_section(head_dim: int) -> list[int]:
    """Qwen2.5-VL's multimodal rope split (t, h, w) of ``head_dim / 2`` frequencies: 16/24/24 at
    head dim 128 (the released config), the same 1/4, 3/8, 3/8 proportions otherwise.

    Raises:
        ValueError: an odd ``head_dim``.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    half = head_dim // 2
    hw = (3 * half) // 8
    return [half - 2 * hw, hw, hw]


def flux_rope_axes(head_dim: int) -> tuple[int, int, int]:
    """FLUX.1's rope axes (index, height, width) summing to ``head_dim``, each even: (16, 56, 56)
    at head dim 128 (``FluxTransformer2DModel``'s default).

    Raises:
        ValueError: ``head_dim`` not a multiple of 16.
    """
    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16, got {head_dim}")
    hw = 2 * ((7 * head_dim) // 32)
    return (head_dim - 2 * hw, hw, hw)


def judge_overrides(width_scale: float = 1.0, judge_max_pixels: int = SMOKE_JUDGE_MAX_PIXELS) -> dict[str, Any]:
    """``text`` / ``vision`` / ``pixels`` / ``lm_head_scale`` arguments of
    :func:`paco.models.tiny._qwen2_5_vl` for the Qwen2.5-VL-7B text width
    (Qwen/Qwen2.5-VL-7B-Instruct ``config.json``) with 2 layers."""
    s = _check_scale(width_scale)
    kv = _heads(4, s)
    heads = max(kv, kv * round(28 * s / kv))
    head_dim = 128
    hidden = heads * head_dim
    v_heads = _heads(16, s)
    return {
        "text": dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                     intermediate_size=_scaled(18944, s, 64), num_hidden_layers=2, max_window_layers=2,
                     max_position_embeddings=128000,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                      "mrope_section": mrope_section(head_dim)}),
        "vision": dict(depth=2, hidden_size=v_heads * 80, num_heads=v_heads,
                       intermediate_size=_scaled(3420, s, 4), fullatt_block_indexes=[1]),
        "pixels": (tiny.JUDGE_MIN_PIXELS, int(judge_max_pixels)),
        # the tiny judge's first-token logit spread (std 0.02 * 10 * sqrt(128) ~ 2.3 after RMSNorm) at
        # this width: 10 * sqrt(128 / hidden) (1.9 at 3584), not 10, whose +-40 logits would leave
        # bf16 a 0.25 resolution and P(Yes) pinned at 0 or 1
        "lm_head_scale": tiny.LM_HEAD_INIT_SCALE * math.sqrt(128 / hidden),
    }


def flux_overrides(width_scale: float = 1.0) -> dict[str, Any]:
    """``clip`` / ``t5`` / ``transformer`` / ``vae`` overrides of :func:`paco.models.tiny._build_flux`
    for FLUX.1-dev's widths (black-forest-labs/FLUX.1-dev ``transformer`` and ``vae`` configs,
    openai/clip-vit-large-patch14 text, google/t5-v1_1-xxl encoder) with 2 + 2 blocks."""
    s = _check_scale(width_scale)
    heads = _heads(24, s)
    clip_heads, t5_heads = _heads(12, s), _heads(64, s)
    clip_hidden = clip_heads * 64
    channels = tuple(_scaled(c, s, 32) for c in (128, 256, 512, 512))
    return {
        "clip": dict(hidden_size=clip_hidden, intermediate_size=_scaled(3072, s, 64), num_hidden_layers=2,
                     num_attention_heads=clip_heads, projection_dim=clip_hidden),
        "t5": dict(d_model=t5_heads * 64, d_kv=64, d_ff=_scaled(10240, s, 64), num_layers=2, num_heads=t5_heads,
                   relative_attention_num_buckets=32, relative_attention_max_distance=128),
        "transformer": dict(num_layers=2, num_single_layers=2, attention_head_dim=128, num_attention_heads=heads,
                            axes_dims_rope=flux_rope_axes(128)),
        "vae": dict(block_out_channels=channels, layers_per_block=2, norm_num_groups=32, sample_size=1024),
    }


def _check_scale(width_scale: float) -> float:
    s = float(width_scale)
    if not 0.0 < s <= 1.0:
        raise ValueError(f"width_scale must be in (0, 1], got {width_scale!r}")
    return s


def build_smoke_models(out_root: str | Path, *, seed: int = 0, width_scale: float = 1.0,
                       judge_max_pixels: int = SMOKE_JUDGE_MAX_PIXELS) -> dict[str, Path]:
    """Write the smoke models (see the module docstring) under ``out_root/<role>``.

    Args:
        out_root: parent directory; each role's directory is emptied first.
        seed: weight seed (the judge, the FLUX pipeline and CLIP each seed from it, as the
            ``models`` stage's tiny builds do).
        width_scale: in ``(0, 1]``; 1 = the real widths.
        judge_max_pixels: the judge processor's ``max_pixels`` (images are resized to at most
            this many pixels, in 28 px steps).

    Returns:
        ``{role: directory}`` for :data:`SMOKE_ROLES`, each loadable with ``from_pretrained``
        (:func:`paco.models.loading.load_judge`, :func:`paco.grpo.policies.load_policy`,
        :class:`paco.models.clip.ClipScorer`).

    Raises:
        ValueError: ``width_scale`` outside ``(0, 1]``.
    """
    judge = judge_overrides(width_scale, judge_max_pixels)
    flux = flux_overrides(width_scale)
    root = Path(out_root)
    dirs = {}
    for role in SMOKE_ROLES:
        d = root / role
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        dirs[role] = d
    with tiny._quiet():
        model, processor = tiny._qwen2_5_vl(int(seed), **judge)
        model.save_pretrained(dirs["judge_base"])
        processor.save_pretrained(dirs["judge_base"])
        del model
        tiny._build_flux(dirs["policy_t2is"], int(seed), **flux)
    tiny.build_tiny("clip", dirs["clip"], int(seed))
    return dirs
