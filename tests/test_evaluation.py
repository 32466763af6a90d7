"""ConsistencyRank evaluation plumbing: orders from scores, metrics, refusals, EditReward accuracy."""

import json

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from paco.judge import evaluation as E
from paco.core.io import ArtifactError


def setup(n_inst=6):
    """Instances whose candidates are images with a known 'consistency' value in pixel (0,0)."""
    rng = np.random.default_rng(0)
    panels, rows = {}, []
    for i in range(n_inst):
        ref = f"r{i}"
        panels[ref] = Image.new("RGB", (8, 8), (0, 0, 0))
        values = rng.permutation(4) * 60
        cands = []
        for k, v in enumerate(values):
            pid = f"c{i}-{k}"
            panels[pid] = Image.new("RGB", (8, 8), (int(v), 0, 0))
            cands.append(pid)
        ranking = [cands[k] for k in np.argsort(-values)]
        rows.append({"instance_id": f"i{i}", "prompt_id": f"p{i % 3}", "ref_panel_id": ref,
                     "candidate_panel_ids": cands, "ranking": ranking})
    return pd.DataFrame(rows), panels, {f"p{j}": "q" for j in range(3)}


def red(triples):
    return [float(b.getpixel((0, 0))[0]) for _, b, _ in triples]


def test_perfect_scorer_gets_perfect_metrics():
    inst, panels, instr = setup()
    pred = E.rank_predictions(inst, panels, instr, red, "oracle", chunk=5)
    assert (pred["predicted_order"].map(list) == pred["reference_order"].map(list)).all()
    m = E.summarise_rankings(pred)
    assert m["accuracy"] == 1.0 and m["kendall_tau"] == 1.0 and m["top1_bottom1"] == 1.0
    assert m["accuracy_vs_chance"]["p_value"] < 1e-3


def test_reversed_scorer_and_paired_comparison():
    inst, panels, instr = setup(12)
    good = E.rank_predictions(inst, panels, instr, red, "good")
    bad = E.rank_predictions(inst, panels, instr, lambda t: [-s for s in red(t)], "bad")
    assert E.summarise_rankings(bad)["kendall_tau_ranks"] == -1.0
    cmp = E.paired_comparison(good, bad)
    assert cmp["mean"] == 1.0 and cmp["p_value"] < 1e-3
    assert cmp["per_prompt"]["n"] == inst["prompt_id"].nunique() and cmp["per_prompt"]["mean"] == 1.0


@pytest.mark.parametrize("scorer", [lambda t: [float("nan")] * len(t), lambda t: [0.5]])
def test_bad_scores_are_refused(scorer):
    inst, panels, instr = setup(2)
    with pytest.raises(ArtifactError):
        E.rank_predictions(inst, panels, instr, scorer, "broken")


def test_edit_benchmark(tmp_path):
    recs = []
    for i, dim in enumerate(["consistency", "instruction_following", "overall", "consistency"]):
        for name, v in (("in", 0), ("a", 200), ("b", 50)):
            Image.new("RGB", (8, 8), (v, 0, 0)).save(tmp_path / f"{name}{i}.png")
        recs.append({"instruction": "make it red", "input_image": f"in{i}.png", "output_a": f"a{i}.png",
                     "output_b": f"b{i}.png", "dimension": dim})
    path = tmp_path / "bench.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    bench = E.read_edit_benchmark(path)
    scorer = lambda t: [b.getpixel((0, 0))[0] / 255 for _, b, _ in t]  # noqa: E731
    acc = E.edit_accuracy(bench, scorer, scorer)
    assert acc == {"consistency": {"accuracy": 1.0, "n": 2}, "instruction_following": {"accuracy": 1.0, "n": 1},
                   "overall": {"accuracy": 1.0, "n": 1}}
    path.write_text(json.dumps({"instruction": "x"}))
    with pytest.raises(ArtifactError, match="missing key"):
        E.read_edit_benchmark(path)
