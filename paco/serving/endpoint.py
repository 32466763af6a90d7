"""How PaCo-GRPO and final sampling reach the PaCo-Reward judge (the ``judge_endpoint:`` params section):
the served judge's URL for a stage's lifetime (``judge_endpoint.url``, or a local ``python -m paco.serving.server``
or vLLM server of the merged judge, on the CPU or on GPUs of the stage's own job with
``judge_endpoint.server.gpus``), and the supervisor its clients report a dead server to. The reward
context built on it is :func:`paco.grpo.rewards.make_reward_context`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path

from paco.core.io import ArtifactError
from paco.core.params import Params

log = logging.getLogger("paco.serving.endpoint")


class HealthWait:
    """The supervisor of the processes that share a node's judge server but did not start it: after
    a request got no HTTP response it waits, up to ``timeout_s``, for the server at ``url`` to
    answer ``/health`` again (its owner restarts it on the same port, :class:`LocalServer`).

    ``generation`` counts the outages it saw end; :meth:`recover` is ``True`` when the server had
    stopped answering and answers again, ``False`` when it answered at once (the request's own
    retries go on) or never came back within ``timeout_s`` (they go on, and fail)."""

    def __init__(self, url: str, model: str, timeout_s: float):
        self.url, self.model, self.timeout_s = url, model, float(timeout_s)
        self.generation = 0
        self._lock = threading.Lock()  # one thread waits; the others then see the new generation

    def _healthy(self) -> bool:
        from paco.serving.client import ServedClient, ServedModelError

        client = ServedClient(self.url, self.model, retries=0, timeout_s=5.0)
        try:
            return client.health().get("status") == "ok"
        except ServedModelError:
            return False
        finally:
            client.close()

    def recover(self, generation: int) -> bool:
        with self._lock:
            if generation != self.generation:
                return True
            if self._healthy():
                return False
            end = time.monotonic() + self.timeout_s
            while time.monotonic() < end:
                time.sleep(1.0)
                if self._healthy():
                    self.generation += 1
                    log.warning("judge server at %s answers again", self.url)
                    return True
            return False


class JudgeEndpoint:
    """The judge a stage scores with, while :func:`judge_endpoint` holds it: ``judge_endpoint.url``,
    or the local server the local main process of this node started (one replica per node, reached
    over loopback). :meth:`url` waits until that server is ready; every process must call it (the
    URLs, or a start-up error, are gathered from every node's local main process; each process takes
    its own node's, and every process raises an error of any node)."""

    def __init__(self, accelerator, *, url: str | None = None, server=None, startup_timeout_s: float | None = None):
        self._accelerator = accelerator
        self._url = url  # set once known on this process (gathered from its node's local main one)
        self._server = server
        self._startup_timeout_s = startup_timeout_s  # None: a URL endpoint (nobody restarts it)

    @property
    def restarts(self) -> int:
        """How many times this process restarted the local server (0 for a URL, or on a process
        that did not start it)."""
        return self._server.restarts if self._server is not None else 0

    def supervisor(self):
        """What this process's judge clients report a server that stopped answering to (call after
        :meth:`url`): the local server itself on the process that started it (it restarts it), a
        :class:`HealthWait` on the other processes of its node, ``None`` for ``judge_endpoint.url``
        (its requests keep their retries)."""
        if self._server is not None:
            return self._server
        if self._startup_timeout_s is None:
            return None
        return HealthWait(self.url(), "judge", self._startup_timeout_s)

    def url(self) -> str:
        """The judge's base URL (``http://host:port/v1``).

        Raises:
            paco.serving.judge_client.JudgeError: the local server did not come up (on every process).
        """
        from paco.serving.judge_client import JudgeError

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
            from paco.core.distributed import gather_objects

            acc = self._accelerator
            node = acc.process_index - acc.local_process_index  # the global index of this node's local main
            entries = gather_objects(acc, [(node, self._url, error)])
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
    (``judge_endpoint.server.engine``: ``paco.serving.server`` or vLLM, :class:`LocalServer`) that
    the main process starts now and stops on exit, logging to ``log_dir/log_name`` (grpo: its
    persisted checkpoints directory, so the server log of every run is kept; final_samples:
    ``logs/final_samples_<k>.judge_server.log``; ``None``: a temp file). The server loads while
    the stage does its own start-up (imports, models); :meth:`JudgeEndpoint.url` waits for it.

    With ``judge_endpoint.server.gpus`` N > 0 the server runs on the judge GPUs that
    ``paco.core.launch --serves_judge`` split off the job's allocation (``PACO_JUDGE_DEVICES``;
    vLLM's tensor parallelism over N), and the stage's processes on the rest. On several machines
    each node's local main process starts a replica on its own node (log ``log_name`` with
    ``.node<R>`` before its suffix on node R > 0); with ``engine: paco`` the replicas give the same
    scores (batch-invariant, same weights), so the bytes do not depend on the node count. A local
    server that dies is restarted on its port (``judge_endpoint.server.max_restarts``;
    :meth:`JudgeEndpoint.supervisor`).

    Raises:
        ArtifactError: no judge model in ``judge_dir`` (and no ``judge_endpoint.url``); or
            ``server.gpus`` > 0 but no ``PACO_JUDGE_DEVICES`` (the stage was not started by
            ``paco.core.launch --serves_judge``).
    """
    from paco.serving.judge_client import JudgeError
    from paco.serving.local import LocalServer, server_options

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
        server = LocalServer(judge_dir, cfg.served_model_name, visible_devices=devices, error=JudgeError,
                             **server_options(s, request_timeout_s=cfg.timeout_s),
                             log_path=log_dir / log_name if log_dir else None)
    try:
        if server is not None:
            server.start()
        yield JudgeEndpoint(accelerator, server=server, startup_timeout_s=s.startup_timeout_s)
    finally:
        accelerator.wait_for_everyone()
        if server is not None:
            server.__exit__(None, None, None)

