"""Stage launcher: ``python -m paco.core.launch --config_file CFG --num_processes N [--resources KEY] -m MODULE ARGS``.

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
   import and torch-elastic agent, seconds per stage on a small CPU host.

   Of the variables accelerate's launcher sets for such a process, the mixed-precision and
   dynamo ones hold their defaults and the torch-elastic ones make the gloo group of one; the
   one left is ``OMP_NUM_THREADS`` (libgomp's default team size for threads other than the
   one that set torch's thread count). Unless it is set, it gets accelerate's value
   (:func:`accelerate_omp_threads`).

``--resources KEY`` (every registry command has it) names the stage member's resources block in
the params file (``resources.stages.<stage>``, ``grpo.<subtask>.resources``); the launcher reads
its ``gpus`` and ``nodes`` (per node; ``resources.default`` updated by the block, as the Snakefile
gives them to SLURM: :func:`member_resources`). They are launch-only keys, so they are read here,
not written into the command (a command change reruns the stage).

With ``--serves_judge`` (the command of a stage that may start its own judge server: grpo,
final_samples) and a served judge on GPUs of the job (``judge_endpoint.url`` null,
``judge_endpoint.server.gpus`` N > 0), the launcher first splits this node's GPUs
(:func:`judge_gpu_split`): of the allocation (:func:`visible_gpus`; on a machine without one, every
GPU ``nvidia-smi`` lists) it takes the first ``gpus`` of the member (a message says so when more are
visible), gives the first N to the judge (``PACO_JUDGE_DEVICES``, read by
``paco.serving.endpoint``) and the rest to the stage's processes (``CUDA_VISIBLE_DEVICES``), one
each: ``--num_processes`` must equal their count. This is the reference's hand step on one 8-GPU
node (PaCo-GRPO/README.md §3-4: the vLLM server on ``CUDA_VISIBLE_DEVICES=0``, training on
``1,...,7``) done by the job itself.

Several machines (the member's ``nodes`` > 1, a SLURM job of that many nodes): started once in the
allocation, the launcher replaces itself with ``srun`` starting itself once per node
(:func:`fan_out_command`). Under snakemake-executor-plugin-slurm the command runs without the
allocation's ``SLURM_*`` variables but the job id (its jobstep strips them), so the hosts come from
``scontrol show job $SLURM_JOB_ID`` when ``SLURM_JOB_NODELIST`` is unset
(:func:`slurm_allocation`), and an allocation of another node count is exit code 2. Each per-node
launcher splits its node's GPUs as above and runs ``accelerate launch --num_machines M
--machine_rank R --main_process_ip IP --main_process_port P --num_processes processes*M``
(:func:`machine_topology`, :func:`accelerate_command`). The four flags may also be given to the
launcher itself (then no fan-out; ``--num_machines 1`` turns it off), and ``--num_processes`` stays
per machine. Without ``--resources`` the node count is ``SLURM_NNODES`` (1 outside SLURM).

Exit codes: the stage's own (2: invalid params, a bad input artifact, a GPU split that does not
fit, a malformed multi-machine launch), or accelerate's.
"""

from __future__ import annotations

import argparse
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping

import yaml

from paco.core.dotted import get_dotted
from paco.core.numerics import fix_numerics_env, set_default_omp_threads

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


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """This node's GPUs for the job, in order, as opaque entries (indices, UUIDs or MIG names):
    ``CUDA_VISIBLE_DEVICES`` if set, else ``SLURM_STEP_GPUS``, else ``SLURM_JOB_GPUS``, else
    every GPU ``nvidia-smi --query-gpu=index --format=csv,noheader`` lists (as the reference's
    ``PaCo-GRPO/vllm_server/launch.sh`` l.33-35). ``env``: default ``os.environ`` (its ``PATH``
    finds ``nvidia-smi``).

    Raises:
        LaunchError: ``CUDA_VISIBLE_DEVICES`` set but naming no GPU (empty, ``NoDevFiles``, ``-1``),
            or none of the variables set and no ``nvidia-smi`` that answers.
    """
    env = os.environ if env is None else env
    cuda = env.get("CUDA_VISIBLE_DEVICES")
    if cuda is not None:
        gpus = [g.strip() for g in cuda.split(",") if g.strip()]
        if not gpus or gpus[0] in ("NoDevFiles", "-1"):
            raise LaunchError(f"CUDA_VISIBLE_DEVICES={cuda!r} names no GPU")
        return gpus
    for var in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        gpus = [g.strip() for g in env.get(var, "").split(",") if g.strip()]
        if gpus:
            return gpus
    smi = shutil.which("nvidia-smi", path=env.get("PATH"))
    if smi is None:
        raise LaunchError("no GPU allocation found: CUDA_VISIBLE_DEVICES, SLURM_STEP_GPUS and SLURM_JOB_GPUS are "
                          "unset and nvidia-smi is not on PATH")
    try:
        out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise LaunchError(f"no GPU allocation found: {smi} --query-gpu=index failed ({exc})") from exc
    gpus = [g.strip() for g in out.splitlines() if g.strip()]
    if not gpus:
        raise LaunchError(f"no GPU allocation found: {smi} lists no GPU")
    return gpus


def split_gpus(gpus: list[str], n: int) -> tuple[list[str], list[str]]:
    """``(judge, rest)``: the first ``n`` of ``gpus`` and the others, order kept.

    Raises:
        LaunchError: ``n`` < 1, or not more than ``n`` GPUs (none left for the stage's processes).
    """
    if n < 1:
        raise LaunchError(f"judge_endpoint.server.gpus {n}: nothing to split")
    if len(gpus) <= n:
        raise LaunchError(f"judge_endpoint.server.gpus {n} takes all {len(gpus)} GPUs of the allocation "
                          f"({','.join(gpus)}): none left for the stage's processes")
    return list(gpus[:n]), list(gpus[n:])


def resources_at(config: Mapping[str, Any], key: str) -> dict[str, Any]:
    """The resources of the stage member whose block is at the dotted ``key`` of the params
    ``config`` as written (``resources.stages.composites``, ``grpo.t2is.resources``):
    ``resources.default`` updated by that block. A block the params do not write is empty (the
    defaults apply). The one rule for both the Snakefile's job (``workflow.stage.Member.resources``:
    what SLURM is asked for) and the launcher (:func:`member_resources`: the ``gpus`` and ``nodes``
    it places the processes on).

    Raises:
        LaunchError: ``key`` or ``resources.default`` holds a value that is not a mapping.
    """
    node = get_dotted(config, key, None)
    default = get_dotted(config, "resources.default", None) or {}
    if not isinstance(node or {}, Mapping) or not isinstance(default, Mapping):
        raise LaunchError(f"{key}: the params hold no resources mapping there")
    return {**default, **(node or {})}


def member_resources(params_file: str, key: str) -> dict[str, Any]:
    """:func:`resources_at` of the params file ``params_file`` (read as written).

    Raises:
        LaunchError: ``key`` reaches a value that is not a mapping (names the file).
        paco.core.params.ParamsError: the params file is unreadable.
    """
    from paco.core.params.base import read_params_yaml

    try:
        return resources_at(read_params_yaml(params_file) or {}, key)
    except LaunchError:
        raise LaunchError(f"--resources {key}: {params_file} holds no resources mapping there") from None


def judge_gpu_split(params_file: str, config: Mapping[str, Any], num_processes: int,
                    env: Mapping[str, str] | None = None, gpus: int | None = None,
                    key: str = "resources") -> dict[str, str]:
    """The variables that give this node's first ``judge_endpoint.server.gpus`` GPUs to the stage's
    judge server and the rest to its processes: ``{"PACO_JUDGE_DEVICES": ..., "CUDA_VISIBLE_DEVICES":
    ...}`` (comma-joined :func:`split_gpus` of :func:`visible_gpus`); ``{}`` when the params serve no
    judge on GPUs of its own (``judge_endpoint.url`` set, or ``server.gpus`` 0).

    ``gpus``: the member's ``resources.gpus`` (``key``: its resources block, named in messages):
    of more visible GPUs (a machine without an allocation, where ``nvidia-smi`` lists all), the
    first ``gpus`` are taken, with a message on stderr; ``None``: every visible GPU.

    Raises:
        LaunchError: no allocation found, fewer visible GPUs than ``gpus``, too few GPUs,
            ``num_processes`` (``resources.processes``) not the number of GPUs left, or an
            accelerate ``config`` whose ``gpu_ids`` is not ``all`` (accelerate would set
            ``CUDA_VISIBLE_DEVICES`` itself).
        paco.core.params.ParamsError: the params file is invalid.
    """
    from paco.core.params import load_params

    judge = load_params(params_file).judge_endpoint
    n = judge.server.gpus
    if judge.url is not None or n == 0:
        return {}
    ids = str(config.get("gpu_ids") or "all")
    if ids != "all":
        raise LaunchError(f"accelerate config gpu_ids {ids!r} with judge_endpoint.server.gpus {n}: the launcher "
                          "splits the GPUs itself; use a config with gpu_ids: all")
    visible = visible_gpus(env)
    if gpus is not None and len(visible) < gpus:
        raise LaunchError(f"{key}.gpus {gpus} but this node has {len(visible)} GPUs for the job "
                          f"({','.join(visible)})")
    if gpus is not None and len(visible) > gpus:
        print(f"paco.core.launch: {key}.gpus {gpus}: taking the first {gpus} of the {len(visible)} visible GPUs "
              f"({','.join(visible)})", file=sys.stderr)
        visible = visible[:gpus]
    mine, rest = split_gpus(visible, n)
    if len(rest) != num_processes:
        raise LaunchError(f"resources.processes {num_processes} (--num_processes) but {len(rest)} GPUs are left "
                          f"for the stage's processes on this node: {len(visible)} GPUs ({','.join(visible)}) minus "
                          f"judge_endpoint.server.gpus {n}")
    return {"PACO_JUDGE_DEVICES": ",".join(mine), "CUDA_VISIBLE_DEVICES": ",".join(rest)}


#: set by the SLURM fan-out (:func:`fan_out_command`) in the environment of each per-node launcher
NODE_TASK_ENV = "PACO_NODE_TASK"


def slurm_nodes(env: Mapping[str, str]) -> int:
    """The nodes of the SLURM allocation this runs in (``SLURM_NNODES``; 1 outside SLURM).

    Raises:
        LaunchError: ``SLURM_NNODES`` is not a positive integer.
    """
    value = env.get("SLURM_NNODES") or "1"
    if not value.isdigit() or int(value) < 1:
        raise LaunchError(f"SLURM_NNODES={value!r} is not a positive integer")
    return int(value)


def _scontrol(env: Mapping[str, str], *args: str) -> str:
    """``scontrol ARGS``'s output.

    Raises:
        LaunchError: no ``scontrol`` on ``PATH``, or it fails.
    """
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol is None:
        raise LaunchError("a multi-node launch needs scontrol on PATH (it names the allocation's hosts)")
    try:
        return subprocess.run([scontrol, *args], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise LaunchError(f"scontrol {' '.join(args)}: {exc}") from exc


def slurm_allocation(env: Mapping[str, str]) -> tuple[list[str], int | None]:
    """``(hosts, cpus_per_task)`` of the SLURM job this runs in: the hosts in order (the first is
    where machine rank 0 runs and the others meet it), and the job's CPUs per task (``None``: not
    set). From ``SLURM_JOB_NODELIST`` and ``SLURM_CPUS_PER_TASK`` when set; otherwise (the slurm
    executor plugin's jobstep drops every ``SLURM_*`` variable but the job id,
    ``snakemake_executor_plugin_slurm_jobstep`` 0.6 ``run_job``) from ``scontrol show job
    $SLURM_JOB_ID`` (its ``NodeList=`` and ``CPUs/Task=`` fields). The list is expanded by
    ``scontrol show hostnames``.

    Raises:
        LaunchError: neither a node list nor a job id (not in a SLURM job), no ``scontrol``, or a
            job with no node list.
    """
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    cpus = env.get("SLURM_CPUS_PER_TASK")
    if not nodelist:
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job:
            raise LaunchError("not in a SLURM job (neither SLURM_JOB_NODELIST nor SLURM_JOB_ID is set): several "
                              "nodes need a SLURM allocation of that many nodes")
        fields: dict[str, str] = {}
        for token in _scontrol(env, "show", "job", job).split():
            name, _, value = token.partition("=")
            fields.setdefault(name, value)
        nodelist = fields.get("NodeList", "")
        cpus = cpus or fields.get("CPUs/Task")
        if not nodelist or nodelist == "(null)":
            raise LaunchError(f"scontrol show job {job} names no NodeList (the job is not running?)")
    hosts = _scontrol(env, "show", "hostnames", nodelist).split()
    if not hosts:
        raise LaunchError(f"scontrol show hostnames {nodelist} printed no host")
    return hosts, int(cpus) if cpus and cpus.isdigit() and int(cpus) > 0 else None


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` now (the OS picks it: bind to port 0); ``""``: every interface
    (a port other machines connect to), ``"127.0.0.1"``: loopback only."""
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def fan_out_command(argv: list[str], env: Mapping[str, str], nodes: int | None = None, key: str = "SLURM_NNODES",
                    port: int | None = None) -> tuple[list[str], dict[str, str]]:
    """``(srun argv, its environment)`` that starts this launcher (``argv``: its own arguments) once
    on every node of a SLURM allocation of ``nodes`` > 1 nodes (``None``: ``SLURM_NNODES``; ``key``:
    where the count comes from, named in messages): ``srun --nodes N --ntasks-per-node 1
    [--cpus-per-task=C] --kill-on-bad-exit=1 [$PACO_SRUN_ARGS] python -m paco.core.launch ARGV``,
    with :data:`NODE_TASK_ENV`, ``PACO_NUM_MACHINES`` (N), ``PACO_MAIN_PROCESS_IP`` (the first host,
    :func:`slurm_allocation`) and ``PACO_MAIN_PROCESS_PORT`` (``port``, default a port free here:
    the batch script runs on the first host) set, and this host's ``CUDA_VISIBLE_DEVICES`` /
    ``PACO_JUDGE_DEVICES`` dropped (each node's step has its own GPUs). ``C`` is the job's CPUs per
    task: srun does not inherit ``SLURM_CPUS_PER_TASK`` since Slurm 22.05, so without it each
    node's step would get one CPU. The reference edits its ``multi_node.yaml`` per node by hand
    (``num_machines``, ``machine_rank``, ``main_process_ip``, ``main_process_port``).

    Raises:
        LaunchError: no ``srun`` or ``scontrol`` on PATH, not in a SLURM job, or an allocation whose
            node count is not ``nodes``.
    """
    import shlex

    srun = shutil.which("srun", path=env.get("PATH"))
    if srun is None:
        raise LaunchError(f"{key} > 1 but srun is not on PATH (it starts one launcher per node)")
    nodes = slurm_nodes(env) if nodes is None else nodes
    hosts, cpus = slurm_allocation(env)
    if len(hosts) != nodes:
        raise LaunchError(f"{key} {nodes} but the SLURM allocation has {len(hosts)} node(s) ({','.join(hosts)}): "
                          "submit the stage with that many nodes, or set the key to the allocation's")
    cmd = [srun, "--nodes", str(nodes), "--ntasks-per-node", "1", *([f"--cpus-per-task={cpus}"] if cpus else []),
           "--kill-on-bad-exit=1", *shlex.split(env.get("PACO_SRUN_ARGS", "")), sys.executable, "-m",
           "paco.core.launch", *argv]
    child = {k: v for k, v in env.items() if k not in ("CUDA_VISIBLE_DEVICES", "PACO_JUDGE_DEVICES")}
    child.update({NODE_TASK_ENV: "1", "PACO_NUM_MACHINES": str(nodes), "PACO_MAIN_PROCESS_IP": hosts[0],
                  "PACO_MAIN_PROCESS_PORT": str(port or free_port())})
    return cmd, child


def machine_topology(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[int, int, str | None, int | None]:
    """``(num_machines, machine_rank, main_process_ip, main_process_port)`` of this launcher: its
    ``--num_machines`` ... flags when given, else a per-node launcher's values (``PACO_NUM_MACHINES``
    or ``SLURM_NNODES``, ``SLURM_NODEID``, ``PACO_MAIN_PROCESS_IP`` / ``_PORT``), else one machine.

    Raises:
        LaunchError: ``--num_machines`` > 1 without the other three flags, a rank out of range, or
            a per-node launcher without its variables.
    """
    if args.num_machines is not None:
        machines, rank, ip, port = args.num_machines, args.machine_rank or 0, args.main_process_ip, args.main_process_port
        if machines > 1 and (args.machine_rank is None or not ip or port is None):
            raise LaunchError(f"--num_machines {machines} needs --machine_rank, --main_process_ip and "
                              "--main_process_port")
    elif env.get(NODE_TASK_ENV):
        try:
            machines = int(env["PACO_NUM_MACHINES"]) if env.get("PACO_NUM_MACHINES") else slurm_nodes(env)
            rank = int(env["SLURM_NODEID"])
            ip, port = env["PACO_MAIN_PROCESS_IP"], int(env["PACO_MAIN_PROCESS_PORT"])
        except (KeyError, ValueError) as exc:
            raise LaunchError(f"a per-node launcher ({NODE_TASK_ENV} set) without its SLURM variables: {exc}") from exc
    else:
        return 1, 0, None, None
    if machines < 1 or not 0 <= rank < machines:
        raise LaunchError(f"machine rank {rank} of {machines} machines")
    return machines, rank, ip, port


def accelerate_command(config_file: str, config: Mapping[str, Any], num_processes: int, machines: int = 1,
                       rank: int = 0, ip: str | None = None, port: int | None = None) -> list[str]:
    """The ``accelerate launch`` argv (without ``-m MODULE ARGS``) for ``num_processes`` processes on
    each of ``machines`` machines (accelerate's ``--num_processes`` is the total over them). With
    several machines: ``--num_machines --machine_rank --main_process_ip --main_process_port``, and for a
    DeepSpeed ``config`` ``--deepspeed_multinode_launcher standard``: each node's launcher starts its
    own processes (accelerate's default for DeepSpeed on several machines, ``pdsh``, would start
    every node's from this one over ssh: ``accelerate/commands/launch.py``, ``deepspeed_launcher``)."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config_file,
               "--num_processes", str(num_processes * machines)]
    if machines > 1:
        command += ["--num_machines", str(machines), "--machine_rank", str(rank), "--main_process_ip", str(ip),
                    "--main_process_port", str(port)]
        if str(config.get("distributed_type", "NO")).upper() == "DEEPSPEED":
            command += ["--deepspeed_multinode_launcher", "standard"]
    return command


def _parse(launcher_args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m paco.core.launch",
                                     description="Run a stage in this process or under accelerate launch.")
    parser.add_argument("--config_file", required=True, help="accelerate config (YAML)")
    parser.add_argument("--num_processes", type=int, default=1, help="processes on this machine")
    parser.add_argument("--resources", default=None,
                        help="the dotted params key of the stage member's resources block (member_resources)")
    parser.add_argument("--serves_judge", action="store_true",
                        help="the stage may serve its judge on GPUs of its own (judge_gpu_split)")
    parser.add_argument("--num_machines", type=int, default=None,
                        help="machines (one launcher each; default: the member's nodes, by srun)")
    parser.add_argument("--machine_rank", type=int, default=None)
    parser.add_argument("--main_process_ip", default=None)
    parser.add_argument("--main_process_port", type=int, default=None)
    return parser.parse_args(launcher_args)


def _place(args: argparse.Namespace, argv: list[str], params_file: str,
           config: Mapping[str, Any]) -> tuple[int, int, str | None, int | None]:
    """Fan out over the nodes (an exec) or return this launcher's :func:`machine_topology`, after
    setting this node's GPU split for a served judge.

    Raises:
        LaunchError: see :func:`fan_out_command`, :func:`machine_topology`, :func:`judge_gpu_split`.
    """
    res = member_resources(params_file, args.resources) if args.resources else {}
    where = f"{args.resources}.nodes" if args.resources else "SLURM_NNODES"
    nodes = int(res.get("nodes", 1)) if args.resources else slurm_nodes(os.environ)
    node_task = bool(os.environ.get(NODE_TASK_ENV))
    if args.num_machines is None and not node_task and nodes > 1:
        command, env = fan_out_command(argv, os.environ, nodes, where)  # this launcher again, on every node
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(command[0], command, env)
    machines, rank, ip, port = machine_topology(args, os.environ)
    if node_task and args.num_machines is None and machines != nodes:
        raise LaunchError(f"{where} {nodes} but this per-node launcher is one of {machines} machines")
    if args.serves_judge:  # per node
        gpus = int(res.get("gpus", 0)) if args.resources else None
        os.environ.update(judge_gpu_split(params_file, config, args.num_processes, gpus=gpus,
                                          key=args.resources or "resources"))
    return machines, rank, ip, port


def main(argv: list[str] | None = None) -> int:
    """Run the launch described in the module docstring; returns the exit code (the in-process
    stage's ``SystemExit`` code; an exec does not return)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # first, before the params check imports numpy and torch: the stage (in this process or
    # under accelerate launch) runs the fixed CPU code paths (paco.core.numerics)
    fix_numerics_env()
    try:
        launcher_args, module, stage_args = split_command(argv)
        args = _parse(launcher_args)
        config = read_accelerate_config(args.config_file)
    except LaunchError as exc:
        print(exc, file=sys.stderr)
        return 2

    from paco.core.params.cli import main as check_params

    code = check_params([params_path(stage_args)])
    if code != 0:
        return code
    try:
        machines, rank, ip, port = _place(args, argv, params_path(stage_args), config)
    except LaunchError as exc:
        print(f"paco.core.launch: {exc}", file=sys.stderr)
        return 2

    reason = launcher_needed(config, args.num_processes) or (f"{machines} machines" if machines > 1 else None)
    if reason is not None:
        command = accelerate_command(args.config_file, config, args.num_processes, machines, rank, ip, port)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [*command, "-m", module, *stage_args])

    set_default_omp_threads(accelerate_omp_threads(config, args.num_processes))
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
