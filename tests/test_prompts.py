"""paco.data.prompts: T2IS jsonl parsing, malformed rows, the split, the shipped set (the panel tags:
tests/test_panel_prompts.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from paco.data import prompts as P
from paco.core.io import ArtifactError, read_parquet, write_parquet
from paco.data.panel_prompts import PromptFormatError

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "data" / "raw" / "t2is_prompts.jsonl"

TAGS_2X2 = ["[TOP]-[LEFT]", "[TOP]-[RIGHT]", "[BOTTOM]-[LEFT]", "[BOTTOM]-[RIGHT]"]


def grid(tags: list[str], head: str = "FOUR-PANEL Images of a cat.") -> str:
    """A grid prompt whose k-th tag (in the given list order) carries text 'p<k>'."""
    return head + " " + " ".join(f"{t}:p{k} text." for k, t in enumerate(tags))


_DROP = object()  # record(key=_DROP) leaves the key out


def record(**over) -> dict:
    rec = {
        "idx": 1,
        "prompt": grid(TAGS_2X2, "FOUR-PANEL Images with a 2x2 grid layout of a tabby cat."),
        "height": 1024,
        "width": 1024,
        "layout": "2x2",
        "theme": "Four pictures of a cat.",
        "category": "Character Generation",
        "task_name": "Multi-pose",
        "criteria": {"Style": {"b": "style text"}, "Identity": {"a": "identity text"},
                     "Logic": {"c": "logic text"}},
    }
    rec.update(over)
    return {k: v for k, v in rec.items() if v is not _DROP}


def write_jsonl(path: Path, rows: list) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------
# reading files
# --------------------------------------------------------------------------------------------


def test_read_columns_types_and_values(tmp_path):
    rows = [
        record(),
        record(idx="0002", layout="1x3", height=512, width=1536, split="test",
               subject="cat", editing_prompts=["a", "b", "c"],
               prompt="THREE-PANEL Images with a 1x3 grid layout of a cat. [RIGHT]: r "
                      "[LEFT]: l [MIDDLE]: m"),
        record(idx="My Set/7", prompt=grid(TAGS_2X2), split="train"),
    ]
    df = P.read_t2is_jsonl(write_jsonl(tmp_path / "p.jsonl", rows))
    assert list(df.columns) == P.PROMPT_COLUMNS
    assert df["prompt_id"].tolist() == ["t2is-0001", "t2is-0002", "t2is-my-set-7"]
    assert df["split"].tolist() == [None, "test", "train"]
    assert df["subject"].tolist() == [None, "cat", None]
    assert df.loc[0, "editing_prompts"] is None
    assert df.loc[1, "editing_prompts"] == ["a", "b", "c"]
    assert df.loc[1, "panel_prompts"] == ["l", "m", "r"]
    assert df.loc[1, "global_prompt"] == "THREE-PANEL Images with a 1x3 grid layout of a cat."
    assert (df.loc[1, "rows"], df.loc[1, "cols"]) == (1, 3)
    assert (df.loc[1, "height"], df.loc[1, "width"]) == (512, 1536)
    for c in ("rows", "cols", "height", "width"):
        assert str(df[c].dtype) == "int64"
    crit = df.loc[0, "criteria"]
    assert isinstance(crit, str)
    assert list(json.loads(crit)) == ["Identity", "Logic", "Style"]  # keys sorted
    assert crit == json.dumps(json.loads(crit), sort_keys=True)
    assert df.loc[0, "category"] == "Character Generation"
    assert df.loc[0, "task_name"] == "Multi-pose"


def test_parquet_round_trip(tmp_path):
    df = P.read_t2is_jsonl(write_jsonl(tmp_path / "p.jsonl", [record(), record(idx=2,
                                       subject="cat", split="test")]))
    write_parquet(tmp_path / "prompts.parquet", df)
    back = read_parquet(tmp_path / "prompts.parquet", required=P.PROMPT_COLUMNS)
    assert back["prompt_id"].tolist() == ["t2is-0001", "t2is-0002"]
    assert list(back.loc[0, "panel_prompts"]) == df.loc[0, "panel_prompts"]
    assert back["split"].isna().tolist() == [True, False]


def test_blank_lines_are_skipped_but_counted(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n" + json.dumps(record()) + "\n   \n" + "{oops\n", encoding="utf-8")
    with pytest.raises(PromptFormatError, match="line 4") as ei:
        P.read_t2is_jsonl(path)
    assert ei.value.line == 4


BAD_ROWS = {
    "bad json": ('{"idx": 3, "prompt": ', "invalid JSON"),
    "not an object": ("[1, 2, 3]", "must be a JSON object"),
    "missing key": (record(layout=_DROP), "missing key.*layout"),
    "missing several": (record(theme=_DROP, criteria=_DROP), "missing key.*theme, criteria"),
    "height is a string": (record(height="1024"), "'height' must be an integer"),
    "width is a float": (record(width=1024.0), "'width' must be an integer"),
    "height is bool": (record(height=True), "'height' must be an integer"),
    "prompt not a string": (record(prompt=["a"]), "'prompt' must be a string"),
    "empty category": (record(category="  "), "'category' is empty"),
    "criteria a list": (record(criteria=["a"]), "'criteria' must be"),
    "criteria inner text": (record(criteria={"Style": {"x": 1}}), r"criteria\['Style'\]\['x'\]"),
    "idx a float": (record(idx=1.5), "idx must be an int or a string"),
    "idx empty": (record(idx="///"), "empty prompt id"),
    "bad layout": (record(layout="2by2"), "bad layout"),
    "layout a list": (record(layout=[2, 2]), "layout must be a string"),
    "single panel": (record(layout="1x1"), "at least 2 panels"),
    "too few panels": (record(prompt=grid(TAGS_2X2[:3])), "found 3 panel tag.*needs 4"),
    "too many panels": (record(layout="1x3", prompt=grid(["[LEFT]", "[MIDDLE]", "[RIGHT]",
                                                          "PANEL-2"])), "duplicate panel"),
    "tag misfit": (record(layout="1x3", prompt=grid(TAGS_2X2)), "'\\[TOP\\]-\\[LEFT\\]:' does "
                   "not fit layout 1x3"),
    "tags for a smaller layout": (record(layout="2x3", prompt=grid(TAGS_2X2)),
                                  "found 4 panel tag.*layout 2x3 needs 6"),
    "duplicate position": (record(prompt=grid(["[TOP]-[LEFT]", "[TOP-LEFT]", "[BOTTOM]-[LEFT]",
                                               "[BOTTOM]-[RIGHT]"])), "duplicate panel position"),
    "zero height": (record(height=0), "'height' must be positive"),
    "negative width": (record(width=-512), "'width' must be positive"),
    "unknown split": (record(split="val"), "unknown split 'val'"),
    "grid text contradicts layout": (
        record(prompt=grid(TAGS_2X2, "FOUR-PANEL Images with a 1x4 grid layout.")),
        "says '1x4 grid' but layout is 2x2"),
    "editing prompts wrong length": (record(editing_prompts=["a", "b"]), "editing_prompts.*2"),
    "editing prompts not strings": (record(editing_prompts=["a", "b", 3, "d"]),
                                    "editing_prompts' must be a list"),
    "subject not a string": (record(subject=7), "'subject' must be a string"),
    "height past int64": (record(height=10**20), r"'height' must be at most 16384 px, got 100000000000000000000"),
    "width too large": (record(width=16385), r"'width' must be at most 16384 px"),
    "number past the digit limit": ('{"idx": ' + "1" * 5000 + "}", "invalid JSON"),
    "nested too deep": ("[" * 100_000, "invalid JSON"),
    "unknown subject": (record(subject="unicorn"),
                        r"'subject': unknown photo subject 'unicorn' \(known subjects: .*'astronaut'"),
}


@pytest.mark.parametrize("kind", list(BAD_ROWS))
def test_malformed_row_raises_with_line_number(tmp_path, kind):
    bad, match = BAD_ROWS[kind]
    rows = [record(idx=10), record(idx=11), bad]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(PromptFormatError, match=match) as ei:
        P.read_t2is_jsonl(path)
    assert ei.value.line == 3
    assert "line 3" in str(ei.value) and str(path) in str(ei.value)
    assert isinstance(ei.value, ValueError)


@pytest.mark.parametrize("dup", [7, "7", "0007", "00007"])
def test_duplicate_ids_are_an_error(tmp_path, dup):
    path = write_jsonl(tmp_path / "p.jsonl", [record(idx=1), record(idx=7), record(idx=dup)])
    with pytest.raises(PromptFormatError, match=r"duplicate prompt_id 't2is-0007' \(first on "
                                                r"line 2\)") as ei:
        P.read_t2is_jsonl(path)
    assert ei.value.line == 3


def test_non_strict_skips_and_reports_every_bad_row(tmp_path):
    kinds = ["bad json", "missing key", "unknown split", "zero height", "too few panels"]
    rows = [record(idx=1)]
    for k in kinds:
        rows.append(BAD_ROWS[k][0])
    rows += [record(idx=2), record(idx=1)]  # a good row, then a duplicate of the first
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    df, skipped = P.read_t2is_jsonl_with_report(path, strict=False)
    assert df["prompt_id"].tolist() == ["t2is-0001", "t2is-0002"]
    assert [s["line"] for s in skipped] == [2, 3, 4, 5, 6, 8]
    for s in skipped:
        assert set(s) == {"line", "reason"} and isinstance(s["reason"], str) and s["reason"]
    assert "duplicate prompt_id" in skipped[-1]["reason"]
    assert "unknown split" in skipped[2]["reason"]
    # the DataFrame-only reader warns instead of dropping silently
    with pytest.warns(UserWarning, match="skipped 6 malformed row"):
        df2 = P.read_t2is_jsonl(path, strict=False)
    assert df2["prompt_id"].tolist() == df["prompt_id"].tolist()
    # strict mode stops at the first one
    with pytest.raises(PromptFormatError, match="line 2"):
        P.read_t2is_jsonl_with_report(path, strict=True)


def test_non_strict_skips_and_counts_a_huge_size_and_an_unknown_subject(tmp_path):
    rows = [record(idx=1), record(idx=2, height=10**20), record(idx=3, subject="unicorn"),
            record(idx=4, subject="cat")]
    df, skipped = P.read_t2is_jsonl_with_report(write_jsonl(tmp_path / "p.jsonl", rows), strict=False)
    assert df["prompt_id"].tolist() == ["t2is-0001", "t2is-0004"]
    assert [s["line"] for s in skipped] == [2, 3]
    assert "'height' must be at most" in skipped[0]["reason"] and "'unicorn'" in skipped[1]["reason"]


def test_strict_report_is_empty(tmp_path):
    df, skipped = P.read_t2is_jsonl_with_report(write_jsonl(tmp_path / "p.jsonl", [record()]))
    assert skipped == [] and len(df) == 1


@pytest.mark.parametrize(
    "idx, pid",
    [(0, "t2is-0000"), (7, "t2is-0007"), (12345, "t2is-12345"), ("0007", "t2is-0007"),
     ("0001_0003", "t2is-0001_0003"), ("  Hello World!  ", "t2is-hello-world"),
     ("a.b-c", "t2is-a.b-c")],
)
def test_prompt_id_from_idx(idx, pid):
    assert P.prompt_id_from_idx(idx) == pid


@pytest.mark.parametrize("idx", [-1, True, None, 1.0, [1], "  ", "!!!"])
def test_prompt_id_rejects(idx):
    with pytest.raises(PromptFormatError):
        P.prompt_id_from_idx(idx)


def test_extra_keys_are_ignored(tmp_path):
    df = P.read_t2is_jsonl(write_jsonl(tmp_path / "p.jsonl",
                                       [record(**{"from": "T2IS", "original_idx": "0001_0001"})]))
    assert list(df.columns) == P.PROMPT_COLUMNS


def test_other_criteria_dimensions_are_kept(tmp_path):
    crit = {"Identity": {"a": "x"}, "Surroundings": {"b": "y"}}
    df = P.read_t2is_jsonl(write_jsonl(tmp_path / "p.jsonl", [record(criteria=crit)]))
    assert json.loads(df.loc[0, "criteria"]) == crit


# --------------------------------------------------------------------------------------------
# encodings, empty sets, null criteria (real T2IS-Bench rows)
# --------------------------------------------------------------------------------------------

#: T2IS-Bench case 0557, verbatim from PaCo-RL's PaCo-GRPO/dataset/T2IS/all/test_metadata.jsonl
#: (commit 08caac6): each criteria dimension carries an ``"image": null`` criterion.
T2IS_0557 = (
    '{"idx": "0557", "prompt": "THREE-PANEL Images with a 1x3 grid layout highlighting Amsterda'
    "m's iconic landmarks with cultural and historical significance.All images use a realistic "
    'style with vibrant colors, focusing on architectural details and lively surroundings to em'
    "phasize Amsterdam's charm. Each scene incorporates water elements, reflecting the city\\u20"
    '19s canal-centric identity. [LEFT]:A historic canal-side building with ornate gabled facad'
    'es and large windows, mirrored in calm water below. Bicycles lean against the brick walls,'
    ' and vibrant flower boxes adorn the ledges. Sunlight casts warm tones on the architecture,'
    ' with a small boat passing by to add movement. [MIDDLE]:A grand museum with a Neo-Gothic d'
    'esign, featuring intricate stone carvings and a central arched entrance. Visitors stroll a'
    'cross a spacious square with shallow puddles reflecting the structure. Flags flutter gentl'
    'y, and the sky transitions from soft blue to golden hues near the horizon. [RIGHT]:A narro'
    'w, iconic house with a tilted fa\\u00e7ade and steep staircase, flanked by cobblestone stre'
    'ets. A tranquil canal runs alongside it, dotted with floating petals. Tourists gather near'
    ' the entrance under soft daylight, while arched bridges frame the background.", "height": '
    '512, "width": 1536, "layout": "1x3", "theme": "Create a comprehensive guide to Amsterdam\'s'
    ' top tourist attractions, including 3 high-quality images of iconic landmarks. For each at'
    'traction, provide a detailed image.", "category": "Instruction Generation", "task_name": "'
    'Travel Guide", "criteria": {"Style": {"Color Palette Consistency": "All images should feat'
    'ure a consistent color palette that reflects the typical weather and architectural styles '
    'of Amsterdam. For example, if one image features a bright, sunny day with vibrant colors i'
    'n the flower markets, the other images should either reflect similar conditions or appropr'
    'iately adjust the color palette to match different weather or lighting conditions realisti'
    'cally.", "image": null, "Lighting and Rendering Harmony": "The lighting conditions should '
    'be realistic and consistent. If one image depicts a daytime scene with natural lighting, t'
    'he other images should not abruptly switch to a dramatically different lighting style (e.g'
    '., a dark, moody evening scene) unless the context explicitly warrants it. The rendering s'
    'tyle (e.g., photorealistic, painterly) should also be consistent across all images.", "Arc'
    'hitectural Style Uniformity": "The architectural details and style depicted in each image '
    "must accurately represent Amsterdam's architectural characteristics. All images should adh"
    'ere to the correct historical and stylistic elements relevant to the specific landmark."},'
    ' "Identity": {"Landmark Representation Accuracy": "Each image must accurately depict the k'
    'ey architectural features and unique visual characteristics of the specific Amsterdam land'
    'mark it represents (e.g., the Anne Frank House, Rijksmuseum, or canals). These landmarks s'
    'hould be identifiable and recognizable across all images.", "image": null, "Perspective an'
    'd Composition Consistency": "The perspective and composition used in each image should be '
    'consistent to provide a cohesive visual experience. For example, if one image showcases a '
    'wide-angle view of the canals, other canal-related images should maintain a similar wide-a'
    'ngle perspective unless a close-up detail is specifically required."}, "Logic": {"Contextu'
    'al Relevance": "Each image\'s description should directly relate to the visual content of t'
    'hat image, providing clear and accurate information about the depicted landmark. The descr'
    'iption should highlight key features or historical facts relevant to the image.", "image":'
    ' null, "Scene Appropriateness": "Each scene should be realistically plausible and appropri'
    'ate for the described location. For example, images of the canals should show boats, build'
    'ings, and appropriate weather conditions typical of Amsterdam\'s canals.", "Description Acc'
    'uracy": "The descriptions accompanying each image should be factually accurate and devoid '
    "of misleading or false information regarding the landmark's history, significance, or feat"
    'ures."}}, "from": "T2IS", "original_idx": "0025_0011", "editing_prompts": ["A realistic, v'
    'ibrant image of Amsterdam, divided into a 1x3 grid, where each panel highlights a differen'
    't iconic landmark incorporating water elements and architectural details.", "Replace the h'
    'istoric canal-side building with a grand Neo-Gothic museum. Change the narrow canal and sm'
    'all boat for a spacious square with shallow puddles. Swap the bicycles and flower boxes fo'
    'r visitors strolling and flags fluttering. Alter the warm sunlight on the facades to a sky'
    ' with a golden-horizon transition.", "Replace the grand museum with a narrow, tilted iconi'
    'c house. Change the spacious square and puddles for a narrow cobblestone street and a tran'
    'quil canal. Swap the crowds of visitors and flags for a smaller group of tourists and add '
    'arched bridges in the background. Introduce floating petals on the water\'s surface."]}'
)


def test_real_row_with_null_criteria_loads_strictly(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(record(idx=1)) + "\n" + T2IS_0557 + "\n", encoding="utf-8")
    res = P.read_t2is_jsonl_report(path, strict=True)
    assert res.skipped == [] and res.table["prompt_id"].tolist() == ["t2is-0001", "t2is-0557"]
    crit = json.loads(res.table.loc[1, "criteria"])
    raw = json.loads(T2IS_0557)["criteria"]
    # the reference scorer's rule: keep the criteria with truthy text (`if c_t`)
    assert crit == {d: {k: v for k, v in items.items() if v} for d, items in raw.items()}
    assert all("image" not in items for items in crit.values())
    assert res.dropped_criteria == [
        {"line": 2, "prompt_id": "t2is-0557", "dimension": d, "criterion": "image"}
        for d in ("Style", "Identity", "Logic")
    ]
    with pytest.warns(UserWarning, match="dropped 3 null or blank criteria"):
        P.read_t2is_jsonl(path)


def test_blank_criteria_are_dropped_but_structural_errors_stay(tmp_path):
    crit = {"Style": {"a": "", "b": "  ", "c": "text"}, "Logic": {"d": "x"}}
    res = P.read_t2is_jsonl_report(write_jsonl(tmp_path / "p.jsonl", [record(criteria=crit)]))
    assert json.loads(res.table.loc[0, "criteria"]) == {"Style": {"c": "text"}, "Logic": {"d": "x"}}
    assert [d["criterion"] for d in res.dropped_criteria] == ["a", "b"]
    bad = [
        ({"Style": {"a": None, "b": None}}, r"criteria\['Style'\] has no criterion with text"),
        ({"Style": {"a": 3}}, r"criteria\['Style'\]\['a'\] must be a string \(or null\)"),
        ({"Style": {"a": ["x"]}}, "must be a string"),
        ({"Style": None}, "must be a non-empty object"),
    ]
    for c, match in bad:
        path = write_jsonl(tmp_path / "p.jsonl", [record(idx=1), record(idx=2, criteria=c)])
        with pytest.raises(PromptFormatError, match=match) as ei:
            P.read_t2is_jsonl(path)
        assert ei.value.line == 2


def test_utf8_bom_costs_no_row(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(record(idx=1)).encode() + b"\r\n"
                     + json.dumps(record(idx=2)).encode() + b"\r\n")
    df, skipped = P.read_t2is_jsonl_with_report(path, strict=True)
    assert df["prompt_id"].tolist() == ["t2is-0001", "t2is-0002"] and skipped == []


def test_invalid_utf8_is_reported_by_line_and_skippable(tmp_path):
    path = tmp_path / "p.jsonl"
    bad = json.dumps(record(idx=2, theme="caf\u00e9")).encode().replace(b"\\u00e9", b"\xe9")  # a latin-1 byte
    assert b"\xe9" in bad
    path.write_bytes(json.dumps(record(idx=1)).encode() + b"\n" + bad + b"\n" + json.dumps(record(idx=3)).encode())
    with pytest.raises(PromptFormatError, match=r"line 2: invalid UTF-8 byte\(s\) b'\\xe9' at byte column \d+") as ei:
        P.read_t2is_jsonl(path)
    assert ei.value.line == 2
    df, skipped = P.read_t2is_jsonl_with_report(path, strict=False)
    assert df["prompt_id"].tolist() == ["t2is-0001", "t2is-0003"]
    assert [s["line"] for s in skipped] == [2] and "invalid UTF-8" in skipped[0]["reason"]


@pytest.mark.parametrize("content", [b"", b"\n  \n", b"\xef\xbb\xbf"])
def test_empty_file_fails_early(tmp_path, content):
    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    for strict in (True, False):
        with pytest.raises(P.EmptyPromptSetError, match="no valid prompt row.*empty") as ei:
            P.read_t2is_jsonl_with_report(path, strict=strict)
        assert isinstance(ei.value, ArtifactError)


def test_all_rows_skipped_fails_early(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ["{oops", record(height=0)])
    with pytest.raises(P.EmptyPromptSetError, match=r"2 malformed row\(s\) skipped: line 1: invalid JSON"):
        P.read_t2is_jsonl_with_report(path, strict=False)


def test_missing_file_is_a_named_error(tmp_path):
    with pytest.raises(PromptFormatError, match="no such prompt file"):
        P.read_t2is_jsonl(tmp_path / "nope.jsonl")


def run_prompts_stage(tmp_path, jsonl, strict=True):
    import yaml

    from stages import prompts as stage

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["prompts"]["strict"] = strict
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    return stage.main(["--params", str(tmp_path / "params.yaml"), "--jsonl", str(jsonl),
                       "--out", str(tmp_path / "prompts.parquet"), "--metrics", str(tmp_path / "m.json")])


def test_stage_counts_dropped_criteria_and_fails_on_an_empty_set(tmp_path, caplog):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(record(idx=1)) + "\n" + T2IS_0557 + "\n", encoding="utf-8")
    assert run_prompts_stage(tmp_path, path) == 0
    metrics = json.loads((tmp_path / "report.json").read_text())  # the details; m.json: the headline
    assert metrics["prompts"] == 2 and metrics["dropped_criteria"] == 3
    assert {d["dimension"] for d in metrics["dropped_criteria_detail"]} == {"Style", "Identity", "Logic"}
    (tmp_path / "prompts.parquet").unlink()
    write_jsonl(path, ["{oops"])
    assert run_prompts_stage(tmp_path, path, strict=False) == 2  # clean stage error, exit code 2
    assert "no valid prompt row" in caplog.text and not (tmp_path / "prompts.parquet").exists()


def test_stage_refuses_or_counts_a_height_past_int64(tmp_path, caplog):
    path = write_jsonl(tmp_path / "p.jsonl", [record(idx=1), record(idx=2, height=10**20)])
    assert run_prompts_stage(tmp_path, path) == 2  # a clean stage error, no traceback
    assert "line 2: 'height' must be at most" in caplog.text and not (tmp_path / "prompts.parquet").exists()
    assert run_prompts_stage(tmp_path, path, strict=False) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["prompts"] == 1 and report["skipped_rows"] == 1 and report["skipped"][0]["line"] == 2


# --------------------------------------------------------------------------------------------
# split
# --------------------------------------------------------------------------------------------

IDS = [f"t2is-{i:04d}" for i in range(1, 31)]


def test_split_deterministic_and_stable_under_shuffle():
    a = P.assign_split(IDS, 0.25, seed=3)
    assert P.assign_split(list(IDS), 0.25, seed=3) == a
    rng = random.Random(1)
    for _ in range(10):
        shuffled = rng.sample(IDS, len(IDS))
        assert P.assign_split(shuffled, 0.25, seed=3) == a
    assert set(a) == set(IDS)
    assert set(a.values()) == {"train", "test"}
    assert P.assign_split(IDS, 0.25, seed=4) != a  # the seed matters


def test_split_known_value_is_platform_independent():
    # sha256 keys, not Python's salted hash(): a fixed expectation for a fixed seed
    expected = ["t2is-0002", "t2is-0004", "t2is-0006", "t2is-0007", "t2is-0011", "t2is-0022"]
    for ids in (IDS, list(reversed(IDS))):
        test = sorted(k for k, v in P.assign_split(ids, 0.2, seed=0).items() if v == "test")
        assert test == expected


@pytest.mark.parametrize(
    "n, frac, n_test",
    [(30, 0.25, round(0.25 * 30)), (30, 0.2, 6), (10, 0.25, round(2.5)), (4, 0.1, 1),
     (2, 0.01, 1), (2, 0.9, 1), (5, 0.99, 4), (30, 0.0, 0), (1, 0.5, 0), (1, 0.9, 0), (0, 0.3, 0),
     (100, 0.3, 30)],
)
def test_split_sizes(n, frac, n_test):
    ids = [f"p{i}" for i in range(n)]
    split = P.assign_split(ids, frac, seed=0)
    assert sum(v == "test" for v in split.values()) == n_test
    assert len(split) == n
    assert set(split.values()) <= {"train", "test"}


def test_split_rejects_duplicates_and_bad_fractions():
    with pytest.raises(ValueError, match="duplicate"):
        P.assign_split(["a", "b", "a"], 0.5, 0)
    for frac in (-0.1, 1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="test_fraction"):
            P.assign_split(["a", "b"], frac, 0)


def test_split_stratified_by_category():
    cats = {pid: ["A", "B", "C", "D", "E"][i % 5] for i, pid in enumerate(IDS)}  # 6 each
    split = P.assign_split(IDS, 0.25, seed=0, categories=cats)
    assert sum(v == "test" for v in split.values()) == round(0.25 * 30)
    for c in "ABCDE":
        members = [p for p in IDS if cats[p] == c]
        n_test = sum(split[p] == "test" for p in members)
        assert 1 <= n_test <= 2 and n_test < len(members)
    # same answer for the aligned-sequence form, under any order
    rng = random.Random(5)
    shuffled = rng.sample(IDS, len(IDS))
    assert P.assign_split(shuffled, 0.25, 0, categories=[cats[p] for p in shuffled]) == split


def test_split_stratified_keeps_small_categories_in_train_when_possible():
    ids = [f"p{i}" for i in range(9)]
    cats = ["big"] * 8 + ["solo"]
    split = P.assign_split(ids, 0.25, 0, categories=cats)
    assert split["p8"] == "train"
    assert sum(v == "test" for v in split.values()) == 2
    with pytest.raises(ValueError, match="categories"):
        P.assign_split(ids, 0.25, 0, categories=cats[:-1])
    with pytest.raises(ValueError, match="lack"):
        P.assign_split(ids, 0.25, 0, categories={"p0": "a"})


# --------------------------------------------------------------------------------------------
# the shipped prompt set
# --------------------------------------------------------------------------------------------

# words the grid prompt's global description must contain for each photo subject, so the
# photo composites match their prompt
SUBJECT_WORDS = {
    "astronaut": ["astronaut", "orange-and-white"],
    "cat": ["tabby cat"],
    "coffee": ["cup", "coffee", "saucer"],
    "rocket": ["rocket", "launch pad"],
    "grace_hopper": ["naval officer", "uniform"],
    "motorcycle": ["motorcycle"],
    "galaxies": ["galaxies"],
    "tissue": ["stained tissue", "microscope"],
    "cameraman": ["camera", "tripod"],
    "horse": ["horse", "silhouette"],
    "coins": ["coins", "table"],
    "clock": ["wall clock"],
    "moon": ["moon", "cratered surface"],
    "brick": ["brick wall"],
    "grass": ["grass"],
    "gravel": ["gravel"],
}


@pytest.fixture(scope="module")
def shipped():
    return P.read_t2is_jsonl(SHIPPED, strict=True)


def test_shipped_set_parses_strictly(shipped):
    assert len(shipped) >= 24
    assert shipped["prompt_id"].is_unique
    assert set(shipped["category"]) == set(P.T2IS_CATEGORIES)
    assert shipped["split"].isna().all()  # the pipeline assigns the split
    for line in SHIPPED.read_text(encoding="utf-8").splitlines():
        if line.strip():
            assert "split" not in json.loads(line)


def test_shipped_subjects(shipped):
    assert set(SUBJECT_WORDS) == set(P.PHOTO_SUBJECTS)
    assert shipped["subject"].notna().all()
    assert set(shipped["subject"]) == set(P.PHOTO_SUBJECTS)  # only valid ones, each used
    for _, row in shipped.iterrows():
        text = row["global_prompt"].lower()
        for word in SUBJECT_WORDS[row["subject"]]:
            assert word.lower() in text, (row["prompt_id"], row["subject"], word)


def test_shipped_layouts_sizes_and_criteria(shipped):
    layouts = set(zip(shipped["rows"], shipped["cols"], strict=True))
    assert {(2, 2), (1, 3), (3, 1), (2, 3)} <= layouts
    assert (shipped["rows"].eq(2) & shipped["cols"].eq(2)).mean() > 0.5  # mostly 2x2
    for _, row in shipped.iterrows():
        assert row["height"] // row["rows"] == row["width"] // row["cols"] == 512
        assert len(row["panel_prompts"]) == row["rows"] * row["cols"]
        assert len(row["editing_prompts"]) == row["rows"] * row["cols"]
        crit = json.loads(row["criteria"])
        assert set(crit) == {"Identity", "Style", "Logic"}
        assert row["theme"].strip() and row["task_name"].strip()
