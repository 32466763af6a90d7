"""Benchmark the judge served by vLLM against ``paco-serve-judge`` on a GPU (needs the ``[gpu]`` extra).

    python benchmarks/bench_vllm.py [--judge data/reward_merge/model] [--pairs 256] [--inflight 1 16 64]

Serves the merged judge twice on the GPU, ``vllm serve <dir> --served-model-name paco-reward``
and ``python -m paco.serving.server`` (``--batching single`` / ``dynamic``), scores the same pairs
of 128 px panels through the official client (:class:`paco.serving.judge_client.JudgeClient`) at each
``--inflight`` concurrency, and prints pairs per second and the largest |P(Yes)| difference
from the in-process transformers judge. Figures only: nothing here asserts. The correctness
check is ``tests/test_vllm.py`` (``-m gpu``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import stages  # noqa: E402,F401  a stage process's set-up before numpy loads: fixed numerics env, hub offline

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--judge", type=Path, default=ROOT / "data/reward_merge/model")
    ap.add_argument("--pairs", type=int, default=256)
    ap.add_argument("--inflight", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--engines", default="vllm,paco-single,paco-dynamic")
    args = ap.parse_args()
    import torch

    from bench_judge import panels
    from paco.serving.judge_client import JudgeClient
    from paco.serving.local import LocalServer
    from paco.judge.model import Judge
    from paco.core.templates import judge_instruction

    if not torch.cuda.is_available():
        sys.exit("bench_vllm needs a CUDA device")
    text = judge_instruction(None)
    triples = [(a.resize((128, 128)), b.resize((128, 128)), text) for a, b in panels(args.pairs)]
    judge = Judge.from_pretrained(args.judge, device="cuda", dtype=getattr(torch, args.dtype), batch_size=16)
    judge.score(triples[:16])
    t0 = time.perf_counter()
    ref = np.asarray(judge.score(triples))
    print(f"in process (transformers, batch 16, {args.dtype}): {len(triples) / (time.perf_counter() - t0):8.1f} pairs/s")
    del judge
    torch.cuda.empty_cache()
    for engine in args.engines.split(","):
        kind, _, batching = engine.partition("-")
        with tempfile.TemporaryDirectory() as tmp, LocalServer(
                args.judge, "paco-reward", engine=kind, dtype=args.dtype, batching=batching or "auto",
                device="cuda", max_batch_size=64, startup_timeout_s=900, log_path=Path(tmp) / "server.log") as url:
            JudgeClient(url, "paco-reward", concurrency=8).score(triples[:16])  # warm-up
            for n in args.inflight:
                client = JudgeClient(url, "paco-reward", concurrency=n)
                t0 = time.perf_counter()
                got = np.asarray(client.score(triples))
                rate = len(triples) / (time.perf_counter() - t0)
                print(f"{engine:13s} {n:3d} in flight: {rate:8.1f} pairs/s   max |dP| vs in process "
                      f"{np.abs(got - ref).max():.2e}", flush=True)


if __name__ == "__main__":
    main()
