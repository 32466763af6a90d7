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
from paco.core.numerics import FIXED_CPU_ISA_ENV, FIXED_THREAD_ENV, numerics_info
from paco.core.params import Params, ParamsError, load_params
from paco.core.teardown import freeze_heap_at_exit

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


def subtask_params(params: Params, section: str, subtask: str) -> Any:
    """``params.<section>[subtask]``: a per-subtask stage's params (``grpo``, ``final_samples``).

    Raises:
        ParamsError: no such subtask (the message names the known ones).
    """
    table = getattr(params, section)
    if subtask not in table:
        raise ParamsError(f"params.yaml: {section}.{subtask} does not exist (subtasks: {sorted(table)})")
    return table[subtask]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (if imported) global RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    if "torch" in sys.modules:
        import torch

        torch.manual_seed(seed)


def hub_offline() -> bool:
    """Whether this process runs with the Hugging Face hub off: ``huggingface_hub``'s
    ``HF_HUB_OFFLINE`` constant when the module is loaded (it reads the environment once, at
    import), else the environment now (``HF_HUB_OFFLINE`` or else ``TRANSFORMERS_OFFLINE`` true:
    ``1``/``ON``/``YES``/``TRUE``, case-insensitive, as huggingface_hub/constants.py reads them).
    Every stage but ``models`` sets both by default (``stages/__init__.py``)."""
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        return bool(constants.HF_HUB_OFFLINE)
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def launch_info() -> dict[str, Any]:
    """How this process was launched, for ``report.json``'s ``run``: ``processes`` (the launcher's
    ``WORLD_SIZE``, 1 without one) and, inside a SLURM job, ``slurm`` with the job id, the node
    and the CPUs the job was given (``SLURM_JOB_ID``, ``SLURMD_NODENAME``,
    ``SLURM_CPUS_PER_TASK``; the CPU count is ``None`` when the job did not ask per task);
    ``threads``: torch's intra-op threads in this process (``None`` if the stage never imported
    torch) and the variables a stage's bytes depend on (``PACO_NUM_THREADS``,
    ``OMP_NUM_THREADS``, ``OMP_DYNAMIC``, ``MKL_DYNAMIC``, the CPU code-path variables of
    :data:`paco.core.numerics.FIXED_CPU_ISA_ENV`; ``None`` when unset); ``numerics``: the code
    paths the loaded libraries actually run (:func:`paco.core.numerics.numerics_info`);
    ``hub_offline``: :func:`hub_offline`."""
    info: dict[str, Any] = {"processes": int(os.environ.get("WORLD_SIZE", "1")), "hub_offline": hub_offline()}
    torch = sys.modules.get("torch")
    info["threads"] = {"torch": torch.get_num_threads() if torch is not None else None,
                       **{k: os.environ.get(k) for k in ("PACO_NUM_THREADS", "OMP_NUM_THREADS", *FIXED_THREAD_ENV,
                                                         *FIXED_CPU_ISA_ENV)}}
    info["numerics"] = numerics_info()
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
    deterministic, so a cached run equals a fresh one), ``report`` (the
    ``report.json`` beside it, a declared output but not metrics: timings, memory, resume
    decisions, per-item details; not deterministic) and ``writes``: whether this process writes
    them (``False`` on every process of a multi-process launch but the main one, which writes
    the stage's outputs; :meth:`nothing`)."""

    metrics: dict[str, Any]
    report: dict[str, Any] = field(default_factory=dict)
    writes: bool = True

    @classmethod
    def headline(cls, report: dict[str, Any], *keys: str) -> StageOutput:
        """``report`` whole in the report, its ``keys`` (top level) also as the metrics."""
        return cls({k: report[k] for k in keys if k in report}, report)

    @classmethod
    def nothing(cls) -> StageOutput:
        """What a process that writes nothing returns (not the main process of the launch)."""
        return cls({}, writes=False)


#: errno values of OSErrors that are the user's environment, not a bug: one clear line, exit 2
_USER_OS_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS, errno.EPERM, errno.ENOENT}


def report_path(metrics_path: str | os.PathLike[str]) -> Path:
    """``report.json`` beside a stage's ``metrics.json``."""
    return Path(metrics_path).with_name("report.json")


def _remove_previous_report(metrics_path: str | os.PathLike[str] | None) -> None:
    """Remove the ``report.json`` beside ``metrics_path`` on the main process (``RANK`` 0 or unset:
    workers start at the same time and write nothing)."""
    if metrics_path is not None and os.environ.get("RANK", "0") == "0":
        report_path(metrics_path).unlink(missing_ok=True)


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
    plus ``run.wall_seconds`` and ``run.peak_rss_mb`` to ``report.json`` beside it, unless the
    output says this process writes nothing (:attr:`StageOutput.writes`, false on every process
    but the main one) or the stage has no ``--metrics``. The previous run's
    ``report.json`` (a declared output, :attr:`workflow.stage.Stage.reports`, but a stage run by
    hand has no engine to remove it) is removed first, by the main process (launcher ``RANK`` 0
    or unset), before params are read: a failed run leaves no report that looks like its own.
    The process's exit skips the garbage collector's walk over its heap
    (:func:`paco.core.teardown.freeze_heap_at_exit`).

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
    freeze_heap_at_exit()
    t0 = time.perf_counter()
    try:
        _remove_previous_report(getattr(args, metrics_arg, None))
        params = load_params(args.params)
        log.info("stage %s: params %s validated", name, args.params)
        out = body(args, params)
        if not isinstance(out, StageOutput):
            out = StageOutput(dict(out))
        report = dict(out.report)
        report["run"] = {"wall_seconds": round(time.perf_counter() - t0, 3), "peak_rss_mb": round(peak_rss_mb(), 1),
                         **launch_info()}
        path = getattr(args, metrics_arg, None)
        if path is not None and out.writes:
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
