"""How recognisable the embedded default's samples are, from a repro.

    python benchmarks/embedded_quality.py [--data data] [--out quality.json]

Reads what ``dvc repro`` left under ``--data`` and prints (and writes as JSON):

* ``t2is``: the share of final-sample panels (base and LoRA) whose nearest subject photograph by a
  fixed, non-learned feature is their prompt's subject (:mod:`paco.pretrain.quality`: 16 x
  16 px box-downsampled RGB, nearest of 48 views per photograph; chance 1/16);
* ``kontext_editing``, ``qwen_editing``: the edits' SSIM to their input image, base and LoRA, and
  to the correct result where the item has one (``target_image``);
* ``clip_t``: CLIP-T's accuracy at picking a photograph's own subject prompt among the 16 (one
  prompt per subject: its first T2IS prompt) on fresh views (``default_rng(2026)``): a single view
  against the first panel prompts (what the ``clip_t`` reward compares), a composite in that
  prompt's layout against the whole prompts (what ``pickscore`` compares);
* ``judge``: the trained judge and CLIP-I on ConsistencyRank and the editing table
  (``data/reward_eval/metrics.json``);
* ``grpo``: each subtask's training gain and final LoRA - base gain with p-values
  (``data/grpo/<k>/metrics.json``, ``data/final_samples/<k>/metrics.json``).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import stages  # noqa: E402,F401  a stage process's set-up before numpy loads: fixed numerics env, hub offline
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from PIL import Image  # noqa: E402

from paco.pretrain.quality import edit_ssim, subject_match_share  # noqa: E402


def _image(cell) -> Image.Image:
    data = cell["bytes"] if isinstance(cell, dict) else cell
    return Image.open(io.BytesIO(data)).convert("RGB")


def t2is_figures(data: Path) -> dict:
    samples = pd.read_parquet(data / "final_samples/t2is/samples.parquet")
    subjects = pd.read_parquet(data / "prompts/prompts.parquet").set_index("prompt_id")["subject"]
    out = {}
    for variant, rows in samples.groupby("variant"):
        panels, names = [], []
        for _, row in rows.iterrows():
            for cell in row["panels"]:
                panels.append(_image(cell))
                names.append(subjects[row["prompt_id"]])
        out[variant] = {"subject_match": round(subject_match_share(panels, names), 4), "panels": len(panels)}
    return out


def edit_figures(data: Path, subtask: str) -> dict:
    samples = pd.read_parquet(data / f"final_samples/{subtask}/samples.parquet")
    items = pd.read_parquet(data / "edits/edits.parquet").set_index("item_id")
    out = {}
    for variant, rows in samples.groupby("variant"):
        to_input, to_target = [], []
        for _, row in rows.iterrows():
            edited = _image(row["image"])
            item = items.loc[row["prompt_id"]]
            to_input.append(edit_ssim(edited, _image(item["input_image"])))
            if item["target_image"] is not None:
                to_target.append(edit_ssim(edited, _image(item["target_image"])))
        out[variant] = {"ssim_to_input": round(float(np.mean(to_input)), 4),
                        "ssim_to_target": round(float(np.mean(to_target)), 4) if to_target else None,
                        "edits": len(to_input)}
    return out


def clip_t_figures(data: Path, per_subject: int = 8) -> dict:
    """CLIP-T's subject accuracy: a fresh single view against each subject's first panel prompt
    (the texts the ``clip_t`` reward compares panels with), and a fresh composite in the layout of
    the subject's first prompt against each subject's whole prompt (what ``pickscore`` compares)."""
    from paco.models.clip import ClipScorer
    from paco.pretrain.views import layout_grid, subject_view, to_pil

    prompts = pd.read_parquet(data / "prompts/prompts.parquet").sort_values("prompt_id")
    first = prompts.groupby("subject", sort=True).head(1).set_index("subject")
    names = sorted(first.index)
    scorer = ClipScorer(str(data / "models/clip"), device="cpu")
    rng = np.random.default_rng(2026)
    views, composites = [], []
    for name in names:
        row = first.loc[name]
        for _ in range(per_subject):
            views.append(to_pil(subject_view(name, 128, 128, rng)))
            composites.append(to_pil(layout_grid(name, int(row["rows"]), int(row["cols"]), 256, 256, rng)))
    truth = np.repeat(np.arange(len(names)), per_subject)
    out = {"subjects": len(names), "chance": round(1 / len(names), 4)}
    for kind, images, texts in (("view_vs_panel_prompts", views, [first.loc[n, "panel_prompts"][0] for n in names]),
                                ("composite_vs_prompts", composites, [first.loc[n, "prompt"] for n in names])):
        sim = scorer.similarity_matrix(scorer.image_embeddings(images), scorer.text_embeddings(texts))
        out[kind] = round(float(np.mean(sim.numpy().argmax(axis=1) == truth)), 4)
    return out


def judge_figures(data: Path) -> dict:
    metrics = json.loads((data / "reward_eval/metrics.json").read_text())
    return {"consistencyrank": {k: v.get("accuracy") for k, v in metrics.get("judges", {}).items()},
            "editing": metrics.get("editing", {})}


def grpo_figures(data: Path) -> dict:
    out = {}
    for sub in sorted(p.name for p in (data / "grpo").iterdir() if (p / "metrics.json").exists()):
        out[sub] = {"grpo": json.loads((data / "grpo" / sub / "metrics.json").read_text())}
        final = data / "final_samples" / sub / "metrics.json"
        if final.exists():
            out[sub]["final_samples"] = json.loads(final.read_text())
    return out


def print_figures(figures: dict, out: Path | None) -> None:
    """Print ``figures`` as indented JSON (keys sorted), and write the same text to ``out`` if given."""
    text = json.dumps(figures, indent=2, sort_keys=True)
    print(text)
    if out:
        out.write_text(text + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("data"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    figures = {"t2is": t2is_figures(args.data)}
    for sub in ("kontext_editing", "qwen_editing"):
        if (args.data / f"final_samples/{sub}/samples.parquet").exists():
            figures[sub] = edit_figures(args.data, sub)
    figures["clip_t"] = clip_t_figures(args.data)
    figures["judge"] = judge_figures(args.data)
    figures["grpo"] = grpo_figures(args.data)
    print_figures(figures, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
