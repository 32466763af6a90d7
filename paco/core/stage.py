"""What every stage CLI shares: argument parsing, params validation, logging, seeding, and the
split of what a stage writes into headline ``metrics.json`` and detailed ``report.json`` (wall
time, peak memory, timings), and one clear line instead of a traceback for expected failures.

A stage module (``stages/<name>.py``) only parses arguments, loads params, reads its declared
inputs, calls the library and writes its outputs (docs/architecture.md §1). Paths always arrive on the
command line from the stage registry (``workflow/registry.py``); nothing is hard-coded.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import random
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from paco.core.io import ArtifactError, write_json
from paco.core.params import Params, ParamsError, load_params

log = logging.getLogger("paco")


def parser(name: str, description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every stage takes (``--params``)."""
    p = argparse.ArgumentParser(
        prog=f"python -m stages.{name}",
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--params", type=Path, default=Path("params.yaml"), help="params file")
    p.add_argument("--log-level", default=os.environ.get("PACO_LOG_LEVEL", "INFO"))
    return p


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (if imported) global RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    if "torch" in sys.modules:
        import torch

        torch.manual_seed(seed)


# A stage's floating-point results depend on how many threads each OpenMP region gets (CPU
# reductions are split per thread). With dynamic adjustment on, libgomp sizes each region from the
# machine's load average (cores minus load) and MKL picks its own count, so the same run gives
# different bytes on a busy machine: with ``OMP_DYNAMIC=true`` and a loaded CPU, reward_train's
# loss changes in its 3rd step (measured, torch 2.13). Stage processes and the judge server run
# with these variables, set before torch is imported (libgomp reads them when it is loaded).
FIXED_THREAD_ENV = {"OMP_DYNAMIC": "false", "MKL_DYNAMIC": "false"}

# The same run gives different bytes on different x86-64 CPUs too: torch's vectorised kernels
# (softmax, ...), oneDNN's (convolution, GELU) and MKL's GEMM pick their code path from the
# CPU's instruction set, and the paths round differently. Measured on the embedded default
# (torch 2.13): an AVX-512 AMD EPYC trains a different judge than the AVX2 paths do (held-out
# ConsistencyRank accuracy 0.446 vs 0.449) and everything downstream differs. With these
# variables every CPU that has AVX2 runs the AVX2 paths (MKL's conditional numerical
# reproducibility branch), so a CPU run's bytes do not depend on the machine. They only touch
# CPU kernels (a GPU run is unaffected) and are defaults: a variable already set is kept.
FIXED_CPU_ISA_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2"}


def cpu_has_avx2(machine: str | None = None, cpuinfo: str | None = None) -> bool:
    """Whether this is an x86-64 CPU with AVX2 and FMA (``platform.machine()`` and the
    ``/proc/cpuinfo`` flags, or the given ones; ``False`` where they cannot be read): forcing
    the AVX2 paths on a CPU without them would crash the process."""
    import platform

    machine = platform.machine() if machine is None else machine
    if machine.lower() not in ("x86_64", "amd64"):
        return False
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return {"avx2", "fma"} <= set(line.split(":", 1)[1].split())
    return False


def fix_numerics_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set the variables a stage's bytes depend on in ``environ`` (default ``os.environ``), before
    torch is imported: :data:`FIXED_THREAD_ENV` always, :data:`FIXED_CPU_ISA_ENV` where the
    CPU has AVX2 and the variable is unset. Returns what it set."""
    env = os.environ if environ is None else environ
    set_now = dict(FIXED_THREAD_ENV)
    if cpu_has_avx2():
        set_now.update({k: v for k, v in FIXED_CPU_ISA_ENV.items() if k not in env})
    env.update(set_now)
    return set_now


def cpu_threads_per_process(local_processes: int) -> int:
    """Torch threads per process on CPU: ``$PACO_NUM_THREADS`` if set, else the cores this
    process may run on (``sched_getaffinity``, which honours cgroups/SLURM binding) divided by
    the processes on this node, at least 1. Launchers' ``OMP_NUM_THREADS`` is not trusted:
    torchrun sets it to 1 for every multi-process run."""
    env = os.environ.get("PACO_NUM_THREADS")
    if env:
        return max(1, int(env))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_processes))


def broadcast_from_main(accelerator: Any, obj: Any) -> Any:
    """``obj`` of the main process, on every process (``accelerate``'s ``broadcast_object_list``;
    with no accelerator or one process, ``obj`` itself)."""
    if accelerator is None or accelerator.num_processes == 1:
        return obj
    from accelerate.utils import broadcast_object_list

    box = [obj]
    broadcast_object_list(box, from_process=0)
    return box[0]


def launch_info() -> dict[str, Any]:
    """How this process was launched, for ``report.json``'s ``run``: ``processes`` (the launcher's
    ``WORLD_SIZE``, 1 without one) and, inside a SLURM job, ``slurm`` with the job id, the node
    and the CPUs the job was given (``SLURM_JOB_ID``, ``SLURMD_NODENAME``,
    ``SLURM_CPUS_PER_TASK``; the CPU count is ``None`` when the job did not ask per task);
    ``threads``: torch's intra-op threads in this process (``None`` if the stage never imported
    torch) and the variables a stage's bytes depend on (``PACO_NUM_THREADS``,
    ``OMP_NUM_THREADS``, ``OMP_DYNAMIC``, ``MKL_DYNAMIC``, the CPU code paths of
    :data:`FIXED_CPU_ISA_ENV`; ``None`` when unset)."""
    info: dict[str, Any] = {"processes": int(os.environ.get("WORLD_SIZE", "1"))}
    torch = sys.modules.get("torch")
    info["threads"] = {"torch": torch.get_num_threads() if torch is not None else None,
                       **{k: os.environ.get(k) for k in ("PACO_NUM_THREADS", "OMP_NUM_THREADS", *FIXED_THREAD_ENV,
                                                         *FIXED_CPU_ISA_ENV)}}
    if "SLURM_JOB_ID" in os.environ:
        cpus = os.environ.get("SLURM_CPUS_PER_TASK")
        info["slurm"] = {"job_id": os.environ["SLURM_JOB_ID"], "node": os.environ.get("SLURMD_NODENAME"),
                         "cpus_per_task": int(cpus) if cpus else None}
    return info


def peak_rss_mb() -> float:
    """Peak resident memory of this process and its waited-for children, in MiB (Linux)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024.0


@dataclass
class StageOutput:
    """What a stage body returns: ``metrics`` (the stage's declared ``metrics.json``: the headline
    figures a user compares across runs with ``dvc metrics diff`` / ``dvc exp show``;
    deterministic, so a cached run equals a fresh one) and ``report`` (the undeclared
    ``report.json`` beside it: timings, memory, resume decisions, per-item details)."""

    metrics: dict[str, Any]
    report: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def headline(cls, report: dict[str, Any], *keys: str) -> StageOutput:
        """``report`` whole in the report, its ``keys`` (top level) also as the metrics."""
        return cls({k: report[k] for k in keys if k in report}, report)


#: errno values of OSErrors that are the user's environment, not a bug: one clear line, exit 2
_USER_OS_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS, errno.EPERM, errno.ENOENT}


def report_path(metrics_path: str | os.PathLike[str]) -> Path:
    """``report.json`` beside a stage's ``metrics.json``."""
    return Path(metrics_path).with_name("report.json")


def run(
    name: str,
    argv: Sequence[str] | None,
    build_parser: Callable[[argparse.ArgumentParser], None],
    body: Callable[[argparse.Namespace, Params], StageOutput | dict[str, Any]],
    *,
    description: str,
    metrics_arg: str = "metrics",
) -> int:
    """Run a stage: parse ``argv``, validate params, call ``body``, write metrics and report.

    ``body(args, params)`` does the work and returns a :class:`StageOutput` (a plain dict is
    taken as the metrics); this writes ``metrics`` atomically to ``--metrics`` and ``report``
    plus ``run.wall_seconds`` and ``run.peak_rss_mb`` to ``report.json`` beside it (a body sets
    ``args.<metrics_arg> = None`` on non-main processes: nothing is written).

    Returns the process exit code: 0 on success, 2 for invalid params, a bad input artifact or
    an environment failure (full disk, no permission: ``OSError`` naming its file) -- one logged
    line, no traceback; anything else is re-raised.
    """
    p = parser(name, description)
    build_parser(p)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s [%(name)s] %(message)s",
        stream=sys.stderr,
    )
    # the HTTP clients log every request at INFO (thousands per GRPO epoch): only their problems
    for noisy in ("httpx", "httpx2", "httpcore", "openai"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    t0 = time.perf_counter()
    try:
        params = load_params(args.params)
        log.info("stage %s: params %s validated", name, args.params)
        out = body(args, params)
        if not isinstance(out, StageOutput):
            out = StageOutput(dict(out))
        report = dict(out.report)
        report["run"] = {"wall_seconds": round(time.perf_counter() - t0, 3), "peak_rss_mb": round(peak_rss_mb(), 1),
                         **launch_info()}
        path = getattr(args, metrics_arg, None)
        if path is not None:
            write_json(path, out.metrics)
            write_json(report_path(path), report)
    except (ParamsError, ArtifactError) as exc:
        log.error("stage %s failed: %s", name, exc)
        return 2
    except OSError as exc:
        if exc.errno not in _USER_OS_ERRORS:
            raise
        where = f" ({exc.filename})" if exc.filename else ""
        log.error("stage %s failed: %s%s", name, exc.strerror or exc, where)
        return 2
    log.info("stage %s done in %.1f s (peak RSS %.0f MiB)", name, report["run"]["wall_seconds"],
             report["run"]["peak_rss_mb"])
    return 0
