"""A server a stage starts for itself and keeps for its lifetime (:class:`LocalServer`): the project's
``python -m paco.serving.server`` (engine ``paco``) or vLLM's OpenAI server (engine ``vllm``,
:mod:`paco.serving.vllm`, on GPUs or a CPU), in the environment :func:`server_env` builds (the
model's own GPUs when the launcher gave it some: ``PACO_JUDGE_DEVICES``, see
:mod:`paco.core.launch`). A server that dies is restarted on the same port, a bounded number of
times (:meth:`LocalServer.recover`, called by the clients of :mod:`paco.serving.client`).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from paco.core.launch import free_port
from paco.core.numerics import fix_numerics_env
from paco.serving.client import ServedClient, ServedModelError
from paco.serving.vllm import check_vllm_python, vllm_command, vllm_device

log = logging.getLogger("paco.serving.local")

#: the engines a stage can serve with
ENGINES = ("paco", "vllm")

#: variables of the distributed launch (torchrun / torch-elastic, accelerate) that a server started
#: by the stage's rank-0 process would inherit: vLLM's own workers read ``RANK``, ``LOCAL_RANK``,
#: ``WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT`` to set up their process group, and would join
#: the stage's (torch ``init_process_group(init_method="env://")``)
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                    "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: prefixes of the same: torch-elastic's agent (``TORCHELASTIC_RUN_ID`` ...) and accelerate's
#: launcher (``ACCELERATE_MIXED_PRECISION``, ``ACCELERATE_USE_DEEPSPEED`` ...)
LAUNCH_PREFIXES = ("TORCHELASTIC_", "ACCELERATE_")

#: seconds :meth:`LocalServer.recover` waits for a server that refused a connection to be seen
#: exiting (the kernel closes a dying process's sockets before its parent can reap it)
EXIT_GRACE_S = 2.0

#: the prefix of a run directory in the system temp folder (``paco-serve-<pid>-...``, pid the
#: starting process's), for a server started without a log path
RUN_DIR_PREFIX = "paco-serve-"


def server_env(base_env: Mapping[str, str], visible_devices: str | None = None) -> dict[str, str]:
    """The environment of a local server: a copy of ``base_env`` with

    - the fixed numerics variables (:func:`paco.core.numerics.fix_numerics_env`): scores must not
      depend on the machine's load or CPU model; and ``OMP_WAIT_POLICY=PASSIVE`` unless set (OpenMP
      threads busy-waiting between the server's small forward passes would take the cores the
      trainer needs, and the other way round);
    - no ``PACO_JUDGE_API_KEY`` (a key set to reach some remote judge is not this loopback server's,
      which would then refuse its own stage's requests);
    - none of the stage's launch variables (:data:`LAUNCH_VARIABLES`, names starting with
      :data:`LAUNCH_PREFIXES`): the server is a process of its own, not a rank of the stage;
    - ``CUDA_VISIBLE_DEVICES=visible_devices`` when it is given (the model's GPUs, comma-separated
      indices or UUIDs, ``PACO_JUDGE_DEVICES``); otherwise the caller's own.
    """
    env = {k: v for k, v in base_env.items() if k not in LAUNCH_VARIABLES and not k.startswith(LAUNCH_PREFIXES)}
    fix_numerics_env(env)
    env.pop("PACO_JUDGE_API_KEY", None)
    if visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices
    return env


def server_options(server: Any, *, request_timeout_s: float, max_logprobs: int | None = None) -> dict[str, Any]:
    """:class:`LocalServer`'s keywords from a ``judge_endpoint.server`` params block (its engine,
    batching, threads, device, dtype, restarts and vLLM settings; ``gpus`` becomes vLLM's
    ``tensor_parallel_size``, at least 1), with ``request_timeout_s`` (the client's timeout: a
    request it has given up on is not computed later) and ``max_logprobs`` (default the block's own;
    the benchmark raises it to its ``top_logprobs``). ``visible_devices`` and ``log_path`` are the
    caller's."""
    return {"engine": server.engine, "max_batch_size": server.max_batch_size, "max_wait_ms": server.max_wait_ms,
            "threads": server.threads, "startup_timeout_s": server.startup_timeout_s, "device": server.device,
            "dtype": server.dtype, "max_logprobs": server.max_logprobs if max_logprobs is None else max_logprobs,
            "batching": server.batching, "max_model_len": server.max_model_len,
            "gpu_memory_utilization": server.gpu_memory_utilization, "tensor_parallel_size": max(server.gpus, 1),
            "kv_cache_gib": server.kv_cache_gib, "max_restarts": server.max_restarts,
            "python": server.python, "extra_args": server.extra_args, "request_timeout_s": request_timeout_s}


def _parent_death_signal() -> Any:
    """A ``preexec_fn`` that makes the child get SIGTERM when the thread that started it exits
    (Linux ``PR_SET_PDEATHSIG``), or ``None`` elsewhere. libc is loaded here, in the parent: the
    child, between fork and exec, only calls ``prctl``."""
    import ctypes
    import signal

    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None

    def preexec() -> None:  # pragma: no cover - runs in the child
        prctl(1, signal.SIGTERM)

    return preexec


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_run_dirs(tmp: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the run directories (:data:`RUN_DIR_PREFIX`) in the temp folder ``tmp`` (default the
    system's) whose starting process is gone (a stage killed before it could clean up); the
    removed paths."""
    root = Path(tmp or tempfile.gettempdir())
    removed = []
    for path in root.glob(RUN_DIR_PREFIX + "*"):
        pid = path.name[len(RUN_DIR_PREFIX):].split("-", 1)[0]
        if path.is_dir() and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class LocalServer:
    """Run a model server on a localhost port for the duration of a ``with``: ``python -m
    paco.serving.server`` (``engine="paco"``), or vLLM's OpenAI server (``engine="vllm"``, the
    interpreter ``python`` of an environment with vLLM, :mod:`paco.serving.vllm`; its batching,
    dtype handling and kernels are vLLM's own, so its log-probs depend on the batch).

    ``__enter__`` is :meth:`start` then :meth:`wait_ready`: it starts the process, waits until it
    answers (``/health`` for the paco engine, ``/v1/models`` listing the name for vLLM; or the
    process dies, or ``startup_timeout_s`` passes from the start), checks that ``/v1/models``
    lists ``served_model_name``, and returns the base URL (``http://127.0.0.1:<port>/v1``). Calling
    the two apart lets the caller do its own start-up while the server loads. ``__exit__`` stops it
    (SIGTERM, then SIGKILL after 10 s, 60 s for vLLM; again is a no-op). The paco server is started
    with ``--parent-pid`` of this process, so it also shuts down when this process dies without
    reaching ``__exit__`` (SIGKILL, OOM kill); vLLM runs in a session of its own (stopping it stops
    its engine processes) and gets SIGTERM when this process's thread that started it exits (Linux
    ``PR_SET_PDEATHSIG``).

    **Restarts**: the server is its clients' :class:`~paco.serving.client.Supervisor`. When a
    request gets no HTTP response and the process has exited, :meth:`recover` starts it again on
    the same port (same command, the log appended after a line naming the restart and the exit
    code) and waits until it is ready; the clients then ask the requests that were in flight
    again. After ``max_restarts`` restarts the next death is an error quoting the log's tail.

    **Files**: the log goes to ``log_path`` (default: a file in the run directory) and the paco
    engine's port file beside it (``<log_path>.port``); without a log path both live in a run
    directory in the system temp folder, removed on exit, and stale ones of stages that were
    killed are removed at start (:func:`remove_stale_run_dirs`).

    ``batching`` and ``max_model_len`` are the paco server's ``--batching`` (default ``auto``:
    batch-invariant, :mod:`paco.serving.server`) and ``--max-model-len`` (``None``: the model's
    ``max_position_embeddings``). With ``engine="vllm"`` the command is
    :func:`paco.serving.vllm.vllm_command` on ``device`` (``cpu``, else CUDA) with ``max_logprobs``,
    ``dtype``, ``max_model_len``, ``gpu_memory_utilization``, ``tensor_parallel_size``,
    ``kv_cache_gib``, ``python`` and ``extra_args``. ``visible_devices`` (both engines) is the
    server's ``CUDA_VISIBLE_DEVICES`` (:func:`server_env`); ``tensor_parallel_size`` ``None``: the
    number of ``visible_devices`` entries, else 1. After :meth:`start`, ``cmd`` and ``env`` hold the
    argv and environment it ran with; ``restarts`` counts the restarts.

    Raises:
        paco.serving.client.ServedModelError: the server did not come up, serves another name, or
            died more than ``max_restarts`` times; :class:`paco.serving.vllm.VllmMissingError`:
            ``engine="vllm"`` and ``python`` has no vLLM (before anything is started).
        ValueError: an unknown engine, or ``max_restarts`` < 0.
    """

    #: the clients' error class (a subclass of :class:`ServedModelError`; the judge's stages
    #: raise :class:`paco.serving.judge_client.JudgeError`)
    error: type[ServedModelError] = ServedModelError

    def __init__(self, model_dir: str | os.PathLike[str], served_model_name: str, *, max_batch_size: int = 16,
                 max_wait_ms: float = 10.0, threads: int = 0, startup_timeout_s: float = 120.0,
                 log_path: str | os.PathLike[str] | None = None, device: str = "auto", dtype: str = "float32",
                 max_logprobs: int = 20, batching: str = "auto", max_model_len: int | None = None,
                 engine: str = "paco", request_timeout_s: float = 300.0, visible_devices: str | None = None,
                 gpu_memory_utilization: float = 0.85, tensor_parallel_size: int | None = None,
                 kv_cache_gib: float | None = None, max_restarts: int = 2, python: str | None = None,
                 extra_args: Sequence[str] = (), error: type[ServedModelError] | None = None):
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.engine = engine
        self.request_timeout_s = float(request_timeout_s)
        self.model_dir = Path(model_dir)
        self.served_model_name = served_model_name
        self.max_batch_size, self.max_wait_ms, self.threads = max_batch_size, max_wait_ms, threads
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(log_path) if log_path else None
        self.device, self.dtype, self.max_logprobs = device, dtype, max_logprobs
        self.batching, self.max_model_len = batching, max_model_len
        self.visible_devices = visible_devices
        self.gpu_memory_utilization, self.kv_cache_gib = gpu_memory_utilization, kv_cache_gib
        if tensor_parallel_size is None:
            tensor_parallel_size = len(visible_devices.split(",")) if visible_devices else 1
        self.tensor_parallel_size = tensor_parallel_size if vllm_device(device) == "cuda" else 1
        self.max_restarts = int(max_restarts)
        self.python = python
        self.extra_args = list(extra_args)
        if error is not None:
            self.error = error
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.port: int | None = None
        self.cmd: list[str] | None = None
        self.env: dict[str, str] | None = None
        self.restarts = 0
        self.generation = 0
        self._ready = False
        self._stopped = False
        self._given_up: ServedModelError | None = None
        self._tmp: Path | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> str:
        self.start()
        return self.wait_ready()

    def _log_tail(self) -> str:
        try:
            return "\n".join(self._log_file.read_text(errors="replace").splitlines()[-15:])
        except OSError:
            return "(no log)"

    def _command(self, port: int) -> list[str]:
        """The argv on ``port`` (0: the paco engine picks a free one and writes it to the port file)."""
        if self.engine == "vllm":
            return vllm_command(self.model_dir, self.served_model_name, port, python=self.python,
                                device=vllm_device(self.device), dtype=self.dtype, max_model_len=self.max_model_len,
                                max_logprobs=self.max_logprobs, gpu_memory_utilization=self.gpu_memory_utilization,
                                tensor_parallel_size=self.tensor_parallel_size, kv_cache_gib=self.kv_cache_gib,
                                extra_args=self.extra_args)
        return [sys.executable, "-m", "paco.serving.server", "--model", str(self.model_dir),
                "--served-model-name", self.served_model_name, "--host", "127.0.0.1", "--port", str(port),
                "--port-file", str(self._port_file), "--max-batch-size", str(self.max_batch_size),
                "--max-wait-ms", str(self.max_wait_ms), "--threads", str(self.threads), "--device", self.device,
                "--dtype", self.dtype, "--max-logprobs", str(self.max_logprobs), "--batching", self.batching,
                "--max-model-len", str(self.max_model_len or 0), "--parent-pid", str(os.getpid()),
                "--request-timeout-s", str(self.request_timeout_s)]

    def _run_files(self) -> None:
        """Where the log and the port file go (class docstring, "Files")."""
        if self.log_path is not None:
            self._log_file = self.log_path
            self._port_file = self.log_path.with_name(self.log_path.name + ".port")
        else:
            remove_stale_run_dirs()
            self._tmp = Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-"))
            self._log_file, self._port_file = self._tmp / "server.log", self._tmp / "port"
        self._log_file.parent.mkdir(parents=True, exist_ok=True)
        self._port_file.unlink(missing_ok=True)

    def start(self) -> None:
        """Start the server process and return at once (:meth:`wait_ready` waits for it).

        Raises:
            RuntimeError: already started.
            paco.serving.vllm.VllmMissingError: engine ``vllm`` and ``python`` has no vLLM.
        """
        if self.proc is not None:
            raise RuntimeError(f"server for {self.model_dir} already started")
        if self.engine == "vllm":
            check_vllm_python(self.python)
        self._run_files()
        if self.engine == "vllm":
            self.port = free_port("127.0.0.1")
        self.env = server_env(os.environ, self.visible_devices)
        self._spawn(self.port or 0)

    def _spawn(self, port: int) -> None:
        self.cmd = self._command(port)
        with open(self._log_file, "ab") as logf:
            # vLLM runs its engine in child processes: its own session, so stopping it stops them all
            self.proc = subprocess.Popen(self.cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=self.engine == "vllm",
                                         preexec_fn=_parent_death_signal() if self.engine == "vllm" else None)
        self._deadline = time.monotonic() + self.startup_timeout_s
        self._ready = False

    def _fail(self, message: str) -> ServedModelError:
        tail = self._log_tail()
        self.__exit__(None, None, None)
        return self.error(f"{message}; its log:\n{tail}")

    def _answers(self, client: ServedClient) -> bool:
        try:
            if self.engine == "vllm":
                return self.served_model_name in client.served_models()
            return client.health().get("status") == "ok"
        except ServedModelError:
            return False

    def wait_ready(self) -> str:
        """Wait until the started server is ready (see the class docstring); its base URL.

        Raises:
            paco.serving.client.ServedModelError: it exited, was not healthy ``startup_timeout_s``
                after its start, or serves another name (the server is stopped and its log's tail
                quoted).
            RuntimeError: not started.
        """
        if self.proc is None:
            raise RuntimeError(f"server for {self.model_dir} not started")
        if self.url is not None and self._ready:
            return self.url
        client: ServedClient | None = None  # one polling client, closed below
        try:
            while True:
                if self.proc.poll() is not None:
                    raise self._fail(f"server ({self.model_dir}) exited with code {self.proc.returncode} "
                                     "before it was ready")
                if self.port is None and self._port_file.is_file() and self._port_file.read_text().strip():
                    self.port = int(self._port_file.read_text())
                if client is None and self.port is not None:
                    self.url = f"http://127.0.0.1:{self.port}/v1"
                    client = ServedClient(self.url, self.served_model_name, retries=0, timeout_s=5.0)
                if client is not None and self._answers(client):
                    break
                if time.monotonic() > self._deadline:
                    raise self._fail(f"server ({self.model_dir}) not healthy after {self.startup_timeout_s:g} s "
                                     "(judge_endpoint.server.startup_timeout_s)")
                time.sleep(0.2)
        finally:
            if client is not None:
                client.close()
        checker = ServedClient(self.url, self.served_model_name, retries=2, timeout_s=10.0)
        try:
            checker.check_model()
        except ServedModelError as exc:
            self.__exit__(None, None, None)
            raise self.error(str(exc)) from None
        finally:
            checker.close()
        self._ready = True
        log.info("%s server for %s up at %s (pid %d)", self.engine, self.model_dir, self.url, self.proc.pid)
        return self.url

    def recover(self, generation: int) -> bool:
        """The :class:`~paco.serving.client.Supervisor` call: ``True`` if the server was restarted
        since ``generation`` (by this call: it had exited; or by another thread's), ``False`` if it
        runs (or was stopped by :meth:`__exit__`). A process that refused a connection is given
        :data:`EXIT_GRACE_S` seconds to be seen exiting.

        Raises:
            paco.serving.client.ServedModelError: it exited after ``max_restarts`` restarts, or
                its restart did not come up (the log's tail quoted); raised again to every later
                caller.
        """
        with self._lock:
            if self.generation != generation:
                return True
            if self._given_up is not None:  # every request that meets the dead server hears why
                raise self.error(str(self._given_up))
            if self._stopped or self.proc is None:
                return False
            try:  # a killed process closes its socket before it can be reaped: give its exit a moment
                self.proc.wait(timeout=EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                return False
            code = self.proc.returncode
            if self.restarts >= self.max_restarts:
                self._given_up = self._fail(f"{self.engine} server ({self.model_dir}) exited with code {code} "
                                            f"after {self.restarts} restart(s) (judge_endpoint.server.max_restarts "
                                            f"{self.max_restarts})")
                raise self._given_up
            self._reap()
            self.restarts += 1
            log.warning("%s server for %s exited with code %s: restart %d of %d on port %s", self.engine,
                        self.model_dir, code, self.restarts, self.max_restarts, self.port)
            with open(self._log_file, "ab") as logf:
                logf.write(f"\n--- paco.serving.local: exited with code {code}; restart {self.restarts} of "
                           f"{self.max_restarts} ---\n".encode())
            self._spawn(self.port)
            try:
                self.wait_ready()
            except ServedModelError as exc:  # the restart did not come up (stopped, its log quoted)
                self._given_up = exc
                raise
            self.generation += 1
            return True

    def _signal(self, sig: int) -> None:
        import signal as _signal

        if self.engine == "vllm":  # the whole session: the API server and its engine processes
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        elif sig == _signal.SIGKILL:
            self.proc.kill()
        else:
            self.proc.terminate()

    def _reap(self) -> None:
        """Stop the process (running or not) and, for vLLM, what is left of its session."""
        import signal as _signal

        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal(_signal.SIGTERM)
            try:
                self.proc.wait(timeout=10 if self.engine == "paco" else 60)
            except subprocess.TimeoutExpired:
                self._signal(_signal.SIGKILL)
                self.proc.wait()
        elif self.engine == "vllm":
            self._signal(_signal.SIGKILL)  # the API server is gone; its engine processes may not be

    def __exit__(self, *exc: Any) -> None:
        self._stopped = True
        self._reap()
        if self.proc is not None:
            self._port_file.unlink(missing_ok=True)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
