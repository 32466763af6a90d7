"""How PaCo-GRPO and final sampling reach the PaCo-Reward judge (the ``judge_endpoint:`` params section):
the served judge's URL for a stage's lifetime (``judge_endpoint.url``, or a local ``python -m paco.judge.serve``
of the merged judge). The reward context built on it is :func:`paco.grpo.rewards.make_reward_context`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from paco.core.io import ArtifactError
from paco.core.params import Params


class JudgeEndpoint:
    """The judge a stage scores with, while :func:`judge_endpoint` holds it: ``judge_endpoint.url``,
    or the local server the main process started. :meth:`url` waits until that server is ready;
    every process must call it (the main process broadcasts the URL, or the start-up error)."""

    def __init__(self, accelerator, *, url: str | None = None, server=None):
        self._accelerator = accelerator
        self._url = url  # set once known on this process (broadcast from the main one if several)
        self._server = server

    def url(self) -> str:
        """The judge's base URL (``http://host:port/v1``).

        Raises:
            paco.judge.client.JudgeError: the local server did not come up (on every process).
        """
        from paco.judge.client import JudgeError

        if self._url is not None:
            return self._url
        error = None
        if self._server is not None:
            try:
                self._url = self._server.wait_ready()
            except JudgeError as exc:
                if self._accelerator.num_processes == 1:
                    raise
                error = str(exc)  # told to every process below, so none waits forever
        if self._accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            box = [self._url, error]
            broadcast_object_list(box, from_process=0)
            self._url, error = box
            if error is not None:
                raise JudgeError(error)
        return self._url


@contextlib.contextmanager
def judge_endpoint(params: Params, judge_dir: Path, accelerator, log_dir: Path | None):
    """Yield the stage's :class:`JudgeEndpoint`: ``judge_endpoint.url``, or a local ``paco.judge.serve`` that
    the main process starts now and stops on exit, logging to ``log_dir/judge_server.log`` (a persisted
    directory: the server log of every run is kept). The server loads while the stage does its own
    start-up (imports, models); :meth:`JudgeEndpoint.url` waits for it.

    Raises:
        ArtifactError: no judge model in ``judge_dir`` (and no ``judge_endpoint.url``).
    """
    from paco.judge.client import LocalJudgeServer

    cfg = params.judge_endpoint
    if cfg.url:
        yield JudgeEndpoint(accelerator, url=cfg.url)
        return
    if not (judge_dir / "config.json").is_file():
        raise ArtifactError(f"{judge_dir}: no judge model (run reward_merge, or set judge_endpoint.url)")
    s = cfg.server
    server = None
    if accelerator.is_main_process:
        server = LocalJudgeServer(judge_dir, cfg.served_model_name, max_batch_size=s.max_batch_size,
                                  max_wait_ms=s.max_wait_ms, threads=s.threads, startup_timeout_s=s.startup_timeout_s,
                                  device=s.device, dtype=s.dtype, max_logprobs=s.max_logprobs,
                                  batching=s.batching, max_model_len=s.max_model_len,
                                  # a request the client has given up on is not computed later
                                  request_timeout_s=cfg.timeout_s,
                                  log_path=log_dir / "judge_server.log" if log_dir else None)
    try:
        if server is not None:
            server.start()
        yield JudgeEndpoint(accelerator, server=server)
    finally:
        accelerator.wait_for_everyone()
        if server is not None:
            server.__exit__(None, None, None)

