"""The GPU smoke run's judge steps: one SFT optimizer step with the paper's LoRA, the
``reward_merge`` stage, the in-process judge's reference scores, and the same pairs scored through
the project's judge server and through ``vllm serve``, each against the reference."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from smoke.budget import Budget
from smoke.inputs import pair_images, sft_table
from smoke.run import SmokeRun, lora_b_abs_max, release

#: |P(Yes)| tolerance between the judge server and the in-process judge: the same kernels and
#: one request per forward pass on both sides (``batching auto`` off CPU = single, and
#: ``Judge(batch_size=1)``), so only nondeterministic reductions differ
SERVER_TOLERANCE = 1e-3

#: |P(Yes)| tolerance of ``vllm serve`` against the transformers path in the same dtype: float32
#: ``tests/test_vllm.py``'s 2e-3; bfloat16 a sanity bound (not yet measured on a GPU; bf16 vs float32
#: differ by up to 2.6e-2 on the real-width judge on CPU) that catches a wrong template or token (>= 0.1)
VLLM_TOLERANCE = {"float32": 2e-3, "bfloat16": 5e-2}


def sft_step(run: SmokeRun) -> Path:
    """(a) judge SFT: one optimizer step with the paper's LoRA; returns the SFT table's path."""
    from paco.core.io import write_parquet
    from paco.core.run_identity import params_identity
    from paco.judge.model import check_answer_tokens
    from paco.judge.sft_data import encode_rows, load_sft_rows
    from paco.judge.training import train_reward
    from paco.models.loading import load_qwen_vl_processor
    from workflow.registry import member

    rt, w = run.params.reward_train, run.workdir
    n_train = rt.batch_size * rt.gradient_accumulation_steps
    sft_path = w / "sft.parquet"
    write_parquet(sft_path, sft_table(n_train, 8, run.sizes["panel_px"], run.seed), image_columns=["image_a", "image_b"])
    with run.timer.stage("sft"):
        out = train_reward(rt, sft_path, run.dirs["judge_base"],
                           identity=params_identity(member("reward_train"), {"reward_train": rt.model_dump(mode="json")}),
                           adapter_dir=w / "adapter", checkpoints_dir=w / "sft_checkpoints",
                           plots_dir=None, accelerator=run.accelerator)
    rep = out["report"]
    # tokens of the step: its training rows as the trainer encodes them (prompt + response)
    processor = load_qwen_vl_processor(run.dirs["judge_base"])
    rows = load_sft_rows(sft_path, "train")
    tokens = int(encode_rows(processor, rows, check_answer_tokens(processor.tokenizer))["attention_mask"].sum())
    run.timer.rows["sft"].update(
        loss=rep["train_loss_final"], eval=rep["eval_final"], optimizer_steps=rep["total_steps"],
        mixed_precision=rep["mixed_precision"], train_seconds_per_step=rep["seconds_per_step"],
        lora=dict(rank=rt.lora.rank, alpha=rt.lora.alpha), trainable_parameters=rep["parameters"]["trainable"],
        parameters=rep["parameters"]["total"], lora_b_abs_max=lora_b_abs_max(w / "adapter/adapter_model.safetensors"),
        pairs=n_train, tokens=tokens,
        checkpoints=sorted(p.name for p in (w / "sft_checkpoints").iterdir() if not p.name.startswith(".")),
        # the optimizer step alone (the stage's seconds also hold loading, evaluation, checkpoint)
        pairs_per_s=rep["train_pairs_per_second"],
        tokens_per_s=round(tokens / rep["seconds_per_step"], 1) if rep["seconds_per_step"] else None)
    return sft_path


def merge_step(run: SmokeRun, sft_path: Path) -> Path:
    """(b) merge: the reward_merge stage itself; returns the merged judge's directory."""
    from stages import reward_merge

    w, merged = run.workdir, run.workdir / "judge_merged"
    with run.timer.stage("merge"):
        code = reward_merge.main(["--params", str(run.params_path), "--base", str(run.dirs["judge_base"]), "--adapter",
                                  str(w / "adapter"), "--sft", str(sft_path), "--out", str(merged),
                                  "--metrics", str(w / "merge/metrics.json")])
        if code != 0:
            raise RuntimeError(f"stages.reward_merge exited {code}")
    merge_report = json.loads((w / "merge/report.json").read_text())
    run.timer.rows["merge"].update(max_abs_diff=merge_report["max_abs_diff"], tolerance=merge_report["tolerance"],
                                   parameters=merge_report["parameters"])
    return merged


def reference_scores(run: SmokeRun, merged: Path) -> tuple[list, np.ndarray]:
    """(c, first half) the in-process judge's scores of the test pairs."""
    from paco.core.templates import judge_instruction
    from paco.judge.model import Judge

    run.accelerator.free_memory()  # the judge step's model and optimizer, held by the accelerator
    run.accelerator._custom_objects.clear()  # its scheduler (registered for checkpointing)
    release(run.timer.cuda)
    pairs = pair_images(run.sizes["pairs"], run.sizes["panel_px"], run.seed + 1)
    triples = [(a, b, judge_instruction("a textured wall")) for a, b, _ in pairs]
    judge = Judge.from_pretrained(merged, dtype=run.torch_dtype, device=run.device, batch_size=1)
    judge.score(triples[:1])  # warm-up (kernels, allocator)
    with run.timer.stage("judge_in_process"):
        reference = np.asarray(judge.score(triples))
    run.timer.rows["judge_in_process"]["pairs_per_s"] = round(
        len(triples) / run.timer.rows["judge_in_process"]["seconds"], 2)
    del judge
    release(run.timer.cuda)
    return triples, reference


def serve_vllm(run: SmokeRun, merged: Path, triples: list, reference: np.ndarray, serve_rows: dict[str, Any],
               budget: Budget) -> None:
    """(c, last) ``vllm serve`` of the merged judge (``LocalServer(engine="vllm")``) in the run's
    dtype (the paper's serving), then float32 (tests/test_vllm.py's tolerance, weights upcast from
    the merged bf16 ones), scored through the project's client against the in-process judge
    in the same dtype; after the project's server stopped and the policy was freed (vLLM takes
    most of the free device memory at start-up). Each ``vllm-<dtype>`` row has the scores, or
    ``skipped`` (not installed, no CUDA, budget) or ``failed`` (the server's log tail)."""
    import torch

    from paco.judge.model import Judge
    from paco.serving.judge_client import JudgeClient, JudgeError
    from paco.serving.local import LocalServer

    dtypes, name = list(dict.fromkeys([run.dtype, "float32"])), run.params.judge_endpoint.served_model_name
    if importlib.util.find_spec("vllm") is None:
        print("vLLM not installed: the vllm engine is skipped", flush=True)
        serve_rows.update({f"vllm-{d}": {"skipped": "vLLM not installed: pip install -e '.[gpu]'"} for d in dtypes})
        return
    for vdtype in dtypes:
        stage, key = f"serve_vllm_{vdtype}_start_and_score", f"vllm-{vdtype}"
        if not run.timer.cuda:
            serve_rows[key] = {"skipped": "vllm needs a CUDA device"}
            continue
        if not budget.admit(stage, "vllm", needs=("judge_in_process",)):
            serve_rows[key] = dict(run.timer.rows[stage])
            continue
        release(True)
        ref = reference
        if vdtype != run.dtype:
            judge = Judge.from_pretrained(merged, dtype=torch.float32, device=run.device, batch_size=1)
            ref = np.asarray(judge.score(triples))
            del judge
            release(True)
        try:
            with run.timer.stage(stage), LocalServer(
                    merged, name, engine="vllm", dtype=vdtype, max_logprobs=run.top, startup_timeout_s=900,
                    log_path=run.workdir / f"server/vllm-{vdtype}.log") as url:
                client = JudgeClient(url, name, concurrency=16, top_logprobs=run.top)
                client.score(triples[:1])  # warm-up
                t0 = time.perf_counter()
                got = np.asarray(client.score(triples))
                secs = time.perf_counter() - t0
        except JudgeError as exc:
            serve_rows[key] = {"failed": str(exc)[-3000:]}
            continue
        serve_rows[key] = dict(scores=got.tolist(), max_abs_diff_vs_transformers=float(np.abs(got - ref).max()),
                               tolerance=VLLM_TOLERANCE[vdtype], pairs_per_s=round(len(triples) / secs, 2))


def serve_paco(run: SmokeRun, url: str, triples: list, reference: np.ndarray, serve_rows: dict[str, Any],
               engines: tuple[str, ...]) -> None:
    """(c, second half) the project's judge server, scored through the project's client."""
    from paco.serving.judge_client import JudgeClient

    if "paco" in engines:
        client = JudgeClient(url, run.params.judge_endpoint.served_model_name, concurrency=16, top_logprobs=run.top)
        client.score(triples[:1])  # warm-up
        with run.timer.stage("serve"):
            got = np.asarray(client.score(triples))
        serve_rows["paco"] = dict(scores=got.tolist(), max_abs_diff_vs_transformers=float(np.abs(got - reference).max()),
                                  tolerance=SERVER_TOLERANCE,
                                  pairs_per_s=round(len(triples) / run.timer.rows["serve"]["seconds"], 2))
