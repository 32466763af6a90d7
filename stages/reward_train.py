"""Stage ``reward_train``: LoRA SFT of the PaCo-Reward judge (first-token-weighted loss).

``dvc repro`` runs it through :mod:`paco.core.launch` (``resources.stages.reward_train``: in place for
one process, under ``accelerate launch`` for several, CPU using gloo), as for the embedded default::

    python -m paco.core.launch --config_file workflow/accelerate/cpu.yaml --num_processes 1 \\
        --resources resources.stages.reward_train -m stages.reward_train \\
        --params params.yaml --sft data/reasons/sft.parquet \\
        --base data/models/judge_base --adapter data/reward_train/adapter \\
        --checkpoints data/reward_train/checkpoints --plots data/reward_train/plots \\
        --metrics data/reward_train/metrics.json

Plain ``python -m stages.reward_train ...`` runs one process. Reads ``sft.parquet`` (train on
``split == "train"``, evaluate every epoch on ``split == "test"``, ``status == "ok"`` rows),
writes the PEFT adapter (safetensors), ``plots/train.csv`` and ``plots/eval.csv``, resumable
``checkpoints/`` and ``metrics.json`` (:func:`paco.judge.training.train_reward`). Only the main
process writes the adapter, plots and metrics.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from paco.core.params import Params
from paco.judge.training import make_accelerator, train_reward
from paco.core.stage import StageOutput, log, run


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sft", type=Path, required=True, help="sft.parquet (reasons stage)")
    p.add_argument("--base", type=Path, required=True, help="base judge directory (models stage)")
    p.add_argument("--adapter", type=Path, required=True, help="PEFT adapter directory to write")
    p.add_argument("--checkpoints", type=Path, required=True, help="resumable checkpoints directory")
    p.add_argument("--plots", type=Path, required=True, help="directory for train.csv / eval.csv")
    p.add_argument("--metrics", type=Path, required=True, help="metrics.json to write")


def _body(args: argparse.Namespace, params: Params) -> StageOutput:
    from paco.core.run_identity import stage_identity_on_main
    from workflow.registry import member

    cfg = params.reward_train
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # no per-file lines on every checkpoint
    accelerator = make_accelerator(cfg)
    out = train_reward(
        cfg,
        args.sft,
        args.base,
        identity=stage_identity_on_main(member("reward_train"), args, params, accelerator),
        adapter_dir=args.adapter,
        checkpoints_dir=args.checkpoints,
        plots_dir=args.plots,
        accelerator=accelerator,
    )
    report = out["report"]
    if accelerator.is_main_process:
        final = report.get("eval_final", {})
        log.info(
            "reward_train: %d steps, final train loss %.4f, test first-token accuracy %s, P(Yes) accuracy %s",
            report["total_steps"], report["train_loss_final"] or float("nan"),
            final.get("first_token_accuracy"), final.get("p_yes_accuracy"),
        )
    return StageOutput(out["metrics"], report, writes=accelerator.is_main_process)


def main(argv: list[str] | None = None) -> int:
    return run("reward_train", argv, _args, _body, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
