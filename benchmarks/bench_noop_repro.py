"""Benchmark: wall time of a no-op `dvc repro` (and `dvc status`) on a pipeline that is up to date.

Run from the repository root after a full `dvc repro`:

    python benchmarks/bench_noop_repro.py [--repeats 5]

Prints the median and min/max seconds; fails if the pipeline is not up to date (a stage ran).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def timed(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, proc.stdout + proc.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    for name, cmd in (("dvc repro (no-op)", ["dvc", "repro"]), ("dvc status", ["dvc", "status"])):
        times = []
        for _ in range(args.repeats):
            seconds, out = timed([sys.executable, "-m", *cmd])
            if "Running stage" in out:
                sys.exit(f"{name}: a stage ran; run `dvc repro` first so the pipeline is up to date")
            times.append(seconds)
        print(f"{name:20s} median {statistics.median(times):6.2f} s  (min {min(times):.2f}, max {max(times):.2f}, n={len(times)})")


if __name__ == "__main__":
    main()
