"""How PaCo-GRPO and final sampling reach the PaCo-Reward judge (the ``judge_endpoint:`` params section):
the served judge's URL for a stage's lifetime (``judge_endpoint.url``, or a local ``python -m paco.judge.serve``
or vLLM server of the merged judge, on GPUs of the stage's own job with ``judge_endpoint.server.gpus``).
The reward context built on it is :func:`paco.grpo.rewards.make_reward_context`.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from paco.core.io import ArtifactError
from paco.core.params import Params


class JudgeEndpoint:
    """The judge a stage scores with, while :func:`judge_endpoint` holds it: ``judge_endpoint.url``,
    or the local server the local main process of this node started (one replica per node, reached
    over loopback). :meth:`url` waits until that server is ready; every process must call it (the
    URLs, or a start-up error, are gathered from every node's local main process; each process takes
    its own node's, and every process raises an error of any node)."""

    def __init__(self, accelerator, *, url: str | None = None, server=None):
        self._accelerator = accelerator
        self._url = url  # set once known on this process (gathered from its node's local main one)
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
            from accelerate.utils import gather_object

            acc = self._accelerator
            node = acc.process_index - acc.local_process_index  # the global index of this node's local main
            entries = gather_object([(node, self._url, error)])
            errors = [e for _, _, e in entries if e is not None]
            if errors:
                raise JudgeError(errors[0])
            urls = [u for n, u, _ in entries if n == node and u is not None]
            if not urls:
                raise JudgeError(f"no judge server on the node of process {acc.process_index}")
            self._url = urls[0]
        return self._url


@contextlib.contextmanager
def judge_endpoint(params: Params, judge_dir: Path, accelerator, log_dir: Path | None,
                   log_name: str = "judge_server.log"):
    """Yield the stage's :class:`JudgeEndpoint`: ``judge_endpoint.url``, or a local judge server
    (``judge_endpoint.server.engine``: ``paco.judge.serve`` or vLLM, :class:`LocalJudgeServer`) that
    the main process starts now and stops on exit, logging to ``log_dir/log_name`` (grpo: its
    persisted checkpoints directory, so the server log of every run is kept; final_samples:
    ``logs/final_samples_<k>.judge_server.log``; ``None``: a temp file). The server loads while
    the stage does its own start-up (imports, models); :meth:`JudgeEndpoint.url` waits for it.

    With ``judge_endpoint.server.gpus`` N > 0 the server runs on the judge GPUs that
    ``paco.core.launch --serves_judge`` split off the job's allocation (``PACO_JUDGE_DEVICES``;
    vLLM's tensor parallelism over N), and the stage's processes on the rest. On several machines
    each node's local main process starts a replica on its own node (log ``log_name`` with
    ``.node<R>`` before its suffix on node R > 0); with ``engine: paco`` the replicas give the same
    scores (batch-invariant, same weights), so the bytes do not depend on the node count.

    Raises:
        ArtifactError: no judge model in ``judge_dir`` (and no ``judge_endpoint.url``); or
            ``server.gpus`` > 0 but no ``PACO_JUDGE_DEVICES`` (the stage was not started by
            ``paco.core.launch --serves_judge``).
    """
    from paco.judge.local_server import LocalJudgeServer, server_options

    cfg = params.judge_endpoint
    if cfg.url:
        yield JudgeEndpoint(accelerator, url=cfg.url)
        return
    if not (judge_dir / "config.json").is_file():
        raise ArtifactError(f"{judge_dir}: no judge model (judge_endpoint.model: run reward_merge for "
                            "data/reward_merge/model, models for data/models/<role>; or set judge_endpoint.url)")
    s = cfg.server
    devices = os.environ.get("PACO_JUDGE_DEVICES") if s.gpus > 0 else None
    if s.gpus > 0 and not devices:
        raise ArtifactError(f"judge_endpoint.server.gpus {s.gpus} but the stage was not started by "
                            "paco.core.launch --serves_judge (no PACO_JUDGE_DEVICES: which GPUs are the judge's?)")
    server = None
    node = int(os.environ.get("GROUP_RANK") or 0)  # torch elastic's node rank (several machines)
    if node > 0:
        log_name = f"{Path(log_name).stem}.node{node}{Path(log_name).suffix}"
    if accelerator.is_local_main_process:  # one server per node
        server = LocalJudgeServer(judge_dir, cfg.served_model_name, visible_devices=devices,
                                  **server_options(s, request_timeout_s=cfg.timeout_s),
                                  log_path=log_dir / log_name if log_dir else None)
    try:
        if server is not None:
            server.start()
        yield JudgeEndpoint(accelerator, server=server)
    finally:
        accelerator.wait_for_everyone()
        if server is not None:
            server.__exit__(None, None, None)

