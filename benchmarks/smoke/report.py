"""The GPU smoke run's report: the checks the GPU tests assert, computed from a run's results
(:func:`checks`), and the printed one-line-per-stage summary (:func:`table`)."""

from __future__ import annotations

from typing import Any

from smoke.run import finite


def checks(results: dict[str, Any]) -> dict[str, bool]:
    """The behaviour the GPU tests assert, computed from a run's results (names -> passed), for
    the stages that ran."""
    s = results["stages"]
    _ran = lambda stages, name: name in stages and "skipped" not in stages[name]  # noqa: E731
    out: dict[str, bool] = {}
    if _ran(s, "sft"):
        out.update(sft_loss_finite=finite(s["sft"].get("loss")), sft_lora_changed=s["sft"]["lora_b_abs_max"] > 0)
    if _ran(s, "merge"):
        m, cfg = s["merge"], results["config"]
        out["merge_within_tolerance"] = max(m["max_abs_diff"].values()) <= m["tolerance"]
        if cfg["device"] == "cuda":  # the merge ran on the GPU: its weights (bf16 2 bytes, else 4) were there
            out["merge_on_device"] = m["peak_gib"] >= 0.9 * m["parameters"] * (2 if cfg["dtype"] == "bfloat16" else 4) / 2**30
    if _ran(s, "grpo"):
        out.update(grpo_loss_finite=finite(s["grpo"].get("loss")), grpo_lora_changed=s["grpo"]["lora_b_abs_max"] > 0)
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
        finite(r[k]) and r[k] > 0 for r in results["memory_plan"]
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
