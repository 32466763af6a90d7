"""The memory plan's models: the real models' architecture keys (embedded, no download), which of
them each hub id of the preset's ``models`` section stands for, and their exact parameter and LoRA
counts, from instances on the ``meta`` device (shapes, no memory)."""

from __future__ import annotations

import functools
from typing import Any

#: FLUX.1-dev's transformer (FLUX.1-Kontext-dev's alike), as :data:`REAL_CONFIGS` builds it
FLUX_TRANSFORMER = dict(num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
                        joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, in_channels=64,
                        patch_size=1, axes_dims_rope=(16, 56, 56))
#: Qwen2.5-VL-7B-Instruct (the judge base; Qwen-Image-Edit's text encoder), as :data:`REAL_CONFIGS` builds it
QWEN2_5_VL_7B = dict(
    text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_chans=3,
                       out_hidden_size=3584, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                       window_size=112, fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu"),
    tie_word_embeddings=False)


def _clip(text: tuple[int, int, int, int], vision: tuple[int, int, int, int], projection: int) -> dict[str, Any]:
    """``CLIPConfig`` kwargs from (hidden, intermediate, layers, heads) of each tower."""
    t = dict(zip(("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"), text))
    v = dict(zip(("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"), vision))
    return dict(text_config=dict(vocab_size=49408, max_position_embeddings=77, **t),
                vision_config=dict(image_size=224, patch_size=14, **v), projection_dim=projection)


#: name -> (library, class, config class or None, config kwargs, source): the released configs'
#: architecture keys (the hub ``config.json`` files named in ``source``); everything else is the class default
REAL_CONFIGS: dict[str, tuple[str, str, str | None, dict[str, Any], str]] = {
    "flux_transformer": ("diffusers", "FluxTransformer2DModel", None, FLUX_TRANSFORMER,
                         "black-forest-labs/FLUX.1-dev transformer/config.json (FLUX.1-Kontext-dev: the same)"),
    "flux_vae": ("diffusers", "AutoencoderKL", None, dict(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
        latent_channels=16, norm_num_groups=32, sample_size=1024, use_quant_conv=False, use_post_quant_conv=False),
        "black-forest-labs/FLUX.1-dev vae/config.json"),
    "clip_l_text": ("transformers", "CLIPTextModel", "CLIPTextConfig", dict(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        max_position_embeddings=77, projection_dim=768), "black-forest-labs/FLUX.1-dev text_encoder/config.json"),
    "t5_xxl": ("transformers", "T5EncoderModel", "T5Config", dict(
        vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, tie_word_embeddings=False),
        "black-forest-labs/FLUX.1-dev text_encoder_2/config.json (google/t5-v1_1-xxl)"),
    "qwen_image_transformer": ("diffusers", "QwenImageTransformer2DModel", None, dict(
        patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
        joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56)),
        "Qwen/Qwen-Image-Edit transformer/config.json"),
    "qwen_image_vae": ("diffusers", "AutoencoderKLQwenImage", None, {},
                       "Qwen/Qwen-Image-Edit vae/config.json (base_dim 96, z_dim 16: the class defaults)"),
    "qwen2_5_vl_7b": ("transformers", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig", QWEN2_5_VL_7B,
                      "Qwen/Qwen2.5-VL-7B-Instruct config.json (Qwen-Image-Edit's text_encoder: the same)"),
    "clip_l": ("transformers", "CLIPModel", "CLIPConfig", _clip((768, 3072, 12, 12), (1024, 4096, 24, 16), 768),
               "openai/clip-vit-large-patch14 config.json"),
    "clip_vit_h": ("transformers", "CLIPModel", "CLIPConfig", _clip((1024, 4096, 24, 16), (1280, 5120, 32, 16), 1024),
                   "yuvalkirstain/PickScore_v1 config.json (CLIP ViT-H/14)"),
}

#: hub id of a model role -> its components in :data:`REAL_CONFIGS`
HUB_MODELS = {
    "black-forest-labs/FLUX.1-dev": ("flux_transformer", "t5_xxl", "clip_l_text", "flux_vae"),
    "black-forest-labs/FLUX.1-Kontext-dev": ("flux_transformer", "t5_xxl", "clip_l_text", "flux_vae"),
    "Qwen/Qwen-Image-Edit": ("qwen_image_transformer", "qwen2_5_vl_7b", "qwen_image_vae"),
    "Qwen/Qwen2.5-VL-7B-Instruct": ("qwen2_5_vl_7b",),
    "openai/clip-vit-large-patch14": ("clip_l",),
    "yuvalkirstain/PickScore_v1": ("clip_vit_h",),
}
#: reward -> the model role each training / sampling process holds in float32 for it (served rewards: none)
REWARD_ROLES = {"clip_t": "clip", "pickscore": "pickscore"}
#: the trained transformer of each family and its block classes (the depth's config key)
FAMILY_BLOCKS = {
    "flux": ("flux_transformer", {"FluxTransformerBlock": "num_layers", "FluxSingleTransformerBlock": "num_single_layers"}),
    "flux_kontext": ("flux_transformer", {"FluxTransformerBlock": "num_layers",
                                          "FluxSingleTransformerBlock": "num_single_layers"}),
    "qwen_image_edit": ("qwen_image_transformer", {"QwenImageTransformerBlock": "num_layers"}),
}
JUDGE_BLOCK = "Qwen2_5_VLDecoderLayer"


@functools.lru_cache(maxsize=None)
def meta_model(name: str) -> Any:
    """The real model ``name`` of :data:`REAL_CONFIGS` on the ``meta`` device (shapes, no memory).

    Raises:
        KeyError: an unknown name.
    """
    import importlib

    import torch

    lib, cls, config_cls, kwargs, _ = REAL_CONFIGS[name]
    mod = importlib.import_module(lib)
    with torch.device("meta"):
        if config_cls is None:
            return getattr(mod, cls)(**kwargs)
        return getattr(mod, cls)(getattr(mod, config_cls)(**kwargs))


def parameter_count(name: str) -> int:
    """Exact parameter count of :data:`REAL_CONFIGS` ``name``."""
    return sum(p.numel() for p in meta_model(name).parameters())


def lora_params(model: Any, target_modules: list[str], rank: int, prefix: str | None = None) -> int:
    """LoRA parameters PEFT adds for ``target_modules`` at rank ``rank``: ``rank * (in + out)`` per
    ``nn.Linear`` whose name equals a target or ends with ``.<target>`` (``peft.tuners.tuners_utils
    .check_target_module_exists`` for a list), inside ``prefix`` when given.

    Raises:
        ValueError: a target matches no linear layer (a typo the trainers also refuse).
    """
    import torch

    total, seen = 0, set()
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or (prefix is not None and not name.startswith(prefix + ".")):
            continue
        hit = [t for t in target_modules if name == t or name.endswith("." + t)]
        if hit:
            seen.update(hit)
            total += rank * (module.in_features + module.out_features)
    missing = [t for t in target_modules if t not in seen]
    if missing:
        raise ValueError(f"lora target_modules {missing} match no linear layer of {type(model).__name__}")
    return total
