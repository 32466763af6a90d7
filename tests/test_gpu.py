"""The GPU smoke run (``benchmarks/gpu_smoke.py``): every paper-scale path once at the real model
widths in bf16 on CUDA (``-m gpu``), and its CPU path at the smallest width (always), so the GPU
script cannot rot unnoticed.

GPU tests (skipped with the reason where ``torch.cuda.is_available()`` is false; on a GPU
machine: ``python -m pytest -m gpu tests/test_gpu.py -s``, a few minutes, about 10 GB of disk
for the float32 model files): one smoke run (module fixture) at width scale 1, then one test per
stage. LoRA parameter counts are computed here from the widths (``r * (in + out)`` per adapted
``Linear``), independently of peft / diffusers.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_smoke.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def judge_lora_parameters(text: dict, rank: int) -> int:
    """LoRA parameters on the judge's language model: q, k, v, o, gate, up, down of each layer
    (the paper preset's ``reward_train.lora.target_modules``; the vision tower is not adapted)."""
    h, inter = text["hidden_size"], text["intermediate_size"]
    kv = text["num_key_value_heads"] * (h // text["num_attention_heads"])
    per_layer = rank * (2 * (h + h) + 2 * (h + kv) + 3 * (h + inter))
    return text["num_hidden_layers"] * per_layer


def flux_lora_parameters(transformer: dict, rank: int) -> int:
    """LoRA parameters of the paper preset's ``grpo.t2is.lora.target_modules`` on FLUX.1: a double
    block adapts 8 attention projections (h -> h) and 4 feed-forward ones (h <-> 4h), a single
    block its q, k, v (its attention has no output projection)."""
    h = transformer["num_attention_heads"] * transformer["attention_head_dim"]
    double = 8 * rank * (h + h) + 4 * rank * (h + 4 * h)
    single = 3 * rank * (h + h)
    return transformer["num_layers"] * double + transformer["num_single_layers"] * single


def _unit(xs) -> bool:
    return all(0.0 <= float(x) <= 1.0 for x in xs)


# --------------------------------------------------------------------------------------------
# CPU: the script's path at the smallest width (not a GPU test)
# --------------------------------------------------------------------------------------------

CPU_SCALE = 0.04


def test_the_smoke_script_runs_on_cpu(tmp_path):
    from paco.models.smoke import flux_overrides, judge_overrides

    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--dtype", "float32", "--width-scale",
                           str(CPU_SCALE), "--workdir", str(tmp_path / "work"), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    s = res["stages"]
    assert list(s) == ["build", "sft", "merge", "judge_in_process", "serve_start", "serve", "grpo", "final"]
    assert res["checks"] and all(res["checks"].values()), res["checks"]
    # the paper's LoRA sizes reached the trainers, at this width
    assert s["sft"]["lora"] == {"rank": 32, "alpha": 64.0}
    assert s["sft"]["trainable_parameters"] == judge_lora_parameters(judge_overrides(CPU_SCALE)["text"], 32)
    assert s["grpo"]["lora"] == {"rank": 64, "alpha": 128.0}
    assert s["grpo"]["lora_parameters"] == flux_lora_parameters(flux_overrides(CPU_SCALE)["transformer"], 64)
    assert math.isfinite(s["sft"]["loss"]) and s["sft"]["lora_b_abs_max"] > 0
    assert s["sft"]["checkpoints"] == ["step-0000001"] and s["grpo"]["checkpoints"] == ["epoch-0001"]
    assert s["grpo"]["trajectories"] == 2 * 2 and s["grpo"]["judge_requests"] > 0
    assert _unit(s["serve"]["engines"]["paco"]["scores"]) and _unit(s["final"]["consistency"])
    assert s["final"]["image_sizes"] == [[64, 64]] and s["final"]["samples"] == 2 * 1 * 2
    assert "checks:" in proc.stdout and all(name in proc.stdout for name in s)  # the printed table


# --------------------------------------------------------------------------------------------
# GPU: the real widths in bf16
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One real-width bf16 smoke run on CUDA (its table is printed: ``-s`` shows it)."""
    script = _script()
    res = script.run_smoke(tmp_path_factory.mktemp("gpu_smoke"), device="cuda", dtype="bfloat16", width_scale=1.0)
    print(script.table(res))
    return res


@pytest.mark.gpu
def test_judge_sft_step_with_the_paper_lora(smoke):
    from paco.models.smoke import judge_overrides

    sft = smoke["stages"]["sft"]
    assert sft["mixed_precision"] == "bf16" and sft["optimizer_steps"] == 1 and sft["pairs"] == 32
    assert sft["trainable_parameters"] == judge_lora_parameters(judge_overrides(1.0)["text"], 32)
    assert math.isfinite(sft["loss"]) and math.isfinite(sft["eval"]["loss"])
    assert sft["lora_b_abs_max"] > 0  # one AdamW step at lr 2e-4 moved the zero-initialised B
    assert sft["checkpoints"] == ["step-0000001"] and sft["peak_gib"] > 0


@pytest.mark.gpu
def test_merged_judge_matches_the_adapter(smoke):
    merge = smoke["stages"]["merge"]
    assert max(merge["max_abs_diff"].values()) <= merge["tolerance"]


@pytest.mark.gpu
def test_served_judge_scores_equal_the_transformers_path(smoke):
    serve = smoke["stages"]["serve"]
    assert _unit(serve["reference"])
    paco = serve["engines"]["paco"]
    assert _unit(paco["scores"]) and paco["max_abs_diff_vs_transformers"] <= paco["tolerance"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vllm_serves_the_merged_judge_with_the_transformers_scores(smoke, dtype):
    row = smoke["stages"]["serve"]["engines"][f"vllm-{dtype}"]
    if "skipped" in row:
        pytest.skip(row["skipped"])
    assert "failed" not in row, row.get("failed")
    assert _unit(row["scores"]) and row["max_abs_diff_vs_transformers"] <= row["tolerance"], row


@pytest.mark.gpu
def test_one_grpo_epoch_at_the_real_width(smoke):
    from paco.models.smoke import flux_overrides

    g = smoke["stages"]["grpo"]
    assert g["lora_parameters"] == flux_lora_parameters(flux_overrides(1.0)["transformer"], 64)
    assert g["trajectories"] == 2 * 16 and g["sde_steps"] == [1] and g["rollout_steps"] == 10
    assert g["resolution"] == 512 and g["eval_resolution"] == 1024
    assert math.isfinite(g["loss"]) and all(math.isfinite(v) for v in g["rewards"].values())
    assert 0.0 <= g["rewards"]["consistency"] <= 1.0 and g["judge_requests"] >= g["trajectories"]
    assert g["lora_b_abs_max"] > 0 and g["checkpoints"] == ["epoch-0001"] and g["peak_gib"] > 0


@pytest.mark.gpu
def test_final_samples_at_1024_with_and_without_the_lora(smoke):
    f = smoke["stages"]["final"]
    assert f["image_sizes"] == [[1024, 1024]] == [f["expected_size"]]
    assert f["samples"] == 2 * 2 * 2  # 2 test prompts x 2 seeds x (base, LoRA)
    assert _unit(f["consistency"]) and f["lora_differs"]
