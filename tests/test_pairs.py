"""Ranking instances and pairs (paper §3.1): counts, rankings, splits, annotation import."""

import json

import numpy as np
import pandas as pd
import pytest

from paco.data import pairs as P
from paco.core.io import ArtifactError


def panel_table(n_prompts=2, seeds=4, rows=2, cols=2, levels=(0, 1, 3, 7)):
    """Panels with the photos source's Latin-square drift levels."""
    recs = []
    for p in range(n_prompts):
        pid = f"t2is-{p:04d}"
        for k in range(seeds):
            for q in range(rows * cols):
                recs.append(
                    {
                        "panel_id": f"{pid}-s{k}-p{q}",
                        "prompt_id": pid,
                        "seed": k,
                        "index": q,
                        "level": levels[(k + q) % len(levels)],
                    }
                )
    return pd.DataFrame(recs)


def test_48_instances_per_prompt_for_four_2x2_composites():
    inst = P.build_instances(panel_table(n_prompts=3))
    assert len(inst) == 3 * 48
    assert inst.groupby("prompt_id").size().tolist() == [48, 48, 48]
    assert inst["instance_id"].is_unique
    row = inst.iloc[0]
    # candidates: position y from every composite, in seed order; reference position differs
    assert row.ref_index != row.candidate_index
    assert [c.split("-p")[-1] for c in row.candidate_panel_ids] == [str(row.candidate_index)] * 4
    assert [c.split("-s")[-1].split("-")[0] for c in row.candidate_panel_ids] == ["0", "1", "2", "3"]


def test_instance_count_general_layout():
    # 4 composites of 1x3: 4 x 3 x 2 = 24 instances per prompt
    inst = P.build_instances(panel_table(n_prompts=1, rows=1, cols=3))
    assert len(inst) == 24


def test_wrong_composite_count_is_an_error():
    panels = panel_table(n_prompts=1)
    with pytest.raises(ArtifactError, match="3 composites"):
        P.build_instances(panels[panels.seed < 3])


def test_ground_truth_ranking_by_level_distance():
    panels = panel_table(n_prompts=1)
    level = dict(zip(panels.panel_id, panels.level))
    rank = P.ground_truth_ranker(panels)
    for inst in P.build_instances(panels).itertuples():
        ranking = rank(inst.ref_panel_id, list(inst.candidate_panel_ids))
        dists = [abs(level[inst.ref_panel_id] - level[c]) for c in ranking]
        assert dists == sorted(dists) and len(set(dists)) == 4
        # the Latin square puts the reference's own level among the candidates: rank 1 is a match
        assert dists[0] == 0


def test_ground_truth_needs_levels_and_rejects_ties():
    panels = panel_table(n_prompts=1)
    with pytest.raises(ArtifactError, match="drift levels"):
        P.ground_truth_ranker(panels.assign(level=pd.array([None] * len(panels), dtype="Int64")))
    tied = panel_table(n_prompts=1, levels=(0, 1, 2, 3))  # 1 is equidistant from 0 and 2
    rank = P.ground_truth_ranker(tied)
    with pytest.raises(ArtifactError, match="tied"):
        for inst in P.build_instances(tied).itertuples():
            rank(inst.ref_panel_id, list(inst.candidate_panel_ids))


def test_pairs_yes_is_rank1_no_is_last_and_split_by_prompt():
    panels = panel_table(n_prompts=4)
    split = {"t2is-0000": "train", "t2is-0001": "test", "t2is-0002": "train", "t2is-0003": "train"}
    ranked, missing = P.rank_instances(P.build_instances(panels), P.ground_truth_ranker(panels), "ground_truth", split)
    assert missing == 0
    pairs = P.make_pairs(ranked)
    assert len(pairs) == 2 * len(ranked) and pairs["pair_id"].is_unique
    assert pairs["label"].mean() == 0.5
    first = ranked.iloc[0]
    yes, no = pairs[pairs.instance_id == first.instance_id].sort_values("label", ascending=False).itertuples()
    assert (yes.panel_a, yes.panel_b, yes.label) == (first.ref_panel_id, first.ranking[0], True)
    assert (no.panel_b, no.label) == (first.ranking[-1], False)
    by_prompt = pairs.groupby("prompt_id")["split"].nunique()
    assert (by_prompt == 1).all()
    assert set(pairs.loc[pairs.prompt_id == "t2is-0001", "split"]) == {"test"}


def test_similarity_ranker_orders_by_cosine():
    rng = np.random.default_rng(0)
    emb = {name: v / np.linalg.norm(v) for name, v in zip("rabcd", rng.normal(size=(5, 8)))}
    ranking = P.similarity_ranker(emb)("r", list("abcd"))
    sims = [emb["r"] @ emb[c] for c in ranking]
    assert sims == sorted(sims, reverse=True)
    emb["a"] = np.full(8, np.nan)
    with pytest.raises(ArtifactError, match="non-finite"):
        P.similarity_ranker(emb)("r", list("abcd"))


def test_annotations_map_files_to_panels(tmp_path):
    panels = panel_table(n_prompts=1)
    rec = {
        "folder": "0",  # integer idx of t2is-0000
        "ref_image": "0_0.png",
        "comp_images": ["0_1.png", "1_1.png", "2_1.png", "3_1.png"],
        "rank_images": ["2_1.png", "0_1.png", "3_1.png", "1_1.png"],
    }
    path = tmp_path / "consistency_full_rank.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    rankings = P.annotation_rankings(P.read_annotations(tmp_path), panels)
    inst = P.build_instances(panels)
    ranked, missing = P.rank_instances(inst, P.annotation_ranker(rankings), "annotations", {"t2is-0000": "test"})
    assert len(ranked) == 1 and missing == 47  # unannotated instances are counted, not hidden
    assert ranked.iloc[0].ranking == ["t2is-0000-s2-p1", "t2is-0000-s0-p1", "t2is-0000-s3-p1", "t2is-0000-s1-p1"]


@pytest.mark.parametrize(
    ("record", "needle"),
    [
        ({"folder": "0"}, "lacks keys"),
        ({"folder": "0", "ref_image": "0_0.png", "comp_images": ["0_1.png"], "rank_images": ["1_1.png"]}, "permutation"),
    ],
)
def test_malformed_annotations(tmp_path, record, needle):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(ArtifactError, match=needle):
        P.read_annotations(path)


def test_annotation_naming_unknown_panel(tmp_path):
    panels = panel_table(n_prompts=1)
    rec = {"folder": "t2is-0000", "ref_image": "9_0.png", "comp_images": ["0_1.png"], "rank_images": ["0_1.png"]}
    with pytest.raises(ArtifactError, match="9_0.png"):
        P.annotation_rankings([rec], panels)


# --------------------------------------------------------------------------------------------
# annotation import: real line numbers, types, duplicates, records that match no instance
# --------------------------------------------------------------------------------------------

GOOD = {"folder": "0", "ref_image": "0_0.png", "comp_images": ["0_1.png", "1_1.png", "2_1.png", "3_1.png"],
        "rank_images": ["2_1.png", "0_1.png", "3_1.png", "1_1.png"]}


def write_records(tmp_path, lines):
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_annotation_json_error_names_its_real_line(tmp_path):
    path = write_records(tmp_path, [GOOD, "", '{"folder": oops}'])
    with pytest.raises(ArtifactError, match=r"a.jsonl:3: invalid JSON"):
        P.read_annotations(path)


@pytest.mark.parametrize(("field", "value"), [("ref_image", 0), ("comp_images", [0, 1, 2, 3]),
                                              ("rank_images", "0_1.png"), ("folder", None)])
def test_annotation_wrong_types_name_line_and_field(tmp_path, field, value):
    path = write_records(tmp_path, [GOOD, {**GOOD, field: value}])
    with pytest.raises(ArtifactError, match=rf"a.jsonl:2: field '{field}' must be"):
        P.read_annotations(path)


def test_conflicting_annotations_name_both_records(tmp_path):
    other = {**GOOD, "comp_images": GOOD["comp_images"][::-1], "rank_images": GOOD["rank_images"][::-1]}
    path = write_records(tmp_path, [GOOD, other])
    with pytest.raises(ArtifactError, match=r"a.jsonl:1 and .*a.jsonl:2 rank the same instance differently"):
        P.match_annotations(P.read_annotation_records(path), panel_table(n_prompts=1))


def test_identical_duplicate_annotations_are_kept_once_and_counted(tmp_path):
    same = {**GOOD, "comp_images": GOOD["comp_images"][::-1]}  # the same candidates, listed otherwise
    path = write_records(tmp_path, [GOOD, same])
    match = P.match_annotations(P.read_annotation_records(path), panel_table(n_prompts=1))
    assert len(match.rankings) == 1
    assert [(d["record"], d["same_as"]) for d in match.duplicates] == [(f"{path}:2", f"{path}:1")]


@pytest.mark.parametrize(("change", "needle"), [
    ({"comp_images": ["0_1.png", "1_1.png", "2_1.png"], "rank_images": ["0_1.png", "1_1.png", "2_1.png"]},
     r"3 candidates, but prompt t2is-0000 has 4 composites"),
    ({"comp_images": ["0_1.png", "1_2.png", "2_1.png", "3_1.png"],
      "rank_images": ["0_1.png", "1_2.png", "2_1.png", "3_1.png"]}, r"panel positions \[1, 2\]"),
    ({"comp_images": ["0_0.png", "1_0.png", "2_0.png", "3_0.png"],
      "rank_images": ["0_0.png", "1_0.png", "2_0.png", "3_0.png"]}, r"the reference's own position 0"),
    ({"comp_images": ["0_1.png", "0_1.png", "2_1.png", "3_1.png"],
      "rank_images": ["0_1.png", "0_1.png", "2_1.png", "3_1.png"]}, r"repeats image\(s\) \['0_1.png'\]"),
])
def test_annotations_matching_no_instance_are_an_error(tmp_path, change, needle):
    path = write_records(tmp_path, [GOOD, {**GOOD, **change}])
    with pytest.raises(ArtifactError, match=rf"a.jsonl:2: .*{needle}"):
        P.match_annotations(P.read_annotation_records(path), panel_table(n_prompts=1))


def run_pairs_stage(tmp_path, annotations):
    import yaml
    from pathlib import Path

    from paco.core.io import write_parquet
    from stages import pairs as stage

    root = Path(__file__).resolve().parents[1]
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["pairs"].update(ranking="annotations", editing=False)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    write_parquet(tmp_path / "panels.parquet", panel_table(n_prompts=1).assign(image=None))
    write_parquet(tmp_path / "prompts.parquet", pd.DataFrame({"prompt_id": ["t2is-0000"], "split": ["test"]}))
    out = {k: str(tmp_path / f"{k}.parquet") for k in ("instances", "pairs", "edit-pairs")}
    return stage.main(["--params", str(tmp_path / "params.yaml"), "--panels", str(tmp_path / "panels.parquet"),
                       "--prompts", str(tmp_path / "prompts.parquet"), "--clip", str(tmp_path),
                       "--annotations", str(annotations), "--instances", out["instances"], "--pairs", out["pairs"],
                       "--edits", str(tmp_path / "none.parquet"), "--edit-pairs", out["edit-pairs"],
                       "--metrics", str(tmp_path / "m.json")])


def test_stage_reports_duplicates_and_refuses_bad_records_cleanly(tmp_path, caplog):
    path = write_records(tmp_path, [GOOD, GOOD])
    assert run_pairs_stage(tmp_path, path) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["instances"] == 1 and report["unannotated_instances"] == 47
    assert report["annotation_records"] == 2 and report["duplicate_annotations"] == 1
    for name in ("instances", "pairs", "edit-pairs"):
        (tmp_path / f"{name}.parquet").unlink()
    path = write_records(tmp_path, [GOOD, {**GOOD, "ref_image": 0}])
    assert run_pairs_stage(tmp_path, path) == 2  # a clean stage error, no traceback
    assert "a.jsonl:2: field 'ref_image' must be" in caplog.text
    assert not any((tmp_path / f"{name}.parquet").exists() for name in ("instances", "pairs", "edit-pairs"))
