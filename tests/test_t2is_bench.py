"""T2IS-Bench protocol (issue 27): questions verbatim, pairs, aggregation exact to the official
code (chengyou-jia/T2IS T2IS_Eval/test_prompt_consistency.py, vqa_alignment.py), Avg, panels,
the official file layout."""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

import pytest
from PIL import Image

from paco.benchmark.t2is_bench import (
    PA_QUESTION,
    VC_QUESTION,
    CriteriaFormatError,
    ScoreError,
    T2ISBenchError,
    aggregate_pa,
    aggregate_vc,
    case_from_prompt_row,
    pa_questions,
    t2is_avg,
    t2is_metrics,
    vc_case_scores,
    vc_pairs,
    vc_questions,
)
from paco.benchmark.t2is_panels import (
    OfficialLayoutError,
    check_official_case_ids,
    cut_panels,
    load_official_bench,
    official_file_name,
    resize_for_vc,
    to_official_json,
    vc_image_side,
    write_official_layout,
)

ROOT = Path(__file__).resolve().parents[1]


def _scored(questions, fn):
    return [{**q, "score": fn(q)} for q in questions]


# --------------------------------------------------------------------------------------------
# questions
# --------------------------------------------------------------------------------------------


def test_question_texts_are_verbatim():
    assert VC_QUESTION == "Do images meet the following criteria? {criterion} Please answer Yes or No."
    assert PA_QUESTION == 'Does this figure show "{}"? Please answer yes or no.'
    case = {"case_id": "c", "n_panels": 2, "criteria": {"Style": {"Tone": "Same warm palette."}},
            "alignment": [{"Entity": ["a red fox"], "Attribute": ["red"], "Relation": ["on snow"]}] * 2}
    assert vc_questions(case)[0]["question"] == (
        "Do images meet the following criteria? Same warm palette. Please answer Yes or No.")
    assert pa_questions(case)[0]["question"] == 'Does this figure show "a red fox"? Please answer yes or no.'


@pytest.mark.parametrize("n", range(0, 9))
def test_pairs_are_every_unordered_pair_in_official_order(n):
    pairs = vc_pairs(n)
    assert len(pairs) == math.comb(n, 2)
    assert pairs == [(i, j) for i in range(n) for j in range(i + 1, n)]  # lines 119-120


def test_vc_questions_cover_each_criterion_and_pair():
    crit = {"Logic": {"l1": "L1"}, "Surroundings": {"x": "X"}, "Style": {"s1": "S1", "s2": "S2"},
            "Identity": {"i1": "I1"}}
    qs = vc_questions({"case_id": "c", "n_panels": 4, "criteria": crit})
    assert len(qs) == 5 * math.comb(4, 2)
    # official dimension order Style, Identity, Logic; the ignored dimension last, flagged
    assert [q["dimension"] for q in qs[::6]] == ["Style", "Style", "Identity", "Logic", "Surroundings"]
    assert [q["official"] for q in qs[::6]] == [True, True, True, True, False]
    assert len(vc_questions({"case_id": "c", "n_panels": 4, "criteria": crit},
                            extra_dimensions=False)) == 4 * 6


# --------------------------------------------------------------------------------------------
# VC aggregation
# --------------------------------------------------------------------------------------------

CASES = [
    {"case_id": "A", "n_panels": 3, "criteria": {"Style": {"s1": "S1", "s2": "S2"},
                                                 "Identity": {"i1": "I1"},
                                                 "Surroundings": {"x1": "X1"}}},
    {"case_id": "B", "n_panels": 2, "criteria": {"Style": {"s1": "S1"}, "Identity": {"i1": "I1"},
                                                 "Logic": {"l1": "L1"}}},
    {"case_id": "C", "n_panels": 4, "criteria": {}},
    {"case_id": "D", "n_panels": 0, "criteria": {"Style": {"s1": "S1"}}},
]
HAND = {  # (case, dimension, criterion) -> scores in pair order
    ("A", "Style", "s1"): [0.5, 0.25, 0.75], ("A", "Style", "s2"): [1.0, 0.5, 0.0],
    ("A", "Identity", "i1"): [0.25, 0.25, 0.25], ("A", "Surroundings", "x1"): [0.5, 0.5, 0.5],
    ("B", "Style", "s1"): [0.75], ("B", "Identity", "i1"): [0.5], ("B", "Logic", "l1"): [0.125],
}


def _hand_scores():
    qs = [q for c in CASES for q in vc_questions(c)]
    pos = {}
    out = []
    for q in qs:
        key = (q["case_id"], q["dimension"], q["criterion"])
        out.append({**q, "score": HAND[key][pos.setdefault(key, 0)]})
        pos[key] += 1
    return out


def test_vc_aggregation_by_hand():
    r = aggregate_vc(CASES, _hand_scores())
    # A: Style mean(0.5, 0.5) = 0.5, Identity 0.25, Logic absent -> 0; B: 0.75, 0.5, 0.125
    assert r["cases"]["A"]["dimensions"] == {"Style": 0.5, "Identity": 0.25, "Logic": 0.0}
    assert r["cases"]["B"]["dimensions"] == {"Style": 0.75, "Identity": 0.5, "Logic": 0.125}
    assert r["style"] == 0.625 and r["identity"] == 0.375
    assert r["logic"] == 0.125  # A's missing Logic drops out (a plain mean would give 0.0625)
    assert r["vc"] == (0.625 + 0.375 + 0.125) / 3
    assert r["n_nonzero"] == {"Style": 2, "Identity": 2, "Logic": 1}
    assert r["n_cases"] == 2
    assert r["skipped"] == [{"case_id": "C", "reason": "no criteria"},
                            {"case_id": "D", "reason": "no images"}]
    # Surroundings apart, never in VC
    assert r["extra_dimensions"] == {"Surroundings": {"mean": 0.5, "n_nonzero": 1, "n_cases": 1}}
    assert r["cases"]["A"]["extra_dimensions"] == {"Surroundings": 0.5}


def test_a_present_dimension_scoring_zero_also_drops_out_and_an_unscored_one_stays_zero():
    cases = [{"case_id": "a", "n_panels": 2, "criteria": {"Style": {"s": "S"}, "Identity": {"i": "I"}}},
             {"case_id": "b", "n_panels": 2, "criteria": {"Style": {"s": "S"}, "Identity": {"i": "I"}}}]
    scores = _scored([q for c in cases for q in vc_questions(c)],
                     lambda q: 0.0 if (q["case_id"], q["dimension"]) == ("a", "Style") else 0.5)
    r = aggregate_vc(cases, scores)
    assert r["style"] == 0.5 and r["n_nonzero"]["Style"] == 1  # line 224: "if avg > 0"
    assert r["logic"] == 0.0 and r["n_nonzero"]["Logic"] == 0  # no case has Logic
    assert r["vc"] == (0.5 + 0.5 + 0.0) / 3  # a 0.0 dimension still counts in the mean (line 237)


def _official_vc(cases, score_of):
    """A line-by-line transcription of test_prompt_consistency.py:61-237's arithmetic."""
    results = {"case_results": {}}
    for case in cases:
        case_id, case_criteria = case["case_id"], case["criteria"]
        if not case_criteria:
            continue
        if case["n_panels"] == 0:
            continue
        dimension_scores = {"Style": {"scores": []}, "Identity": {"scores": []}, "Logic": {"scores": []}}
        for dimension in ["Style", "Identity", "Logic"]:
            if dimension not in case_criteria:
                continue
            for name in case_criteria[dimension]:
                softmax_values = []
                for i in range(case["n_panels"]):
                    for j in range(i + 1, case["n_panels"]):
                        softmax_values.append(score_of(case_id, dimension, name, (i, j)))
                if softmax_values:
                    dimension_scores[dimension]["scores"].append(sum(softmax_values) / len(softmax_values))
        dimension_averages = {}
        for dimension, data in dimension_scores.items():
            dimension_averages[dimension] = (sum(data["scores"]) / len(data["scores"])
                                             if data["scores"] else 0.0)
        results["case_results"][case_id] = {"dimension_averages": dimension_averages}
    dimension_totals, dimension_counts = {}, {}
    for case_result in results["case_results"].values():
        for dimension, avg in case_result["dimension_averages"].items():
            if dimension not in dimension_totals:
                dimension_totals[dimension] = 0.0
                dimension_counts[dimension] = 0
            if avg > 0:
                dimension_totals[dimension] += avg
                dimension_counts[dimension] += 1
    final = {d: (t / dimension_counts[d] if dimension_counts[d] > 0 else 0.0)
             for d, t in dimension_totals.items()}
    return final, sum(final.values()) / len(final)


def test_vc_matches_a_transcription_of_the_official_code_bit_for_bit():
    rng = random.Random(7)
    dims = ["Style", "Identity", "Logic", "Surroundings"]
    cases = []
    for n in range(40):
        crit = {d: {f"{d}{k}": f"text {d} {k}" for k in range(rng.randint(1, 4))}
                for d in dims if rng.random() < 0.75}
        cases.append({"case_id": f"{n:04d}", "n_panels": rng.choice([0, 1, 2, 3, 4, 6, 8]),
                      "criteria": crit})
    table = {}
    for c in cases:
        for q in vc_questions(c):
            table[(q["case_id"], q["dimension"], q["criterion"], q["panels"])] = rng.random()
    r = aggregate_vc(cases, [{"case_id": k[0], "dimension": k[1], "criterion": k[2],
                              "panels": list(k[3]), "score": v} for k, v in table.items()])
    final, overall = _official_vc(cases, lambda *k: table[k])
    assert (r["style"], r["identity"], r["logic"]) == (final["Style"], final["Identity"], final["Logic"])
    assert r["vc"] == overall


def test_no_scored_case_gives_none_not_zero():
    r = aggregate_vc([{"case_id": "x", "n_panels": 0, "criteria": {"Style": {"s": "S"}}}], [])
    assert r["vc"] is None and r["style"] is None and r["skipped"][0]["reason"] == "no images"


def test_single_panel_case_scores_zero_and_drops_out_as_officially():
    r = aggregate_vc([{"case_id": "x", "n_panels": 1, "criteria": {"Style": {"s": "S"}}}], [])
    assert r["n_cases"] == 1 and r["cases"]["x"]["dimensions"]["Style"] == 0.0
    assert r["style"] == 0.0 and r["n_nonzero"]["Style"] == 0


def test_vc_case_scores_per_criterion():
    out = vc_case_scores(CASES[0], [s for s in _hand_scores() if s["case_id"] == "A"])
    assert out["criteria"]["Style"] == {"s1": 0.5, "s2": 0.5}
    assert out["overall"] == (0.5 + 0.25 + 0.0) / 3


@pytest.mark.parametrize("bad", ["missing", "extra", "duplicate", "nan", "above", "bool", "skipped"])
def test_bad_vc_scores_raise(bad):
    scores = _hand_scores()
    if bad == "missing":
        scores = scores[1:]
    elif bad == "extra":
        scores.append({**scores[0], "panels": (0, 5)})
    elif bad == "duplicate":
        scores.append(dict(scores[0]))
    elif bad == "skipped":
        scores.append({"case_id": "D", "dimension": "Style", "criterion": "s1", "panels": (0, 1),
                       "score": 0.5})
    else:
        scores[0]["score"] = {"nan": float("nan"), "above": 1.5, "bool": True}[bad]
    with pytest.raises(ScoreError):
        aggregate_vc(CASES, scores)


@pytest.mark.parametrize("case", [
    {"case_id": "x", "n_panels": 2, "criteria": {"Style": {}}},
    {"case_id": "x", "n_panels": 2, "criteria": {"Style": {"s": None}}},
    {"case_id": "x", "n_panels": 2, "criteria": "{not json"},
    {"case_id": "x", "n_panels": 2, "criteria": ["Style"]},
])
def test_malformed_criteria_raise(case):
    with pytest.raises(CriteriaFormatError):
        vc_questions(case)


@pytest.mark.parametrize("case", [{"n_panels": 2, "criteria": {}}, {"case_id": "", "n_panels": 2},
                                  {"case_id": "x", "n_panels": -1}, {"case_id": "x"}, "x"])
def test_malformed_cases_raise(case):
    with pytest.raises(T2ISBenchError):
        vc_questions(case)


def test_repeated_case_id_raises():
    with pytest.raises(T2ISBenchError, match="twice"):
        aggregate_vc([CASES[2], CASES[2]], [])


# --------------------------------------------------------------------------------------------
# PA
# --------------------------------------------------------------------------------------------

PA_CASES = [
    {"case_id": "p", "n_panels": 1, "alignment": [
        {"Entity": ["e1", "e2"], "Attribute": ["a1"], "Relation": ["r1"]}]},
    {"case_id": "q", "n_panels": 3, "alignment": [
        {"Entity": ["e"], "Attribute": ["a"], "Relation": ["r"]}] * 4},  # panel 3 has no image
    {"case_id": "r", "n_panels": 2},  # no PA criteria
]


def test_pa_is_panel_weighted_and_skips_missing_images():
    vals = {("p", 0, "Entity", 0): 1.0, ("p", 0, "Entity", 1): 0.5, ("p", 0, "Attribute", 0): 1.0,
            ("p", 0, "Relation", 0): 1.0}
    qs = [q for c in PA_CASES for q in pa_questions(c)]
    assert len(qs) == 4 + 3 * 3
    r = aggregate_pa(PA_CASES, _scored(qs, lambda q: vals.get(
        (q["case_id"], q["panel"], q["dimension"], q["criterion_index"]), 0.25)))
    assert r["panels"][("p", 0)] == {"Entity": 0.75, "Attribute": 1.0, "Relation": 1.0}
    # 4 panels: p's one and q's three (a case mean would give (0.75 + 0.25) / 2 = 0.5)
    assert r["entity"] == (0.75 + 3 * 0.25) / 4
    assert r["attribute"] == r["relation"] == (1.0 + 3 * 0.25) / 4
    assert r["pa"] == (r["entity"] + r["attribute"] + r["relation"]) / 3
    assert r["n_panels"] == 4
    assert r["skipped_panels"] == [{"case_id": "q", "panel": 3, "reason": "no image"}]
    assert r["cases_without_alignment"] == ["r"]


def test_pa_bad_inputs_raise():
    qs = [q for c in PA_CASES for q in pa_questions(c)]
    with pytest.raises(ScoreError):
        aggregate_pa(PA_CASES, _scored(qs[1:], lambda q: 0.5))
    with pytest.raises(ScoreError):
        aggregate_pa(PA_CASES, _scored(qs, lambda q: -0.1))
    with pytest.raises(CriteriaFormatError):  # the official code divides by len([]) here
        pa_questions({"case_id": "x", "n_panels": 1,
                      "alignment": [{"Entity": [], "Attribute": ["a"], "Relation": ["r"]}]})
    with pytest.raises(CriteriaFormatError):
        pa_questions({"case_id": "x", "n_panels": 1, "alignment": [{"Entity": ["e"]}]})
    assert aggregate_pa([PA_CASES[2]], [])["pa"] is None


# --------------------------------------------------------------------------------------------
# Avg
# --------------------------------------------------------------------------------------------


def test_avg_formula_by_hand():
    # 0.2 * 0.5 + 0.3 * mean(0.6, 0.7, 0.8) + 0.5 * mean(0.4, 0.5, 0.6) = 0.1 + 0.21 + 0.25
    got = t2is_avg(0.5, entity=0.6, attribute=0.7, relation=0.8, identity=0.4, style=0.5, logic=0.6)
    assert got == pytest.approx(0.56, abs=1e-12)
    assert t2is_avg(None, entity=0.6, attribute=0.7, relation=0.8, identity=0.4, style=0.5,
                    logic=0.6) is None
    with pytest.raises(ScoreError):
        t2is_avg(5.3, entity=0.6, attribute=0.7, relation=0.8, identity=0.4, style=0.5, logic=0.6)


def test_metrics_entry_never_invents_aesthetics():
    vc = aggregate_vc(CASES, _hand_scores())
    m = t2is_metrics(vc)
    assert m["aesthetics"] is None and m["avg"] is None and m["pa"] is None
    assert m["vc"] == vc["vc"]
    pa = {"entity": 0.5, "attribute": 0.5, "relation": 0.5, "pa": 0.5}
    m = t2is_metrics(vc, pa, aesthetics=0.5)
    assert m["avg"] == pytest.approx(0.2 * 0.5 + 0.3 * 0.5 + 0.5 * vc["vc"], abs=1e-12)


# --------------------------------------------------------------------------------------------
# panels
# --------------------------------------------------------------------------------------------


def _grid(rows, cols, cw=16, ch=12, extra=(0, 0)):
    img = Image.new("RGB", (cols * cw + extra[0], rows * ch + extra[1]), (255, 255, 255))
    for r in range(rows):
        for c in range(cols):
            img.paste((10 + 30 * r, 20 + 25 * c, 200), (c * cw, r * ch, (c + 1) * cw, (r + 1) * ch))
    return img


@pytest.mark.parametrize("layout", ["1x2", "1x3", "2x2", "2x3", "1x4", "2x4"])
def test_cut_panels_row_major(layout):
    rows, cols = (int(v) for v in layout.split("x"))
    panels = cut_panels(_grid(rows, cols, extra=(cols - 1, rows - 1)), layout)  # remainder dropped
    assert len(panels) == rows * cols
    for k, p in enumerate(panels):
        r, c = divmod(k, cols)
        assert p.size == (16, 12)
        assert p.getcolors() == [(16 * 12, (10 + 30 * r, 20 + 25 * c, 200))]


def test_cut_panels_bad_input():
    with pytest.raises(T2ISBenchError):
        cut_panels(_grid(2, 2), "2by2")
    with pytest.raises(T2ISBenchError):
        cut_panels(_grid(2, 2), "1x1")
    with pytest.raises(T2ISBenchError):
        cut_panels("not an image", "2x2")
    assert len(cut_panels(_grid(2, 2), (2, 2))) == 4


def test_resize_for_vc_is_qwen_rounded_bicubic_rgb():
    assert vc_image_side() == 504 and vc_image_side(512, None) == 512
    img = Image.new("RGBA", (512, 512), (1, 2, 3, 4))
    img.paste((250, 0, 0, 255), (0, 0, 100, 512))
    out = resize_for_vc(img)
    assert out.mode == "RGB" and out.size == (504, 504)
    ref = img.convert("RGB").resize((504, 504), Image.Resampling.BICUBIC)
    assert out.tobytes() == ref.tobytes()
    assert resize_for_vc(img, side=512).size == (512, 512)


# --------------------------------------------------------------------------------------------
# official layout and files
# --------------------------------------------------------------------------------------------


def test_official_layout_is_what_the_official_scripts_read(tmp_path):
    panels = cut_panels(_grid(2, 3), "2x3")
    paths = write_official_layout(panels, "0001_0003", tmp_path)
    assert [p.name for p in paths] == [f"0001_0003_{k:04d}.png" for k in range(6)]
    # test_prompt_consistency.py:82-92: prefix + extension, sorted by the last number
    found = sorted((int(f.split("_")[-1].replace(".png", "")), f) for f in os.listdir(tmp_path)
                   if f.startswith("0001_0003") and f.endswith(".png"))
    assert [f for _, f in found] == [p.name for p in paths]
    # vqa_alignment.py:15,65 with --start_idx 0 (run_prompt_alignment.sh)
    assert (tmp_path / f"0001_0003_{0:04d}.png").is_file()
    assert Image.open(paths[4]).getcolors() == panels[4].getcolors()
    assert official_file_name("x", 2, start=1) == "x_0003.png"


def test_official_layout_bad_inputs(tmp_path):
    with pytest.raises(OfficialLayoutError):
        write_official_layout([Image.new("RGB", (2, 2))], "../evil", tmp_path)
    with pytest.raises(OfficialLayoutError):
        write_official_layout([], "ok", tmp_path)
    with pytest.raises(OfficialLayoutError):
        write_official_layout(["nope"], "ok", tmp_path)
    with pytest.raises(OfficialLayoutError, match="prefix"):
        check_official_case_ids(["t2is-10", "t2is-1", "t2is-2"])
    check_official_case_ids(["0001_0001", "0001_0002"])


def _official_files(tmp_path):
    dataset = {"0001_0001": {"task_name_case_id": "multi_view_0001", "output_image_count": 3},
               "0001_0002": {"task_name_case_id": "multi_view_0002", "output_image_count": 2},
               "0001_0003": {"task_name_case_id": "multi_view_0003", "output_image_count": 2}}
    consistency = {
        "0001_0001": {"Style": [{"Tone": "Same tone."}, {"Ignored": "x"}],
                      "Identity": [{"Face": "Same face.", "Hat": None}]},
        "0001_0002": {"Logic": [{"Order": "Steps in order."}], "Surroundings": [{"Room": "Same room."}]},
    }
    alignment = {"0001_0001": {"1": {"Entity": ["a cat"], "Attribute": ["grey"], "Relation": ["on a mat"]},
                               "2": {"Entity": ["a cat"], "Attribute": ["grey"], "Relation": ["on a sofa"]},
                               "3": {"Entity": ["a cat"], "Attribute": ["grey"], "Relation": ["on a bed"]}}}
    paths = []
    for name, obj in (("T2IS-Bench.json", dataset), ("prompt_consistency.json", consistency),
                      ("prompt_alignment.json", alignment)):
        (tmp_path / name).write_text(json.dumps(obj))
        paths.append(tmp_path / name)
    return paths


def test_load_official_bench(tmp_path):
    cases, report = load_official_bench(*_official_files(tmp_path))
    assert [c["case_id"] for c in cases] == ["0001_0001", "0001_0002", "0001_0003"]
    a, b, c = cases
    assert a["criteria"] == {"Style": {"Tone": "Same tone."}, "Identity": {"Face": "Same face."}}
    assert a["n_panels"] == 3 and len(a["alignment"]) == 3
    assert report["ignored_extra_objects"] == [{"case_id": "0001_0001", "dimension": "Style", "count": 1}]
    assert report["dropped_criteria"] == [{"case_id": "0001_0001", "dimension": "Identity", "criterion": "Hat"}]
    assert c["criteria"] == {}
    qs = [q for case in cases for q in vc_questions(case)]
    r = aggregate_vc(cases, _scored(qs, lambda q: 0.5))
    assert r["skipped"] == [{"case_id": "0001_0003", "reason": "no criteria"}]
    assert r["extra_dimensions"]["Surroundings"]["n_cases"] == 1
    assert r["logic"] == 0.5 and r["vc"] == 0.5
    # round trip through the official layouts
    cases2, _ = load_official_bench(*to_official_json(cases))
    assert [(x["case_id"], x["n_panels"], x["criteria"], x["alignment"]) for x in cases2] == \
        [(x["case_id"], x["n_panels"], x["criteria"], x["alignment"]) for x in cases]


@pytest.mark.parametrize("which,content", [
    (0, "{broken"), (0, json.dumps({"x": {"output_image_count": "3"}})),
    (1, json.dumps({"0001_0001": {"Style": {"Tone": "t"}}})),
    (1, json.dumps({"0001_0001": {"Style": []}})),
    (2, json.dumps({"0001_0001": ["a cat"]})), (2, json.dumps([1, 2])),
])
def test_load_official_bench_malformed(tmp_path, which, content):
    paths = _official_files(tmp_path)
    paths[which].write_text(content)
    with pytest.raises(CriteriaFormatError):
        load_official_bench(*paths)


def test_missing_official_file_raises(tmp_path):
    with pytest.raises(CriteriaFormatError, match="cannot read"):
        load_official_bench(tmp_path / "none.json", {})


# --------------------------------------------------------------------------------------------
# the project's own prompt file
# --------------------------------------------------------------------------------------------


def test_cases_from_the_shipped_prompt_file():
    from paco.data.prompts import read_t2is_jsonl

    table = read_t2is_jsonl(ROOT / "data" / "raw" / "t2is_prompts.jsonl")
    cases = [case_from_prompt_row(row) for _, row in table.iterrows()]
    first = cases[0]
    assert first["case_id"] == table.iloc[0]["prompt_id"] and first["n_panels"] == 4
    n_crit = sum(len(v) for v in json.loads(table.iloc[0]["criteria"]).values())
    assert len(vc_questions(first)) == n_crit * math.comb(4, 2)
    raw = json.loads((ROOT / "data" / "raw" / "t2is_prompts.jsonl").read_text().splitlines()[0])
    from_raw = case_from_prompt_row(raw, case_id="x")
    assert from_raw["criteria"] == first["criteria"] and from_raw["n_panels"] == 4
    with pytest.raises(T2ISBenchError):
        case_from_prompt_row({"prompt_id": "y", "criteria": {}})


def test_lora_minus_base_of_a_dimension_is_over_the_cases_that_have_it():
    """score_t2is's paired tests: a dimension's mean_diff is lora.dim - base.dim over the cases with
    a criterion of it (a case lacking it is not a 0 in the test), while VC pairs every case."""
    import hashlib

    import numpy as np
    import pandas as pd

    from paco.benchmark.t2is_run import plan_t2is, score_t2is
    from paco.core.io import encode_image

    crits = {"p1": {"Identity": {"Face": "same face"}, "Style": {"Light": "same light", "Tone": "same tone"}},
             "p2": {"Style": {"Light": "same light"}, "Logic": {"Order": "in order"}},
             "p3": {"Style": {"Light": "same light"}}}
    prompts = pd.DataFrame([{"prompt_id": p, "rows": 1, "cols": 3, "criteria": json.dumps(c)} for p, c in crits.items()])
    grid = encode_image(Image.new("RGB", (96, 32), (10, 20, 30)))
    samples = pd.DataFrame([{"sample_id": f"{p}-{v}", "prompt_id": p, "seed": 0, "variant": v, "image": grid}
                            for p in crits for v in ("base", "lora")])
    plan = plan_t2is(samples, prompts, seeds_per_prompt=None, max_prompts=None, prompt_alignment="none")

    def rule(q):  # a P(Yes) in [0, 1) from the question's identity
        key = f"{q['case_id']}|{q['variant']}|{q['dimension']}|{q['criterion']}|{q['panels']}"
        return hashlib.sha256(key.encode()).digest()[0] / 256

    answers = {"ev": [rule(q) for q in plan.questions]}
    _, metrics, _ = score_t2is(plan, answers, prompt_alignment="none")
    # by hand: per criterion the mean over the 3 pairs, per dimension the mean over its criteria
    dim = {}
    for q in plan.questions:
        dim.setdefault((q["case_id"], q["variant"], q["dimension"]), {}).setdefault(q["criterion"], []).append(rule(q))
    value = {k: float(np.mean([np.mean(v) for v in crit.values()])) for k, crit in dim.items()}
    cases = sorted({q["case_id"] for q in plan.questions})
    pairs = metrics["lora_minus_base"]["ev"]
    for d, n in (("Identity", 1), ("Style", 3), ("Logic", 1)):
        diffs = [value[c, "lora", d] - value[c, "base", d] for c in cases if (c, "base", d) in value]
        assert pairs[d.lower()]["n"] == n == len(diffs)
        assert pairs[d.lower()]["mean_diff"] == pytest.approx(float(np.mean(diffs)), abs=1e-12)
    # VC per case: the mean of the three dimensions, a lacking one counted 0 (official per-case score)
    vc = {(c, v): sum(value.get((c, v, d), 0.0) for d in ("Identity", "Style", "Logic")) / 3
          for c in cases for v in ("base", "lora")}
    assert pairs["vc"]["n"] == 3
    assert pairs["vc"]["mean_diff"] == pytest.approx(float(np.mean([vc[c, "lora"] - vc[c, "base"] for c in cases])),
                                                     abs=1e-12)
