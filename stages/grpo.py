"""Stage ``grpo@<subtask>``: PaCo-GRPO of the subtask's FLUX policy against PaCo-Reward and CLIP.

Run under ``accelerate launch`` (one process or several; CPU uses gloo)::

    accelerate launch --config_file workflow/accelerate/cpu.yaml --num_processes 1 -m stages.grpo \\
        --params params.yaml --subtask t2is --prompts data/prompts/prompts.parquet \\
        --policy data/models/policy_t2is --judge data/reward_merge/model --clip data/models/clip \\
        --lora data/grpo/t2is/lora --checkpoints data/grpo/t2is/checkpoints \\
        --plots data/grpo/t2is/plots --metrics data/grpo/t2is/metrics.json

The judge: with ``judge.url: null`` the main process starts ``python -m paco.serve`` on the
``--judge`` model on a free localhost port, waits for ``/health``, checks the served model name
and stops it on exit; with a URL (e.g. of ``vllm serve data/reward_merge/model
--served-model-name paco-reward``) that server is checked and used. Params: ``grpo.<subtask>``
(:class:`paco.params.GrpoSubtaskParams`), ``judge``, ``subfigures`` (how grids are cut for the
panel rewards). Writes the LoRA (diffusers format), resumable checkpoints, ``plots/train.csv``,
``plots/eval.csv`` and ``metrics.json`` (:func:`paco.grpo.train_grpo`).
"""

from __future__ import annotations

import os

# Tiny CPU models run many small ops: idle OpenMP threads must sleep, not spin, or they starve
# the judge server sharing the cores (set before torch is imported).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from paco.io import ArtifactError, read_parquet  # noqa: E402
from paco.params import Params, ParamsError  # noqa: E402
from paco.stage import log, run  # noqa: E402


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--subtask", required=True, help="key of params.yaml grpo.<subtask>")
    p.add_argument("--prompts", type=Path, required=True, help="prompts.parquet")
    p.add_argument("--policy", type=Path, required=True, help="policy model directory (models stage)")
    p.add_argument("--judge", type=Path, required=True, help="merged judge directory (reward_merge), served "
                   "locally unless judge.url is set")
    p.add_argument("--clip", type=Path, required=True, help="CLIP model directory (models stage)")
    p.add_argument("--lora", type=Path, required=True, help="LoRA directory to write")
    p.add_argument("--checkpoints", type=Path, required=True, help="resumable checkpoints directory")
    p.add_argument("--plots", type=Path, required=True, help="directory for train.csv / eval.csv")
    p.add_argument("--metrics", type=Path, required=True, help="metrics.json to write")


def subtask_params(params: Params, section: str, subtask: str):
    """``params.<section>[subtask]``; a missing subtask is a params error naming the known ones."""
    table = getattr(params, section)
    if subtask not in table:
        raise ParamsError(f"params.yaml: {section}.{subtask} does not exist (subtasks: {sorted(table)})")
    return table[subtask]


@contextlib.contextmanager
def judge_endpoint(params: Params, judge_dir: Path, accelerator, log_dir: Path | None):
    """Yield the judge base URL: ``judge.url``, or a local ``paco.serve`` started by the main
    process (the URL is broadcast to the other processes), logging to ``log_dir/judge_server.log``
    (a persisted directory: the server log of every run is kept)."""
    from paco.judge_client import JudgeError, LocalJudgeServer

    cfg = params.judge
    if cfg.url:
        yield cfg.url
        return
    if not (judge_dir / "config.json").is_file():
        raise ArtifactError(f"{judge_dir}: no judge model (run reward_merge, or set judge.url)")
    s = cfg.server
    server = None
    url = error = None
    if accelerator.is_main_process:
        server = LocalJudgeServer(judge_dir, cfg.served_model_name, max_batch_size=s.max_batch_size,
                                  max_wait_ms=s.max_wait_ms, threads=s.threads, startup_timeout_s=s.startup_timeout_s,
                                  device=s.device, dtype=s.dtype, max_logprobs=s.max_logprobs,
                                  log_path=log_dir / "judge_server.log" if log_dir else None)
        try:
            url = server.__enter__()
        except JudgeError as exc:
            if accelerator.num_processes == 1:
                raise
            server, error = None, str(exc)  # told to every process below, so none waits forever
    try:
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            box = [url, error]
            broadcast_object_list(box, from_process=0)
            url, error = box
            if error is not None:
                raise JudgeError(error)
        yield url
    finally:
        accelerator.wait_for_everyone()
        if server is not None:
            server.__exit__(None, None, None)


def make_reward_context(params: Params, url: str, clip_dir: Path):
    """The judge client and CLIP scorer the rewards use."""
    from paco.clip import ClipScorer
    from paco.judge_client import JudgeClient
    from paco.rewards import RewardContext

    cfg = params.judge
    api_key = None
    if cfg.api_key_env:
        api_key = os.environ.get(cfg.api_key_env)
        if not api_key:
            raise ParamsError(f"judge.api_key_env names {cfg.api_key_env!r}, which is not set")
    client = JudgeClient(url, cfg.served_model_name, concurrency=cfg.concurrency, timeout_s=cfg.timeout_s,
                         retries=cfg.retries, backoff_s=cfg.backoff_s, backoff_max_s=cfg.backoff_max_s,
                         top_logprobs=cfg.top_logprobs, answer_variants=cfg.answer_variants, api_key=api_key)
    client.check_model()
    return RewardContext(judge=client, clip=ClipScorer(clip_dir), instruction=cfg.instruction,
                         split_method=params.subfigures.method, tolerance=params.subfigures.tolerance)


def make_accelerator():
    import torch
    from accelerate import Accelerator

    return Accelerator(cpu=not torch.cuda.is_available())


def _body(args: argparse.Namespace, params: Params) -> dict:
    from paco.grpo import PROMPT_COLUMNS, train_grpo
    from paco.judge_client import JudgeError
    from paco.rewards import RewardError

    cfg = subtask_params(params, "grpo", args.subtask)
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    prompts = read_parquet(args.prompts, required=PROMPT_COLUMNS)
    accelerator = make_accelerator()
    try:
        with judge_endpoint(params, args.judge, accelerator, args.checkpoints) as url:
            ctx = make_reward_context(params, url, args.clip)
            metrics = train_grpo(cfg, prompts, args.policy, ctx, lora_dir=args.lora, checkpoints_dir=args.checkpoints,
                                 plots_dir=args.plots, accelerator=accelerator)
    except (JudgeError, RewardError) as exc:
        # a judge or reward failure is fatal: no reward is ever made up (exit code 2, clear message)
        raise ArtifactError(f"grpo@{args.subtask}: {exc}") from exc
    metrics["subtask"] = args.subtask
    metrics["judge"] = {"url": params.judge.url or "local paco.serve", "model": params.judge.served_model_name,
                        "requests": ctx.judge.requests}
    if not accelerator.is_main_process:
        args.metrics = None
    else:
        sig = metrics["learning_signal"]
        log.info("grpo@%s: train reward %.4f (first %d epochs) -> %.4f (last %d), p=%s; eval reward %.4f -> %.4f",
                 args.subtask, sig["first_epochs_reward"], sig["window_epochs"], sig["last_epochs_reward"],
                 sig["window_epochs"], sig.get("p_value"), metrics["eval_first"].get("reward", float("nan")),
                 metrics["eval_final"].get("reward", float("nan")))
    return metrics


def main(argv: list[str] | None = None) -> int:
    return run("grpo", argv, _args, _body, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
