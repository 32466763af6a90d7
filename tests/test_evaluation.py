"""ConsistencyRank evaluation plumbing: orders from scores, metrics, refusals, EditReward accuracy."""

import io
import json
import re

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from paco.judge import evaluation as E
from paco.core.io import ArtifactError, decode_image


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


def _bench_scorer(triples):
    """SC question -> the output's red, PF question -> its green (/255): independent of the judge."""
    out = []
    for _, b, text in triples:
        r, g, _ = b.getpixel((0, 0))
        out.append((r if "consistency" in text else g) / 255)
    return out


def test_edit_benchmark_accuracy_by_hand(tmp_path):
    # (dimension, task type, output a colour, output b colour)
    cases = [("consistency", "colour", (200, 0, 0), (50, 0, 0)),        # SC .78 > .20: win
             ("prompt_following", "colour", (0, 100, 0), (0, 100, 0)),  # tie: lost strictly, won with >=
             ("overall", "colour", (100, 100, 0), (200, 25, 0)),         # sqrt(SC*PF) .392 > .277: win
             ("consistency", "other", (10, 0, 0), (20, 0, 0)),           # lose
             ("consistency", "colour", (90, 0, 0), (80, 0, 0))]          # win
    recs = []
    for i, (dim, task, a, b) in enumerate(cases):
        for name, colour in (("in", (0, 0, 0)), ("a", a), ("b", b)):
            Image.new("RGB", (8, 8), colour).save(tmp_path / f"{name}{i}.png")
        recs.append({"id": f"e{i}", "instruction": "make it red", "input_image": f"in{i}.png", "output_a": f"a{i}.png",
                     "output_b": f"b{i}.png", "dimension": dim, "task_type": task})
    path = tmp_path / "bench.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    bench = E.read_edit_benchmark(path)
    scores = E.edit_scores(bench, _bench_scorer, templates="bench")
    overall = scores.set_index("instance_id").loc["e2"]
    assert overall["score_a"] == pytest.approx(np.sqrt(100 / 255 * 100 / 255))
    assert overall["score_b"] == pytest.approx(np.sqrt(200 / 255 * 25 / 255))
    acc = E.edit_accuracy(scores)
    assert acc["consistency"]["accuracy"] == pytest.approx(2 / 3) and acc["consistency"]["n"] == 3
    assert acc["consistency"]["accuracy_macro"] == pytest.approx(0.5)  # colour 2/2, other 0/1
    assert acc["prompt_following"]["accuracy"] == 0.0 and acc["prompt_following"]["accuracy_ge"] == 1.0
    assert acc["overall"]["accuracy"] == 1.0
    assert acc["consistency"]["p_value"] == pytest.approx(0.5)  # P(X >= 2), X ~ Bin(3, 1/2)
    # CLIP-I style: one score for every dimension (here the red channel)
    single = E.edit_scores(bench, _bench_scorer, single=True).set_index("instance_id")
    assert single.loc["e2", "score_a"] == pytest.approx(100 / 255)
    path.write_text(json.dumps({"instruction": "x"}))
    with pytest.raises(ArtifactError, match="missing key"):
        E.read_edit_benchmark(path)


def _png(colour, size=(8, 8)) -> dict:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


def _write_editreward_parquet(path, rows) -> None:
    """The EditScore/EditReward-Bench export: datasets Image cells are {bytes, path} structs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("key", pa.list_(pa.string())), ("instruction", pa.string()), ("input_image", image),
                        ("output_images", pa.list_(image)), ("task_type", pa.string()), ("dimension", pa.string())])
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def test_editreward_bench_parquet_layout_is_read_and_scored(tmp_path):
    """EditReward-Bench as the authors' evaluation reads it: two output ids per row, the first
    output preferred, one row per dimension; shards of a directory in sorted order; an output id
    decoded once; an output of another size resized to the input's before scoring."""
    inp = _png((0, 0, 0))
    rows = [  # (keys, outputs, task, dimension)
        {"key": ["m1-0", "m2-0"], "instruction": "make it red", "input_image": inp,
         "output_images": [_png((200, 0, 0)), _png((50, 0, 0))], "task_type": "color_alter", "dimension": "consistency"},
        {"key": ["m1-0", "m2-0"], "instruction": "make it red", "input_image": inp,
         "output_images": [_png((200, 0, 0)), _png((50, 0, 0))], "task_type": "color_alter",
         "dimension": "prompt_following"},
    ]
    rows2 = [{"key": ["m1-1", "m3-1"], "instruction": "add a hat", "input_image": _png((9, 9, 9)),
              "output_images": [_png((10, 0, 0), (16, 4)), _png((20, 0, 0))], "task_type": "subject-add",
              "dimension": "overall"}]
    _write_editreward_parquet(tmp_path / "bench/data/train-00000-of-00002.parquet", rows)
    _write_editreward_parquet(tmp_path / "bench/data/train-00001-of-00002.parquet", rows2)
    bench = E.read_edit_benchmark(tmp_path / "bench")
    assert list(bench["instance_id"]) == ["m1-0|m2-0|consistency", "m1-0|m2-0|prompt_following",
                                          "m1-1|m3-1|overall"]
    assert bench.loc[0, "output_a"] is bench.loc[1, "output_a"]  # one decoded image per output id
    assert bench.loc[2, "output_a"].size == (16, 4)
    seen = []

    def scorer(triples):
        seen.extend(b.size for _, b, _ in triples)
        return _bench_scorer(triples)

    scores = E.edit_scores(bench, scorer, templates="bench").set_index("instance_id")
    assert set(seen) == {(8, 8)}  # resized to the input's size
    assert scores.loc["m1-0|m2-0|consistency", "score_a"] == pytest.approx(200 / 255)
    assert scores.loc["m1-0|m2-0|prompt_following", "score_b"] == pytest.approx(0.0)
    acc = E.edit_accuracy(scores.reset_index())
    assert acc["consistency"]["accuracy"] == 1.0 and acc["prompt_following"]["accuracy_ge"] == 1.0
    assert acc["overall"]["accuracy"] == 0.0  # PF is 0 for both outputs: a tie
    # one file works too
    assert len(E.read_edit_benchmark(tmp_path / "bench/data/train-00001-of-00002.parquet")) == 1


@pytest.mark.parametrize("change, message", [
    (lambda r: r.update(output_images=r["output_images"][:1]), "row 0: output_images must hold two images"),
    (lambda r: r.update(key=["only-one"]), "row 0: key must be two output ids"),
    (lambda r: r.update(dimension="instruction_following"), "row 0: dimension 'instruction_following'"),
    (lambda r: r.update(instruction=" "), "row 0: blank instruction"),
    (lambda r: r["output_images"].__setitem__(1, {"bytes": b"not a png", "path": None}), "row 0 output m2"),
], ids=["one-output", "one-key", "unknown-dimension", "blank-instruction", "corrupt-output"])
def test_editreward_bench_parquet_bad_rows_are_named(tmp_path, change, message):
    row = {"key": ["m1", "m2"], "instruction": "make it red", "input_image": _png((0, 0, 0)),
           "output_images": [_png((1, 0, 0)), _png((2, 0, 0))], "task_type": "t", "dimension": "overall"}
    change(row)
    _write_editreward_parquet(tmp_path / "b.parquet", [row])
    with pytest.raises(ArtifactError, match=re.escape(message)):
        E.read_edit_benchmark(tmp_path / "b.parquet")


def test_editreward_bench_parquet_missing_columns_and_duplicates(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"key": [["a", "b"]], "instruction": ["x"]}), tmp_path / "b.parquet")
    with pytest.raises(ArtifactError, match=r"missing column\(s\) \['dimension', 'input_image'"):
        E.read_edit_benchmark(tmp_path / "b.parquet")
    row = {"key": ["m1", "m2"], "instruction": "x", "input_image": _png((0, 0, 0)),
           "output_images": [_png((1, 0, 0)), _png((2, 0, 0))], "task_type": "t", "dimension": "overall"}
    _write_editreward_parquet(tmp_path / "d/b.parquet", [row, dict(row)])
    with pytest.raises(ArtifactError, match=re.escape("duplicate instance 'm1|m2|overall'")):
        E.read_edit_benchmark(tmp_path / "d")
    with pytest.raises(ArtifactError, match="no EditReward-Bench Parquet file"):
        E.read_edit_benchmark(tmp_path / "empty.parquet")


def test_photo_edit_benchmark_prefers_the_correct_edit():
    from paco.data.edit_pairs import make_edit_pairs
    from paco.data.edits import photo_edits

    edits = photo_edits(["astronaut", "cat", "coffee", "rocket"], ["greyscale", "mirror"], 32, 2, 0)
    pairs, _ = make_edit_pairs(edits, seed=0, repeats=2)
    bench = E.photo_edit_benchmark(pairs, "test")
    test_items = sorted(edits.loc[edits["split"] == "test", "item_id"])
    assert sorted(bench["item_id"].unique()) == test_items
    assert len(bench) == 6 * len(test_items) and bench["instance_id"].is_unique  # no mirrored copies
    # an oracle that knows the correct edit wins every instance; its inverse loses every one
    targets = {iid: np.asarray(decode_image(t)) for iid, t in zip(edits["item_id"], edits["target_image"])}
    correct = {id(r.output_a) for r in bench.itertuples()}

    def oracle(triples):
        return [1.0 if id(b) in correct else 0.0 for _, b, _ in triples]

    acc = E.edit_accuracy(E.edit_scores(bench, oracle, templates="reward"))
    assert all(v["accuracy"] == 1.0 for v in acc.values()) and set(acc) == set(E.EDIT_DIMENSIONS)
    assert all(np.array_equal(np.asarray(r.output_a), targets[r.item_id]) for r in bench.itertuples())
    worse = E.edit_scores(bench, lambda t: [1.0 - x for x in oracle(t)], templates="reward")
    cmp = E.edit_paired_comparison(E.edit_scores(bench, oracle, templates="reward"), worse)
    assert cmp["overall"]["mean"] == 1.0
