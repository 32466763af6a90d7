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
CUDA, none on CPU; :class:`smoke.budget.Budget`) starts a stage only if it is expected to end
within ``S`` seconds of the start, else records it ``skipped``. Last comes the memory plan of the
paper preset (:mod:`memory_plan`, stored as ``memory_plan``), with activations measured per block
during the SFT step and the GRPO epoch on CUDA at the real widths in bf16, analytic otherwise.

Prints a table (stage, seconds, peak GiB allocated by this process, device GiB in use at the
stage's end -- which includes a judge server's process --, throughput), then the memory plan,
and writes everything to ``--out`` (JSON). Figures only: the checks are ``tests/test_gpu.py``
(``-m gpu``) and, for the CPU path, ``tests/test_gpu.py::test_the_smoke_script_runs_on_cpu``.

``--device cpu --dtype float32 --width-scale S`` runs the same code at widths times ``S``
(head counts and feed-forward widths scaled, depths unchanged) with the CPU sizes of
:data:`smoke.run.SIZES`, so the path can be checked without a GPU.

This file is the command and the run's order; its parts are the package ``smoke`` beside it
(:mod:`smoke.run`: sizes, params and models; :mod:`smoke.judge_steps`; :mod:`smoke.policy_steps`;
:mod:`smoke.budget`: the time budget and per-stage figures; :mod:`smoke.report`: the checks and the
table; :mod:`smoke.inputs`: the synthetic pairs and prompts) and the memory plan,
``benchmarks/memory_plan.py``. It runs from a plain copy of the working tree.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_T0 = time.perf_counter()  # the budget counts from here (a cold start: the heavy imports come later)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# a stage process's set-up (stages/__init__.py) before numpy loads: fixed numerics env, hub offline
importlib.import_module("stages")
import memory_plan  # noqa: E402
from smoke.budget import CUDA_BUDGET_S, ESTIMATE_S, Budget, Stages  # noqa: E402
from smoke.inputs import prompts_table  # noqa: E402
from smoke.judge_steps import merge_step, reference_scores, serve_paco, serve_vllm, sft_step  # noqa: E402
from smoke.policy_steps import final_sampling, grpo_epoch  # noqa: E402
from smoke.report import checks, table  # noqa: E402
from smoke.run import SIZES, build_run, release  # noqa: E402


def run_smoke(workdir: Path, *, device: str = "cuda", dtype: str = "bfloat16", width_scale: float = 1.0,
              seed: int = 0, engines: tuple[str, ...] = ("paco", "vllm"), sizes: dict[str, int] | None = None,
              budget_s: float | None = None, start: float | None = None) -> dict[str, Any]:
    """Build the models under ``workdir`` and run every stage (see the module docstring).

    Args:
        budget_s: the time limit (:class:`smoke.budget.Budget`) in seconds since ``start``
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
    timer = Stages(device)
    budget = Budget(budget_s, ESTIMATE_S[kind], timer.rows, start=_T0 if start is None else start)
    results: dict[str, Any] = {"config": {"device": device, "dtype": dtype, "width_scale": width_scale, "seed": seed,
                                          "sizes": sizes, "torch": torch.__version__, "budget_s": budget_s,
                                          "gpu": torch.cuda.get_device_name() if timer.cuda else None},
                               "stages": timer.rows}
    run = build_run(workdir, device, dtype, width_scale, seed, sizes, timer)
    budget.calibrate(timer.rows["build"]["seconds"])
    # saved activations per block, measured where they are the paper's (bf16 at the real widths on CUDA)
    probe = memory_plan.BlockProbe(enabled=timer.cuda and dtype == "bfloat16" and width_scale == 1.0)
    st: dict[str, Any] = {}
    if budget.admit("sft"):
        with probe:
            st["sft"] = sft_step(run)
    if budget.admit("merge", needs=("sft",)):
        st["merged"] = merge_step(run, st["sft"])
    if budget.admit("judge_in_process", needs=("merge",)):
        st["triples"], st["reference"] = reference_scores(run, st["merged"])
    serve_rows: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        if budget.admit("serve_start", needs=("judge_in_process",)):
            with timer.stage("serve_start"):
                endpoint = stack.enter_context(judge_endpoint(run.params, st["merged"], run.accelerator,
                                                              workdir / "server"))
                url = endpoint.url()
            if budget.admit("serve", needs=("serve_start",)):
                serve_paco(run, url, st["triples"], st["reference"], serve_rows, engines)
            # the smoke builds no PickScore role: its CLIP stands in (the embedded default's bytes alike)
            rewards = [*run.params.grpo["t2is"].rewards, *run.params.final_samples["t2is"].rewards]
            ctx = make_reward_context(run.params, endpoint, run.dirs["clip"], run.dirs["clip"], rewards=rewards,
                                      device=device)
            prompts = prompts_table(run.params.grpo["t2is"].prompts_per_epoch, 2)
            if budget.admit("grpo", needs=("serve_start",)):
                with probe:
                    grpo_epoch(run, ctx, prompts)
            if budget.admit("final", needs=("grpo",)):
                final_sampling(run, ctx, prompts)
    release(timer.cuda)  # the policy and the scorers: vLLM wants the free memory
    for name, dep in (("serve", "serve_start"), ("grpo", "serve_start"), ("final", "grpo")):
        if name not in timer.rows:  # not tried: record why
            budget.admit(name, needs=(dep,))
    if "triples" in st:
        if "vllm" in engines:
            serve_vllm(run, st["merged"], st["triples"], st["reference"], serve_rows, budget)
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
                         f"(default {CUDA_BUDGET_S:g} on cuda, no limit on cpu)")
    args = ap.parse_args(argv)
    budget_s = CUDA_BUDGET_S if (args.budget_s is None and args.device == "cuda") else args.budget_s
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
