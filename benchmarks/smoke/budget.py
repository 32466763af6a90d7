"""The GPU smoke run's clock: the time budget that keeps it inside a short GPU slot
(:class:`Budget`, ``--budget-s``) and the per-stage wall seconds and CUDA memory
(:class:`Stages`)."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any


#: default ``--budget-s`` on CUDA: the run fits an 8-minute GPU slot
CUDA_BUDGET_S = 480.0

#: expected seconds per stage at :data:`smoke.run.SIZES` (``vllm``: each vLLM dtype's start and scoring;
#: ``memory_plan``: the final step, always kept in reserve). CUDA: estimates, not yet measured on
#: a GPU (vLLM's start-up with CUDA graphs dominates its rows); CPU: width 0.04 on 2 shared cores
ESTIMATE_S = {
    "cuda": dict(build=90, sft=45, merge=30, judge_in_process=20, serve_start=45, serve=10, grpo=120, final=45,
                 vllm=150, memory_plan=30),
    "cpu": dict(build=15, sft=15, merge=10, judge_in_process=5, serve_start=25, serve=5, grpo=30, final=15,
                vllm=60, memory_plan=30),
}


class Budget:
    """Which stages start under a time limit (``--budget-s``).

    ``admit(name, key, needs)`` (the stage ``name``, its :data:`ESTIMATE_S` entry ``key``,
    default ``name``) is true when every stage in ``needs`` ran and (no limit, or)
    ``elapsed + estimate(key) + estimate("memory_plan") <= limit_s``, with ``elapsed`` the
    seconds since ``start`` on ``clock`` and ``estimate`` the :data:`ESTIMATE_S` entry times
    ``factor`` (:meth:`calibrate`). Otherwise ``rows[name]`` becomes ``{"skipped": reason}``
    (``"budget: ..."`` or ``"needs ..."``) and it is false.
    """

    def __init__(self, limit_s: float | None, estimates: dict[str, float], rows: dict[str, dict[str, Any]], *,
                 start: float, clock: Any = time.perf_counter):
        if limit_s is not None and not limit_s > 0:
            raise ValueError(f"--budget-s must be > 0, got {limit_s}")
        self.limit_s, self.estimates, self.rows, self.start, self.clock = limit_s, estimates, rows, start, clock
        self.factor = 1.0

    def calibrate(self, build_seconds: float) -> None:
        """Scale every estimate by the measured build time over the estimated one when it is slower."""
        self.factor = max(1.0, build_seconds / self.estimates["build"])

    def elapsed(self) -> float:
        return self.clock() - self.start

    def admit(self, name: str, key: str | None = None, needs: tuple[str, ...] = ()) -> bool:
        missing = [n for n in needs if n not in self.rows or "skipped" in self.rows[n]]
        reason = f"needs {', '.join(missing)}" if missing else None
        if reason is None and self.limit_s is not None:
            now, est = self.elapsed(), self.estimates[key or name] * self.factor
            reserve = self.estimates["memory_plan"] * self.factor
            if now + est + reserve > self.limit_s:
                reason = (f"budget: {now:.0f} s elapsed + {est:.0f} s estimated + {reserve:.0f} s for the memory "
                          f"plan > --budget-s {self.limit_s:g}")
        if reason is not None:
            self.rows[name] = {"skipped": reason}
            print(f"[gpu_smoke] {name}: skipped ({reason})", file=sys.stderr, flush=True)
        return reason is None


class Stages:
    """Per-stage wall seconds and CUDA memory (``max_memory_allocated`` reset at the start,
    in GiB; ``device_used_gib``: total minus free device memory at the end, every process)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.rows: dict[str, dict[str, Any]] = {}

    @contextlib.contextmanager
    def stage(self, name: str):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        row: dict[str, Any] = {}
        t0 = time.perf_counter()
        try:
            yield row
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            row["seconds"] = round(time.perf_counter() - t0, 3)
            if self.cuda:
                free, total = torch.cuda.mem_get_info()
                row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
                row["device_used_gib"] = round((total - free) / 2**30, 3)
            self.rows[name] = {**row, **self.rows.get(name, {})}
            print(f"[gpu_smoke] {name}: {row['seconds']:.1f} s", file=sys.stderr, flush=True)
