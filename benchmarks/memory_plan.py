"""Memory plan of the paper preset: what each GPU of a paper-scale run holds, against an 80 GB GPU; and
the time budget that keeps ``benchmarks/gpu_smoke.py`` inside a short GPU slot (:class:`Budget`, from
:mod:`smoke.budget`).

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
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, Path(__file__).resolve().parent):  # paco; this script's parts beside it
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

# the plan's parts, reachable from here as the docstring names them (and as tests/test_gpu.py and
# gpu_smoke.py use them: ``memory_plan.plan``, ``memory_plan.BlockProbe``, ``memory_plan.Budget``, ...)
from memplan.activations import BlockProbe, analytic_bytes_per_token, bytes_per_token  # noqa: E402,F401
from memplan.models import REAL_CONFIGS, lora_params, meta_model, parameter_count  # noqa: E402,F401
from memplan.planner import (DEVICE_GIB, JUDGE_TEXT_TOKENS, LOGIT_BYTES, VAE_DECODE_BYTES_PER_PIXEL,  # noqa: E402,F401
                             _row, final_samples_row, format_table, grpo_row, judge_row, plan, reward_train_row)
from smoke.budget import CUDA_BUDGET_S, ESTIMATE_S, Budget, Stages  # noqa: E402,F401


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
