"""paco.data.t2is_bench_import: T2IS-Bench's three official files (+ grid prompts) -> the prompts
jsonl -> prompts.parquet rows with criteria and alignment -> the benchmark's PA questions.

The official-format files here are hand-made in the layouts the official scripts read
(chengyou-jia/T2IS T2IS_Eval/test_prompt_consistency.py, vqa_alignment.py); the expected rows are
written out by hand from them."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from PIL import Image

from paco.core.io import encode_image, read_parquet, write_parquet
from paco.data import prompts as P
from paco.data.panel_prompts import PromptFormatError
from paco.data.t2is_bench_import import (LAYOUT_OF_COUNT, T2ISBenchImportError, convert, layout_for_count,
                                         main, write_jsonl)

GRID = [
    {"idx": "0000", "original_idx": "0001_0001", "layout": "1x3", "height": 512, "width": 1536,
     "category": "Character Generation", "task_name": "Multi-Scenario", "theme": "A barber at work.",
     "prompt": "THREE-PANEL Images with a 1x3 grid layout a barber. [LEFT]:cutting hair. "
               "[MIDDLE]:trimming a beard. [RIGHT]:sweeping the floor.",
     "criteria": {"Style": {"ignored": "the grid file's criteria are not used"}},
     "editing_prompts": ["a barber cutting hair", "make him trim a beard", "make him sweep"]},
    {"idx": "0001", "original_idx": "0004_0002", "layout": "2x2", "theme": "",
     "prompt": "FOUR-PANEL Images with a 2x2 grid layout a fox. [TOP-LEFT]:front. [TOP-RIGHT]:back. "
               "[BOTTOM-LEFT]:left. [BOTTOM-RIGHT]:right.",
     "criteria": {"Identity": {"x": "y"}}},
    {"idx": "0002", "original_idx": "9999_0001", "layout": "1x2", "theme": "", "prompt": "p",
     "criteria": {"Style": {"x": "y"}}},  # not in the bench: reported, not written
]
BENCH = {"0001_0001": {"task_name_case_id": "dynamic_character_scenario_design_0001", "output_image_count": 3},
         "0004_0002": {"task_name_case_id": "multi_view_0002", "output_image_count": 4}}
CONSISTENCY = {
    "0001_0001": {"Identity": [{"Face": "The barber's face is the same.", "Gone": None}],
                  "Style": [{"Palette": "The colours match."}, {"Second": "ignored by the official code"}]},
    "0004_0002": {"Identity": [{"Fur": "The fox's fur is the same."}], "Logic": [{"Empty": "  "}]},
}
ALIGNMENT = {"0001_0001": {"1": {"Entity": ["a barber", "clippers"], "Attribute": ["black apron"],
                                 "Relation": ["barber cutting hair"]},
                           "2": {"Entity": ["scissors"], "Attribute": ["silver scissors"],
                                 "Relation": ["barber trimming a beard"], "prompt": "extra key, left out"},
                           "3": {"Entity": ["dustpan"], "Attribute": ["clean towels"],
                                 "Relation": ["hair in the dustpan"]}}}

EXPECTED_CRITERIA = {
    "t2is-0001_0001": {"Identity": {"Face": "The barber's face is the same."},
                       "Style": {"Palette": "The colours match."}},
    "t2is-0004_0002": {"Identity": {"Fur": "The fox's fur is the same."}},
}
EXPECTED_ALIGNMENT = [
    {"Entity": ["a barber", "clippers"], "Attribute": ["black apron"], "Relation": ["barber cutting hair"]},
    {"Entity": ["scissors"], "Attribute": ["silver scissors"], "Relation": ["barber trimming a beard"]},
    {"Entity": ["dustpan"], "Attribute": ["clean towels"], "Relation": ["hair in the dustpan"]},
]


def _files(tmp_path, bench=BENCH, consistency=CONSISTENCY, alignment=ALIGNMENT, grid=GRID):
    paths = {}
    for name, obj in (("bench", bench), ("consistency", consistency), ("alignment", alignment)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(obj), encoding="utf-8")
    paths["grid"] = tmp_path / "grid.jsonl"
    paths["grid"].write_text("".join(json.dumps(r) + "\n" for r in grid), encoding="utf-8")
    return paths


def _convert(paths, **kw):
    return convert(paths["bench"], paths["consistency"], paths["grid"], paths["alignment"], **kw)


def test_official_files_to_prompt_rows_with_criteria_and_alignment(tmp_path):
    paths = _files(tmp_path)
    records, report = _convert(paths)
    assert [r["idx"] for r in records] == ["0001_0001", "0004_0002"]
    assert report["written"] == 2 and report["cases"] == 2 and report["skipped"] == []
    assert report["dropped_criteria"] == [{"case_id": "0001_0001", "dimension": "Identity", "criterion": "Gone"},
                                          {"case_id": "0004_0002", "dimension": "Logic", "criterion": "Empty"}]
    assert report["dropped_dimensions"] == [{"case_id": "0004_0002", "dimension": "Logic"}]
    assert report["ignored_extra_objects"] == [{"case_id": "0001_0001", "dimension": "Style", "count": 1}]
    assert report["ignored_alignment_keys"] == [{"case_id": "0001_0001", "sub_id": "2", "keys": ["prompt"]}]
    assert report["cases_without_alignment"] == ["0004_0002"]
    assert report["grid_rows_not_in_bench"] == ["9999_0001"]

    write_jsonl(records, tmp_path / "out" / "T2IS-Bench.jsonl")
    res = P.read_t2is_jsonl_report(tmp_path / "out" / "T2IS-Bench.jsonl", strict=True)
    df = res.table
    assert list(df.columns) == P.PROMPT_COLUMNS + ["alignment"]
    assert df["prompt_id"].tolist() == ["t2is-0001_0001", "t2is-0004_0002"]
    assert df[["rows", "cols", "height", "width"]].values.tolist() == [[1, 3, 512, 1536], [2, 2, 1024, 1024]]
    assert df["category"].tolist() == ["Character Generation", "Character Generation"]
    assert df["task_name"].tolist() == ["Multi-Scenario", "Multi-view"]
    assert df["theme"].tolist() == ["A barber at work.", ""]
    assert df["panel_prompts"][0] == ["cutting hair.", "trimming a beard.", "sweeping the floor."]
    assert df["editing_prompts"][0] == GRID[0]["editing_prompts"] and df["editing_prompts"][1] is None
    assert {pid: json.loads(c) for pid, c in zip(df["prompt_id"], df["criteria"])} == EXPECTED_CRITERIA
    assert json.loads(df["alignment"][0]) == EXPECTED_ALIGNMENT and df["alignment"][1] is None

    # the column survives the parquet round trip as JSON text / null (pandas reads a null string as NaN)
    write_parquet(tmp_path / "prompts.parquet", df)
    back = read_parquet(tmp_path / "prompts.parquet", required=P.PROMPT_COLUMNS + ["alignment"])
    assert json.loads(back["alignment"][0]) == EXPECTED_ALIGNMENT and pd.isna(back["alignment"][1])


def test_round_trip_through_the_benchmarks_official_files(tmp_path):
    from paco.benchmark.t2is_bench import case_from_prompt_row
    from paco.benchmark.t2is_panels import load_official_bench, to_official_json

    paths = _files(tmp_path)
    records, _ = _convert(paths)
    write_jsonl(records, tmp_path / "T2IS-Bench.jsonl")
    df = P.read_t2is_jsonl(tmp_path / "T2IS-Bench.jsonl")
    cases = []
    for row in df.to_dict("records"):
        case = case_from_prompt_row({**row, "alignment": row["alignment"] and json.loads(row["alignment"])},
                                    case_id=row["prompt_id"].removeprefix("t2is-"))
        cases.append({**case, "task_name_case_id": BENCH[case["case_id"]]["task_name_case_id"]})
    dataset, consistency, alignment = to_official_json(cases)
    assert dataset == BENCH
    assert consistency == {"0001_0001": {"Identity": [{"Face": "The barber's face is the same."}],
                                         "Style": [{"Palette": "The colours match."}]},
                           "0004_0002": {"Identity": [{"Fur": "The fox's fur is the same."}]}}
    assert alignment == {"0001_0001": {f"{k:04d}": e for k, e in enumerate(EXPECTED_ALIGNMENT)}}
    # the benchmark's own reader of the official files agrees with what the converter kept
    # (load_official_bench keeps a sub-entry's other keys, which its PA questions never read)
    official, _ = load_official_bench(paths["bench"], paths["consistency"], paths["alignment"])

    def pa_only(alignment):
        return None if alignment is None else [{d: e[d] for d in P.PA_DIMENSIONS} for e in alignment]

    assert [(c["case_id"], c["n_panels"], c["criteria"], pa_only(c["alignment"])) for c in official] == [
        (c["case_id"], c["n_panels"], c["criteria"], c["alignment"]) for c in cases]


def test_the_benchmark_plans_pa_questions_from_the_converted_table(tmp_path):
    from paco.benchmark.t2is_bench import PA_QUESTION
    from paco.benchmark.t2is_run import plan_t2is

    paths = _files(tmp_path)
    records, _ = _convert(paths)
    write_jsonl(records, tmp_path / "T2IS-Bench.jsonl")
    prompts = P.read_t2is_jsonl(tmp_path / "T2IS-Bench.jsonl")
    samples = []
    for pid, (w, h) in (("t2is-0001_0001", (48, 16)), ("t2is-0004_0002", (32, 32))):
        for v in ("base", "lora"):
            samples.append({"sample_id": f"{pid}-s0-{v}", "prompt_id": pid, "seed": 0, "variant": v,
                            "image": encode_image(Image.new("RGB", (w, h), (9, 9, 9)))})
    # as the stage reads it: through parquet, where the case without alignment holds a null (NaN) cell
    prompts.to_parquet(tmp_path / "prompts.parquet")
    read_back = pd.read_parquet(tmp_path / "prompts.parquet")
    assert read_back["alignment"].isna().sum() == 1
    plan = plan_t2is(pd.DataFrame(samples), read_back, seeds_per_prompt=None, max_prompts=None,
                     prompt_alignment="yes_no")
    in_memory = plan_t2is(pd.DataFrame(samples), prompts, seeds_per_prompt=None, max_prompts=None,
                          prompt_alignment="yes_no")
    assert plan.questions == in_memory.questions
    pa = [q for q in plan.questions if q["protocol"] == "pa"]
    want = [(k, dim, text) for k, e in enumerate(EXPECTED_ALIGNMENT) for dim in ("Entity", "Attribute", "Relation")
            for text in e[dim]]
    assert len(want) == 10
    for v in ("base", "lora"):
        got = [(q["panels"][0], q["dimension"], q["criterion"]) for q in pa if q["variant"] == v]
        assert got == want  # only the case with alignment is asked, panel by panel
    assert {q["question"] for q in pa} == {PA_QUESTION.format(t) for _, _, t in want}
    assert all(q["case_id"].startswith("t2is-0001_0001") for q in pa)


def test_layout_rule_and_grid_rows_without_layout(tmp_path):
    assert layout_for_count(5) == (1, 5) and layout_for_count(8) == (2, 4)
    assert sorted(LAYOUT_OF_COUNT) == list(range(2, 9))
    for bad in (1, 9, "4", True):
        with pytest.raises(T2ISBenchImportError, match="no T2IS-Bench layout"):
            layout_for_count(bad)
    grid = [{k: v for k, v in GRID[1].items() if k != "layout"}]
    records, _ = _convert(_files(tmp_path, grid=grid, bench={"0004_0002": BENCH["0004_0002"]}, alignment={}))
    assert (records[0]["layout"], records[0]["height"], records[0]["width"]) == ("2x2", 1024, 1024)


@pytest.mark.parametrize("change, message", [
    (lambda b, c, a, g: b["0004_0002"].pop("output_image_count"), r"'0004_0002'\]: output_image_count must be"),
    (lambda b, c, a, g: b["0004_0002"].update(output_image_count=6), "layout 2x2 has 4 panels, output_image_count is 6"),
    (lambda b, c, a, g: c.pop("0004_0002"), "'0004_0002': not in prompt_consistency.json"),
    (lambda b, c, a, g: c.update({"0004_0002": {"Logic": [{"x": None}]}}), "no consistency criterion with text"),
    (lambda b, c, a, g: a["0001_0001"]["1"].update(Entity="a barber"), r"'alignment'\[0\]\['Entity'\] must be a non-empty list"),
    (lambda b, c, a, g: a["0001_0001"]["1"].pop("Relation"), r"lacks \['Relation'\]"),
    (lambda b, c, a, g: a["0001_0001"].pop("3"), "'alignment' has 2 entries, the layout has 3 panels"),
    (lambda b, c, a, g: a["0001_0001"].update({"4": dict(a["0001_0001"]["3"])}), "'alignment' has 4 entries"),
    (lambda b, c, a, g: g.pop(0), "'0001_0001': no grid-prompt row"),
    (lambda b, c, a, g: g[0].update(height=1024), "grid-prompt height 1024 != 512"),
    (lambda b, c, a, g: g[0].update(task_name="Multi-view"), "grid-prompt task_name 'Multi-view' != 'Multi-Scenario'"),
    (lambda b, c, a, g: g[0].update(prompt="no tags at all"), r"'0001_0001': found 0 panel tag\(s\), layout 1x3 needs 3"),
    (lambda b, c, a, g: b.update({"0099_0001": {"output_image_count": 2}}) or g.append(
        {"original_idx": "0099_0001", "layout": "1x2", "prompt": "x"}), "unknown T2IS-Bench task id '0099'"),
])
def test_bad_cases_are_named_and_skippable(tmp_path, change, message):
    b, c, a, g = (json.loads(json.dumps(x)) for x in (BENCH, CONSISTENCY, ALIGNMENT, GRID))
    change(b, c, a, g)
    paths = _files(tmp_path, b, c, a, g)
    with pytest.raises(T2ISBenchImportError, match=message):
        _convert(paths)
    records, report = _convert(paths, allow_skips=True)
    assert len(report["skipped"]) == 1 and len(records) == len(b) - 1
    assert report["written"] + len(report["skipped"]) == report["cases"] == len(b)


def test_file_level_errors(tmp_path):
    paths = _files(tmp_path, alignment={**ALIGNMENT, "0002_0001": ALIGNMENT["0001_0001"]})
    with pytest.raises(T2ISBenchImportError, match=r"prompt_alignment.json has 1 case\(s\) not in T2IS-Bench.json: \['0002_0001'\]"):
        _convert(paths, allow_skips=True)
    paths = _files(tmp_path, bench=[1, 2])
    with pytest.raises(T2ISBenchImportError, match="T2IS-Bench.json: .* must be a JSON object keyed by case id"):
        _convert(paths)
    paths = _files(tmp_path)
    paths["consistency"].write_text("{not json", encoding="utf-8")
    with pytest.raises(T2ISBenchImportError, match="prompt_consistency.json: .* is not valid JSON"):
        _convert(paths)
    paths = _files(tmp_path, grid=[GRID[0], GRID[0]])
    with pytest.raises(T2ISBenchImportError, match="original_idx '0001_0001' repeats"):
        _convert(paths)
    with pytest.raises(T2ISBenchImportError, match="no case could be converted"):
        _convert(_files(tmp_path, grid=[GRID[2]]), allow_skips=True)


def test_command_line(tmp_path, capsys):
    paths = _files(tmp_path)
    argv = ["--bench", str(paths["bench"]), "--consistency", str(paths["consistency"]), "--alignment",
            str(paths["alignment"]), "--grid-prompts", str(paths["grid"]), "--out", str(tmp_path / "o.jsonl"),
            "--report", str(tmp_path / "report.json")]
    assert main(argv) == 0
    assert [json.loads(line)["idx"] for line in (tmp_path / "o.jsonl").read_text().splitlines()] == ["0001_0001", "0004_0002"]
    assert json.loads((tmp_path / "report.json").read_text())["written"] == 2
    assert "wrote 2 of 2 cases" in capsys.readouterr().err
    paths["bench"].write_text(json.dumps({"0001_0001": {}}), encoding="utf-8")
    assert main(argv) == 2
    assert "output_image_count must be an int" in capsys.readouterr().err


def test_prompt_parser_alignment_field(tmp_path):
    base = {k: v for k, v in GRID[0].items() if k not in ("original_idx",)}
    base["criteria"] = {"Style": {"a": "b"}}
    rows = [{**base, "alignment": EXPECTED_ALIGNMENT}, {**base, "idx": "0001", "alignment": None}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    df = P.read_t2is_jsonl(tmp_path / "p.jsonl")
    assert json.loads(df["alignment"][0]) == EXPECTED_ALIGNMENT and df["alignment"][1] is None
    assert P.parse_alignment(json.dumps(EXPECTED_ALIGNMENT), 3) == json.dumps(EXPECTED_ALIGNMENT, sort_keys=True)
    bad = [
        ("a string", "'alignment' is not valid JSON"),
        ({"Entity": ["x"]}, "'alignment' must be a list"),
        (EXPECTED_ALIGNMENT[:2], "'alignment' has 2 entries, the layout has 3 panels"),
        ([EXPECTED_ALIGNMENT[0], EXPECTED_ALIGNMENT[1], {"Entity": ["x"], "Attribute": ["y"]}], r"'alignment'\[2\] must be an object"),
        ([EXPECTED_ALIGNMENT[0], EXPECTED_ALIGNMENT[1], {**EXPECTED_ALIGNMENT[2], "Extra": ["z"]}], "exactly the keys"),
        ([EXPECTED_ALIGNMENT[0], EXPECTED_ALIGNMENT[1], {**EXPECTED_ALIGNMENT[2], "Relation": []}], r"\[2\]\['Relation'\] must be a non-empty list"),
        ([EXPECTED_ALIGNMENT[0], EXPECTED_ALIGNMENT[1], {**EXPECTED_ALIGNMENT[2], "Entity": ["ok", " "]}], r"\[2\]\['Entity'\]"),
    ]
    for value, message in bad:
        (tmp_path / "bad.jsonl").write_text(json.dumps({**base, "alignment": value}) + "\n", encoding="utf-8")
        with pytest.raises(PromptFormatError, match=message) as e:
            P.read_t2is_jsonl(tmp_path / "bad.jsonl")
        assert e.value.line == 1
    # a set without alignment keeps exactly the old columns (the default's prompts.parquet bytes)
    (tmp_path / "none.jsonl").write_text(json.dumps(base) + "\n", encoding="utf-8")
    assert list(P.read_t2is_jsonl(tmp_path / "none.jsonl").columns) == P.PROMPT_COLUMNS


def test_the_two_readers_of_the_official_files_share_the_reading_and_differ_on_missing_criteria(tmp_path):
    """paco.data.t2is_bench_files reads the files for both the importer and the benchmark's
    load_official_bench, each with its own error class. A case missing from
    prompt_consistency.json: the importer refuses it (a row needs VC criteria), the benchmark
    keeps it with criteria {} (VC skips it, PA still scores its alignment)."""
    from paco.benchmark.t2is_bench import CriteriaFormatError
    from paco.benchmark.t2is_panels import load_official_bench
    from paco.data.t2is_bench_files import T2ISBenchFileError, load_official_json, official_criteria

    consistency = {k: v for k, v in CONSISTENCY.items() if k != "0001_0001"}
    paths = _files(tmp_path, consistency=consistency)
    with pytest.raises(T2ISBenchImportError, match="'0001_0001': not in prompt_consistency.json"):
        _convert(paths)
    cases, report = load_official_bench(paths["bench"], paths["consistency"], paths["alignment"])
    assert [(c["case_id"], c["criteria"], c["alignment"] is None) for c in cases] == [
        ("0001_0001", {}, False), ("0004_0002", EXPECTED_CRITERIA["t2is-0004_0002"], True)]
    assert report["dropped_dimensions"] == [{"case_id": "0004_0002", "dimension": "Logic"}]
    assert report["dropped_criteria"] == [{"case_id": "0004_0002", "dimension": "Logic", "criterion": "Empty"}]
    # the shared reading itself: first object only, null / blank dropped and listed; a BOM is read
    report = {"dropped_criteria": [], "dropped_dimensions": [], "ignored_extra_objects": []}
    assert official_criteria("0001_0001", CONSISTENCY["0001_0001"], report) == \
        EXPECTED_CRITERIA["t2is-0001_0001"]
    assert report == {"dropped_criteria": [{"case_id": "0001_0001", "dimension": "Identity", "criterion": "Gone"}],
                      "dropped_dimensions": [],
                      "ignored_extra_objects": [{"case_id": "0001_0001", "dimension": "Style", "count": 1}]}
    (tmp_path / "bom.json").write_text("\ufeff" + json.dumps(BENCH), encoding="utf-8")
    assert load_official_json(tmp_path / "bom.json", "T2IS-Bench.json") == BENCH
    # each caller's error class, same message
    bad = {"0001_0001": {"Style": [{"Tone": 3}]}}
    for error in (T2ISBenchFileError, T2ISBenchImportError, CriteriaFormatError):
        with pytest.raises(error, match=r"prompt_consistency\['0001_0001'\]\['Style'\]\['Tone'\] must be a string"):
            official_criteria("0001_0001", bad["0001_0001"], report, error=error)
    with pytest.raises(CriteriaFormatError, match=r"\['Style'\]\['Tone'\] must be a string"):
        load_official_bench(BENCH, bad)
    with pytest.raises(T2ISBenchFileError, match="prompt_alignment.json: must be a JSON object keyed by case id"):
        load_official_json([1], "prompt_alignment.json")
