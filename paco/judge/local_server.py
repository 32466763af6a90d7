"""A judge server a stage starts for itself (:class:`LocalJudgeServer`) and the commands it runs:
``python -m paco.judge.serve`` (engine ``paco``) or vLLM's OpenAI server (engine ``vllm``,
:func:`vllm_command`), in the environment :func:`server_env` builds (the judge's own GPUs when the
launcher gave it some: ``PACO_JUDGE_DEVICES``, see :mod:`paco.core.launch`).

The vLLM command is the reference's ``PaCo-GRPO/vllm_server/launch.sh`` (l.138-146: ``vllm serve
$MODEL --served-model-name $NAME --gpu-memory-utilization 0.85 --max-model-len 8192 --port ...
--tensor-parallel-size $NUM_GPUS``, one model over all its visible GPUs, l.62-64), with every value
from ``judge_endpoint.server`` and three differences: it listens on loopback only (the stage is its
only client), it passes ``--dtype`` and ``--max-logprobs`` explicitly (the reference leaves vLLM's
defaults, ``auto`` and 20), and ``--seed 0``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from paco.core.launch import free_port
from paco.core.numerics import fix_numerics_env
from paco.judge.client import JudgeClient, JudgeError

log = logging.getLogger("paco.judge.local_server")

#: the module vLLM's ``vllm serve`` runs (``python -m`` of it needs no ``vllm`` script on PATH)
VLLM_MODULE = "vllm.entrypoints.openai.api_server"


def vllm_command(model_dir: str | os.PathLike[str], served_model_name: str, port: int, *, python: str | None = None,
                 dtype: str = "auto", max_model_len: int | None = None, max_logprobs: int = 20,
                 gpu_memory_utilization: float = 0.85, tensor_parallel_size: int = 1,
                 extra_args: Sequence[str] = (), host: str = "127.0.0.1") -> list[str]:
    """The argv of vLLM's OpenAI server for the judge (a pure function):

    ``[python, -m, vllm.entrypoints.openai.api_server, --model, model_dir, --served-model-name, name,
    --host, host, --port, port, --dtype, dtype, --max-logprobs, n, --gpu-memory-utilization, u,
    --tensor-parallel-size, tp, --seed, 0, (--max-model-len, L), *extra_args]``.

    ``python``: the interpreter (``None``: this one, ``sys.executable``); ``port`` in 1..65535;
    ``gpu_memory_utilization`` in (0, 1] (launch.sh l.16: 0.85); ``tensor_parallel_size`` >= 1, the
    judge's GPU count (launch.sh l.62-64); ``max_model_len`` ``None`` leaves vLLM's (the model's
    ``max_position_embeddings``; launch.sh l.19: 8192).

    Raises:
        ValueError: a value out of those ranges, or ``max_logprobs`` < 1.
    """
    if not 0 < int(port) < 65536:
        raise ValueError(f"port {port} is not in 1..65535")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization {gpu_memory_utilization} is not in (0, 1]")
    if tensor_parallel_size < 1 or max_logprobs < 1:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} and max_logprobs {max_logprobs} must be >= 1")
    cmd = [python or sys.executable, "-m", VLLM_MODULE, "--model", str(model_dir),
           "--served-model-name", served_model_name, "--host", host, "--port", str(int(port)),
           "--dtype", dtype, "--max-logprobs", str(max_logprobs),
           "--gpu-memory-utilization", str(gpu_memory_utilization), "--tensor-parallel-size", str(tensor_parallel_size),
           "--seed", "0"]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd + [str(a) for a in extra_args]


#: variables of the distributed launch (torchrun / torch-elastic, accelerate) that the judge
#: server, started by the stage's rank-0 process, would inherit: vLLM's own workers read
#: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT`` to set up their
#: process group, and would join the stage's (torch ``init_process_group(init_method="env://")``)
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                    "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: prefixes of the same: torch-elastic's agent (``TORCHELASTIC_RUN_ID`` ...) and accelerate's
#: launcher (``ACCELERATE_MIXED_PRECISION``, ``ACCELERATE_USE_DEEPSPEED`` ...)
LAUNCH_PREFIXES = ("TORCHELASTIC_", "ACCELERATE_")


def server_env(base_env: Mapping[str, str], visible_devices: str | None = None) -> dict[str, str]:
    """The environment of a local judge server: a copy of ``base_env`` with

    - ``OMP_WAIT_POLICY=PASSIVE`` unless set (OpenMP threads busy-waiting between the server's small
      forward passes would steal the cores the trainer needs, and the other way round);
    - the fixed numerics variables (:func:`paco.core.numerics.fix_numerics_env`): scores must not
      depend on the machine's load or CPU model;
    - no ``PACO_JUDGE_API_KEY`` (a key set to reach some remote judge is not this loopback server's,
      which would then refuse its own stage's requests);
    - none of the stage's launch variables (:data:`LAUNCH_VARIABLES`, names starting with
      :data:`LAUNCH_PREFIXES`): the server is a process of its own, not a rank of the stage;
    - ``CUDA_VISIBLE_DEVICES=visible_devices`` when it is given (the judge's GPUs, comma-separated
      indices or UUIDs, ``PACO_JUDGE_DEVICES``); otherwise the caller's own.
    """
    env = {k: v for k, v in base_env.items() if k not in LAUNCH_VARIABLES and not k.startswith(LAUNCH_PREFIXES)}
    env["OMP_WAIT_POLICY"] = base_env.get("OMP_WAIT_POLICY", "PASSIVE")
    fix_numerics_env(env)
    env.pop("PACO_JUDGE_API_KEY", None)
    if visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices
    return env


def server_options(server: Any, *, request_timeout_s: float, max_logprobs: int | None = None) -> dict[str, Any]:
    """:class:`LocalJudgeServer`'s keywords from a ``judge_endpoint.server`` params block (its
    ``engine``, batching, threads, device, dtype and vLLM settings; ``gpus`` becomes vLLM's
    ``tensor_parallel_size``, at least 1), with ``request_timeout_s`` (the client's timeout: a request
    it has given up on is not computed later) and ``max_logprobs`` (default the block's own; the
    benchmark raises it to its ``top_logprobs``). ``visible_devices`` and ``log_path`` are the
    caller's."""
    return {"engine": server.engine, "max_batch_size": server.max_batch_size, "max_wait_ms": server.max_wait_ms,
            "threads": server.threads, "startup_timeout_s": server.startup_timeout_s, "device": server.device,
            "dtype": server.dtype, "max_logprobs": server.max_logprobs if max_logprobs is None else max_logprobs,
            "batching": server.batching, "max_model_len": server.max_model_len,
            "gpu_memory_utilization": server.gpu_memory_utilization, "tensor_parallel_size": max(server.gpus, 1),
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


class LocalJudgeServer:
    """Run a judge server on a free localhost port for the duration of a ``with``: ``python -m
    paco.judge.serve`` (``engine="paco"``), or vLLM's OpenAI server (``engine="vllm"``, the ``[gpu]``
    extra or ``python`` of another env, CUDA devices; its batching, dtype handling and kernels are
    vLLM's own, so its log-probs depend on the batch).

    ``__enter__`` is :meth:`start` then :meth:`wait_ready`: it starts the process, waits until
    ``/health`` answers (or the process dies, or ``startup_timeout_s`` passes from the start),
    checks that ``/v1/models`` lists ``served_model_name``, and returns the base URL
    (``http://127.0.0.1:<port>/v1``). Calling the two apart lets the caller do its own start-up
    while the server loads. ``__exit__`` stops it (SIGTERM, then SIGKILL after 10 s, 60 s for vLLM;
    again is a no-op). The paco server is started with ``--parent-pid`` of this process, so it also
    shuts down when this process dies without reaching ``__exit__`` (SIGKILL, OOM kill). The
    server's log goes to ``log_path`` (default: a temp file), whose tail is quoted if it fails to
    start. ``batching`` and ``max_model_len`` are the server's ``--batching`` (default ``auto``:
    batch-invariant, see :mod:`paco.judge.serve`) and ``--max-model-len`` (``None``: the model's
    ``max_position_embeddings``).

    With ``engine="vllm"`` the command is :func:`vllm_command` (``max_logprobs``, ``dtype``,
    ``max_model_len``, ``gpu_memory_utilization``, ``tensor_parallel_size``, ``python``,
    ``extra_args``); readiness is ``/v1/models`` listing the name; the server runs in a session of
    its own (stopping it stops its engine processes) and gets SIGTERM when this process's thread
    that started it exits (Linux ``PR_SET_PDEATHSIG``). ``visible_devices`` (both engines) is the
    server's ``CUDA_VISIBLE_DEVICES`` (:func:`server_env`); ``tensor_parallel_size`` ``None``: the
    number of ``visible_devices`` entries, else 1. After :meth:`start`, ``cmd`` and ``env`` hold
    the argv and environment it ran with.

    Raises:
        JudgeError: the server did not come up or serves another name.
        ValueError: an unknown engine.
    """

    def __init__(self, model_dir: str | os.PathLike[str], served_model_name: str, *, max_batch_size: int = 16,
                 max_wait_ms: float = 10.0, threads: int = 0, startup_timeout_s: float = 120.0,
                 log_path: str | os.PathLike[str] | None = None, device: str = "auto", dtype: str = "float32",
                 max_logprobs: int = 20, batching: str = "auto", max_model_len: int | None = None,
                 engine: str = "paco", request_timeout_s: float = 300.0, visible_devices: str | None = None,
                 gpu_memory_utilization: float = 0.85, tensor_parallel_size: int | None = None,
                 python: str | None = None, extra_args: Sequence[str] = ()):
        if engine not in ("paco", "vllm"):
            raise ValueError(f"engine must be 'paco' or 'vllm', got {engine!r}")
        self.engine = engine
        self.request_timeout_s = float(request_timeout_s)
        self.model_dir = Path(model_dir)
        self.served_model_name = served_model_name
        self.max_batch_size = max_batch_size
        self.max_wait_ms = max_wait_ms
        self.threads = threads
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(log_path) if log_path else None
        self.device = device
        self.dtype = dtype
        self.max_logprobs = max_logprobs
        self.batching = batching
        self.max_model_len = max_model_len
        self.visible_devices = visible_devices
        self.gpu_memory_utilization = gpu_memory_utilization
        if tensor_parallel_size is None:
            tensor_parallel_size = len(visible_devices.split(",")) if visible_devices else 1
        self.tensor_parallel_size = tensor_parallel_size
        self.python = python
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.cmd: list[str] | None = None
        self.env: dict[str, str] | None = None
        self._ready = False
        self._tmp: tempfile.TemporaryDirectory | None = None

    def _log_tail(self) -> str:
        try:
            return "\n".join(self._log_file.read_text(errors="replace").splitlines()[-15:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> str:
        self.start()
        return self.wait_ready()

    def _paco_command(self, port_file: Path) -> list[str]:
        return [sys.executable, "-m", "paco.judge.serve", "--model", str(self.model_dir),
                "--served-model-name", self.served_model_name, "--host", "127.0.0.1", "--port", "0",
                "--port-file", str(port_file), "--max-batch-size", str(self.max_batch_size),
                "--max-wait-ms", str(self.max_wait_ms), "--threads", str(self.threads), "--device", self.device,
                "--dtype", self.dtype, "--max-logprobs", str(self.max_logprobs), "--batching", self.batching,
                "--max-model-len", str(self.max_model_len or 0), "--parent-pid", str(os.getpid()),
                "--request-timeout-s", str(self.request_timeout_s)]

    def start(self) -> None:
        """Start the server process and return at once (:meth:`wait_ready` waits for it).

        Raises:
            RuntimeError: already started.
        """
        if self.proc is not None:
            raise RuntimeError(f"judge server for {self.model_dir} already started")
        self._tmp = tempfile.TemporaryDirectory(prefix="paco-judge-")
        self._port_file = port_file = Path(self._tmp.name) / "port"
        self._log_file = self.log_path or Path(self._tmp.name) / "server.log"
        self._log_file.parent.mkdir(parents=True, exist_ok=True)
        preexec = None
        if self.engine == "vllm":
            port = free_port("127.0.0.1")
            self.cmd = vllm_command(self.model_dir, self.served_model_name, port, python=self.python,
                                    dtype=self.dtype, max_model_len=self.max_model_len,
                                    max_logprobs=self.max_logprobs,
                                    gpu_memory_utilization=self.gpu_memory_utilization,
                                    tensor_parallel_size=self.tensor_parallel_size, extra_args=self.extra_args)
            preexec = _parent_death_signal()
            port_file.write_text(str(port))
        else:
            self.cmd = self._paco_command(port_file)
        self.env = server_env(os.environ, self.visible_devices)
        with open(self._log_file, "ab") as logf:
            # vLLM runs its engine in child processes: its own session, so stopping it stops them all
            self.proc = subprocess.Popen(self.cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, preexec_fn=preexec, start_new_session=self.engine == "vllm")
        self._deadline = time.monotonic() + self.startup_timeout_s

    def wait_ready(self) -> str:
        """Wait until the started server is ready (see the class docstring); its base URL.

        Raises:
            JudgeError: it exited, was not healthy ``startup_timeout_s`` after :meth:`start`, or
                serves another name (the server is stopped and its log's tail quoted).
            RuntimeError: not started.
        """
        if self.proc is None:
            raise RuntimeError(f"judge server for {self.model_dir} not started")
        if self.url is not None and self._ready:
            return self.url
        port_file, deadline = self._port_file, self._deadline
        client: JudgeClient | None = None  # one polling client, closed below
        while True:
            if self.proc.poll() is not None:
                tail = self._log_tail()
                self.__exit__(None, None, None)
                raise JudgeError(f"judge server ({self.model_dir}) exited with code {self.proc.returncode} "
                                 f"before it was ready; its log:\n{tail}")
            if client is None and port_file.is_file() and port_file.read_text().strip():
                self.url = f"http://127.0.0.1:{int(port_file.read_text())}/v1"
                client = JudgeClient(self.url, self.served_model_name, retries=0, timeout_s=5.0)
            if client is not None:
                try:
                    if self.engine == "vllm":
                        if self.served_model_name in client.served_models():
                            break
                    elif client.health().get("status") == "ok":
                        break
                except JudgeError:
                    pass
            if time.monotonic() > deadline:
                tail = self._log_tail()
                self.__exit__(None, None, None)
                raise JudgeError(f"judge server ({self.model_dir}) not healthy after {self.startup_timeout_s:g} s; "
                                 f"its log:\n{tail}")
            time.sleep(0.2)
        client.close()
        checker = JudgeClient(self.url, self.served_model_name, retries=2, timeout_s=10.0)
        try:
            checker.check_model()
        except JudgeError:
            self.__exit__(None, None, None)
            raise
        finally:
            checker.close()
        self._ready = True
        log.info("judge server for %s up at %s (pid %d)", self.model_dir, self.url, self.proc.pid)
        return self.url

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

    def __exit__(self, *exc: Any) -> None:
        import signal as _signal

        if self.proc is not None and self.proc.poll() is None:
            self._signal(_signal.SIGTERM)
            try:
                self.proc.wait(timeout=10 if self.engine == "paco" else 60)
            except subprocess.TimeoutExpired:
                self._signal(_signal.SIGKILL)
                self.proc.wait()
        elif self.proc is not None and self.engine == "vllm":
            try:  # the API server is gone; its engine processes may not be
                os.killpg(self.proc.pid, _signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
