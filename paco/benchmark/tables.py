"""``table.md`` of the ``benchmark@<subtask>`` stage: the paper's table layout (PaCo-RL,
arXiv 2512.04784: Table 3, T2IS-Bench; Table 4, GEdit-Bench) with the paper's own rows for
reference beside this run's, and what in this run stands in for the paper's protocol.

The paper's rows are figures copied from Tables 3 and 4 (``PAPER_T2IS``, ``PAPER_GEDIT``); a
figure not copied there is left blank, never filled in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: Table 3, FLUX.1-dev + PaCo-Reward-7B, per VC evaluator: Identity, Style, Logic, Avg
PAPER_T2IS = (
    ("FLUX.1-dev + PaCo-Reward-7B (paper)", "Qwen2.5-VL-7B-Instruct",
     {"identity": 0.508, "style": 0.549, "logic": 0.422, "avg": 0.576}),
    ("FLUX.1-dev + PaCo-Reward-7B (paper)", "Gemma-3-4B-IT",
     {"identity": 0.837, "style": 0.867, "logic": 0.859, "avg": 0.757}),
)
#: Table 4, the EN-I cell (SC, PQ, Overall) of the two editing models trained with PaCo
PAPER_GEDIT = (
    ("FLUX.1-Kontext + PaCo (paper)", "", {"en_i": {"sc": 7.279, "pq": 7.036, "overall": 6.636}}),
    ("Qwen-Image-Edit + PaCo (paper)", "", {"en_i": {"sc": 7.799, "pq": 8.053, "overall": 7.451}}),
)
T2IS_COLUMNS = ("aesthetics", "entity", "attribute", "relation", "identity", "style", "logic", "vc", "avg")
GEDIT_CELLS = ("en", "en_i", "cn", "cn_i")


def _fmt(v: Any, digits: int) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def _p(test: Mapping[str, Any]) -> str:
    p = test.get("t_p")
    return "n/a" if p is None else f"{p:.3g}"


def _evaluator_lines(evaluators: Mapping[str, Mapping[str, Any]]) -> list[str]:
    out = []
    for name, ev in evaluators.items():
        where = ev.get("url") or f"{ev.get('model')} served by the stage"
        stand = f", standing in for {ev['stand_in_for']}" if ev.get("stand_in_for") else ""
        out.append(f"- `{name}`: {where} (served model name `{ev['served_model_name']}`{stand})")
    return out


def t2is_table(subtask: str, metrics: Mapping[str, Any], evaluators: Mapping[str, Mapping[str, Any]],
               notes: Sequence[str]) -> str:
    """Table 3's layout (Aesthetics, Entity, Attribute, Relation, Identity, Style, Logic, VC, Avg;
    one row per method and evaluator), the paper's rows, this run's base and LoRA rows, LoRA minus
    base on VC with its paired p-value, and ``notes`` (what is a stand-in, what is not scored)."""
    head = "| Method | Evaluator | " + " | ".join(c.capitalize() if c != "vc" else "VC" for c in T2IS_COLUMNS) + " |"
    lines = [f"# T2IS-Bench: benchmark@{subtask} (paper Table 3 layout)", "", head,
             "|" + "---|" * (len(T2IS_COLUMNS) + 2)]
    for method, ev, row in PAPER_T2IS:
        lines.append(f"| {method} | {ev} | " + " | ".join(_fmt(row.get(c), 3) for c in T2IS_COLUMNS) + " |")
    for variant, label in (("base", "base policy (this run)"), ("lora", "LoRA (this run)")):
        for name, m in metrics["scores"][variant].items():
            lines.append(f"| {label} | `{name}` | " + " | ".join(_fmt(m.get(c), 3) for c in T2IS_COLUMNS) + " |")
    lines += ["", f"LoRA minus base over {metrics['cases']} cases (paired t-test p):"]
    for name, t in metrics["lora_minus_base"].items():
        vc = t["vc"]
        lines.append(f"- `{name}`: VC {_fmt(vc['mean_diff'], 4) or 'n/a'} (p {_p(vc)}, n {vc['n']})")
    lines += ["", "Evaluators of this run:", *_evaluator_lines(evaluators), "", "Notes:", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def gedit_table(subtask: str, metrics: Mapping[str, Any], evaluators: Mapping[str, Mapping[str, Any]],
                notes: Sequence[str]) -> str:
    """Table 4's layout (SC, PQ, Overall for EN, EN-I, CN, CN-I), the paper's rows, this run's base
    and LoRA rows, LoRA minus base on Overall with its paired p-value, and ``notes``."""
    cols = [f"{cell.upper().replace('_I', '-I')} {k}" for cell in GEDIT_CELLS for k in ("SC", "PQ", "O")]
    lines = [f"# GEdit-Bench: benchmark@{subtask} (paper Table 4 layout)", "",
             "| Method | Evaluator | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 2)]

    def cells(row: Mapping[str, Any]) -> str:
        return " | ".join(_fmt((row.get(c) or {}).get(k), 3) for c in GEDIT_CELLS for k in ("sc", "pq", "overall"))

    for method, ev, row in PAPER_GEDIT:
        lines.append(f"| {method} | {ev} | {cells(row)} |")
    for variant, label in (("base", "base policy (this run)"), ("lora", "LoRA (this run)")):
        for name, m in metrics["scores"][variant].items():
            lines.append(f"| {label} | `{name}` | {cells(m)} |")
    lines += ["", f"LoRA minus base over {metrics['cases']} cases (paired t-test p; unparsed base/LoRA):"]
    for name, t in metrics["lora_minus_base"].items():
        o = t["overall"]
        lines.append(f"- `{name}`: Overall {_fmt(o['mean_diff'], 4) or 'n/a'} (p {_p(o)}, n {o['n']}; unparsed "
                     f"{metrics['unparsed']['base'][name]}/{metrics['unparsed']['lora'][name]})")
    lines += ["", "Evaluators of this run:", *_evaluator_lines(evaluators), "", "Notes:", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def monitor_lines(monitors: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The table's reward-hacking section: per monitor (:mod:`paco.grpo.monitors`, measured by
    final sampling on the scored cases) the base and LoRA means and LoRA minus base with its paired
    p-value, beside the benchmark's own figures; empty without monitors."""
    if not monitors:
        return []
    lines = ["", "Reward-hacking monitors of the scored cases (`paco.grpo.monitors`, measured by final_samples):", "",
             "| monitor | base | LoRA | LoRA - base | p | n |", "|---|---|---|---|---|---|"]
    for name, m in monitors.items():
        d = m["lora_minus_base"]
        diff = "" if d["mean_diff"] is None else f"{d['mean_diff']:+.4f}"
        lines.append(f"| {name} | {m['base']:.4f} | {m['lora']:.4f} | {diff} | {_p(d)} | {d['n']} |")
    return lines


def stand_in_notes(protocol: str, cfg: Any, evaluators: Mapping[str, Mapping[str, Any]],
                   not_scored: Mapping[str, str], extra: Sequence[str] = ()) -> list[str]:
    """The notes of ``table.md``: what in this run stands in for the paper's protocol (evaluators
    standing in for the paper's, the yes/no prompt alignment, the expected score), which
    prompt-alignment and aesthetics scorer ran (T2IS), that the answers of URL evaluators are
    cached by URL and served model name only, what is not scored and why, and ``extra``."""
    notes = []
    stand = [f"`{n}` for {e['stand_in_for']}" for n, e in evaluators.items() if e.get("stand_in_for")]
    if stand:
        notes.append("stand-in evaluators: " + ", ".join(stand))
    if protocol == "t2is" and cfg.t2is.prompt_alignment == "yes_no":
        notes.append("prompt alignment: the VQAScore question as each evaluator's yes/no log-prob, an approximation "
                     "of the official clip-flant5-xxl VQAScore")
    if protocol == "t2is" and cfg.t2is.prompt_alignment == "t2v_metrics":
        notes.append("prompt alignment: the official VQAScore (t2v_metrics clip-flant5-xxl, T2IS_Eval/vqa_alignment.py), "
                     "independent of the VC evaluator: the same Entity / Attribute / Relation in every row of a variant")
    if protocol == "t2is" and cfg.t2is.aesthetics == "laion":
        notes.append("aesthetics: the LAION aesthetic predictor (sac+logos+ava1-l14-linearMSE on CLIP ViT-L/14 image "
                     "embeddings), a stand-in (the released T2IS code has no aesthetics metric): per case the mean over "
                     "its panels, then the mean over cases, divided by 10 (the AVA scale; the paper's scaling is not "
                     "published); Avg = 0.2 Aes + 0.3 PA + 0.5 VC is inferred from paper Table 3")
    if protocol == "gedit" and cfg.gedit.scoring == "expected_score":
        notes.append("SC and PQ: the expected score over the first token's log-probs of 0..10 (a stand-in for the "
                      "VIEScore JSON reply, which a tiny model cannot write)")
    if protocol == "gedit" and cfg.gedit.official_random:
        notes.append(f"unparsed replies get the official random guess (seed {cfg.gedit.seed})")
    if cfg.seeds_per_prompt is not None or cfg.max_prompts is not None:
        seeds = "every seed" if cfg.seeds_per_prompt is None else f"the first {cfg.seeds_per_prompt} seed(s)"
        items = "every prompt / item" if cfg.max_prompts is None else f"the first {cfg.max_prompts} prompts / items"
        notes.append(f"cases: {seeds} of {items} of final_samples' split (not the whole benchmark)")
    remote = [f"`{n}`" for n, e in evaluators.items() if e.get("url")]
    if remote:
        notes.append(f"answers of URL evaluators ({', '.join(remote)}) are trusted by name: a changed remote model is "
                     f"not detected; clear data/benchmark/<k>/answers")
    notes += [f"not scored, {k}: {v}" for k, v in not_scored.items()]
    return notes + list(extra)
