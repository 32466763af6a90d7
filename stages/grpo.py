"""Stage ``grpo@<subtask>``: PaCo-GRPO of the subtask's policy against PaCo-Reward (and CLIP).

``dvc repro`` runs it through :mod:`paco.core.launch` (``grpo.<subtask>.resources``: in place for one
process, under ``accelerate launch`` for several, CPU using gloo), here the embedded default's ``t2is``::

    python -m paco.core.launch --config_file workflow/accelerate/cpu.yaml --num_processes 1 \\
        --resources grpo.t2is.resources --serves_judge -m stages.grpo \\
        --params params.yaml --subtask t2is --items data/prompts/prompts.parquet \\
        --policy data/models/policy_t2is --judge data/reward_merge/model --clip data/models/clip \\
        --pickscore data/models/pickscore --lora data/grpo/t2is/lora --checkpoints data/grpo/t2is/checkpoints \\
        --plots data/grpo/t2is/plots --metrics data/grpo/t2is/metrics.json

The judge: with ``judge_endpoint.url: null`` the main process starts ``python -m paco.serving.server`` on the
``--judge`` model on a free localhost port, loads CLIP and PickScore while it starts, then waits for
``/health``, checks the served model name, and stops it on exit; with a URL (e.g. of ``vllm serve
data/reward_merge/model --served-model-name paco-reward``) that server is checked and used. Params: ``grpo.<subtask>``
(:class:`paco.core.params.GrpoSubtaskParams`), ``judge_endpoint``, ``subfigures`` (how grids are cut for the
panel rewards). Writes the LoRA (diffusers format), resumable checkpoints, ``plots/train.csv``,
``plots/eval.csv`` and ``metrics.json`` (:func:`paco.grpo.trainer.train_grpo`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from paco.core.io import ArtifactError, read_parquet
from paco.core.distributed import make_accelerator
from paco.serving.endpoint import judge_endpoint
from paco.core.params import Params
from paco.core.stage import StageOutput, log, run, subtask_params


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--subtask", required=True, help="key of params.yaml grpo.<subtask>")
    p.add_argument("--items", type=Path, required=True,
                   help="the subtask's items: prompts.parquet (dataset prompts) or edits.parquet (dataset edits)")
    p.add_argument("--policy", type=Path, required=True, help="policy model directory (models stage)")
    p.add_argument("--judge", type=Path, required=True, help="judge directory: judge_endpoint.model (reward_merge's, "
                   "or a released judge from the models stage), served locally unless judge_endpoint.url is set")
    p.add_argument("--clip", type=Path, required=True, help="CLIP model directory (models stage)")
    p.add_argument("--pickscore", type=Path, required=True,
                   help="PickScore model directory (models stage; loaded only for the pickscore reward)")
    p.add_argument("--lora", type=Path, required=True, help="LoRA directory to write")
    p.add_argument("--checkpoints", type=Path, required=True, help="resumable checkpoints directory")
    p.add_argument("--plots", type=Path, required=True, help="directory for train.csv / eval.csv")
    p.add_argument("--metrics", type=Path, required=True, help="metrics.json to write")


def _body(args: argparse.Namespace, params: Params) -> StageOutput:
    from paco.grpo.rewards import ITEM_COLUMNS, RewardError, check_reward_names, make_reward_context
    from paco.grpo.trainer import check_splits, train_grpo
    from paco.serving.judge_client import JudgeError
    from paco.core.run_identity import stage_identity_on_main
    from workflow.registry import member

    cfg = subtask_params(params, "grpo", args.subtask)
    check_reward_names(cfg.rewards, f"grpo.{args.subtask}.rewards", source=str(args.params))
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    prompts = read_parquet(args.items, required=ITEM_COLUMNS[cfg.dataset])
    check_splits(cfg, prompts, f"grpo.{args.subtask}")
    accelerator = make_accelerator()
    grpo_member = member(f"grpo@{args.subtask}", params.model_dump(mode="json", by_alias=True))
    identity = stage_identity_on_main(grpo_member, args, params, accelerator)
    try:
        # a local judge server loads while make_reward_context loads CLIP (and PickScore) and the policy
        # loads; the judge client is made (waiting for the server) once the policy is in memory
        with judge_endpoint(params, args.judge, accelerator, args.checkpoints) as endpoint:
            ctx = make_reward_context(params, endpoint, args.clip, args.pickscore, rewards=cfg.rewards,
                                      device=accelerator.device, connect=False)
            out = train_grpo(cfg, prompts, args.policy, ctx, identity=identity, lora_dir=args.lora,
                             checkpoints_dir=args.checkpoints, plots_dir=args.plots, accelerator=accelerator)
            restarts = endpoint.restarts
    except (JudgeError, RewardError) as exc:
        # a judge or reward failure is fatal: no reward is ever made up (exit code 2, clear message)
        raise ArtifactError(f"grpo@{args.subtask}: {exc}") from exc
    report = out["report"]
    report["subtask"] = args.subtask
    endpoint = params.judge_endpoint
    report["judge"] = {"url": endpoint.url or f"local {endpoint.server.engine} server",
                       "model": endpoint.served_model_name, "requests": ctx.judge.requests,
                       "server_restarts": restarts}
    if accelerator.is_main_process:
        sig = report["learning_signal"]
        log.info("grpo@%s: train reward %.4f (first %d epochs) -> %.4f (last %d), higher on %s of %s prompts, "
                 "paired p=%s; eval reward %.4f -> %.4f",
                 args.subtask, sig["first_epochs_reward"], sig["window_epochs"], sig["last_epochs_reward"],
                 sig["window_epochs"], sig.get("prompts_improved"), sig.get("prompts_paired"), sig.get("p_value"),
                 report["eval_first"].get("reward", float("nan")), report["eval_final"].get("reward", float("nan")))
    return StageOutput(out["metrics"], report, writes=accelerator.is_main_process)


def main(argv: list[str] | None = None) -> int:
    return run("grpo", argv, _args, _body, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
