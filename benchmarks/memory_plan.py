"""Memory plan of the paper preset: what each GPU of a paper-scale run holds, against an 80 GB GPU; and
the time budget (:class:`Budget`) that keeps ``benchmarks/gpu_smoke.py`` inside a short GPU slot.

    python benchmarks/memory_plan.py [--preset workflow/presets/paper.yaml] [--json plan.json]

One row per GPU role of ``workflow/presets/paper.yaml`` (resolutions, batch sizes, LoRA ranks and
targets, rewards and dtypes are read from the preset, never written here): ``reward_train``,
``grpo@<k>`` and ``final_samples@<k>`` for every subtask, and ``judge``, the GPU the stage's own
vLLM server holds. Columns (GiB = 2**30 bytes):

==================  ==============================================================================
weights             exact parameter counts of the real models, instantiated on the ``meta`` device
                    from the configs embedded in :data:`REAL_CONFIGS` (no download), times 2 bytes
                    (bf16: policy, text encoders, VAE, judge) or 4 (float32: the CLIP-T and
                    PickScore scorers, which each training process holds in float32 as the
                    reference's ``rewards.py`` does)
LoRA + opt.         ``r * (in + out)`` summed over the ``nn.Linear`` modules matched by the preset's
                    ``lora.target_modules`` (PEFT's rule: the module name equals a target or ends
                    with ``.<target>``; the judge: inside its language model only,
                    :func:`paco.judge.lora.lora_config`), times bytes per parameter: GRPO 24 (float32
                    trained, old and EMA copies, gradient, AdamW's two moments:
                    ``paco.grpo.trainer.setup``), judge SFT 16 (float32 weight, gradient, two
                    moments; not divided by ZeRO-2's sharding: an upper bound), sampling 4 (the
                    loaded LoRA, float32 at most)
activations         training: the transformer blocks' saved activations for one forward of
                    ``train.batch_size`` (``reward_train.batch_size``) samples at the preset's train
                    resolution, ``bytes_per_token x tokens x depth`` per block type; with gradient
                    checkpointing every block keeps only its input (``2 * width`` bytes per token)
                    and one block at a time holds its full activations; the judge adds its logits
                    (:data:`LOGIT_BYTES` per token and vocabulary entry). Sampling / evaluation (no
                    gradient): one block's activations at the sampling batch and resolution plus the
                    VAE decode (:data:`VAE_DECODE_BYTES_PER_PIXEL`); the larger of the two counts
total               weights + LoRA + activations, without and with checkpointing; ``fits``: <=
                    :data:`DEVICE_GIB` (78.6 GiB: an "80 GB" GPU's usable memory)
as configured       ``fits_configured``: ``fits_ckpt`` where the preset's ``gradient_checkpointing``
                    (``reward_train``, ``grpo.<k>.train``; missing: off) is on, else ``fits``
==================  ==============================================================================

``bytes_per_token`` per block type comes from :class:`BlockProbe` when the GPU smoke
(``benchmarks/gpu_smoke.py``) ran in bf16 at the real widths on CUDA: the CUDA memory each
block's forward leaves allocated while gradients are on (its saved activations and its output),
divided by its tokens (batch x sequence), the largest over the smoke's judge SFT step and GRPO
epoch; Qwen-Image's blocks take the FLUX double block's value (same width 3072, two streams with
a 4x MLP each). Otherwise (CPU runs, float32 or narrower smoke runs) :func:`analytic_bytes_per_token`
estimates it and the row says ``analytic``.

Token counts: FLUX ``(resolution / 16)**2`` image tokens plus ``rollout.max_sequence_length`` text
tokens; FLUX Kontext and Qwen-Image-Edit twice the image tokens (the reference image's latents are
in the sequence); Qwen-Image-Edit with true CFG (``negative_prompt`` set, scale > 1) runs two
forward passes with gradients (``paco.grpo.policies.qwen_image``); the judge two images of
``composites.generate.height`` px (``round(px / 28)**2`` tokens each, Qwen2.5-VL's 28 px merged
patches; the largest composites and the editing pairs' images) plus :data:`JUDGE_TEXT_TOKENS` and
``reasons.teacher.openai.max_tokens`` of text.

Figures only, not a guarantee: allocator fragmentation and NCCL buffers are not counted (the CUDA
context is, as the memory :data:`DEVICE_GIB` leaves out).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GIB = 2**30
#: the memory an "80 GB" H100 / A100 reports, GiB: ``torch.cuda.mem_get_info`` total (PyTorch's
#: out-of-memory message, "GPU 0 has a total capacity of ... GiB"), 79.11-79.25 GiB on such cards
#: depending on the driver's reservation; the lower end, so a plan that fits here fits there
DEVICE_TOTAL_GIB = 79.1
#: what the CUDA context of each process takes of it (kernels and cuBLAS / cuDNN handles, not in
#: ``torch.cuda.max_memory_allocated``), GiB: about 0.5 on an H100 with torch 2.x
CUDA_CONTEXT_GIB = 0.5
#: the memory the plan is checked against, GiB: what one process can allocate on an "80 GB" GPU
DEVICE_GIB = DEVICE_TOTAL_GIB - CUDA_CONTEXT_GIB
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: LoRA bytes per parameter: GRPO (trained, old, EMA, gradient, 2 AdamW moments, float32), judge SFT
#: (weight, gradient, 2 moments, float32), sampling (the loaded adapter, float32)
LORA_BYTES = {"grpo": 24, "sft": 16, "sampling": 4}
#: judge logits per token and vocabulary entry: bf16 logits, their float32 copy and the float32
#: log-softmax ``F.cross_entropy`` saves (``paco.judge.losses.first_token_weighted_loss``)
LOGIT_BYTES = 10
#: judge text tokens besides the reasons: chat template and instruction (``paco.core.templates``), rounded up
JUDGE_TEXT_TOKENS = 256
#: VAE decode working set per output pixel and image (bf16): about four 128-channel full-resolution
#: tensors alive in the decoder's last up block (an estimate)
VAE_DECODE_BYTES_PER_PIXEL = 1024
#: vLLM's ``--gpu-memory-utilization`` when the preset names none (reference ``vllm_server/launch.sh`` l.16)
VLLM_UTILIZATION = 0.85

_FLUX_TRANSFORMER = dict(num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
                         joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, in_channels=64,
                         patch_size=1, axes_dims_rope=(16, 56, 56))
_QWEN_VL_7B = dict(
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
    "flux_transformer": ("diffusers", "FluxTransformer2DModel", None, _FLUX_TRANSFORMER,
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
    "qwen2_5_vl_7b": ("transformers", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig", _QWEN_VL_7B,
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
#: block classes :class:`BlockProbe` measures in the smoke, and the measured class standing in for each
PROBED = ("FluxTransformerBlock", "FluxSingleTransformerBlock", JUDGE_BLOCK)
PROXY = {"QwenImageTransformerBlock": "FluxTransformerBlock"}


# --------------------------------------------------------------------------------------------
# parameters
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# activations
# --------------------------------------------------------------------------------------------


class BlockProbe:
    """Saved-activation bytes per token of the block classes ``names``, measured on the device.

    Global forward hooks (``torch.nn.modules.module.register_module_forward_[pre_]hook``) read
    ``memory_fn()`` (default ``torch.cuda.memory_allocated``) before and after the forward of
    every module whose class name is in ``names`` while gradients are enabled (the training
    forward; rollouts and evaluation run under ``no_grad``); the difference is what the block
    leaves allocated for the backward (saved tensors and its output). Tokens: ``shape[0] *
    shape[1]`` summed over the 3-D tensors the block returns (batch x sequence of each stream).

    ``result()``: ``{class: {"bytes_per_token", "tokens", "calls"}}``, the largest ratio over the
    calls. ``enabled=False`` (no CUDA) registers nothing and gives ``{}``.
    """

    def __init__(self, names: tuple[str, ...] = PROBED, *, enabled: bool = True, memory_fn: Any = None):
        self.names, self.enabled, self.memory_fn = set(names), enabled, memory_fn
        self.found: dict[str, dict[str, float]] = {}
        self._before: dict[int, list[int]] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> BlockProbe:
        if not self.enabled:
            return self
        import torch

        if self.memory_fn is None:
            self.memory_fn = torch.cuda.memory_allocated
        mm = torch.nn.modules.module
        self._handles = [mm.register_module_forward_pre_hook(self._pre), mm.register_module_forward_hook(self._post)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre(self, module: Any, args: Any) -> None:
        import torch

        if type(module).__name__ in self.names and torch.is_grad_enabled():
            self._before.setdefault(id(module), []).append(self.memory_fn())

    def _post(self, module: Any, args: Any, output: Any) -> None:
        stack = self._before.get(id(module))
        if type(module).__name__ not in self.names or not stack:
            return
        delta = self.memory_fn() - stack.pop()
        outs = output if isinstance(output, (tuple, list)) else (output,)
        tokens = sum(int(o.shape[0] * o.shape[1]) for o in outs if hasattr(o, "shape") and len(o.shape) == 3)
        if tokens <= 0 or delta <= 0:
            return
        row = self.found.setdefault(type(module).__name__, {"bytes_per_token": 0.0, "tokens": 0, "calls": 0})
        row["calls"] += 1
        if delta / tokens > row["bytes_per_token"]:
            row.update(bytes_per_token=delta / tokens, tokens=tokens)

    def result(self) -> dict[str, dict[str, float]]:
        return {k: dict(v) for k, v in self.found.items()}


def _widths(block: str) -> tuple[int, int, int]:
    """(width, MLP width, MLP input projections: 1 GELU / 2 gated) of a block class."""
    if block == JUDGE_BLOCK:
        t = _QWEN_VL_7B["text_config"]
        return t["hidden_size"], t["intermediate_size"], 2
    h = 24 * 128  # FLUX.1 and Qwen-Image: 24 heads x 128
    return h, 4 * h, 1


def analytic_bytes_per_token(block: str) -> float:
    """Estimated saved-activation bytes per token of one block in 16-bit: ``2 * (9 h + (1 + g) f)``
    for width ``h``, MLP width ``f`` and ``g`` gated input projections, i.e. ``34 h`` for a 4x GELU
    MLP (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    §4.1: ``34 s b h`` per layer without the attention-score term, which flash attention does not
    store); FLUX's single block adds its concatenated ``(h + f)`` input of ``proj_out``."""
    h, f, g = _widths(block)
    extra = 2 * (h + f) if block == "FluxSingleTransformerBlock" else 0
    return 2.0 * (9 * h + (1 + g) * f) + extra


def bytes_per_token(block: str, measured: dict[str, dict[str, float]] | None) -> tuple[float, str]:
    """(bytes per token, source) of ``block``: measured (directly, or through :data:`PROXY`) when
    ``measured`` holds it, else :func:`analytic_bytes_per_token`."""
    key = PROXY.get(block, block)
    if measured and key in measured:
        return float(measured[key]["bytes_per_token"]), "measured" if key == block else f"measured ({key})"
    return analytic_bytes_per_token(block), "analytic"


# --------------------------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------------------------


def _components(preset: dict[str, Any], role: str) -> tuple[str, ...]:
    hub = preset["models"].get(role)
    if hub not in HUB_MODELS:
        raise ValueError(f"models.{role} = {hub!r}: no embedded config (known: {sorted(HUB_MODELS)})")
    return HUB_MODELS[hub]


def _weights(preset: dict[str, Any], role: str, rewards: list[str], dtype: str) -> dict[str, dict[str, Any]]:
    """Weights on one process's GPU: the role's components in ``dtype``, the rewards' scorers in float32."""
    out = {c: dict(parameters=parameter_count(c), dtype=dtype) for c in _components(preset, role)}
    for r in rewards:
        for c in _components(preset, REWARD_ROLES[r]) if r in REWARD_ROLES else ():
            out[c] = dict(parameters=parameter_count(c), dtype="float32")
    for row in out.values():
        row["gib"] = row["parameters"] * DTYPE_BYTES[row["dtype"]] / GIB
    return out


def _blocks(family: str, tokens: int, forwards: int, measured: Any) -> tuple[float, float, list[str], float]:
    """(training activation bytes, with checkpointing, sources, one block's bytes) of the family's transformer."""
    name, blocks = FAMILY_BLOCKS[family]
    cfg = REAL_CONFIGS[name][3]
    full = ckpt_inputs = biggest = 0.0
    sources = []
    for block, depth_key in blocks.items():
        per, src = bytes_per_token(block, measured)
        sources.append(f"{block} {src}")
        full += per * tokens * cfg[depth_key] * forwards
        ckpt_inputs += 2 * _widths(block)[0] * tokens * cfg[depth_key] * forwards
        biggest = max(biggest, per * tokens)
    return full, ckpt_inputs + biggest, sources, biggest


def _image_tokens(family: str, resolution: int) -> int:
    n = (int(resolution) // 16) ** 2
    return 2 * n if family in ("flux_kontext", "qwen_image_edit") else n


def _row(stage: str, weights: dict, lora_parameters: int | None, lora_kind: str | None, act: float, act_ckpt: float,
         sources: list[str], checkpointing: bool | None = None, **extra: Any) -> dict[str, Any]:
    w = sum(v["gib"] for v in weights.values())
    lora = None if lora_parameters is None else lora_parameters * LORA_BYTES[lora_kind] / GIB
    a, ac = act / GIB, act_ckpt / GIB
    total, total_ckpt = w + (lora or 0.0) + a, w + (lora or 0.0) + ac
    fits, fits_ckpt = total <= DEVICE_GIB, total_ckpt <= DEVICE_GIB  # checkpointing: a training row's switch or None
    return dict(stage=stage, weights_gib=w, lora_opt_gib=lora, activations_gib=a, activations_ckpt_gib=ac,
                total_gib=total, total_ckpt_gib=total_ckpt, fits=fits, fits_ckpt=fits_ckpt,
                gradient_checkpointing=checkpointing, fits_configured=fits_ckpt if checkpointing else fits,
                activation_source="; ".join(sources), weights=weights, lora_parameters=lora_parameters, **extra)


def _switch(section: dict[str, Any], where: str) -> bool:
    """``section["gradient_checkpointing"]`` (missing: off, the schema's default). Raises ValueError: not a bool."""
    if not isinstance(value := section.get("gradient_checkpointing", False), bool):
        raise ValueError(f"{where}.gradient_checkpointing must be true or false, got {value!r}")
    return value


def _inference(family: str, resolution: int, batch: int, text: int, measured: Any) -> tuple[float, list[str]]:
    """No-gradient working set of sampling: one block at ``batch`` samples plus the VAE decode."""
    tokens = batch * (_image_tokens(family, resolution) + text)
    per = max(bytes_per_token(b, measured)[0] for b in FAMILY_BLOCKS[family][1])
    return per * tokens + VAE_DECODE_BYTES_PER_PIXEL * batch * resolution**2, ["VAE decode analytic"]


def grpo_row(preset: dict[str, Any], key: str, measured: Any = None) -> dict[str, Any]:
    """The row of ``grpo.<key>`` (see the module docstring)."""
    g = preset["grpo"][key]
    fam, r, t = g["family"], g["rollout"], g["train"]
    text = int(r["max_sequence_length"])
    tokens = int(t["batch_size"]) * (_image_tokens(fam, t["resolution"]) + text)
    cfg_on = fam == "qwen_image_edit" and r.get("negative_prompt") is not None and float(r["guidance_scale"]) > 1
    act, act_ckpt, sources, _ = _blocks(fam, tokens, 2 if cfg_on else 1, measured)
    inf = max(_inference(fam, t["resolution"], int(r["batch_size"]), text, measured)[0],
              _inference(fam, g["eval"]["resolution"], int(g["eval"]["batch_size"]), text, measured)[0])
    lora = lora_params(meta_model(FAMILY_BLOCKS[fam][0]), list(g["lora"]["target_modules"]), int(g["lora"]["rank"]))
    return _row(f"grpo@{key}", _weights(preset, g["policy"], list(g["rewards"]), g["dtype"]), lora, "grpo",
                max(act, inf), max(act_ckpt, inf), sources + ["sampling: VAE decode analytic"],
                _switch(t, f"grpo.{key}.train"), train_tokens=tokens, sampling_gib=inf / GIB, true_cfg=cfg_on)


def final_samples_row(preset: dict[str, Any], key: str, measured: Any = None) -> dict[str, Any]:
    """The row of ``final_samples.<key>``: the policy with the LoRA sampling at the resolution (native: 1024 x 2048 px, the
    largest T2IS-Bench grid, as a 1456 px square: 91**2 >= 8192 tokens)."""
    fam, res = (f := preset["final_samples"][key])["family"], (1456 if f["resolution"] == "native" else f["resolution"])
    inf, sources = _inference(fam, res, int(f["batch_size"]), int(f["max_sequence_length"]), measured)
    grpo = preset.get("grpo", {}).get(f["lora"].split("/")[2] if f["lora"].startswith("data/grpo/") else key)
    lora = None  # the LoRA of the grpo member that trains it (a <k>_bench member samples <k>'s)
    if grpo is not None:
        lora = lora_params(meta_model(FAMILY_BLOCKS[fam][0]), list(grpo["lora"]["target_modules"]),
                           int(grpo["lora"]["rank"]))
    blocks = [f"{b} {bytes_per_token(b, measured)[1]}" for b in FAMILY_BLOCKS[fam][1]]
    return _row(f"final_samples@{key}", _weights(preset, f["policy"], list(f["rewards"]), f["dtype"]), lora,
                "sampling", inf, inf, blocks + sources)


def reward_train_row(preset: dict[str, Any], measured: Any = None) -> dict[str, Any]:
    """The row of ``reward_train``: the judge with its LoRA, one batch of the largest pairs."""
    from paco.judge.lora import language_model_prefix

    rt = preset["reward_train"]
    px = int(preset["composites"]["generate"]["height"])
    reason = int(preset["reasons"]["teacher"]["openai"]["max_tokens"])
    seq = 2 * round(px / 28) ** 2 + JUDGE_TEXT_TOKENS + reason
    tokens = int(rt["batch_size"]) * seq
    per, src = bytes_per_token(JUDGE_BLOCK, measured)
    text = _QWEN_VL_7B["text_config"]
    depth, h, vocab = text["num_hidden_layers"], text["hidden_size"], text["vocab_size"]
    logits = LOGIT_BYTES * tokens * vocab
    model = meta_model("qwen2_5_vl_7b")
    lora = lora_params(model, list(rt["lora"]["target_modules"]), int(rt["lora"]["rank"]),
                       prefix=language_model_prefix(model))
    return _row("reward_train", _weights(preset, "judge_base", [], rt["dtype"]), lora, "sft",
                per * tokens * depth + logits, 2 * h * tokens * depth + per * tokens + logits,
                [f"{JUDGE_BLOCK} {src}", "logits analytic"], _switch(rt, "reward_train"), train_tokens=tokens)


def judge_row(preset: dict[str, Any]) -> dict[str, Any]:
    """The judge's GPU: vLLM takes ``gpu_memory_utilization`` of it; the rest of that share (KV
    cache, activations) is the activations column."""
    server = preset["judge_endpoint"].get("server", {})
    util = float(server.get("gpu_memory_utilization", VLLM_UTILIZATION))
    weights = _weights(preset, "judge_base", [], "bfloat16")
    # vLLM's share is of the device's total memory (its worker: torch.cuda.mem_get_info()[1])
    rest = util * DEVICE_TOTAL_GIB - sum(v["gib"] for v in weights.values())
    return _row("judge", weights, None, None, rest * GIB, rest * GIB,
                [f"vLLM gpu_memory_utilization {util:g} x {DEVICE_TOTAL_GIB:g} GiB, KV cache and activations"])


def plan(preset: dict[str, Any], measured: dict[str, dict[str, float]] | None = None) -> list[dict[str, Any]]:
    """Every row of the memory plan of ``preset`` (a raw params mapping), ``measured`` from
    :class:`BlockProbe` (``None``: analytic).

    Raises:
        KeyError: a section or key the plan reads is missing from the preset.
        ValueError: a model role names a hub id without an embedded config, or a LoRA target matches nothing.
    """
    rows = [reward_train_row(preset, measured)]
    rows += [grpo_row(preset, k, measured) for k in preset.get("grpo", {})]
    rows += [final_samples_row(preset, k, measured) for k in preset.get("final_samples", {})]
    return rows + [judge_row(preset)]


def format_table(rows: list[dict[str, Any]]) -> str:
    """The printed table (GiB; ``-`` where a column does not apply)."""
    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.1f}"

    lines = [f"{'stage':30s} {'weights':>8s} {'LoRA+opt':>8s} {'act.':>7s} {'act.ckpt':>8s} {'total':>7s} "
             f"{'tot.ckpt':>8s}  {f'fits {DEVICE_GIB:g} GiB':13s} {'as configured':14s} activations from"]
    mark = {None: "", True: " (ckpt)", False: " (no ckpt)"}
    for r in rows:
        fits = f"{'yes' if r['fits'] else 'NO'}/{'yes' if r['fits_ckpt'] else 'NO'}"
        configured = f"{'yes' if r['fits_configured'] else 'NO'}{mark[r['gradient_checkpointing']]}"
        lines.append(f"{r['stage']:30s} {f(r['weights_gib']):>8s} {f(r['lora_opt_gib']):>8s} "
                     f"{f(r['activations_gib']):>7s} {f(r['activations_ckpt_gib']):>8s} {f(r['total_gib']):>7s} "
                     f"{f(r['total_ckpt_gib']):>8s}  {fits:13s} {configured:14s} {r['activation_source']}")
    lines.append("GiB per GPU; ckpt: with gradient checkpointing (fits: without/with; as configured: the preset's "
                 "gradient_checkpointing); analytic: an estimate, not measured (benchmarks/memory_plan.py)")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# the GPU smoke's time budget and per-stage figures
# --------------------------------------------------------------------------------------------


#: default ``--budget-s`` on CUDA: the run fits an 8-minute GPU slot
CUDA_BUDGET_S = 480.0

#: expected seconds per stage at ``gpu_smoke.SIZES`` (``vllm``: each vLLM dtype's start and scoring;
#: ``memory_plan``: the final step, always kept in reserve). CUDA: estimates, not yet measured on
#: a GPU (vLLM's start-up with CUDA graphs dominates its rows); CPU: width 0.04 on 2 shared cores
ESTIMATE_S = {
    "cuda": dict(build=90, sft=45, merge=30, judge_in_process=20, serve_start=45, serve=10, grpo=120, final=45,
                 vllm=150, memory_plan=30),
    "cpu": dict(build=15, sft=15, merge=10, judge_in_process=5, serve_start=25, serve=5, grpo=30, final=15,
                vllm=60, memory_plan=30),
}


class Budget:
    """Which stages start under a time limit (``--budget-s``).

    ``admit(name, key, needs)`` (the stage ``name``, its :data:`ESTIMATE_S` entry ``key``,
    default ``name``) is true when every stage in ``needs`` ran and (no limit, or)
    ``elapsed + estimate(key) + estimate("memory_plan") <= limit_s``, with ``elapsed`` the
    seconds since ``start`` on ``clock`` and ``estimate`` the :data:`ESTIMATE_S` entry times
    ``factor`` (:meth:`calibrate`). Otherwise ``rows[name]`` becomes ``{"skipped": reason}``
    (``"budget: ..."`` or ``"needs ..."``) and it is false.
    """

    def __init__(self, limit_s: float | None, estimates: dict[str, float], rows: dict[str, dict[str, Any]], *,
                 start: float, clock: Any = time.perf_counter):
        if limit_s is not None and not limit_s > 0:
            raise ValueError(f"--budget-s must be > 0, got {limit_s}")
        self.limit_s, self.estimates, self.rows, self.start, self.clock = limit_s, estimates, rows, start, clock
        self.factor = 1.0

    def calibrate(self, build_seconds: float) -> None:
        """Scale every estimate by the measured build time over the estimated one when it is slower."""
        self.factor = max(1.0, build_seconds / self.estimates["build"])

    def elapsed(self) -> float:
        return self.clock() - self.start

    def admit(self, name: str, key: str | None = None, needs: tuple[str, ...] = ()) -> bool:
        missing = [n for n in needs if n not in self.rows or "skipped" in self.rows[n]]
        reason = f"needs {', '.join(missing)}" if missing else None
        if reason is None and self.limit_s is not None:
            now, est = self.elapsed(), self.estimates[key or name] * self.factor
            reserve = self.estimates["memory_plan"] * self.factor
            if now + est + reserve > self.limit_s:
                reason = (f"budget: {now:.0f} s elapsed + {est:.0f} s estimated + {reserve:.0f} s for the memory "
                          f"plan > --budget-s {self.limit_s:g}")
        if reason is not None:
            self.rows[name] = {"skipped": reason}
            print(f"[gpu_smoke] {name}: skipped ({reason})", file=sys.stderr, flush=True)
        return reason is None


class Stages:
    """Per-stage wall seconds and CUDA memory (``max_memory_allocated`` reset at the start,
    in GiB; ``device_used_gib``: total minus free device memory at the end, every process)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.rows: dict[str, dict[str, Any]] = {}

    @contextlib.contextmanager
    def stage(self, name: str):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        row: dict[str, Any] = {}
        t0 = time.perf_counter()
        try:
            yield row
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            row["seconds"] = round(time.perf_counter() - t0, 3)
            if self.cuda:
                free, total = torch.cuda.mem_get_info()
                row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
                row["device_used_gib"] = round((total - free) / 2**30, 3)
            self.rows[name] = {**row, **self.rows.get(name, {})}
            print(f"[gpu_smoke] {name}: {row['seconds']:.1f} s", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    from paco.core.params import read_params_yaml

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", type=Path, default=ROOT / "workflow/presets/paper.yaml")
    ap.add_argument("--measured", type=Path, default=None, help="a gpu_smoke JSON whose block measurements to use")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args(argv)
    measured = None
    if args.measured is not None:
        measured = json.loads(args.measured.read_text()).get("memory_plan_measured") or None
    with contextlib.redirect_stdout(sys.stderr):  # library chatter stays off the table
        rows = plan(read_params_yaml(args.preset), measured)
    print(format_table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(math.isfinite(r["total_gib"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
