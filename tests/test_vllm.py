"""The merged judge served by vLLM gives the transformers path's first-token P(Yes) (GPU only).

Run on a GPU machine with the ``[gpu]`` extra installed::

    pip install -e ".[test,gpu]" && python -m pytest -m gpu tests/test_vllm.py

The judge is ``$PACO_VLLM_JUDGE`` (a merged judge directory, e.g. a paper-scale
``data/reward_merge/model``), else the embedded default's ``data/reward_merge/model``, else the
tiny judge built offline. Both paths score the same pairs: vLLM through
``vllm serve <dir> --served-model-name <name>`` and the official client
(:class:`paco.serving.judge_client.JudgeClient`), transformers in process
(:meth:`paco.judge.model.Judge.score`), both in float32. Tolerance: |P_vLLM - P_hf| <= 2e-3
per pair (different attention kernels and fused ops, float32 accumulation) and the same
ranking of pairs (Kendall tau >= 0.99). ``benchmarks/bench_vllm.py`` prints the throughput.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 2e-3


def _judge_dir(tiny_model_dirs) -> Path:
    if os.environ.get("PACO_VLLM_JUDGE"):
        return Path(os.environ["PACO_VLLM_JUDGE"])
    merged = ROOT / "data/reward_merge/model"
    return merged if (merged / "config.json").is_file() else tiny_model_dirs["judge_base"]


def _pairs(n: int, seed: int = 0):
    from PIL import Image

    from paco.core.templates import judge_instruction

    rng = np.random.default_rng(seed)
    base = [rng.integers(0, 255, (96, 96, 3), dtype=np.uint8) for _ in range(n)]
    out = []
    for i in range(n):
        a = Image.fromarray(base[i])
        # half the pairs near-identical (consistent), half unrelated
        b = Image.fromarray(np.clip(base[i].astype(int) + rng.integers(-8, 8, base[i].shape), 0, 255).astype(np.uint8)
                            if i % 2 == 0 else base[(i + 1) % n])
        out.append((a, b, judge_instruction(None)))
    return out


def test_vllm_serves_the_merged_judge_with_the_transformers_scores(tiny_model_dirs, tmp_path):
    pytest.importorskip("vllm", reason="the [gpu] extra (vllm) is not installed")
    from scipy.stats import kendalltau

    from paco.serving.judge_client import JudgeClient

    from paco.serving.local import LocalServer
    from paco.judge.model import Judge

    judge_dir = _judge_dir(tiny_model_dirs)
    triples = _pairs(32)
    judge = Judge.from_pretrained(judge_dir, device="cuda")
    hf = np.asarray(judge.score(triples))
    # an untrained tiny judge need not rank Yes/No among its top 20 first tokens: ask for all
    top = 20 if judge_dir != tiny_model_dirs["judge_base"] else len(judge.processor.tokenizer)
    with LocalServer(judge_dir, "paco-reward", engine="vllm", dtype="float32", startup_timeout_s=900,
                          max_logprobs=top, log_path=tmp_path / "vllm.log") as url:
        served = np.asarray(JudgeClient(url, "paco-reward", concurrency=16, top_logprobs=top).score(triples))
    diff = np.abs(served - hf)
    print(f"vLLM vs transformers on {judge_dir}: max |dP| {diff.max():.2e}, mean {diff.mean():.2e}")
    assert diff.max() <= TOLERANCE, (diff.max(), served[:4], hf[:4])
    assert kendalltau(served, hf).statistic >= 0.99
