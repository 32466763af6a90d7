"""The comparison report: markdown tables of the baseline against each experiment, with paired
and Welch tests (:mod:`paco.core.statistics`), written as ``report.md`` and ``report.json``
(:func:`write_report`; the statistics and the reward ratio: :mod:`paco.compare`)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from paco.compare.ablations import format_value
from paco.compare.artifacts import GrpoData, load_grpo, read_parquet
from paco.compare.errors import CompareError, MissingMetricError
from paco.compare.experiments import Experiment, changed_params, exp_show, select
from paco.compare.growth import reward_names, reward_ratio, standardised_growth
from paco.compare.plots import plot_grpo
from paco.compare.timings import queue_log
from paco.core.statistics import paired_test, welch_test


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        if math.isinf(x):
            return "inf"
        if x != 0 and abs(x) < 10 ** -(digits - 1):
            return f"{x:.2e}"
        return f"{x:.{digits}f}"
    return str(x)


def _signed(x: float | None) -> str:
    return "n/a" if x is None else ("+" if x >= 0 else "") + _fmt(x)


def _pval(p: float | None) -> str:
    if p is None:
        return "n/a"
    return f"{p:.2e}" if p < 1e-3 else f"{p:.3f}"


def _changed(exp: Experiment, base: Experiment) -> str:
    if exp.baseline:
        return "(baseline)"
    ch = changed_params(exp, base)
    return ", ".join(f"`{k}={format_value(v) if not isinstance(v, (list, dict)) else v}`" for k, v in ch.items()) or "(none)"


def grpo_section(repo: str | Path, exps: Sequence[Experiment], subtask: str, window: int,
                 logs: Mapping[str, str]) -> tuple[list[str], list[GrpoData], dict[str, Any]]:
    """The GRPO tables (markdown lines), the loaded data and the figures as a dict."""
    base = exps[0]
    mpath = f"data/grpo/{subtask}/metrics.json"
    b = load_grpo(repo, base, subtask, logs)
    data = [b, *(load_grpo(repo, e, subtask, logs, weights=b.weights) for e in exps[1:])]
    for d in data[1:]:
        if not d.lora.index.equals(b.lora.index):
            raise CompareError(f"experiment {d.exp.name!r}: its final samples' (prompt_id, seed) differ from the "
                               f"baseline's; final_samples.{subtask} params must match to pair them")
    results: dict[str, Any] = {}
    lines = [
        f"### GRPO `{subtask}`: headline metrics",
        "",
        f"Differences are experiment minus baseline `{base.name}`. Final samples: LoRA samples of the same "
        f"{len(b.lora)} (prompt, seed) pairs, weighted reward `sum_k w_k r_k`; p from a paired t-test / "
        f"Wilcoxon signed-rank test. Train reward: mean of the per-epoch training reward over the last "
        f"{window} epochs (at the experiment's training resolution), Welch t-test on those epochs. "
        "Reward ratio: max/min standardised growth of the reward components (module docstring of "
        "`paco.compare`). s / epoch: mean seconds per training epoch in the trainer's log lines "
        "(`dvc queue logs` or `--log`; they depend on the machine's load).",
        "",
        "| experiment | changed params | eval reward | Δ eval | final-sample reward | Δ | p (t) | p (Wilcoxon) "
        "| train reward (last epochs) | Δ | p (Welch) | s / epoch | reward ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    b_eval = float(base.metric(mpath, "eval_reward"))
    b_last = b.train["reward"].iloc[-window:].to_numpy()
    for d in data:
        e = d.exp
        ev = float(e.metric(mpath, "eval_reward"))
        fs = paired_test(d.lora["reward"].to_numpy(), b.lora["reward"].to_numpy()) if not e.baseline else None
        last = d.train["reward"].iloc[-window:].to_numpy()
        wt = welch_test(last, b_last) if not e.baseline else None
        growth = standardised_growth(d.train, window)
        ratio = reward_ratio(growth)
        sec = float(np.mean(list(d.seconds.values()))) if d.seconds else None
        results[e.name] = {"eval_reward": ev, "eval_diff": None if e.baseline else ev - b_eval,
                           "final_reward": float(d.lora["reward"].mean()), "final": fs,
                           "train_last": float(last.mean()), "train": wt, "seconds_per_epoch": sec,
                           "growth": growth, "reward_ratio": ratio}
        lines.append(
            f"| {e.name} | {_changed(e, base)} | {_fmt(ev)} | {'' if e.baseline else _signed(ev - b_eval)} "
            f"| {_fmt(float(d.lora['reward'].mean()))} | {'' if fs is None else _signed(fs['mean_diff'])} "
            f"| {'' if fs is None else _pval(fs['t_p'])} | {'' if fs is None else _pval(fs['wilcoxon_p'])} "
            f"| {_fmt(float(last.mean()))} | {'' if wt is None else _signed(wt['mean_diff'])} "
            f"| {'' if wt is None else _pval(wt['p'])} | {_fmt(sec, 2)} | {_fmt(ratio, 2)} |")
    rewards = list(b.weights)
    lines += ["", f"### GRPO `{subtask}`: final samples per reward (LoRA, paired with the baseline)", "",
              "| experiment | " + " | ".join(f"{k} | Δ | p (t)" for k in rewards) + " |",
              "|---|" + "---|---|---|" * len(rewards)]
    for d in data:
        cells = []
        for k in rewards:
            if d.exp.baseline:
                cells += [_fmt(float(d.lora[k].mean())), "", ""]
            else:
                t = paired_test(d.lora[k].to_numpy(), b.lora[k].to_numpy())
                cells += [_fmt(float(d.lora[k].mean())), _signed(t["mean_diff"]), _pval(t["t_p"])]
                results[d.exp.name].setdefault("final_per_reward", {})[k] = t
        lines.append(f"| {d.exp.name} | " + " | ".join(cells) + " |")
    lines += monitor_lines(data, subtask, results)
    lines += ["", f"### GRPO `{subtask}`: standardised growth per reward (last vs first {window} epochs)", "",
              "| experiment | " + " | ".join(reward_names(b.train)) + " | reward ratio |",
              "|---|" + "---|" * (len(reward_names(b.train)) + 1)]
    for d in data:
        g = results[d.exp.name]["growth"]
        lines.append(f"| {d.exp.name} | " + " | ".join(_signed(g[k]) for k in reward_names(b.train))
                     + f" | {_fmt(results[d.exp.name]['reward_ratio'], 2)} |")
    return lines, data, results


def monitor_lines(data: Sequence[GrpoData], subtask: str, results: dict[str, Any]) -> list[str]:
    """The reward-hacking table (:mod:`paco.grpo.monitors`): per experiment the hacking gap of its
    final samples (``final_samples`` metrics.json ``hacking_gap``, LoRA - base within the
    experiment) and every monitor of its LoRA samples with the difference from the baseline's LoRA
    samples (paired t-test over (prompt, seed)); ``results`` gains ``monitors``. Empty when the
    baseline's samples have no monitors."""
    b = data[0]
    names = [m for m in b.monitors.columns if all(m in d.monitors.columns for d in data)]
    if not names:
        return []
    mpath = f"data/final_samples/{subtask}/metrics.json"
    lines = ["", f"### GRPO `{subtask}`: reward-hacking monitors of the final LoRA samples", "",
             "Hacking gap: the LoRA - base gain under the run's judge minus that under the independent judge, within "
             "each experiment (`final_samples` metrics.json; p: paired over its samples). Monitors: the LoRA samples' "
             "means, Δ against the baseline's LoRA samples, p from a paired t-test (`paco.grpo.monitors`: which "
             "setting hacks less).", "",
             "| experiment | hacking gap | p | " + " | ".join(f"{m} | Δ | p (t)" for m in names) + " |",
             "|---|---|---|" + "---|---|---|" * len(names)]
    for d in data:
        e = d.exp
        gap = e.metrics.get(mpath, {}).get("hacking_gap")
        gap_p = e.metrics.get(mpath, {}).get("hacking_gap_p")
        cells, entry = [], {"hacking_gap": gap, "hacking_gap_p": gap_p}
        for m in names:
            keep = d.monitors[m].notna() & b.monitors[m].notna()
            mean = float(d.monitors[m][keep].mean()) if keep.any() else None
            if e.baseline or keep.sum() < 2:
                cells += [_fmt(mean), "", ""]
                continue
            t = paired_test(d.monitors[m][keep].to_numpy(), b.monitors[m][keep].to_numpy())
            entry[m] = t
            cells += [_fmt(mean), _signed(t["mean_diff"]), _pval(t["t_p"])]
        results[e.name]["monitors"] = entry
        lines.append(f"| {e.name} | {_signed(gap)} | {_pval(gap_p)} | " + " | ".join(cells) + " |")
    return lines


def judge_section(repo: str | Path, exps: Sequence[Experiment]) -> tuple[list[str], dict[str, Any]]:
    """The judge (``reward_eval``) table: ConsistencyRank accuracy / Kendall tau of ``paco_reward``
    and the per-instance paired tests of the accuracy against the baseline."""
    from paco.judge.metrics import rank_metrics

    mpath, ppath = "data/reward_eval/metrics.json", "data/reward_eval/predictions.parquet"
    per: dict[str, pd.Series] = {}
    for e in exps:
        p = read_parquet(repo, e, ppath, columns=["instance_id", "scorer", "predicted_order", "reference_order"])
        p = p[p["scorer"] == "paco_reward"]
        if p.empty:
            raise MissingMetricError(f"experiment {e.name!r}: {ppath} has no paco_reward predictions")
        per[e.name] = pd.Series([rank_metrics(list(r.predicted_order), list(r.reference_order))["accuracy"]
                                 for r in p.itertuples(index=False)], index=p["instance_id"].to_numpy()).sort_index()
    base = exps[0]
    results: dict[str, Any] = {}
    lines = ["### Judge (`reward_eval`, ConsistencyRank, scorer `paco_reward`)", "",
             "Accuracy differences are paired over the same ranking instances (t-test / Wilcoxon).", "",
             "| experiment | changed params | accuracy | Kendall tau | Δ accuracy | p (t) | p (Wilcoxon) |",
             "|---|---|---|---|---|---|---|"]
    for e in exps:
        acc = float(e.metric(mpath, "judges.paco_reward.accuracy"))
        tau = float(e.metric(mpath, "judges.paco_reward.kendall_tau"))
        t = None
        if not e.baseline:
            if not per[e.name].index.equals(per[base.name].index):
                raise CompareError(f"experiment {e.name!r}: its ranking instances differ from the baseline's")
            t = paired_test(per[e.name].to_numpy(), per[base.name].to_numpy())
        results[e.name] = {"accuracy": acc, "kendall_tau": tau, "paired": t}
        lines.append(f"| {e.name} | {_changed(e, base)} | {_fmt(acc)} | {_fmt(tau)} "
                     f"| {'' if t is None else _signed(t['mean_diff'])} | {'' if t is None else _pval(t['t_p'])} "
                     f"| {'' if t is None else _pval(t['wilcoxon_p'])} |")
    return lines, results


def write_report(repo: str | Path = ".", names: Sequence[str] | None = None, out: str | Path = "compare",
                 subtask: str = "t2is", window: int = 5, sections: Sequence[str] | None = None,
                 logs: Mapping[str, str] | None = None, experiments: Sequence[Experiment] | None = None,
                 commits: int = 1) -> Path:
    """Write ``out/report.md`` and the PNGs comparing the baseline with the chosen experiments.

    Args:
        repo: the DVC repository (git work tree root).
        names: experiment names (``None``: every finished experiment of ``HEAD``).
        out: output folder (created).
        subtask: the GRPO subtask whose stages are compared.
        window: epochs at each end of the training curve (train-reward test and reward ratio).
        sections: ``grpo`` and/or ``judge``; ``None``: each whose metrics file the baseline has.
        logs: experiment name -> log text (epoch timings); queued experiments' logs are read with
            ``dvc queue logs`` when not given.
        experiments: the ``dvc exp show`` rows (``None``: :func:`paco.compare.experiments.exp_show`).
        commits: also the experiments of the last ``commits`` commits (compared with ``HEAD``).

    A section leaves out the experiments whose section output (``final_samples`` samples,
    ``reward_eval`` predictions) has the baseline's DVC hash (they did not change it) or is not
    among their outputs (a stage not in their ``dvc.lock``); the report says which.

    Returns:
        the path of ``report.md``.

    Raises:
        CompareError / MissingMetricError: see :func:`paco.compare.experiments.select`,
            :meth:`paco.compare.experiments.Experiment.metric`.
    """
    exps = select(experiments if experiments is not None else exp_show(repo, commits), names)
    base = exps[0]
    known = {"grpo": f"data/grpo/{subtask}/metrics.json", "judge": "data/reward_eval/metrics.json"}
    if sections is None:
        sections = [s for s, p in known.items() if p in base.metrics]
        if not sections:
            raise MissingMetricError(f"baseline {base.name!r}: none of the metrics files {sorted(known.values())}; "
                                     "run `dvc repro` and commit dvc.lock first")
    for s in sections:
        if s not in known:
            raise CompareError(f"unknown section {s!r}; choose from {sorted(known)}")
    logs = dict(logs or {})
    if "grpo" in sections:
        for e in exps:
            if e.name not in logs and not e.baseline:
                text = queue_log(repo, e.name)
                if text:
                    logs[e.name] = text
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Experiment comparison", "",
             f"Baseline `{base.name}` ({base.rev[:7]}); experiments: "
             + ", ".join(f"`{e.name}` ({e.rev[:7]}" + ("" if e.parent == base.rev else f", run on {e.parent[:7]}")
                         + ")" for e in exps[1:]) + ".", ""]
    summary: dict[str, Any] = {"baseline": base.name, "experiments": [e.name for e in exps[1:]]}
    keys = {"grpo": f"data/final_samples/{subtask}/samples.parquet", "judge": "data/reward_eval/predictions.parquet"}

    def changed(section: str) -> list[Experiment]:
        key = keys[section]
        same = [e for e in exps[1:] if e.outs.get(key) is not None and e.outs.get(key) == base.outs.get(key)]
        absent = [e for e in exps[1:] if e.outs and e.outs.get(key) is None]  # no hash: not in its dvc.lock
        if same:
            lines.extend([f"Section {section}: left out " + ", ".join(f"`{e.name}`" for e in same)
                          + f" (`{key}` identical to the baseline's).", ""])
        if absent:
            lines.extend([f"Section {section}: left out " + ", ".join(f"`{e.name}`" for e in absent)
                          + f" (no `{key}` in its dvc.lock).", ""])
        return [base, *(e for e in exps[1:] if e not in same and e not in absent)]

    if "grpo" in sections and len(g := changed("grpo")) > 1:
        glines, data, res = grpo_section(repo, g, subtask, window, logs)
        lines += glines + [""]
        figs = plot_grpo(data, window, out, subtask)
        lines += [f"![{f}]({f})" for f in figs] + [""]
        summary["grpo"] = res
    if "judge" in sections and len(j := changed("judge")) > 1:
        jlines, res = judge_section(repo, j)
        lines += jlines + [""]
        summary["judge"] = res
    (out / "report.md").write_text("\n".join(lines))
    (out / "report.json").write_text(json.dumps(summary, indent=2, default=float))
    return out / "report.md"
