"""How firmly a trained judge answers Yes or No on a repro's final samples.

    python benchmarks/judge_answer_mass.py [--data data] [--out mass.json]

The GRPO and final-sampling stages read P(Yes) / (P(Yes) + P(No)) from the served judge's 20 most
likely first tokens (``judge_endpoint.top_logprobs``) and fail a request where neither answer is
among them (``paco.judge.model.yes_probability``). This measures how far a judge is from that
failure on what the policies actually draw: it loads ``--data``'s merged judge
(``reward_merge/model``) and asks it the reward's own questions about every final sample, base and
LoRA (``final_samples/<subtask>/samples.parquet``): each pair of a t2is sample's panels with the
theme-free consistency question (``reasons.instruction: rank``, the default's), each edit against
its input image with the ``edit_sc`` and ``edit_pf`` questions, both images as they are, as
``paco.grpo.rewards.editing_scores`` sends them. Per subtask it prints (and writes as JSON):

* ``requests``: how many questions;
* ``worst_answer_rank``: over the requests, the largest rank (0 = most likely) of the better-ranked
  of ``Yes`` and ``No`` among the first-token logits; 20 or more would fail the stage;
* ``min_answer_mass`` / ``median_answer_mass``: P(Yes) + P(No) of the first token (softmax over the
  whole vocabulary, float32), in [0, 1].
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import stages  # noqa: E402,F401  a stage process's set-up before numpy loads: fixed numerics env, hub offline
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from embedded_quality import _image, print_figures  # noqa: E402

from paco.core.templates import get_template, judge_instruction  # noqa: E402
from paco.judge.model import Judge  # noqa: E402

SUBTASKS = ("t2is", "kontext_editing", "qwen_editing")


def questions(data: Path, subtask: str) -> list[tuple]:
    """The reward's ``(image_a, image_b, question)`` triples for every final sample of ``subtask``."""
    samples = pd.read_parquet(data / f"final_samples/{subtask}/samples.parquet")
    triples = []
    if subtask == "t2is":
        text = judge_instruction(None)
        for cells in samples["panels"]:
            panels = [_image(c) for c in cells]
            triples += [(panels[a], panels[b], text) for a, b in itertools.combinations(range(len(panels)), 2)]
        return triples
    items = pd.read_parquet(data / "edits/edits.parquet").set_index("item_id")
    sc, pf = get_template("edit_sc"), get_template("edit_pf")
    for _, row in samples.iterrows():
        item = items.loc[row["prompt_id"]]
        original, edited = _image(item["input_image"]), _image(row["image"])
        triples += [(original, edited, sc.format(prompt=item["instruction"])),
                    (original, edited, pf.format(prompt=item["instruction"]))]
    return triples


@torch.no_grad()
def answer_mass(judge: Judge, triples: list[tuple], batch: int = 8) -> dict:
    yes, no = list(judge.answer.yes), list(judge.answer.no)
    ranks, mass = [], []
    for i in range(0, len(triples), batch):
        logits = judge.first_token_logits(triples[i:i + batch]).float()
        rank = logits.argsort(-1, descending=True).argsort(-1)
        ranks += torch.minimum(rank[:, yes].min(-1).values, rank[:, no].min(-1).values).tolist()
        probs = logits.softmax(-1)
        mass += (probs[:, yes].sum(-1) + probs[:, no].sum(-1)).tolist()
    return {"requests": len(ranks), "worst_answer_rank": int(max(ranks)),
            "min_answer_mass": round(float(np.min(mass)), 4), "median_answer_mass": round(float(np.median(mass)), 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("data"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    judge = Judge.from_pretrained(args.data / "reward_merge/model")
    figures = {sub: answer_mass(judge, questions(args.data, sub)) for sub in SUBTASKS
               if (args.data / f"final_samples/{sub}/samples.parquet").exists()}
    print_figures(figures, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
