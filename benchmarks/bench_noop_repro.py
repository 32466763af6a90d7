"""Benchmark: wall time of a no-op `dvc repro` (and `dvc status`) on a pipeline that is up to date.

Run from the repository root after a full `dvc repro`:

    python benchmarks/bench_noop_repro.py [--repeats 5] [--breakdown]

Prints the median and min/max seconds; fails if the pipeline is not up to date (a stage ran).
``--breakdown`` also runs one `dvc repro` in this process with DVC's steps timed, to show where a
no-op's time goes: the params file parsed once per stage, one ``dpath`` lookup of the params tree
per tracked key, ``dvc.lock`` loaded (twice: once for the targets, once for the index), each
dependency's status (one code digest per stage, and the ``code`` stage's ``paco`` and ``stages``
directories), and what is left (Python and DVC's imports, the graph).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable


def timed(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, proc.stdout + proc.stderr


#: the DVC steps ``--breakdown`` times: (module, attribute path, label)
STEPS = (
    ("dvc.utils.serialize._yaml", "parse_yaml", "params.yaml parses (one per stage)"),
    ("dpath", "get", "params key lookups (dpath, one per tracked key)"),
    ("dvc.dependency.param", "ParamsDependency.workspace_status", "params status (parse + lookups)"),
    ("dvc.dvcfile", "Lockfile.load", "dvc.lock loads"),
    ("dvc.stage", "Stage.changed_deps", "dependency status (params and files)"),
    ("dvc.stage", "Stage.changed_outs", "output status"),
    ("dvc.repo.reproduce", "collect_stages", "dvc.yaml's stages for the targets"),
)


def _wrap(totals: dict[str, list[float]], module: str, attr: str, label: str) -> None:
    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    inner: Callable = getattr(owner, name)

    def timed_call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[label][0] += time.perf_counter() - t0
            totals[label][1] += 1

    setattr(owner, name, timed_call)


def breakdown() -> None:
    """One `dvc repro` in this process, DVC's :data:`STEPS` timed (the timers add a little)."""
    t0 = time.perf_counter()
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for module, attr, label in STEPS:
        _wrap(totals, module, attr, label)
    from dvc.cli import main as dvc_main

    t1 = time.perf_counter()
    if dvc_main(["repro", "--quiet"]) != 0:
        sys.exit("dvc repro failed")
    t2 = time.perf_counter()
    print(f"one in-process `dvc repro`: {t2 - t0:.2f} s ({t1 - t0:.2f} s importing DVC's entry point)")
    for _, _, label in STEPS:
        seconds, calls = totals[label]
        print(f"  {label:50s} {seconds:6.3f} s  ({int(calls)} calls)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--breakdown", action="store_true", help="also time DVC's steps of one no-op repro")
    args = ap.parse_args()
    for name, cmd in (("dvc repro (no-op)", ["dvc", "repro"]), ("dvc status", ["dvc", "status"])):
        times = []
        for _ in range(args.repeats):
            seconds, out = timed([sys.executable, "-m", *cmd])
            if "Running stage" in out:
                sys.exit(f"{name}: a stage ran; run `dvc repro` first so the pipeline is up to date")
            times.append(seconds)
        print(f"{name:20s} median {statistics.median(times):6.2f} s  (min {min(times):.2f}, max {max(times):.2f}, n={len(times)})")
    if args.breakdown:
        breakdown()


if __name__ == "__main__":
    main()
