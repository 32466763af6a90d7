"""How PaCo-GRPO and final sampling reach the PaCo-Reward judge (the ``judge_endpoint:`` params section):
the served judge's URL for a stage's lifetime (``judge_endpoint.url``, or a local ``python -m paco.judge.serve``
of the merged judge), the reward context (judge client, CLIP scorer, instruction, grid cutting),
the accelerator and the subtask's params.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from paco.core.io import ArtifactError
from paco.core.params import Params, ParamsError


def subtask_params(params: Params, section: str, subtask: str):
    """``params.<section>[subtask]``; a missing subtask is a params error naming the known ones."""
    table = getattr(params, section)
    if subtask not in table:
        raise ParamsError(f"params.yaml: {section}.{subtask} does not exist (subtasks: {sorted(table)})")
    return table[subtask]


@contextlib.contextmanager
def judge_endpoint(params: Params, judge_dir: Path, accelerator, log_dir: Path | None):
    """Yield the judge base URL: ``judge_endpoint.url``, or a local ``paco.judge.serve`` started by the main
    process (the URL is broadcast to the other processes), logging to ``log_dir/judge_server.log``
    (a persisted directory: the server log of every run is kept)."""
    from paco.judge.client import JudgeError, LocalJudgeServer

    cfg = params.judge_endpoint
    if cfg.url:
        yield cfg.url
        return
    if not (judge_dir / "config.json").is_file():
        raise ArtifactError(f"{judge_dir}: no judge model (run reward_merge, or set judge_endpoint.url)")
    s = cfg.server
    server = None
    url = error = None
    if accelerator.is_main_process:
        server = LocalJudgeServer(judge_dir, cfg.served_model_name, max_batch_size=s.max_batch_size,
                                  max_wait_ms=s.max_wait_ms, threads=s.threads, startup_timeout_s=s.startup_timeout_s,
                                  device=s.device, dtype=s.dtype, max_logprobs=s.max_logprobs,
                                  batching=s.batching, max_model_len=s.max_model_len,
                                  # a request the client has given up on is not computed later
                                  request_timeout_s=cfg.timeout_s,
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
    from paco.models.clip import ClipScorer
    from paco.judge.client import JudgeClient
    from paco.grpo.rewards import RewardContext

    cfg = params.judge_endpoint
    api_key = None
    if cfg.api_key_env:
        api_key = os.environ.get(cfg.api_key_env)
        if not api_key:
            raise ParamsError(f"judge.api_key_env names {cfg.api_key_env!r}, which is not set")
    client = JudgeClient(url, cfg.served_model_name, concurrency=cfg.concurrency, timeout_s=cfg.timeout_s,
                         retries=cfg.retries,
                         top_logprobs=cfg.top_logprobs, answer_variants=cfg.answer_variants, api_key=api_key)
    client.check_model()
    return RewardContext(judge=client, clip=ClipScorer(clip_dir), instruction=cfg.instruction,
                         split_method=params.subfigures.method, tolerance=params.subfigures.tolerance)


def make_accelerator():
    import torch
    from accelerate import Accelerator

    return Accelerator(cpu=not torch.cuda.is_available())
