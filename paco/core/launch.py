"""Stage launcher: ``python -m paco.core.launch --config_file CFG --num_processes N -m MODULE ARGS``.

Every stage that shards its work over processes has this command (``workflow/registry.py``).
The launcher

1. validates the stage's ``--params`` file (:func:`paco.core.params.cli.main`): an invalid file is
   one clear message and exit code 2 before any process starts, not a message under
   torch-elastic's traceback from every process;
2. with ``N > 1``, or with an accelerate config that asks more of its launcher than one plain
   local process (:func:`launcher_needed`: several machines, mixed precision, FSDP, DeepSpeed,
   Megatron-LM, a dynamo backend, a GPU subset, another compute environment, any key it does
   not know), replaces itself with
   ``accelerate launch --config_file CFG --num_processes N -m MODULE ARGS`` (``os.execv``, the
   same process id, so a scheduler's signals reach it);
3. otherwise runs ``MODULE`` in this process, as ``python -m MODULE ARGS`` does (``runpy``).
   The stage's ``Accelerator`` is then in accelerate's single-process state
   (``DistributedType.NO``, as under ``python script.py``); under ``accelerate launch`` one CPU
   process is a gloo group of one (``MULTI_CPU``). Both compute the same bytes (checked on
   every artifact of the embedded default). This saves the launcher's own process: its torch
   import and torch-elastic agent, about 3 s per stage on 2 CPU cores.

   Of the variables accelerate's launcher sets for such a process, the mixed-precision and
   dynamo ones hold their defaults and the torch-elastic ones make the gloo group of one; the
   one left is ``OMP_NUM_THREADS`` (libgomp's default team size for threads other than the
   one that set torch's thread count). Unless it is set, it gets accelerate's value
   (:func:`accelerate_omp_threads`).

Exit codes: the stage's own (2: invalid params, a bad input artifact), or accelerate's.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path
from typing import Any, Mapping

import yaml

from paco.core.numerics import fix_numerics_env

#: accelerate config ``distributed_type`` values whose one local process is a plain process.
PLAIN_DISTRIBUTED_TYPES = ("NO", "MULTI_GPU", "MULTI_CPU")

#: config keys that, at their plain values (checked in :func:`launcher_needed`), give one local
#: process nothing a plain ``python -m`` process lacks; any other key set to a true value (an
#: ``fsdp_config``, a ``deepspeed_config``, ...) sends the stage to ``accelerate launch``.
PLAIN_KEYS = frozenset({
    "compute_environment", "distributed_type", "num_machines", "num_processes", "machine_rank",
    "main_process_ip", "main_process_port", "rdzv_backend", "same_network", "gpu_ids", "mixed_precision",
    "use_cpu", "dynamo_config", "dynamo_backend", "debug", "enable_cpu_affinity", "downcast_bf16",
    "main_training_function", "tpu_env", "tpu_use_cluster", "tpu_use_sudo",
})


class LaunchError(ValueError):
    """The launch command itself is malformed (no ``-m MODULE``, an unreadable config)."""


def read_accelerate_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The accelerate config file at ``path`` as a mapping (YAML, as ``accelerate launch
    --config_file`` reads it; JSON is YAML).

    Raises:
        LaunchError: the file is missing, unreadable or not a mapping.
    """
    try:
        config = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise LaunchError(f"accelerate config {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise LaunchError(f"accelerate config {path}: not a mapping")
    return config


def launcher_needed(config: Mapping[str, Any], num_processes: int) -> str | None:
    """Why ``accelerate launch`` must start this stage (a short reason), or ``None`` when what it
    would start is one plain local process: ``num_processes`` 1, one machine, a local compute
    environment, ``distributed_type`` in :data:`PLAIN_DISTRIBUTED_TYPES`, all GPUs visible
    (``gpu_ids: all``), no mixed precision, no dynamo backend, no debug mode, no CPU affinity,
    and no key outside :data:`PLAIN_KEYS` set (FSDP, DeepSpeed, Megatron-LM, FP8, IPEX, ...)."""
    if num_processes != 1:
        return f"{num_processes} processes"
    if int(config.get("num_machines") or 1) != 1:
        return f"{config['num_machines']} machines"
    env = config.get("compute_environment", "LOCAL_MACHINE")
    if env != "LOCAL_MACHINE":
        return f"compute_environment {env}"
    kind = str(config.get("distributed_type", "NO"))
    if kind not in PLAIN_DISTRIBUTED_TYPES:
        return f"distributed_type {kind}"
    gpus = str(config.get("gpu_ids") or "all")
    if gpus != "all":
        return f"gpu_ids {gpus}"  # the launcher sets CUDA_VISIBLE_DEVICES
    mixed = str(config.get("mixed_precision") or "no").lower()
    if mixed != "no":
        return f"mixed_precision {mixed}"
    dynamo = config.get("dynamo_config") or {}
    backend = dynamo.get("dynamo_backend", "NO") if isinstance(dynamo, dict) else "?"
    backend = str(config.get("dynamo_backend") or backend).upper()
    if backend != "NO":
        return f"dynamo backend {backend}"
    for key in ("debug", "enable_cpu_affinity", "tpu_use_cluster", "tpu_use_sudo", "tpu_env"):
        if config.get(key):
            return key
    if str(config.get("downcast_bf16") or "no").lower() not in ("no", "false"):
        return "downcast_bf16"
    for key in sorted(set(config) - PLAIN_KEYS):
        if config[key]:
            return key
    return None


def accelerate_omp_threads(config: Mapping[str, Any], num_processes: int,
                           physical_cores: int | None = None) -> int:
    """The ``OMP_NUM_THREADS`` that ``accelerate launch`` gives each process when it is unset
    (accelerate 1.x, ``commands/launch.py: _validate_launch_command``): with ``use_cpu``, the
    machine's physical cores (``psutil.cpu_count(logical=False)``, or ``physical_cores``) over
    the processes on the machine, where that is more than 1; otherwise 1."""
    threads = 1
    if config.get("use_cpu"):
        if physical_cores is None:
            import psutil

            physical_cores = psutil.cpu_count(logical=False) or 1
        machines = max(1, int(config.get("num_machines") or 1))
        per_process = int(physical_cores / max(int(num_processes / machines), 1))
        if per_process > 1:
            threads = per_process
    return threads


def split_command(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """``(launcher_args, module, stage_args)`` of ``[launcher args] -m MODULE [stage args]``.

    Raises:
        LaunchError: no ``-m MODULE``.
    """
    if "-m" not in argv or argv.index("-m") + 1 >= len(argv):
        raise LaunchError("usage: python -m paco.core.launch --config_file CFG --num_processes N -m MODULE [ARGS]")
    i = argv.index("-m")
    return argv[:i], argv[i + 1], argv[i + 2:]


def params_path(stage_args: list[str]) -> str:
    """The stage's ``--params`` value, read as the stage's own argparse parser reads it
    (:func:`paco.core.stage.parser`: ``--params X``, ``--params=X``, default ``params.yaml``)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--params", default="params.yaml")
    return parser.parse_known_args(stage_args)[0].params


def main(argv: list[str] | None = None) -> int:
    """Run the launch described in the module docstring; returns the exit code (the in-process
    stage's ``SystemExit`` code; an exec does not return)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # first, before the params check imports numpy and torch: the stage (in this process or
    # under accelerate launch) runs the fixed CPU code paths (paco.core.numerics)
    fix_numerics_env()
    try:
        launcher_args, module, stage_args = split_command(argv)
        parser = argparse.ArgumentParser(prog="python -m paco.core.launch",
                                         description="Run a stage in this process or under accelerate launch.")
        parser.add_argument("--config_file", required=True, help="accelerate config (YAML)")
        parser.add_argument("--num_processes", type=int, default=1, help="processes on this machine")
        args = parser.parse_args(launcher_args)
        config = read_accelerate_config(args.config_file)
    except LaunchError as exc:
        print(exc, file=sys.stderr)
        return 2

    from paco.core.params.cli import main as check_params

    code = check_params([params_path(stage_args)])
    if code != 0:
        return code

    reason = launcher_needed(config, args.num_processes)
    if reason is not None:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", args.config_file,
                   "--num_processes", str(args.num_processes), "-m", module, *stage_args]
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, command)

    os.environ.setdefault("OMP_NUM_THREADS", str(accelerate_omp_threads(config, args.num_processes)))
    sys.argv = [module, *stage_args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
