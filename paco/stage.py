"""What every stage CLI shares: argument parsing, params validation, logging, seeding, and the
run summary (wall time, peak memory) written into the stage's metrics.

A stage module (``stages/<name>.py``) only parses arguments, loads params, reads its declared
inputs, calls the library and writes its outputs (DESIGN.md §1). Paths always arrive on the
command line from the stage registry (``workflow/registry.py``); nothing is hard-coded.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import resource
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from paco.io import ArtifactError, write_json
from paco.params import Params, ParamsError, load_params

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


def peak_rss_mb() -> float:
    """Peak resident memory of this process and its waited-for children, in MiB (Linux)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024.0


def run(
    name: str,
    argv: Sequence[str] | None,
    build_parser: Callable[[argparse.ArgumentParser], None],
    body: Callable[[argparse.Namespace, Params], dict[str, Any]],
    *,
    description: str,
    metrics_arg: str = "metrics",
) -> int:
    """Run a stage: parse ``argv``, validate params, call ``body``, write metrics.

    ``body(args, params)`` does the work and returns the stage's metrics dict; this adds
    ``run.wall_seconds`` and ``run.peak_rss_mb`` and writes it atomically to ``--metrics``.

    Returns the process exit code: 0 on success, 2 for invalid params or a bad input artifact
    (the message is logged, no traceback), and re-raises anything else.
    """
    p = parser(name, description)
    build_parser(p)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s [%(name)s] %(message)s",
        stream=sys.stderr,
    )
    t0 = time.perf_counter()
    try:
        params = load_params(args.params)
        log.info("stage %s: params %s validated", name, args.params)
        metrics = body(args, params)
    except (ParamsError, ArtifactError) as exc:
        log.error("stage %s failed: %s", name, exc)
        return 2
    metrics = dict(metrics)
    metrics["run"] = {
        "wall_seconds": round(time.perf_counter() - t0, 3),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
    out = getattr(args, metrics_arg, None)
    if out is not None:
        write_json(out, metrics)
    log.info("stage %s done in %.1f s (peak RSS %.0f MiB)", name, *metrics["run"].values())
    return 0
