"""The GPU smoke run's set-up: its sizes per device (:data:`SIZES`), the paper preset scaled to them
(:func:`smoke_params`), the models built and the state every step shares (:func:`build_run`,
:class:`SmokeRun`), and the small helpers the steps use."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smoke.budget import Stages

ROOT = Path(__file__).resolve().parents[2]

#: sizes of the run per device: rollout / evaluation / final px, rollout and evaluation / final
#: steps, text tokens, judge panel px, prompts per epoch, group size, final seeds per prompt, pairs
#: scored by the servers, and (CPU only) the judge step's batch and accumulation (None: the
#: preset's 8 x 4)
SIZES = {
    "cuda": dict(train_resolution=512, eval_resolution=1024, final_resolution=1024, rollout_steps=10,
                 sample_steps=20, max_sequence_length=512, panel_px=512, prompts_per_epoch=2, group_size=16,
                 seeds_per_prompt=2, pairs=64, sft_batch_size=None, sft_accumulation=None),
    "cpu": dict(train_resolution=64, eval_resolution=64, final_resolution=64, rollout_steps=3, sample_steps=2,
                max_sequence_length=32, panel_px=64, prompts_per_epoch=2, group_size=2, seeds_per_prompt=1,
                pairs=4, sft_batch_size=2, sft_accumulation=2),
}


def smoke_params(device: str, dtype: str, sizes: dict[str, int], top_logprobs: int) -> dict[str, Any]:
    """The paper preset's raw params with the smoke run's changes (every other key as in the
    paper): one judge step, one GRPO epoch on a few prompts, a local judge server asked for every
    first token (``top_logprobs``: a random judge need not rank Yes / No in its top 20)."""
    from paco.core.params import read_params_yaml

    raw = read_params_yaml(ROOT / "workflow/presets/paper.yaml")
    # without gradient checkpointing: BlockProbe measures what each block keeps for the backward
    raw["reward_train"].update(epochs=1, warmup_ratio=0.0, checkpoint_every=1, dtype=dtype, gradient_checkpointing=False)
    if sizes.get("sft_batch_size"):  # CPU path only: the preset's 8 x 4 pairs per step otherwise
        raw["reward_train"].update(batch_size=sizes["sft_batch_size"],
                                   gradient_accumulation_steps=sizes["sft_accumulation"])
    raw["reward_merge"].update(dtype=dtype)
    raw["judge_endpoint"].update(url=None, top_logprobs=top_logprobs, concurrency=16)
    # the project's server on the run's one device (the preset's vLLM on a GPU of its own: the vLLM rows)
    raw["judge_endpoint"]["server"].update(engine="paco", gpus=0, device=device, dtype=dtype, max_logprobs=top_logprobs)
    g = raw["grpo"]["t2is"]
    g.update(epochs=1, prompts_per_epoch=sizes["prompts_per_epoch"], group_size=sizes["group_size"], save_every=1,
             dtype=dtype)
    g["rollout"].update(num_steps=sizes["rollout_steps"], max_sequence_length=sizes["max_sequence_length"])
    g["train"].update(resolution=sizes["train_resolution"], gradient_checkpointing=False)
    g["train"]["ema"].update(update_every=1)  # 2 optimizer steps never reach the preset's every-8th update
    g["eval"].update(resolution=sizes["eval_resolution"], num_steps=sizes["sample_steps"], max_prompts=1)
    f = raw["final_samples"]["t2is"]
    f.update(split="test", resolution=sizes["final_resolution"], num_steps=sizes["sample_steps"],
             seeds_per_prompt=sizes["seeds_per_prompt"], max_sequence_length=sizes["max_sequence_length"], dtype=dtype)
    return raw


def lora_b_abs_max(path: Path) -> float:
    """Largest |weight| over the ``lora_B`` tensors of a safetensors file (0 = the LoRA is still
    at PEFT's / diffusers' zero initialisation)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    b = [t for k, t in tensors.items() if "lora_B" in k or "lora.up" in k]
    if not b:
        raise ValueError(f"{path}: no lora_B tensors")
    return max(float(t.float().abs().max()) for t in b)


def finite(x: Any) -> bool:
    return x is not None and math.isfinite(float(x))


def release(cuda: bool) -> None:
    """Collect garbage and return cached CUDA blocks, so the next stage's figures are its own."""
    import gc

    gc.collect()
    if cuda:
        import torch

        torch.cuda.empty_cache()


@dataclass
class SmokeRun:
    """What the smoke run's steps share: where it writes, the device, the models, the params."""

    workdir: Path
    device: str
    dtype: str
    seed: int
    sizes: dict[str, int]
    timer: Stages
    dirs: dict[str, Path]
    top: int
    params: Any
    params_path: Path
    accelerator: Any

    @property
    def torch_dtype(self) -> Any:
        import torch

        return torch.bfloat16 if self.dtype == "bfloat16" else torch.float32


def build_run(workdir: Path, device: str, dtype: str, width_scale: float, seed: int, sizes: dict[str, int],
              timer: Stages) -> SmokeRun:
    """Build the models, write the scaled paper params, make the run's one accelerator."""
    import yaml
    from accelerate import Accelerator

    from paco.core.params import validate_params
    from paco.models.loading import load_qwen_vl_processor
    from paco.models.smoke import SMOKE_JUDGE_MAX_PIXELS, build_smoke_models

    with timer.stage("build") as row:
        max_px = SMOKE_JUDGE_MAX_PIXELS if width_scale == 1.0 else max(sizes["panel_px"] ** 2, 56 * 56)
        dirs = build_smoke_models(workdir / "models", seed=seed, width_scale=width_scale, judge_max_pixels=max_px)
        row["bytes"] = {r: sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) for r, d in dirs.items()}
    top = len(load_qwen_vl_processor(dirs["judge_base"]).tokenizer)
    raw = smoke_params(device, dtype, sizes, top)
    params = validate_params(raw, source="gpu_smoke params")
    params_path = workdir / "params.yaml"
    params_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    # one accelerator for the run (accelerate's state is a process singleton): the judge step's
    # gradient accumulation and bf16 autocast; GRPO and final sampling only take its device
    rt = params.reward_train
    accelerator = Accelerator(cpu=not device.startswith("cuda"),
                              mixed_precision="bf16" if (dtype == "bfloat16" and timer.cuda) else "no",
                              gradient_accumulation_steps=rt.gradient_accumulation_steps)
    return SmokeRun(workdir, device, dtype, seed, sizes, timer, dirs, top, params, params_path, accelerator)
