"""Stage ``final_samples@<subtask>``: final ODE samples of the test prompts with and without the LoRA.

``dvc repro`` runs it through :mod:`paco.core.launch` (``final_samples.<subtask>.resources``: in place
for one process, under ``accelerate launch`` for several), here the embedded default's ``t2is``::

    python -m paco.core.launch --config_file workflow/accelerate/cpu.yaml --num_processes 1 \\
        --resources final_samples.t2is.resources --serves_judge -m stages.final_samples \\
        --params params.yaml --subtask t2is --items data/prompts/prompts.parquet \\
        --policy data/models/policy_t2is --lora data/grpo/t2is/lora --judge data/reward_merge/model --base-judge data/models/judge_base \\
        --clip data/models/clip --pickscore data/models/pickscore --out data/final_samples/t2is/samples.parquet \\
        --sheets data/final_samples/t2is/sheets --metrics data/final_samples/t2is/metrics.json

Params ``final_samples.<subtask>`` (:class:`paco.core.params.FinalSamplesParams`: ``split: all`` samples every item,
``resolution: native`` each T2IS case at its own size), ``judge_endpoint`` (served like in ``grpo@<subtask>``),
``subfigures``. Writes ``samples.parquet`` (one row per grid and variant:
the grid, its panels, their boxes, every reward), ``sheets/base.png`` and ``sheets/lora.png``
(contact sheets) and ``metrics.json`` (each reward with and without the LoRA).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path

from paco.core.checkpoints import replace_dir
from paco.core.io import ArtifactError, encode_image, read_parquet, write_parquet
from paco.core.params import Params
from paco.core.distributed import make_accelerator
from paco.core.stage import StageOutput, log, run, subtask_params
from paco.serving.endpoint import judge_endpoint


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--subtask", required=True, help="key of params.yaml final_samples.<subtask>")
    p.add_argument("--items", type=Path, required=True,
                   help="the subtask's items: prompts.parquet (dataset prompts) or edits.parquet (dataset edits)")
    p.add_argument("--policy", type=Path, required=True, help="policy model directory (models stage)")
    p.add_argument("--lora", type=Path, required=True,
                   help="LoRA directory: final_samples.<subtask>.lora (grpo stage, or a released LoRA from the models "
                        "stage; diffusers or PEFT layout, paco.grpo.policies.lora_io)")
    p.add_argument("--judge", type=Path, required=True,
                   help="judge directory: judge_endpoint.model (reward_merge's, or a released judge from the "
                        "models stage)")
    p.add_argument("--base-judge", type=Path, required=True,
                   help="the base judge directory (models stage, judge_base): the independent scorer of "
                        "final_samples.<subtask>.independent_scorer base_judge, loaded in process")
    p.add_argument("--clip", type=Path, required=True, help="CLIP model directory (models stage)")
    p.add_argument("--pickscore", type=Path, required=True,
                   help="PickScore model directory (models stage; loaded only for the pickscore reward)")
    p.add_argument("--out", type=Path, required=True, help="samples.parquet to write")
    p.add_argument("--sheets", type=Path, required=True, help="directory for the contact sheets")
    p.add_argument("--metrics", type=Path, required=True, help="metrics.json to write")


def _body(args: argparse.Namespace, params: Params) -> dict:
    from paco.grpo.rewards import ITEM_COLUMNS, RewardError, check_reward_names, make_reward_context
    from paco.serving.judge_client import JudgeError
    from paco.grpo.final_samples import final_samples, final_warnings
    from paco.judge.model import Judge
    import torch
    from paco.grpo.policies.lora_io import lora_format

    cfg = subtask_params(params, "final_samples", args.subtask)
    check_reward_names(cfg.rewards, f"final_samples.{args.subtask}.rewards", source=str(args.params))
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    lora_format(args.lora)  # a LoRA in a known layout (LoraLoadError, an ArtifactError, names the files found)
    prompts = read_parquet(args.items, required=ITEM_COLUMNS[cfg.dataset])
    accelerator = make_accelerator()
    try:
        # a local judge server loads while make_reward_context loads CLIP (and PickScore) and the policy
        # loads; the judge client is made (waiting for the server) once the policy is in memory
        with judge_endpoint(params, args.judge, accelerator, Path("logs"),
                            log_name=f"final_samples_{args.subtask}.judge_server.log") as endpoint:
            ctx = make_reward_context(params, endpoint, args.clip, args.pickscore, rewards=cfg.rewards,
                                      device=accelerator.device, connect=False)
            independent = None
            if cfg.independent_scorer == "base_judge":  # the zero-shot base judge, as reward_eval's baseline
                dtype = torch.bfloat16 if (cfg.dtype == "bfloat16" and accelerator.device.type == "cuda") \
                    else torch.float32
                independent = Judge.from_pretrained(args.base_judge, dtype=dtype, device=accelerator.device,
                                                    answer_variants=params.judge_endpoint.answer_variants)
            table, sheets, metrics = final_samples(cfg, prompts, args.policy, args.lora, ctx, independent=independent,
                                                   rank=accelerator.process_index, world=accelerator.num_processes,
                                                   accelerator=accelerator)
    except (JudgeError, RewardError) as exc:
        raise ArtifactError(f"final_samples@{args.subtask}: {exc}") from exc
    if not accelerator.is_main_process:
        return StageOutput.nothing()
    write_parquet(args.out, table, image_columns=["image"], image_list_columns=["panels"])
    tmp = args.sheets.with_name(f".{args.sheets.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for variant, sheet in sheets.items():
        # zlib's fastest level, as the samples' own PNGs (paco.core.io.encode_image): the same pixels,
        # several times faster to write than the default level 6, for a few more bytes
        (tmp / f"{variant}.png").write_bytes(encode_image(sheet)["bytes"])  # the directory is renamed into place
    replace_dir(tmp, args.sheets)
    for name, r in metrics["rewards"].items():
        log.info("final_samples@%s %-12s base %.4f -> lora %.4f (diff %+.4f, improved %.0f%%, p=%s)", args.subtask, name,
                 r["base_mean"], r["lora_mean"], r["lora_minus_base"], 100 * r["improved_fraction"],
                 r.get("paired_t_p_value"))
    for line in final_warnings(metrics, f"final_samples@{args.subtask}"):
        log.warning("%s", line)
    metrics.update({"subtask": args.subtask, "split": cfg.split, "resolution": cfg.resolution, "num_steps": cfg.num_steps,
                    "guidance_scale": cfg.guidance_scale})
    return StageOutput(headline(metrics, cfg.rewards[0]), metrics)


def headline(metrics: dict, first: str) -> dict:
    """metrics.json: the first listed reward's (consistency's) LoRA - base gain and its paired t-test
    p-value (the paper's headline), the hacking gap of that reward (when the independent judge
    scored it) and every monitor's LoRA - base change with its p-value; every figure is in
    report.json. A p-value is ``None`` where there is no test (no difference)."""
    r = metrics["rewards"][first]
    out = {f"{first}_gain": r.get("lora_minus_base"), f"{first}_p": r.get("paired_t_p_value")}
    if first in metrics.get("hacking_gap", {}):
        g, ind = metrics["hacking_gap"][first], metrics["independent"][first]
        out.update({"independent_gain": ind["lora_minus_base"], "independent_p": ind.get("paired_t_p_value"),
                    "hacking_gap": g["gap"], "hacking_gap_p": g.get("paired_t_p_value")})
    for name, m in metrics.get("monitors", {}).items():
        out.update({f"{name}_change": m["lora_minus_base"], f"{name}_p": m.get("paired_t_p_value")})
    return out


def main(argv: list[str] | None = None) -> int:
    return run("final_samples", argv, _args, _body, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
