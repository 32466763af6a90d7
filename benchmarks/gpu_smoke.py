"""GPU smoke run: every paper-scale path once, at the real model widths, in bf16 on CUDA.

    python benchmarks/gpu_smoke.py [--workdir DIR] [--out smoke.json]            # real widths, CUDA, bf16
    python benchmarks/gpu_smoke.py --device cpu --dtype float32 --width-scale 0.04 --out smoke.json

Builds the real-width random-init models offline (:func:`paco.models.smoke.build_smoke_models`:
FLUX.1 transformer 3072 wide with 2 double + 2 single blocks, FLUX.1's VAE, CLIP / T5 text
encoders at 768 / 4096, the judge at Qwen2.5-VL-7B's text width with 2 layers), then runs the
project's own stage code with the paper preset (``workflow/presets/paper.yaml``) scaled to a few
prompts, timing each stage and resetting ``torch.cuda.max_memory_allocated`` before it:

=========  ===================================================================================
stage      what runs
=========  ===================================================================================
build      :func:`paco.models.smoke.build_smoke_models` (CPU, float32 files)
sft        one optimizer step of :func:`paco.judge.training.train_reward` (``reward_train`` of
           the preset: LoRA r 32 / alpha 64 on every projection, batch 8 x 4 accumulation, bf16
           autocast; ``epochs 1``, ``warmup_ratio 0`` so the one step has a learning rate),
           its end-of-epoch evaluation and checkpoint, on 32 + 8 synthetic pairs
merge      ``python -m stages.reward_merge`` (in process: ``stages.reward_merge.main``) on a
           params file written beside the models; it checks unmerged = merged = reloaded
serve      the project's server ``paco.serving.server`` (the preset's ``judge_endpoint.server``
           settings with ``engine paco`` on the run's one device, kept up for GRPO and final
           sampling), then after ``final`` ``vllm serve`` of the merged judge (``LocalServer(engine="vllm")``,
           when ``vllm`` imports and the device is CUDA) in float32 and in the run's dtype, each scored
           with ``JudgeClient``, compared with the in-process ``Judge`` in the same dtype
grpo       one epoch of :func:`paco.grpo.trainer.train_grpo` (``grpo.t2is`` of the preset:
           10 steps, SDE step 1, noise 0.7, LoRA r 64 / alpha 128, rewards consistency (the
           served judge) + clip_t + pickscore, log-tame aggregation, 2 gradient steps,
           evaluation at 1024 px; ``prompts_per_epoch`` / ``group_size`` from the command line,
           ``ema.update_every 1`` so the saved LoRA holds the epoch's update), checkpoint and LoRA
final      :func:`paco.grpo.final_samples.final_samples` (``final_samples.t2is``: ODE, 20 steps,
           1024 px) with and without the GRPO LoRA, scored by the served judge
=========  ===================================================================================

The vLLM rows run last, after the project's server stopped; without ``vllm`` the run prints
"vLLM not installed: the vllm engine is skipped" and goes on. ``--budget-s S`` (default 480 on
CUDA, none on CPU; :class:`memory_plan.Budget`) starts a stage only if it is expected to end
within ``S`` seconds of the start, else records it ``skipped``. Last comes the memory plan of the
paper preset (:mod:`memory_plan`, stored as ``memory_plan``), with activations measured per block
during the SFT step and the GRPO epoch on CUDA at the real widths in bf16, analytic otherwise.

Prints a table (stage, seconds, peak GiB allocated by this process, device GiB in use at the
stage's end -- which includes a judge server's process --, throughput), then the memory plan,
and writes everything to ``--out`` (JSON). Figures only: the checks are ``tests/test_gpu.py``
(``-m gpu``) and, for the CPU path, ``tests/test_gpu.py::test_the_smoke_script_runs_on_cpu``.

``--device cpu --dtype float32 --width-scale S`` runs the same code at widths times ``S``
(head counts and feed-forward widths scaled, depths unchanged) with the CPU sizes below, so the
path can be checked without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_T0 = time.perf_counter()  # the budget counts from here (a cold start: the heavy imports come later)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# a stage process's set-up (stages/__init__.py) before numpy loads: fixed numerics env, hub offline
importlib.import_module("stages")
import memory_plan  # noqa: E402
import numpy as np  # noqa: E402
from smoke_inputs import pair_images, prompts_table, sft_table  # noqa: E402

#: sizes of the run per device: rollout / evaluation / final px, rollout and evaluation / final
#: steps, text tokens, judge panel px, prompts per epoch, group size, final seeds per prompt, pairs
#: scored by the servers, and (CPU only) the judge step's batch and accumulation (None: the
#: preset's 8 x 4)
SIZES = {
    "cuda": dict(train_resolution=512, eval_resolution=1024, final_resolution=1024, rollout_steps=10,
                 sample_steps=20, max_sequence_length=512, panel_px=512, prompts_per_epoch=2, group_size=16,
                 seeds_per_prompt=2, pairs=64, sft_batch_size=None, sft_accumulation=None),
    "cpu": dict(train_resolution=64, eval_resolution=64, final_resolution=64, rollout_steps=3, sample_steps=2,
                max_sequence_length=32, panel_px=64, prompts_per_epoch=2, group_size=2, seeds_per_prompt=1,
                pairs=4, sft_batch_size=2, sft_accumulation=2),
}

#: |P(Yes)| tolerance between the judge server and the in-process judge: the same kernels and
#: one request per forward pass on both sides (``batching auto`` off CPU = single, and
#: ``Judge(batch_size=1)``), so only nondeterministic reductions differ
SERVER_TOLERANCE = 1e-3

#: |P(Yes)| tolerance of ``vllm serve`` against the transformers path in the same dtype: float32
#: ``tests/test_vllm.py``'s 2e-3; bfloat16 a sanity bound (not yet measured on a GPU; bf16 vs float32
#: differ by up to 2.6e-2 on the real-width judge on CPU) that catches a wrong template or token (>= 0.1)
VLLM_TOLERANCE = {"float32": 2e-3, "bfloat16": 5e-2}


# --------------------------------------------------------------------------------------------
# params: the paper preset scaled to a smoke run
# --------------------------------------------------------------------------------------------


def smoke_params(device: str, dtype: str, sizes: dict[str, int], top_logprobs: int) -> dict[str, Any]:
    """The paper preset's raw params with the smoke run's changes (every other key as in the
    paper): one judge step, one GRPO epoch on a few prompts, a local judge server asked for every
    first token (``top_logprobs``: a random judge need not rank Yes / No in its top 20)."""
    from paco.core.params import read_params_yaml

    raw = read_params_yaml(ROOT / "workflow/presets/paper.yaml")
    # without gradient checkpointing: BlockProbe measures what each block keeps for the backward
    raw["reward_train"].update(epochs=1, warmup_ratio=0.0, checkpoint_every=1, dtype=dtype, gradient_checkpointing=False)
    if sizes.get("sft_batch_size"):  # CPU path only: the preset's 8 x 4 pairs per step otherwise
        raw["reward_train"].update(batch_size=sizes["sft_batch_size"],
                                   gradient_accumulation_steps=sizes["sft_accumulation"])
    raw["reward_merge"].update(dtype=dtype)
    raw["judge_endpoint"].update(url=None, top_logprobs=top_logprobs, concurrency=16)
    # the project's server on the run's one device (the preset's vLLM on a GPU of its own: the vLLM rows)
    raw["judge_endpoint"]["server"].update(engine="paco", gpus=0, device=device, dtype=dtype, max_logprobs=top_logprobs)
    g = raw["grpo"]["t2is"]
    g.update(epochs=1, prompts_per_epoch=sizes["prompts_per_epoch"], group_size=sizes["group_size"], save_every=1,
             dtype=dtype)
    g["rollout"].update(num_steps=sizes["rollout_steps"], max_sequence_length=sizes["max_sequence_length"])
    g["train"].update(resolution=sizes["train_resolution"], gradient_checkpointing=False)
    g["train"]["ema"].update(update_every=1)  # 2 optimizer steps never reach the preset's every-8th update
    g["eval"].update(resolution=sizes["eval_resolution"], num_steps=sizes["sample_steps"], max_prompts=1)
    f = raw["final_samples"]["t2is"]
    f.update(split="test", resolution=sizes["final_resolution"], num_steps=sizes["sample_steps"],
             seeds_per_prompt=sizes["seeds_per_prompt"], max_sequence_length=sizes["max_sequence_length"], dtype=dtype)
    return raw


def _lora_b_abs_max(path: Path) -> float:
    """Largest |weight| over the ``lora_B`` tensors of a safetensors file (0 = the LoRA is still
    at PEFT's / diffusers' zero initialisation)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    b = [t for k, t in tensors.items() if "lora_B" in k or "lora.up" in k]
    if not b:
        raise ValueError(f"{path}: no lora_B tensors")
    return max(float(t.float().abs().max()) for t in b)


def _finite(x: Any) -> bool:
    return x is not None and math.isfinite(float(x))


def _release(cuda: bool) -> None:
    """Collect garbage and return cached CUDA blocks, so the next stage's figures are its own."""
    import gc

    gc.collect()
    if cuda:
        import torch

        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------


@dataclass
class _Run:
    """What the smoke run's steps share: where it writes, the device, the models, the params."""

    workdir: Path
    device: str
    dtype: str
    seed: int
    sizes: dict[str, int]
    timer: memory_plan.Stages
    dirs: dict[str, Path]
    top: int
    params: Any
    params_path: Path
    accelerator: Any

    @property
    def torch_dtype(self) -> Any:
        import torch

        return torch.bfloat16 if self.dtype == "bfloat16" else torch.float32


def _build(workdir: Path, device: str, dtype: str, width_scale: float, seed: int, sizes: dict[str, int],
           timer: memory_plan.Stages) -> _Run:
    """Build the models, write the scaled paper params, make the run's one accelerator."""
    import yaml
    from accelerate import Accelerator

    from paco.core.params import validate_params
    from paco.models.loading import load_qwen_vl_processor
    from paco.models.smoke import SMOKE_JUDGE_MAX_PIXELS, build_smoke_models

    with timer.stage("build") as row:
        max_px = SMOKE_JUDGE_MAX_PIXELS if width_scale == 1.0 else max(sizes["panel_px"] ** 2, 56 * 56)
        dirs = build_smoke_models(workdir / "models", seed=seed, width_scale=width_scale, judge_max_pixels=max_px)
        row["bytes"] = {r: sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) for r, d in dirs.items()}
    top = len(load_qwen_vl_processor(dirs["judge_base"]).tokenizer)
    raw = smoke_params(device, dtype, sizes, top)
    params = validate_params(raw, source="gpu_smoke params")
    params_path = workdir / "params.yaml"
    params_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    # one accelerator for the run (accelerate's state is a process singleton): the judge step's
    # gradient accumulation and bf16 autocast; GRPO and final sampling only take its device
    rt = params.reward_train
    accelerator = Accelerator(cpu=not device.startswith("cuda"),
                              mixed_precision="bf16" if (dtype == "bfloat16" and timer.cuda) else "no",
                              gradient_accumulation_steps=rt.gradient_accumulation_steps)
    return _Run(workdir, device, dtype, seed, sizes, timer, dirs, top, params, params_path, accelerator)


def _sft(run: _Run) -> Path:
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
        parameters=rep["parameters"]["total"], lora_b_abs_max=_lora_b_abs_max(w / "adapter/adapter_model.safetensors"),
        pairs=n_train, tokens=tokens,
        checkpoints=sorted(p.name for p in (w / "sft_checkpoints").iterdir() if not p.name.startswith(".")),
        # the optimizer step alone (the stage's seconds also hold loading, evaluation, checkpoint)
        pairs_per_s=rep["train_pairs_per_second"],
        tokens_per_s=round(tokens / rep["seconds_per_step"], 1) if rep["seconds_per_step"] else None)
    return sft_path


def _merge(run: _Run, sft_path: Path) -> Path:
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


def _reference_scores(run: _Run, merged: Path) -> tuple[list, np.ndarray]:
    """(c, first half) the in-process judge's scores of the test pairs."""
    from paco.core.templates import judge_instruction
    from paco.judge.model import Judge

    run.accelerator.free_memory()  # the judge step's model and optimizer, held by the accelerator
    run.accelerator._custom_objects.clear()  # its scheduler (registered for checkpointing)
    _release(run.timer.cuda)
    pairs = pair_images(run.sizes["pairs"], run.sizes["panel_px"], run.seed + 1)
    triples = [(a, b, judge_instruction("a textured wall")) for a, b, _ in pairs]
    judge = Judge.from_pretrained(merged, dtype=run.torch_dtype, device=run.device, batch_size=1)
    judge.score(triples[:1])  # warm-up (kernels, allocator)
    with run.timer.stage("judge_in_process"):
        reference = np.asarray(judge.score(triples))
    run.timer.rows["judge_in_process"]["pairs_per_s"] = round(
        len(triples) / run.timer.rows["judge_in_process"]["seconds"], 2)
    del judge
    _release(run.timer.cuda)
    return triples, reference


def _vllm(run: _Run, merged: Path, triples: list, reference: np.ndarray, serve_rows: dict[str, Any],
          budget: memory_plan.Budget) -> None:
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
        _release(True)
        ref = reference
        if vdtype != run.dtype:
            judge = Judge.from_pretrained(merged, dtype=torch.float32, device=run.device, batch_size=1)
            ref = np.asarray(judge.score(triples))
            del judge
            _release(True)
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


def _serve(run: _Run, url: str, triples: list, reference: np.ndarray, serve_rows: dict[str, Any],
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


def _grpo(run: _Run, ctx: Any, prompts: Any) -> None:
    """(d) one GRPO epoch through the real trainer, rewards through the served judge."""
    from paco.core.run_identity import params_identity
    from paco.grpo.trainer import train_grpo
    from workflow.registry import member

    cfg, params, w = run.params.grpo["t2is"], run.params, run.workdir
    with run.timer.stage("grpo"):
        gout = train_grpo(cfg, prompts, run.dirs["policy_t2is"], ctx,
                          identity=params_identity(member("grpo@t2is"), {
                              "grpo.t2is": cfg.model_dump(mode="json"),
                              "judge_endpoint": params.judge_endpoint.model_dump(mode="json"),
                              "subfigures": params.subfigures.model_dump(mode="json")}),
                          lora_dir=w / "grpo_lora", checkpoints_dir=w / "grpo_checkpoints",
                          plots_dir=None, accelerator=run.accelerator)
    g = gout["report"]
    n_traj, sec = g["trajectories_per_epoch"], g["seconds"]
    run.timer.rows["grpo"].update(
        loss=g["train_final"].get("loss"), reward=g["train_final"].get("reward"),
        rewards={k: g["train_final"].get(f"{k}_mean") for k in cfg.rewards},
        eval_reward=g["eval_final"].get("reward"), trajectories=n_traj, sde_steps=list(cfg.rollout.sde_indices),
        rollout_steps=cfg.rollout.num_steps, resolution=cfg.train.resolution, eval_resolution=cfg.eval.resolution,
        substeps_seconds=sec, lora=dict(rank=cfg.lora.rank, alpha=cfg.lora.alpha),
        lora_parameters=g["lora_parameters"],
        lora_b_abs_max=_lora_b_abs_max(w / "grpo_lora/pytorch_lora_weights.safetensors"),
        checkpoints=sorted(p.name for p in (w / "grpo_checkpoints").iterdir() if p.name.startswith("epoch-")),
        judge_requests=ctx.judge.requests,
        images_per_s=round(n_traj / sec["rollout"], 3) if sec.get("rollout") else None)


def _final(run: _Run, ctx: Any, prompts: Any) -> None:
    """(e) final sampling with and without the LoRA."""
    from paco.core.io import decode_image
    from paco.grpo.final_samples import final_samples
    from paco.grpo.policies import grid_size

    _release(run.timer.cuda)  # the GRPO policy
    fcfg = run.params.final_samples["t2is"]
    with run.timer.stage("final"):
        table, _, metrics = final_samples(fcfg, prompts, run.dirs["policy_t2is"], run.workdir / "grpo_lora", ctx,
                                          accelerator=run.accelerator)
    sizes_seen = sorted({decode_image(c).size for c in table["image"]})
    h, w = grid_size(1024, 1024, fcfg.resolution)
    base, lora = table[table["variant"] == "base"]["image"], table[table["variant"] == "lora"]["image"]
    run.timer.rows["final"].update(
        samples=len(table), image_sizes=[list(s) for s in sizes_seen], expected_size=[w, h],
        rewards={k: {"base": v["base_mean"], "lora": v["lora_mean"]} for k, v in metrics["rewards"].items()},
        consistency=table["reward_consistency"].tolist(),
        lora_differs=bool(any(decode_image(a).tobytes() != decode_image(b).tobytes()
                              for a, b in zip(base, lora, strict=True))),
        images_per_s=round(len(table) / run.timer.rows["final"]["seconds"], 3))


def run_smoke(workdir: Path, *, device: str = "cuda", dtype: str = "bfloat16", width_scale: float = 1.0,
              seed: int = 0, engines: tuple[str, ...] = ("paco", "vllm"), sizes: dict[str, int] | None = None,
              budget_s: float | None = None, start: float | None = None) -> dict[str, Any]:
    """Build the models under ``workdir`` and run every stage (see the module docstring).

    Args:
        budget_s: the time limit (:class:`memory_plan.Budget`) in seconds since ``start``
            (default: when this module was imported); ``None``: none.

    Returns:
        ``{"config", "stages": {name: {seconds, peak_gib, device_used_gib, ...} or {"skipped": why}},
        "budget", "memory_plan" (:func:`memory_plan.plan`), "memory_plan_measured" (``BlockProbe``'s,
        ``{}`` unless CUDA bf16 at width 1), "checks"}``; the GPU tests check ``sft.{loss,
        lora_b_abs_max}``, ``merge.max_abs_diff``, ``serve.<engine>.{scores, max_abs_diff_vs_transformers}``,
        ``grpo.{loss, lora_b_abs_max, rewards}``, ``final.{image_sizes, expected_size, rewards}``.

    Raises:
        RuntimeError: ``device`` is CUDA and none is available, or a stage exits non-zero.
        ValueError: ``budget_s`` is not positive.
    """
    import torch

    from paco.core.params import read_params_yaml
    from paco.serving.endpoint import judge_endpoint
    from paco.grpo.rewards import make_reward_context

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("gpu_smoke: --device cuda but torch.cuda.is_available() is false "
                           "(use --device cpu --dtype float32 --width-scale 0.04 for the CPU path)")
    kind = "cuda" if device.startswith("cuda") else "cpu"
    sizes = {**SIZES[kind], **(sizes or {})}
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    timer = memory_plan.Stages(device)
    budget = memory_plan.Budget(budget_s, memory_plan.ESTIMATE_S[kind], timer.rows, start=_T0 if start is None else start)
    results: dict[str, Any] = {"config": {"device": device, "dtype": dtype, "width_scale": width_scale, "seed": seed,
                                          "sizes": sizes, "torch": torch.__version__, "budget_s": budget_s,
                                          "gpu": torch.cuda.get_device_name() if timer.cuda else None},
                               "stages": timer.rows}
    run = _build(workdir, device, dtype, width_scale, seed, sizes, timer)
    budget.calibrate(timer.rows["build"]["seconds"])
    # saved activations per block, measured where they are the paper's (bf16 at the real widths on CUDA)
    probe = memory_plan.BlockProbe(enabled=timer.cuda and dtype == "bfloat16" and width_scale == 1.0)
    st: dict[str, Any] = {}
    if budget.admit("sft"):
        with probe:
            st["sft"] = _sft(run)
    if budget.admit("merge", needs=("sft",)):
        st["merged"] = _merge(run, st["sft"])
    if budget.admit("judge_in_process", needs=("merge",)):
        st["triples"], st["reference"] = _reference_scores(run, st["merged"])
    serve_rows: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        if budget.admit("serve_start", needs=("judge_in_process",)):
            with timer.stage("serve_start"):
                endpoint = stack.enter_context(judge_endpoint(run.params, st["merged"], run.accelerator,
                                                              workdir / "server"))
                url = endpoint.url()
            if budget.admit("serve", needs=("serve_start",)):
                _serve(run, url, st["triples"], st["reference"], serve_rows, engines)
            # the smoke builds no PickScore role: its CLIP stands in (the embedded default's bytes alike)
            rewards = [*run.params.grpo["t2is"].rewards, *run.params.final_samples["t2is"].rewards]
            ctx = make_reward_context(run.params, endpoint, run.dirs["clip"], run.dirs["clip"], rewards=rewards,
                                      device=device)
            prompts = prompts_table(run.params.grpo["t2is"].prompts_per_epoch, 2)
            if budget.admit("grpo", needs=("serve_start",)):
                with probe:
                    _grpo(run, ctx, prompts)
            if budget.admit("final", needs=("grpo",)):
                _final(run, ctx, prompts)
    _release(timer.cuda)  # the policy and the scorers: vLLM wants the free memory
    for name, dep in (("serve", "serve_start"), ("grpo", "serve_start"), ("final", "grpo")):
        if name not in timer.rows:  # not tried: record why
            budget.admit(name, needs=(dep,))
    if "triples" in st:
        if "vllm" in engines:
            _vllm(run, st["merged"], st["triples"], st["reference"], serve_rows, budget)
        timer.rows.setdefault("serve", {}).update(engines=serve_rows, reference=st["reference"].tolist(),
                                                  pairs=len(st["triples"]))
    results["memory_plan_measured"], results["memory_plan"] = probe.result(), []
    try:  # a preset the plan cannot read must not cost the run's figures
        results["memory_plan"] = memory_plan.plan(read_params_yaml(ROOT / "workflow/presets/paper.yaml"),
                                                  probe.result() or None)
    except (KeyError, ValueError) as exc:
        results["memory_plan_error"] = f"{type(exc).__name__}: {exc}"
    results["budget"] = dict(limit_s=budget_s, elapsed_s=round(budget.elapsed(), 1), factor=budget.factor,
                             skipped={n: r["skipped"] for n, r in timer.rows.items() if "skipped" in r})
    results["checks"] = checks(results)
    return results


def checks(results: dict[str, Any]) -> dict[str, bool]:
    """The behaviour the GPU tests assert, computed from a run's results (names -> passed), for
    the stages that ran."""
    s = results["stages"]
    _ran = lambda stages, name: name in stages and "skipped" not in stages[name]  # noqa: E731
    out: dict[str, bool] = {}
    if _ran(s, "sft"):
        out.update(sft_loss_finite=_finite(s["sft"].get("loss")), sft_lora_changed=s["sft"]["lora_b_abs_max"] > 0)
    if _ran(s, "merge"):
        m, cfg = s["merge"], results["config"]
        out["merge_within_tolerance"] = max(m["max_abs_diff"].values()) <= m["tolerance"]
        if cfg["device"] == "cuda":  # the merge ran on the GPU: its weights (bf16 2 bytes, else 4) were there
            out["merge_on_device"] = m["peak_gib"] >= 0.9 * m["parameters"] * (2 if cfg["dtype"] == "bfloat16" else 4) / 2**30
    if _ran(s, "grpo"):
        out.update(grpo_loss_finite=_finite(s["grpo"].get("loss")), grpo_lora_changed=s["grpo"]["lora_b_abs_max"] > 0)
    if _ran(s, "final"):
        out["final_image_size"] = s["final"]["image_sizes"] == [s["final"]["expected_size"]]
    scores = (s["final"]["consistency"] if _ran(s, "final") else []) + s.get("serve", {}).get("reference", [])
    out["scores_in_unit_interval"] = all(0.0 <= x <= 1.0 for x in scores)
    for engine, row in s.get("serve", {}).get("engines", {}).items():
        if "failed" in row:
            out[f"{engine}_started"] = False
        if "scores" in row:
            out[f"{engine}_scores_in_unit_interval"] = all(0.0 <= x <= 1.0 for x in row["scores"])
            out[f"{engine}_matches_transformers"] = row["max_abs_diff_vs_transformers"] <= row["tolerance"]
    out["memory_plan_finite"] = bool(results["memory_plan"]) and all(
        _finite(r[k]) and r[k] > 0 for r in results["memory_plan"]
        for k in ("weights_gib", "activations_gib", "total_gib", "total_ckpt_gib"))
    return out


def table(results: dict[str, Any]) -> str:
    """The printed summary: one line per stage."""
    lines = [f"{'stage':18s} {'seconds':>9s} {'peak GiB':>9s} {'device GiB':>10s}  throughput"]
    for name, row in results["stages"].items():
        rate = []
        for key, unit in (("tokens_per_s", "tokens/s"), ("pairs_per_s", "pairs/s"), ("images_per_s", "images/s")):
            if row.get(key) is not None:
                rate.append(f"{row[key]:g} {unit}")
        for engine, e in (row.get("engines") or {}).items():
            rate.append(f"{engine} {e['pairs_per_s']:g} pairs/s" if "pairs_per_s" in e else
                        f"{engine}: {e.get('skipped') or 'failed to start'}")
        peak, used = row.get("peak_gib"), row.get("device_used_gib")
        if "skipped" in row:
            rate.insert(0, f"skipped: {row['skipped']}")
        lines.append(f"{name:18s} {row.get('seconds', float('nan')):9.1f} "
                     f"{'-' if peak is None else f'{peak:.2f}':>9s} {'-' if used is None else f'{used:.2f}':>10s}  "
                     + ", ".join(rate))
    b = results["budget"]
    lines.append(f"elapsed {b['elapsed_s']:.0f} s" + ("" if b["limit_s"] is None else f" of --budget-s {b['limit_s']:g}"))
    lines.append("checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in results["checks"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None, help="where models and outputs go (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="JSON results to write")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--width-scale", type=float, default=1.0, help="model widths x this, in (0, 1] (1: real widths)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", default="paco,vllm", help="servers to score with: paco, vllm")
    ap.add_argument("--prompts-per-epoch", type=int, default=None)
    ap.add_argument("--group-size", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"start a stage only if it is expected to end within this many seconds of the start "
                         f"(default {memory_plan.CUDA_BUDGET_S:g} on cuda, no limit on cpu)")
    args = ap.parse_args(argv)
    budget_s = memory_plan.CUDA_BUDGET_S if (args.budget_s is None and args.device == "cuda") else args.budget_s
    over = {k: v for k, v in (("prompts_per_epoch", args.prompts_per_epoch), ("group_size", args.group_size))
            if v is not None}
    import logging

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device (torch.cuda.is_available() is false); the CPU path is "
              "--device cpu --dtype float32 --width-scale 0.04", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [%(name)s] %(message)s")
    for noisy in ("httpx", "httpcore", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    with (tempfile.TemporaryDirectory(prefix="gpu-smoke-") if args.workdir is None
          else contextlib.nullcontext(str(args.workdir))) as wd:
        results = run_smoke(Path(wd), device=args.device, dtype=args.dtype, width_scale=args.width_scale,
                            seed=args.seed, engines=tuple(args.engines.split(",")), sizes=over, budget_s=budget_s)
    print(table(results))
    print("\nmemory plan of workflow/presets/paper.yaml (GiB per GPU):")
    print(memory_plan.format_table(results["memory_plan"]))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0 if all(results["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
