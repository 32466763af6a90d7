"""``docs/results.md`` from a run's own artifacts: ``python -m paco.results``.

Every figure in the page is read from what the stages wrote under ``data/`` (each stage's
``metrics.json`` and ``report.json``, GRPO's ``plots/train.csv``), so the page cannot drift
from the run it describes: regenerate it after ``dvc repro`` instead of editing it. Nothing is
computed here but formatting, one plot of the training reward curves and small JPEG excerpts of
the final samples' contact sheets (``--figures``: :func:`sample_excerpts`).

Usage::

    python -m paco.results                                  # data/ -> docs/results.md, docs/figures/results/
    python -m paco.results --data /other/clone/data --out /tmp/results.md --figures /tmp/fig

Raises :class:`ResultsError` (exit 2, the message names the file) when a stage's file is missing
or lacks a key the page reports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from paco.core.dotted import get_dotted

#: the judges ``reward_eval`` scores, as the page names them
JUDGES = (("paco_reward", "PaCo-Reward (trained)"), ("base_zero_shot", "base judge, zero-shot"),
          ("clip_i", "CLIP-I"))
#: ``reward_eval`` editing benchmark questions, in table order
EDIT_QUESTIONS = ("consistency", "prompt_following", "overall")
#: the stages whose ``report.json`` holds ``run.wall_seconds`` and ``run.peak_rss_mb``, in DAG order
STAGE_ORDER = ("models", "prompts", "edits", "composites", "subfigures", "pairs", "reasons", "reward_train",
               "reward_merge", "reward_eval", "grpo", "final_samples", "benchmark")


class ResultsError(RuntimeError):
    """A run's artifact is missing or lacks a figure the page reports (the message names it)."""


def _load(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ResultsError(f"{path}: missing (run `dvc repro` first)") from None
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path}: not JSON ({exc})") from None


def _get(doc: Mapping[str, Any], dotted: str, path: Path) -> Any:
    try:
        return get_dotted(doc, dotted)
    except KeyError:
        raise ResultsError(f"{path}: no {dotted!r}") from None


def fmt(x: Any, digits: int = 3) -> str:
    """A figure as the page prints it: ``digits`` decimals, p-values (< 1e-3) in ``1e-08`` form,
    ``-`` for ``None``."""
    if x is None:
        return "-"
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}f}"


def fmt_p(p: float | None) -> str:
    """A p-value: 2 significant digits, scientific below 0.001."""
    if p is None:
        return "-"
    return f"{p:.0e}" if p < 1e-3 else f"{p:.2g}"


def fmt_gain(x: float | None, digits: int = 3) -> str:
    """A signed difference (``+0.022``)."""
    return "-" if x is None else f"{x:+.{digits}f}"


def _subtasks(data: Path, stage: str) -> list[str]:
    root = data / stage
    return sorted(p.name for p in root.iterdir() if (p / "report.json").is_file()) if root.is_dir() else []


# --------------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------------


def judge_section(data: Path) -> list[str]:
    """ConsistencyRank (paper Table 2 layout) and the editing benchmark (Table 1 layout) from
    ``reward_eval/report.json``; the judge's training from ``reward_train/report.json``."""
    path = data / "reward_eval" / "report.json"
    rep = _load(path)
    lines = ["## The judge (PaCo-Reward)", "",
             f"ConsistencyRank on {_get(rep, 'instances', path)} held-out ranking instances "
             f"({_get(rep, 'prompts', path)} test prompts); chance: accuracy 0.25, Kendall tau 0; p: one-sided "
             "t-test against chance over instances (per-prompt means in brackets).", "",
             "| judge | accuracy | Kendall tau | Spearman rho | top1-bottom1 | accuracy vs chance, p |",
             "|---|---|---|---|---|---|"]
    for key, name in JUDGES:
        j = rep.get("judges", {}).get(key)
        if j is None:
            continue
        lines.append(f"| {name} | {fmt(j['accuracy'])} | {fmt(j['kendall_tau'])} | {fmt(j['spearman_rho'])} | "
                     f"{fmt(j['top1_bottom1'])} | {fmt_p(j['accuracy_vs_chance']['p_value'])} "
                     f"({fmt_p(j['accuracy_vs_chance_per_prompt']['p_value'])}) |")
    lines.append("")
    for key, name in JUDGES[1:]:
        vs = rep.get("paco_reward_vs", {}).get(key)
        if vs is not None:
            lines.append(f"- trained minus {name}, accuracy: {fmt_gain(vs['mean'])} (paired p {fmt_p(vs['p_value'])} "
                         f"over {vs['n']} instances, {fmt_p(vs['per_prompt']['p_value'])} over "
                         f"{vs['per_prompt']['n']} prompt means)")
    editing = rep.get("editing")
    if editing:
        lines += ["", f"Editing benchmark ({editing['benchmark']}, {editing['instances']} instances of "
                  f"{editing['items']} items; strict preference accuracy, chance 0.5; n and one-sided binomial p "
                  "in brackets):", "",
                  "| judge | " + " | ".join(q.replace("_", " ") for q in EDIT_QUESTIONS) + " |",
                  "|---|" + "---|" * len(EDIT_QUESTIONS)]
        for key, name in JUDGES:
            j = editing["judges"].get(key)
            if j is not None:
                cells = [f"{fmt(j[q]['accuracy'], 2)} (n {j[q]['n']}, p {fmt_p(j[q]['p_value'])})"
                         for q in EDIT_QUESTIONS if q in j]
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", *_training_lines(data)]
    return lines


def _training_lines(data: Path) -> list[str]:
    path = data / "reward_train" / "report.json"
    rep = _load(path)
    ev = _get(rep, "eval_final", path)
    return [f"Judge SFT: {_get(rep, 'total_steps', path)} steps over {_get(rep, 'train_pairs', path)} training pairs; "
            f"held-out first-token accuracy {fmt(ev['first_token_accuracy'])}, P(Yes) accuracy "
            f"{fmt(ev['p_yes_accuracy'])} on {ev['pairs']} pairs (mean P(Yes) {fmt(ev['p_yes_mean_yes'])} on Yes "
            f"pairs, {fmt(ev['p_yes_mean_no'])} on No pairs)."]


def grpo_section(data: Path) -> list[str]:
    """Per GRPO subtask: the training reward's learning signal (first vs last epochs, paired over
    prompts), the ODE evaluation reward, and the final samples' LoRA - base per reward."""
    lines = ["## PaCo-GRPO", "",
             "Training reward: the mean weighted reward of the first vs the last epochs' samples; p: one-sided "
             "paired t-test over the prompts (items) drawn in both windows (`report.json` `learning_signal`). "
             "Evaluation: ODE samples of the evaluation split's prompts (`grpo.<k>.eval.split`, held-out) at the "
             "evaluation resolution, first and last evaluation.", "",
             "| subtask | epochs | training reward, first -> last | gain (prompts higher, p) | eval reward, "
             "first -> last | s / epoch | wall s | peak RSS GB |",
             "|---|---|---|---|---|---|---|---|"]
    for sub in _subtasks(data, "grpo"):
        path = data / "grpo" / sub / "report.json"
        rep = _load(path)
        sig = _get(rep, "learning_signal", path)
        lines.append(
            f"| {sub} | {rep['epochs']} | {fmt(sig.get('first_epochs_reward'))} -> {fmt(sig.get('last_epochs_reward'))} "
            f"| {fmt_gain(sig.get('improvement'))} ({sig.get('prompts_improved', '-')} of "
            f"{sig.get('prompts_paired', '-')}, p {fmt_p(sig.get('p_value'))}) | {fmt(rep['eval_first']['reward'])} -> "
            f"{fmt(rep['eval_final']['reward'])} | {fmt(rep['seconds_per_epoch'], 1)} | "
            f"{fmt(rep['run']['wall_seconds'], 0)} | {fmt(rep['run']['peak_rss_mb'] / 1024, 2)} |")
    lines += ["", "Final samples (`final_samples@<subtask>`): the member's split of prompts (items; held-out unless "
              "the row says otherwise) sampled with the ODE with and without the LoRA, paired by (prompt, seed); p: "
              "two-sided paired t-test.", "",
              "| subtask | reward | base | LoRA | LoRA - base | better | p |", "|---|---|---|---|---|---|---|"]
    for sub in _subtasks(data, "final_samples"):
        path = data / "final_samples" / sub / "report.json"
        rep = _load(path)
        for name, r in _get(rep, "rewards", path).items():
            size = "native size" if rep["resolution"] == "native" else f"{rep['resolution']} px"
            split = "" if rep.get("split", "test") == "test" else f", split {rep['split']}"
            lines.append(f"| {sub} ({rep['samples'] // 2} pairs, {size}{split}) | {name} | "
                         f"{fmt(r['base_mean'])} | {fmt(r['lora_mean'])} | {fmt_gain(r['lora_minus_base'])} | "
                         f"{r['improved_fraction']:.0%} | {fmt_p(r.get('paired_t_p_value'))} |")
    return lines


#: the independent scorers of ``final_samples.<k>.independent_scorer``, as the page names them
INDEPENDENT = {"base_judge": "the zero-shot base judge"}


def _monitor_verdict(name: str, change: float, p: float | None) -> str:
    """``past its bound`` / ``within`` for a LoRA - base change (:data:`paco.grpo.monitors.THRESHOLDS`),
    with the paired test's reading."""
    from paco.grpo.monitors import THRESHOLDS

    direction, bound = THRESHOLDS[name]
    past = direction * change > bound
    significant = p is not None and p < 0.05 and direction * change > 0
    return "**past its bound**" if past else ("within its bound, significant" if significant else "within its bound")


def hacking_section(data: Path) -> list[str]:
    """The reward-hacking monitors (:mod:`paco.grpo.monitors`) of the final samples, base against
    LoRA (``final_samples/<k>/report.json`` ``monitors``), the hacking gap against the independent
    judge (``hacking_gap``), the monitors of GRPO's first and last evaluation, and one line per
    subtask in plain words."""
    from paco.grpo.monitors import THRESHOLDS

    lines = ["## Reward hacking", "",
             "Monitors that do not ask the judge (`paco.grpo.monitors`), on the final samples, paired by "
             "(prompt, seed); p: two-sided paired t-test. `grid_artifact`: the share of fine detail explained by "
             "the position in the latent patch grid (16 px); `high_frequency`: the spectral energy share above a "
             "quarter of Nyquist; `panel_similarity`: mean SSIM between a composite's panels; `input_ssim`: SSIM of "
             "an edit to its input. Bound: the change that warns (rise, or fall for `input_ssim`).", "",
             "| subtask | monitor | base | LoRA | LoRA - base | LoRA higher | p | bound | reading |",
             "|---|---|---|---|---|---|---|---|---|"]
    verdicts: dict[str, list[str]] = {}
    gaps = []
    for sub in _subtasks(data, "final_samples"):
        path = data / "final_samples" / sub / "report.json"
        rep = _load(path)
        for name, m in rep.get("monitors", {}).items():
            direction, bound = THRESHOLDS[name]
            reading = _monitor_verdict(name, m["lora_minus_base"], m.get("paired_t_p_value"))
            if "past" in reading:
                verdicts.setdefault(sub, []).append(f"{name} {fmt_gain(m['lora_minus_base'])} "
                                                    f"(p {fmt_p(m.get('paired_t_p_value'))})")
            lines.append(f"| {sub} | {name} | {fmt(m['base_mean'], 4)} | {fmt(m['lora_mean'], 4)} | "
                         f"{fmt_gain(m['lora_minus_base'], 4)} | {m['lora_higher_fraction']:.0%} | "
                         f"{fmt_p(m.get('paired_t_p_value'))} | {'+' if direction > 0 else '-'}{bound:g} | {reading} |")
        for name, g in rep.get("hacking_gap", {}).items():
            gaps.append((sub, name, g))
    if gaps:
        params = _load(data / "params_check" / "params.json")
        lines += ["", "The hacking gap: the LoRA - base gain of the judge reward under the run's judge minus the same "
                  "gain under a judge the run did not optimise (`final_samples.<k>.independent_scorer`); p: two-sided "
                  "paired t-test of the per-sample gains under the two judges.", "",
                  "| subtask | reward | independent judge | gain, run's judge | gain, independent judge | gap | p |",
                  "|---|---|---|---|---|---|---|"]
        for sub, name, g in gaps:
            scorer = params.get("final_samples", {}).get(sub, {}).get("independent_scorer", "base_judge")
            lines.append(f"| {sub} | {name} | {INDEPENDENT.get(scorer, scorer)} | {fmt_gain(g['optimised_gain'])} | "
                         f"{fmt_gain(g['independent_gain'])} | {fmt_gain(g['gap'])} | "
                         f"{fmt_p(g.get('paired_t_p_value'))} |")
            if g["gap"] > 0 and (g.get("paired_t_p_value") or 1.0) < 0.05:
                verdicts.setdefault(sub, []).append(
                    f"a hacking gap of {fmt_gain(g['gap'])} in {name} (p {fmt_p(g.get('paired_t_p_value'))}: the run's "
                    f"judge sees {fmt_gain(g['optimised_gain'])}, {INDEPENDENT.get(scorer, scorer)} "
                    f"{fmt_gain(g['independent_gain'])})")
    lines += ["", "GRPO's evaluations (ODE, the evaluated weights): the weighted reward on the held-out prompts "
              "(`reward`) and on the first `eval.train_prompts` training prompts (`train_reward`: a gain there but not "
              "on the held-out prompts is a reward the policy learnt by heart), and the held-out samples' monitors, "
              "at the first evaluation (the base: the LoRA starts at zero) and the last; `lora_epoch`: whose weights "
              "the LoRA is (`grpo.<k>.checkpoint_selection`).", "",
              "| subtask | figure | first eval | last eval | change | LoRA epoch |", "|---|---|---|---|---|---|"]
    for sub in _subtasks(data, "grpo"):
        path = data / "grpo" / sub / "report.json"
        rep = _load(path)
        first, final = rep.get("eval_first", {}), rep.get("eval_final", {})
        for name in ("reward", "train_reward", *THRESHOLDS):  # held-out, then the training prompts' reward
            if name in first and name in final:
                lines.append(f"| {sub} | {name} | {fmt(first[name], 4)} | {fmt(final[name], 4)} | "
                             f"{fmt_gain(final[name] - first[name], 4)} | {rep.get('lora_epoch', '-')} |")
    lines += ["", "In plain words:", ""]
    for sub in _subtasks(data, "final_samples"):
        found = verdicts.get(sub)
        lines.append(f"- {sub}: " + (f"the LoRA shows signs of reward hacking: {'; '.join(found)}." if found else
                                    "no monitor past its bound and no significant hacking gap."))
    return lines


def timing_section(data: Path) -> list[str]:
    """Wall time and peak resident memory of every stage that ran (``report.json`` ``run``)."""
    lines = ["## Stage times", "", "| stage | wall s | peak RSS GB | processes x torch threads |", "|---|---|---|---|"]
    total = 0.0
    for stage in STAGE_ORDER:
        members = [stage] if (data / stage / "report.json").is_file() else [f"{stage}@{s}" for s in _subtasks(data, stage)]
        for member in members:
            path = data / Path(*member.split("@")) / "report.json"
            run = _get(_load(path), "run", path)
            total += run["wall_seconds"]
            threads = run.get("threads", {}).get("torch") or "-"
            lines.append(f"| {member} | {fmt(run['wall_seconds'], 0)} | {fmt(run['peak_rss_mb'] / 1024, 2)} | "
                         f"{run.get('processes', 1)} x {threads} |")
    lines += ["", f"Sum of the stages' wall times: {total / 60:.1f} min (each stage's own process; `dvc repro` adds "
              "its bookkeeping)."]
    return lines


# --------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------


def reward_curves(data: Path, out: Path) -> Path:
    """Plot each GRPO subtask's training reward per epoch (``plots/train.csv``) to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for sub in _subtasks(data, "grpo"):
        train = pd.read_csv(data / "grpo" / sub / "plots" / "train.csv")
        ax.plot(train["epoch"], train["reward"], marker="o", ms=3, label=sub)
    ax.set_xlabel("epoch")
    ax.set_ylabel("mean weighted reward")
    ax.set_title("GRPO training reward")
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, metadata={"Software": None})
    plt.close(fig)
    return out


#: the contact sheet's cell padding, px (``paco.grpo.final_samples.contact_sheet``), to fit labels to a cell
SHEET_PAD = 6
#: the columns an excerpt reads from ``samples.parquet`` (``paco.grpo.final_samples.SAMPLE_COLUMNS``)
EXCERPT_COLUMNS = ("prompt_id", "seed", "variant", "image")


def _read_columns(path: Path, columns: Sequence[str], what: str) -> Any:
    """``columns`` of the parquet file ``path`` as a DataFrame; :class:`ResultsError` naming
    the file and the first missing column (or the read error)."""
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
    except FileNotFoundError:
        raise ResultsError(f"{path}: missing ({what})") from None
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a corrupt file
        raise ResultsError(f"{path}: not a readable parquet file ({exc})") from None
    missing = [c for c in columns if c not in names]
    if missing:
        raise ResultsError(f"{path}: no column {missing[0]!r} ({what} needs {list(columns)})")
    return pq.read_table(path, columns=list(columns)).to_pandas()


def choose_items(ids: Sequence[str], rows: int, *, distinct_edits: bool) -> list[str]:
    """The first ``rows`` ids in sorted order; with ``distinct_edits``, edit item ids
    (``<image>-<edit type>``, e.g. ``coffee-cool_cast``) are taken one per distinct edit type (the
    part after the last ``-``) first, in sorted order, then topped up with the remaining ids in
    sorted order. ``rows >= 1``; returns ``min(rows, len(set(ids)))`` ids."""
    ordered = sorted(set(map(str, ids)))
    if not distinct_edits:
        return ordered[:rows]
    seen: set[str] = set()
    first: list[str] = []
    for pid in ordered:
        edit = pid.rpartition("-")[2]
        if edit not in seen:
            seen.add(edit)
            first.append(pid)
    chosen = first[:rows]
    return chosen + [pid for pid in ordered if pid not in chosen][:rows - len(chosen)]


def _fit_label(label: str, width: int) -> str:
    """``label`` cut (ending in ``..``) to at most ``width`` px in the sheet's default font."""
    from PIL import Image, ImageDraw

    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    if draw.textlength(label) <= width:
        return label
    while label and draw.textlength(label + "..") > width:
        label = label[:-1]
    return label + ".."


def _excerpt_pairs(path: Path, rows: int, edit: bool) -> tuple[list[tuple[str, int, Any, Any]], int]:
    """``([(prompt_id, seed, base cell, lora cell)], n prompts in the file)`` for the chosen items
    (:func:`choose_items`), each at its lowest seed; :class:`ResultsError` for a missing column,
    no base/LoRA sample of a chosen (prompt, seed), or a duplicated (prompt, seed, variant)."""
    table = _read_columns(path, EXCERPT_COLUMNS, "the sample excerpt")
    if table.empty:
        raise ResultsError(f"{path}: no samples (no base/lora pair)")
    table["prompt_id"] = table["prompt_id"].astype(str)
    dup = table.duplicated(["prompt_id", "seed", "variant"])
    if dup.any():
        r = table[dup].iloc[0]
        raise ResultsError(f"{path}: two {r['variant']!r} samples of ({r['prompt_id']}, seed {r['seed']})")
    pairs = []
    for pid in choose_items(table["prompt_id"].tolist(), rows, distinct_edits=edit):
        mine = table[table["prompt_id"] == pid]
        seed = int(mine["seed"].min())
        cells = {v: mine[(mine["seed"] == seed) & (mine["variant"] == v)]["image"] for v in ("base", "lora")}
        for v, cell in cells.items():
            if cell.empty:
                raise ResultsError(f"{path}: no {v!r} sample of ({pid}, seed {seed}) (no base/lora pair)")
        pairs.append((pid, seed, cells["base"].iloc[0], cells["lora"].iloc[0]))
    return pairs, int(table["prompt_id"].nunique())


def sample_excerpts(data: Path, figures: Path, *, rows: int = 4, thumb: int = 128) -> dict[str, Path]:
    """A small contact sheet of the final samples per subtask: ``figures/samples_<subtask>.jpg``.

    For every ``data/final_samples/<subtask>/`` holding a ``samples.parquet``: the first ``rows``
    prompts by ``prompt_id`` (edits: one per distinct edit type first, :func:`choose_items`), each
    at its lowest seed, one sheet row each: ``base | LoRA`` for T2IS, ``input | base | LoRA`` for
    edits (``final_samples.<subtask>.dataset`` in ``params_check/params.json`` is ``edits``; the
    input image is ``data/edits/edits.parquet`` ``input_image`` of the ``item_id``, as the stage's
    ``compare`` sheet takes it). Cells are :func:`paco.grpo.final_samples.contact_sheet` thumbnails
    with a longest side of ``thumb`` px, so the sheet is ``cols * (thumb + 6) + 6`` px wide and
    ``18 + rows * (thumb + 14 + 6) + 6`` px high; JPEG, quality 85, no metadata: the same data
    gives the same bytes.

    Args:
        data: the run's data folder. figures: where the JPEGs go (created).
        rows: items per sheet, >= 1 (fewer when the file has fewer). thumb: cell size, px, >= 16.

    Returns:
        ``{subtask: path}`` in sorted subtask order (empty when no subtask has samples).

    Raises:
        ResultsError: a ``samples.parquet`` lacking a column of :data:`EXCERPT_COLUMNS` or a
            base/LoRA pair, an undecodable image, ``params.json`` without the subtask's
            ``dataset``/``split``, or an edit item without an input image (each names the file).
        ValueError: ``rows < 1`` or ``thumb < 16``.
    """
    from paco.core.io import ImageDecodeError, decode_image
    from paco.grpo.final_samples import contact_sheet

    if rows < 1 or thumb < 16:
        raise ValueError(f"rows must be >= 1 and thumb >= 16 px, got rows={rows}, thumb={thumb}")
    params_path = data / "params_check" / "params.json"
    params = _load(params_path)
    root = data / "final_samples"
    subs = sorted(p.name for p in root.iterdir() if (p / "samples.parquet").is_file()) if root.is_dir() else []
    out: dict[str, Path] = {}
    for sub in subs:
        path = root / sub / "samples.parquet"
        edit = _get(params, f"final_samples.{sub}.dataset", params_path) == "edits"
        split = _get(params, f"final_samples.{sub}.split", params_path)
        pairs, total = _excerpt_pairs(path, rows, edit)
        inputs: dict[str, Any] = {}
        if edit:
            epath = data / "edits" / "edits.parquet"
            items = _read_columns(epath, ("item_id", "input_image"), f"the input images of {sub}")
            inputs = dict(zip(items["item_id"].astype(str), items["input_image"], strict=True))
        images, labels = [], []
        try:
            for pid, seed, base, lora in pairs:
                if edit:
                    if pid not in inputs:
                        raise ResultsError(f"{data / 'edits' / 'edits.parquet'}: no item {pid!r} (the input of {path})")
                    images.append(decode_image(inputs[pid], what=f"edit {pid} input_image"))
                    labels.append(f"{pid} input")
                images += [decode_image(base, what=f"{path} {pid} s{seed} base"),
                           decode_image(lora, what=f"{path} {pid} s{seed} lora")]
                labels += [f"{pid} base", f"{pid} LoRA"]
        except ImageDecodeError as exc:
            raise ResultsError(str(exc)) from None
        seeds = sorted({s for _, s, _, _ in pairs})
        kind = "items" if edit else "prompts"
        which = "held-out" if split == "test" else f"split {split}"
        title = (f"{sub}: {'input | ' if edit else ''}base | LoRA (seed {', '.join(map(str, seeds))}, "
                 f"{len(pairs)} of {total} {which} {kind})")
        cols = 3 if edit else 2
        sheet = contact_sheet(images, [_fit_label(s, thumb + SHEET_PAD - 2) for s in labels], columns=cols,
                              thumb=thumb, title=_fit_label(title, cols * (thumb + SHEET_PAD) - SHEET_PAD))
        figures.mkdir(parents=True, exist_ok=True)
        target = figures / f"samples_{sub}.jpg"
        sheet.save(target, "JPEG", quality=85, optimize=True)
        out[sub] = target
    return out


def render(data: Path, figures: Path | None, out: Path) -> str:
    """The page's markdown; with ``figures``, the reward plot and the final samples' excerpts
    (:func:`sample_excerpts`) are written there and linked relative to ``out``'s folder.

    Raises:
        ResultsError: a stage's file is missing or lacks a figure the page reports (named).
    """
    params = _load(data / "params_check" / "params.json")
    seeds = {k: v["seed"] for k, v in params.get("grpo", {}).items()}
    lines = ["# Results of the embedded default", "",
             "Generated by `python -m paco.results` from the artifacts of one `dvc repro` (each stage's "
             "`metrics.json` / `report.json`); do not edit by hand. The embedded default trains tiny models "
             "(random-init, or pretrained by the project on the shipped photographs) for minutes on 2 CPU "
             "cores: these are one draw of a chaotic process, not the paper's "
             "figures; `docs/numerics.md` has the spread over seeds and numeric paths, and the end-to-end test "
             "asserts only the claims every draw clears.", "",
             f"GRPO seeds: {', '.join(f'{k} {v}' for k, v in seeds.items())}; reward_train seed "
             f"{params.get('reward_train', {}).get('seed', '-')}.", ""]
    if figures is not None:
        figures.mkdir(parents=True, exist_ok=True)
        rel = Path(os.path.relpath(figures, out.parent))
        curve = reward_curves(data, figures / "grpo_reward_curves.png")
        lines += [f"![GRPO training reward per epoch]({(rel / curve.name).as_posix()})", ""]
        excerpts = sample_excerpts(data, figures)
        if excerpts:
            lines += ["Final samples, excerpts: the first prompts (edit items: one per edit type) by id, each at "
                      "its lowest seed, without (base) and with the LoRA. The full contact sheets stay with the run "
                      "(`data/final_samples/<subtask>/sheets/`: `base.png`, `lora.png`, and `compare.png` "
                      "input / base / LoRA for edits; several MB each).", ""]
            lines += [f"![{sub}: final samples, base and LoRA]({(rel / p.name).as_posix()})\n"
                      for sub, p in excerpts.items()]
    for section in (judge_section, grpo_section, hacking_section, timing_section):
        lines += section(data) + [""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paco.results", description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=Path("data"), help="the run's data folder (default data)")
    p.add_argument("--out", type=Path, default=Path("docs/results.md"), help="the page to write")
    p.add_argument("--figures", default="docs/figures/results",
                   help="where the reward plot and sample excerpts go ('' for none)")
    args = p.parse_args(argv)
    try:
        text = render(args.data, Path(args.figures) if args.figures else None, args.out)
    except ResultsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
