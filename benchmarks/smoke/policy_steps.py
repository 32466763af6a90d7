"""The GPU smoke run's policy steps: one GRPO epoch through the real trainer with rewards from the
served judge, and final sampling with and without the trained LoRA."""

from __future__ import annotations

from typing import Any

from smoke.run import SmokeRun, lora_b_abs_max, release


def grpo_epoch(run: SmokeRun, ctx: Any, prompts: Any) -> None:
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
        lora_b_abs_max=lora_b_abs_max(w / "grpo_lora/pytorch_lora_weights.safetensors"),
        checkpoints=sorted(p.name for p in (w / "grpo_checkpoints").iterdir() if p.name.startswith("epoch-")),
        judge_requests=ctx.judge.requests,
        images_per_s=round(n_traj / sec["rollout"], 3) if sec.get("rollout") else None)


def final_sampling(run: SmokeRun, ctx: Any, prompts: Any) -> None:
    """(e) final sampling with and without the LoRA."""
    from paco.core.io import decode_image
    from paco.grpo.final_samples import final_samples
    from paco.grpo.policies import grid_size

    release(run.timer.cuda)  # the GRPO policy
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
