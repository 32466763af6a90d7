"""Tiny random-init models, built offline and saved in Hugging Face format.

The embedded default has no hub (docs/architecture.md §10): the ``models`` stage calls :func:`build_tiny`,
which trains a tokenizer on the built-in corpus, constructs the model from a small config with
weights drawn from ``torch.manual_seed(seed)``, and writes everything with ``save_pretrained``
(safetensors). Later stages load the directory with ``from_pretrained`` exactly as they would a
hub snapshot (:mod:`paco.models.loading`).

Same ``(name, seed)`` -> byte-identical files (tokenizer training and weight init are
deterministic, safetensors headers are sorted); a different seed changes every weight file.

=============  ===============================================================================
name           what is written to ``out_dir``
=============  ===============================================================================
qwen2_5_vl     ``Qwen2_5_VLForConditionalGeneration`` (text 2 layers x 128, vision 2 blocks x
               64, patch 14, merge 2) + processor (image-only, PIL image processor resizing to
               at most 112x112 px: a 128 px panel -> 8x8 patches -> 16 visual tokens)
flux           ``FluxPipeline`` layout: ``transformer`` (1 double + 1 single block, 2 heads x
               16), ``vae`` (``AutoencoderKL``, 16 latent channels, scale factor 8, one
               GroupNorm group, see ``_build_flux``), ``text_encoder`` (CLIP text),
               ``text_encoder_2`` (T5 encoder), ``tokenizer``, ``tokenizer_2``, ``scheduler``
               (flow matching, dynamic shifting)
flux_kontext   the ``flux`` components (same configs, same weights for the same seed) as a
               ``FluxKontextPipeline`` (``model_index.json``): FLUX.1 Kontext's transformer is a
               ``FluxTransformer2DModel`` with the reference image's latents in its sequence
qwen_image_   ``QwenImageEditPipeline`` layout: ``transformer`` (``QwenImageTransformer2DModel``, 2
edit           blocks, 2 heads x 16), ``vae`` (``AutoencoderKLQwenImage``, 16 latent channels, scale
               factor 8), ``text_encoder`` (the ``qwen2_5_vl`` model), ``tokenizer`` and
               ``processor`` (its tokenizer and image-only processor), ``scheduler`` (Qwen-Image's)
clip           ``CLIPModel`` (text + vision, projection 64, 32 px images) + ``CLIPProcessor``
=============  ===============================================================================
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

#: Names accepted by :func:`build_tiny`.
TINY_NAMES = ("qwen2_5_vl", "flux", "flux_kontext", "qwen_image_edit", "clip")

#: Judge image budget: at most 112x112 px (8x8 patches of 14 px -> 4x4 = 16 merged visual
#: tokens), at least 56x56 px (4 tokens).
JUDGE_MIN_PIXELS = 56 * 56
JUDGE_MAX_PIXELS = 112 * 112


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed torch's CPU generator for a construction, restoring the previous state after."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence transformers' / diffusers' info logs and progress bars while building."""
    from diffusers.utils import logging as df_logging
    from transformers.utils import logging as hf_logging

    saved = [(lib, lib.get_verbosity(), lib.is_progress_bar_enabled()) for lib in (hf_logging, df_logging)]
    for lib, _, _ in saved:
        lib.set_verbosity_error()
        lib.disable_progress_bar()
    try:
        yield
    finally:
        for lib, level, bars in saved:
            lib.set_verbosity(level)
            if bars:
                lib.enable_progress_bar()


# --------------------------------------------------------------------------------------------
# judge: Qwen2.5-VL
# --------------------------------------------------------------------------------------------


#: factor on the tiny judge's randomly initialised output head (see ``_build_qwen2_5_vl``)
LM_HEAD_INIT_SCALE = 10.0


def _build_qwen2_5_vl(out_dir: Path, seed: int) -> None:
    model, processor = _qwen2_5_vl(seed)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)


def _qwen2_5_vl(seed: int, *, text: dict | None = None, vision: dict | None = None,
                pixels: tuple[int, int] | None = None,
                lm_head_scale: float = LM_HEAD_INIT_SCALE) -> tuple[object, object]:
    """The tiny Qwen2.5-VL (model, image-only processor) drawn from ``seed``.

    ``text`` / ``vision``: keys overriding the tiny ``text_config`` / ``vision_config`` (e.g. a
    real-width build, :mod:`paco.models.smoke`; ``out_hidden_size`` follows ``hidden_size``);
    ``pixels``: the image processor's ``(min_pixels, max_pixels)``; ``lm_head_scale``: the factor on
    the random output head (below). Without them the tiny judge's bytes are unchanged.
    """
    from transformers import (
        GenerationConfig,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    from paco.models.loading import Qwen2_5_VLImageOnlyProcessor
    from paco.models.tokenizers import train_qwen_tokenizer

    tokenizer = train_qwen_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in
           ("<|endoftext|>", "<|im_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
            "<|vision_end|>")}
    text_config = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                         "mrope_section": [4, 6, 6]},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=2,
    )
    text_config.update(text or {})
    hidden = text_config["hidden_size"]
    head_dim = hidden // text_config["num_attention_heads"]  # tiny: 32 -> 16 rotary frequencies split t/h/w 4/6/6
    vision_config = dict(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        in_channels=3,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[1],
        out_hidden_size=hidden,
        tokens_per_second=2,
    )
    vision_config.update(vision or {})
    vision_config["out_hidden_size"] = hidden
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    if sum(config.text_config.rope_parameters["mrope_section"]) * 2 != head_dim:
        raise ValueError(f"mrope_section {config.text_config.rope_parameters['mrope_section']} must sum to "
                         f"head_dim / 2 = {head_dim // 2}")
    with _seeded(seed):
        model = Qwen2_5_VLForConditionalGeneration(config)
        # A random lm_head with the default std (0.02) after RMSNorm caps every logit near
        # +-2.6, so no token can exceed ~1% probability and the answer-token loss never
        # saturates; a pretrained head has far larger rows. Scale it so the tiny judge can
        # express a confident Yes/No (deterministic: a pure function of the seeded init).
        with torch.no_grad():
            model.lm_head.weight.mul_(lm_head_scale)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    )
    min_pixels, max_pixels = pixels or (JUDGE_MIN_PIXELS, JUDGE_MAX_PIXELS)
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
    )
    processor = Qwen2_5_VLImageOnlyProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )
    return model, processor


# --------------------------------------------------------------------------------------------
# CLIP
# --------------------------------------------------------------------------------------------


def _build_clip(out_dir: Path, seed: int) -> None:
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    from paco.models.tokenizers import train_clip_tokenizer

    tokenizer = train_clip_tokenizer()
    image_size = 32
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=77,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=image_size,
            patch_size=8,
        ),
        projection_dim=64,
    )
    with _seeded(seed):
        model = CLIPModel(config)
    model.save_pretrained(out_dir)
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out_dir)


# --------------------------------------------------------------------------------------------
# FLUX.1
# --------------------------------------------------------------------------------------------

#: FLUX.1-dev's scheduler config (resolution-dependent shift of the sigma schedule).
FLUX_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)


def _build_flux(out_dir: Path, seed: int, pipeline_class: str = "FluxPipeline", *, clip: dict | None = None,
                t5: dict | None = None, transformer: dict | None = None, vae: dict | None = None) -> None:
    """The FLUX.1 pipeline tree drawn from ``seed``. ``clip``, ``t5``, ``transformer``, ``vae``:
    keys overriding the tiny ``CLIPTextConfig``, ``T5Config``, ``FluxTransformer2DModel`` and
    ``AutoencoderKL`` arguments (a real-width build, :mod:`paco.models.smoke`); the transformer's
    ``joint_attention_dim`` / ``pooled_projection_dim`` follow the T5 ``d_model`` / CLIP
    ``hidden_size``. Without them the tiny pipeline's bytes are unchanged."""
    import diffusers
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxTransformer2DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from paco.models.tokenizers import train_clip_tokenizer, train_t5_tokenizer

    tokenizer = train_clip_tokenizer()
    tokenizer_2 = train_t5_tokenizer()
    clip_config = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        projection_dim=32,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    clip_config.update(clip or {})
    t5_config = dict(
        vocab_size=len(tokenizer_2),
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=tokenizer_2.pad_token_id,
        eos_token_id=tokenizer_2.eos_token_id,
        decoder_start_token_id=tokenizer_2.pad_token_id,
    )
    t5_config.update(t5 or {})
    transformer_config = dict(
        patch_size=1,
        in_channels=64,  # 16 latent channels x 2x2 packing
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=t5_config["d_model"],
        pooled_projection_dim=clip_config["hidden_size"],
        guidance_embeds=True,  # FLUX.1-dev is guidance-distilled
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    )
    transformer_config.update(transformer or {})
    vae_config = dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),  # 4 levels -> vae_scale_factor 8 as in FLUX
        layers_per_block=1,
        latent_channels=16,
        # One GroupNorm group: with a group per channel (InstanceNorm on the 8-channel last
        # level) every decoded image has the same per-channel mean, so no policy can change
        # the global colour a reward sees; one group keeps only the overall normalisation.
        norm_num_groups=1,
        sample_size=128,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=True,
    )
    vae_config.update(vae or {})
    with _seeded(seed):
        # One seed for the whole pipeline: components are drawn in a fixed order.
        text_encoder = CLIPTextModel(CLIPTextConfig(**clip_config))
        text_encoder_2 = T5EncoderModel(T5Config(**t5_config))
        transformer = FluxTransformer2DModel(**transformer_config)
        vae = AutoencoderKL(**vae_config)
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER_CONFIG)
    pipe = getattr(diffusers, pipeline_class)(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    pipe.save_pretrained(out_dir)


# --------------------------------------------------------------------------------------------
# Qwen-Image-Edit
# --------------------------------------------------------------------------------------------

#: Qwen-Image's scheduler config (Qwen/Qwen-Image-Edit scheduler/scheduler_config.json).
QWEN_IMAGE_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
    time_shift_type="exponential",
)


def _build_qwen_image_edit(out_dir: Path, seed: int, *, transformer: dict | None = None,
                           vae: dict | None = None) -> None:
    """The Qwen-Image-Edit pipeline tree drawn from ``seed``. ``transformer`` / ``vae``: keys
    overriding the tiny ``QwenImageTransformer2DModel`` / ``AutoencoderKLQwenImage`` arguments (the
    pretrained build, :mod:`paco.pretrain.qwen_image`; a ``z_dim`` override must come with
    ``latents_mean`` / ``latents_std`` of that length and the transformer's ``in_channels`` /
    ``out_channels`` = ``4 z_dim`` / ``z_dim``); ``joint_attention_dim`` follows the text encoder.
    Without them the tiny pipeline's bytes are unchanged."""
    import json

    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImageTransformer2DModel,
    )

    # the text encoder is the tiny Qwen2.5-VL (as the real one is Qwen2.5-VL-7B), same seed
    text_encoder, processor = _qwen2_5_vl(seed)
    transformer_config = dict(
        patch_size=2,
        in_channels=64,  # 16 latent channels x 2x2 packing
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=text_encoder.config.text_config.hidden_size,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    )
    transformer_config.update(transformer or {})
    transformer_config["joint_attention_dim"] = text_encoder.config.text_config.hidden_size
    with _seeded(seed + 1):
        transformer = QwenImageTransformer2DModel(**transformer_config)
        vae = AutoencoderKLQwenImage(**{
            "base_dim": 8,
            "z_dim": 16,
            "dim_mult": [1, 2, 2, 2],
            "num_res_blocks": 1,
            "attn_scales": [],
            "temperal_downsample": [False, True, True],  # 3 levels -> vae_scale_factor 8 as in Qwen-Image
            **(vae or {}),
        })
    pipe = QwenImageEditPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=processor.tokenizer,
        processor=processor,
        transformer=transformer,
    )
    pipe.save_pretrained(out_dir)
    # the stock layout (Qwen/Qwen-Image-Edit): the processor is a transformers Qwen2VLProcessor;
    # without torchvision it is loaded image-only (paco.models.loading.load_pipeline's overrides)
    index_path = out_dir / "model_index.json"
    index = json.loads(index_path.read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


_BUILDERS: dict[str, Callable[[Path, int], None]] = {
    "qwen2_5_vl": _build_qwen2_5_vl,
    "flux": _build_flux,
    "flux_kontext": lambda out_dir, seed: _build_flux(out_dir, seed, "FluxKontextPipeline"),
    "qwen_image_edit": _build_qwen_image_edit,
    "clip": _build_clip,
}


def build_tiny(name: str, out_dir: Path, seed: int) -> Path:
    """Build the tiny model ``name`` from ``seed`` and save it (HF format) into ``out_dir``.

    Args:
        name: one of :data:`TINY_NAMES`.
        out_dir: target directory; created if missing, and an existing one is emptied first
            (write to a fresh directory when atomicity matters: :func:`paco.models.fetch.materialise`
            does).
        seed: seeds ``torch.manual_seed`` before the weights are constructed (the global torch
            RNG state is restored afterwards).

    Returns:
        ``out_dir``. Files: ``config.json``, ``model.safetensors`` and processor/tokenizer files
        (``qwen2_5_vl``, ``clip``) or a diffusers pipeline tree with ``model_index.json``
        (``flux``, ``flux_kontext``, ``qwen_image_edit``). All weights are float32.

    Raises:
        ValueError: unknown ``name``.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown tiny model {name!r}; expected one of {', '.join(TINY_NAMES)}")
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    with _quiet():
        _BUILDERS[name](out_dir, int(seed))
    return out_dir

