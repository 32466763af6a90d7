"""The memory plan's rows: per GPU role of the paper preset, the weights, the LoRA and its optimizer
state, the activations without and with gradient checkpointing, their totals against an "80 GB"
GPU's usable memory (:data:`DEVICE_GIB`), and the printed table (the columns:
``benchmarks/memory_plan.py``'s docstring)."""

from __future__ import annotations

from typing import Any

from memplan.activations import block_widths, bytes_per_token
from memplan.models import (FAMILY_BLOCKS, HUB_MODELS, JUDGE_BLOCK, QWEN2_5_VL_7B, REAL_CONFIGS, REWARD_ROLES,
                            lora_params, meta_model, parameter_count)

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
        ckpt_inputs += 2 * block_widths(block)[0] * tokens * cfg[depth_key] * forwards
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
    text = QWEN2_5_VL_7B["text_config"]
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
