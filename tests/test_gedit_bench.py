"""The GEdit-Bench / VIEScore protocol (issue 27, GEdit-Bench part), checked against the official
code of stepfun-ai/Step1X-Edit ``GEdit-Bench/`` (commit 570eba6e): the prompts verbatim, the
edited image's preparation, the reply parser ``mllm_output_to_dict`` and its edge cases, SC / PQ /
Overall, the re-query loop (and the official random guess, seeded), the aggregation of
``calculate_statistics.py`` and the embedded default's expected score from log-probs."""

from __future__ import annotations

import math
import random

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from paco.benchmark import gedit_bench as G
from paco.core.io import ArtifactError

# GEdit-Bench/viescore/vie_prompts.py:3-10 (_context_no_delimit), one official line per list item
OFFICIAL_CONTEXT_LINES = [
    'You are a professional digital artist. You will have to evaluate the effectiveness of the AI-generated image(s) based on given rules.',  # :3
    'All the input images are AI-generated. All human in the images are AI-generated too. so you need not worry about the privacy confidentials.',  # :4
    '',  # :5
    'You will have to give your output in this way (Keep your reasoning concise and short.):',  # :6
    '{',  # :7
    '"score" : [...],',  # :8
    '"reasoning" : "..."',  # :9
    '}',  # :10
]
# GEdit-Bench/viescore/vie_prompts.py:245-251 (_prompts_0shot_two_image_edit_rule), one official line per list item
OFFICIAL_TWO_IMAGE_EDIT_RULE_LINES = [
    'RULES:',  # :245
    '',  # :246
    'Two images will be provided: The first being the original AI-generated image and the second being an edited version of the first.',  # :247
    'The objective is to evaluate how successfully the editing instruction has been executed in the second image.',  # :248
    '',  # :249
    'Note that sometimes the two images might look identical due to the failure of image edit.',  # :250
    '',  # :251
]
# GEdit-Bench/viescore/vie_prompts.py:326-333 (_prompts_0shot_tie_rule_SC), one official line per list item
OFFICIAL_SC_RULE_LINES = [
    '',  # :326
    'From scale 0 to 10: ',  # :327
    'A score from 0 to 10 will be given based on the success of the editing. (0 indicates that the scene in the edited image does not follow the editing instruction at all. 10 indicates that the scene in the edited image follow the editing instruction text perfectly.)',  # :328
    'A second score from 0 to 10 will rate the degree of overediting in the second image. (0 indicates that the scene in the edited image is completely different from the original. 10 indicates that the edited image can be recognized as a minimal edited yet effective version of original.)',  # :329
    "Put the score in a list such that output score = [score1, score2], where 'score1' evaluates the editing success and 'score2' evaluates the degree of overediting.",  # :330
    '',  # :331
    'Editing instruction: <instruction>',  # :332
    '',  # :333
]
# GEdit-Bench/viescore/vie_prompts.py:359-376 (_prompts_0shot_rule_PQ), one official line per list item
OFFICIAL_PQ_RULE_LINES = [
    'RULES:',  # :359
    '',  # :360
    'The image is an AI-generated image.',  # :361
    'The objective is to evaluate how successfully the image has been generated.',  # :362
    '',  # :363
    'From scale 0 to 10: ',  # :364
    'A score from 0 to 10 will be given based on image naturalness. ',  # :365
    '(',  # :366
    '    0 indicates that the scene in the image does not look natural at all or give a unnatural feeling such as wrong sense of distance, or wrong shadow, or wrong lighting. ',  # :367
    '    10 indicates that the image looks natural.',  # :368
    ')',  # :369
    'A second score from 0 to 10 will rate the image artifacts. ',  # :370
    '(',  # :371
    '    0 indicates that the image contains a large portion of distortion, or watermark, or scratches, or blurred faces, or unusual body parts, or subjects not harmonized. ',  # :372
    '    10 indicates the image has no artifacts.',  # :373
    ')',  # :374
    'Put the score in a list such that output score = [naturalness, artifacts]',  # :375
    '',  # :376
]


def _official(lines: list[str]) -> str:
    return "\n".join(lines)


# --- prompts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["CONTEXT", "TWO_IMAGE_EDIT_RULE", "SC_RULE", "PQ_RULE"])
def test_prompt_parts_are_the_official_text(name):
    assert getattr(G, name) == _official(globals()[f"OFFICIAL_{name}_LINES"])


def test_sc_prompt_is_assembled_as_viescore_does():
    # viescore/__init__.py:41,46 ("\n".join) and :61 (str.replace on the joined text)
    instr = "把背景换成海滩 <instruction>"
    expected = "\n".join([_official(OFFICIAL_CONTEXT_LINES), _official(OFFICIAL_TWO_IMAGE_EDIT_RULE_LINES),
                          _official(OFFICIAL_SC_RULE_LINES)]).replace("<instruction>", instr)
    got = G.sc_prompt(instr)
    assert got == expected
    assert got.endswith("\nEditing instruction: 把背景换成海滩 <instruction>\n")  # one pass: no recursion
    assert '"reasoning" : "..."\n}\nRULES:\n' in got  # context, one "\n", the rule
    assert "failure of image edit.\n\n\nFrom scale 0 to 10: \n" in got  # rule ends "\n", join "\n", SC starts "\n"
    assert len(got) == 403 + 1 + 338 + 1 + 769 - len("<instruction>") + len(instr)
    with pytest.raises(G.GEditError):
        G.sc_prompt(None)


def test_pq_prompt_is_context_and_pq_rule():
    # viescore/__init__.py:47
    assert G.pq_prompt() == _official(OFFICIAL_CONTEXT_LINES) + "\n" + _official(OFFICIAL_PQ_RULE_LINES)
    assert G.pq_prompt().endswith("output score = [naturalness, artifacts]\n")
    assert "<instruction>" not in G.pq_prompt()


def _noise(size, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (size[1], size[0], len(mode)), dtype=np.uint8)
    return Image.fromarray(arr if len(mode) > 1 else arr[..., 0], mode)


def test_prepare_edited_is_rgb_bicubic_to_the_source_size():
    # test_gedit_score.py:34: .convert("RGB").resize(raw.size): PIL's default filter (bicubic for RGB)
    edited, source = _noise((40, 30), "RGBA", 1), _noise((23, 17), "RGB", 2)
    out = G.prepare_edited(edited, source)
    assert out.mode == "RGB" and out.size == (23, 17)
    official = edited.convert("RGB").resize(source.size)
    assert np.array_equal(np.asarray(out), np.asarray(official))
    assert np.array_equal(np.asarray(out), np.asarray(edited.convert("RGB").resize((23, 17), Image.BICUBIC)))
    assert not np.array_equal(np.asarray(out), np.asarray(edited.convert("RGB").resize((23, 17), Image.LANCZOS)))
    same = G.prepare_edited(_noise((23, 17), "L", 3), source)  # same size: still converted
    assert same.mode == "RGB" and same.size == (23, 17)
    for bad in [(None, source), (edited, "x.png")]:
        with pytest.raises(G.GEditError):
            G.prepare_edited(*bad)


def test_item_requests_give_sc_both_images_and_pq_the_edited_one():
    source, edited = _noise((20, 10), "RGB", 4), _noise((8, 8), "RGB", 5)
    req = G.item_requests("add a hat", source, edited)
    sc_text, sc_images = req["sc"]
    pq_text, pq_images = req["pq"]
    assert sc_text == G.sc_prompt("add a hat") and pq_text == G.pq_prompt()
    assert sc_images[0] is source and len(sc_images) == 2 and len(pq_images) == 1
    assert sc_images[1].size == (20, 10) and pq_images[0] is sc_images[1]


# --- the reply parser ------------------------------------------------------------------------
D = "||V^=^V||"


@pytest.mark.parametrize("reply, expected", [
    # the delimited form (viescore/utils.py:167-173)
    (f'{D}\n{{\n"score" : [5, 10],\n"reasoning" : "ok"\n}}\n{D}', [5, 10]),
    (f'text {D}{{"score": [3, 4]}}{D} more {{"score": [9, 9]}}', [3, 4]),  # between the delimiters only
    (f'{D}{{"score": [3, 4]}}{D}{D}{{"score": [1]}}', None),  # 3 delimiters: the outermost braces, bad JSON
    (f'{D}{D}', None),  # empty between the delimiters (:215)
    # the outermost braces (:178-179), the scalar wrapped (:222-223)
    ('```json\n{"score": [7, 8], "reasoning": "fine"}\n```', [7, 8]),
    ('{"score": 5, "reasoning": "x"}', [5]),
    ('{"score": [7.5, 8]}', [7.5, 8]),
    ('{"score": [15, -3]}', [15, -3]),  # no range check on this path
    ('{"score": [7\n8]}', [78]),  # "\n" removed before json.loads (:218)
    ('{"score": [7, 8], "reasoning": "line one\nline two"}', [7, 8]),
    ('{"score": [7, 8]', [7, 8]),  # no "}": the bare-list path (:180, :184)
    # the fix_json fallback (:224-231, utils.py:8-29)
    ('{score: 7}', [7]),
    ('{score: 7, reasoning: fine}', [7]),
    ('{score: [7, 8]}', None),  # fix_json quotes "[7" and breaks the JSON
    ('{"Score": 7}', None),  # no "score" key: fix_json gives {"Score": [7]}, evaluate fails
    ('{"score": []}', None),  # min([]) fails
    ('{"score": ["7", "8"]}', None),  # strings: sqrt fails
    ('{"score": [[7], [8]]}', None),
    ('{"score": [true, 5]}', None),  # deliberate deviation (documented): no bool scores
    ('{"score": [NaN, 5]}', None),  # deliberate deviation: no non-finite scores
    (f'{D} 7 {D}', None),  # json 7 is not a dict: fix_json returns 7, evaluate fails
    (f'{D} [7, 8] {D}', None),  # a list, not a dict
    # the bare list (:194-202): exactly two integers, one optional space, text around ignored
    ('[6, 0]', [6, 0]),
    ('scores: [6,0] done', [6, 0]),
    ('[11, 99]', [11, 99]),
    ('[6,  0]', None),
    ('[6, 0, 1]', None),
    ('[6.5, 0]', None),
    ('[\u0663, 4]', None),  # \d matches Arabic-Indic 3 but json.loads raises: evaluate fails
    # a single integer 0..10 (:203-209): int() of the whole reply
    ('7', [7]),
    (' 7\n', [7]),
    ('+7', [7]),
    ('1_0', [10]),
    ('\u0667', [7]),
    ('10', [10]),
    ('11', None),
    ('-1', None),
    ('7.0', None),
    ('7/10', None),
    ('The score is 7', None),
    # garbage (:210-212) and the rate-limit sentinel (:161, __init__.py:84-86)
    ('', None),
    ('I cannot evaluate this image.', None),
    ('} {', None),
    ('rate_limit_exceeded', None),
])
def test_parse_reply_matches_mllm_output_to_dict(reply, expected):
    got = G.parse_reply(reply)
    assert got == expected
    if expected is not None:
        assert [type(x) for x in got] == [type(x) for x in expected]


def test_parse_reply_rejects_non_text():
    with pytest.raises(G.GEditError):
        G.parse_reply(None)


# --- one item's scores -----------------------------------------------------------------------
def test_item_scores_min_and_sqrt():
    # viescore/__init__.py:92-94
    sc, pq, overall = G.item_scores([9, 4], [6, 8.5])
    assert (sc, pq) == (4.0, 6.0)
    assert overall == math.sqrt(24)
    assert G.item_scores([0, 10], [7]) == (0.0, 7.0, 0.0)
    assert G.item_scores([-2], [-8]) == (-2.0, -8.0, 4.0)  # officially accepted: sqrt(16)
    for bad in [([], [5]), ([5], [-1]), ([True], [5]), (["7"], [5]), (7, [5])]:
        with pytest.raises(G.GEditError):
            G.item_scores(*bad)


class _Asker:
    """Scripted replies: ``script[kind][round]`` (the last one repeats); records the calls."""

    def __init__(self, sc, pq):
        self.script, self.calls = {"sc": sc, "pq": pq}, []

    def __call__(self, kind, rnd):
        self.calls.append((kind, rnd))
        seq = self.script[kind]
        return seq[min(rnd, len(seq) - 1)]


GOOD_SC, GOOD_PQ = '{"score": [8, 6], "reasoning": "x"}', '{"score": [9, 7]}'


def test_score_item_first_round():
    ask = _Asker([GOOD_SC], [GOOD_PQ])
    out = G.score_item(ask)
    assert ask.calls == [("sc", 0), ("pq", 0)]
    assert (out["sc"], out["pq"], out["overall"]) == (6.0, 7.0, math.sqrt(42))
    assert out["parsed"] and out["rounds"] == 1 and out["guessed"] == []
    assert out["sc_scores"] == [8, 6] and out["pq_reply"] == GOOD_PQ


def test_score_item_requeries_both_once_then_uses_the_second_round():
    ask = _Asker(["garbage", GOOD_SC], [GOOD_PQ, '{"score": [5, 5]}'])
    out = G.score_item(ask)
    assert ask.calls == [("sc", 0), ("pq", 0), ("sc", 1), ("pq", 1)]
    assert (out["sc"], out["pq"], out["rounds"]) == (6.0, 5.0, 2)  # the PQ of round 2, as officially


def test_score_item_unparsed_after_one_requery_is_never_scored():
    ask = _Asker(["garbage", "still garbage"], [GOOD_PQ])
    out = G.score_item(ask)
    assert len(ask.calls) == 4
    assert out["parsed"] is False and out["sc"] is None and out["pq"] is None and out["overall"] is None
    assert out["sc_scores"] is None and out["pq_scores"] == [9, 7] and out["sc_reply"] == "still garbage"
    neg = G.score_item(_Asker(['{"score": [-1]}'], [GOOD_PQ]))  # SC x PQ < 0: no Overall, unparsed
    assert neg["parsed"] is False and neg["rounds"] == 2
    raised = G.score_item(_Asker(["[\u0663, 4]"], [GOOD_PQ]))  # SC's parse raises officially; PQ still reported
    assert raised["parsed"] is False and raised["sc_scores"] is None and raised["pq_scores"] == [9, 7]
    with pytest.raises(G.GEditError):
        G.score_item(_Asker([None], [GOOD_PQ]))


def test_official_random_guesses_from_the_second_round_seeded():
    # viescore/utils.py:186-193: from the 2nd try a reply without braces gets randint(0, 10), even "7";
    # each round draws from a fresh Random(seed) (qwen25vl_eval.py:77 set_seed(42)), SC first
    first = random.Random(42).randint(0, 10)
    r = random.Random(42)
    both = (r.randint(0, 10), r.randint(0, 10))
    out = G.score_item(_Asker(["garbage"], [GOOD_PQ]), official_random=True, seed=42)
    assert out["rounds"] == 2 and out["guessed"] == ["sc"] and out["sc_scores"] == [first]
    assert out["sc"] == float(first) and out["pq"] == 7.0
    out = G.score_item(_Asker(["garbage", "7"], ["nope", "[6, 0]"]), official_random=True, seed=42)
    assert out["guessed"] == ["sc", "pq"] and (out["sc_scores"], out["pq_scores"]) == ([both[0]], [both[1]])
    again = G.score_item(_Asker(["garbage", "7"], ["nope", "[6, 0]"]), official_random=True, seed=42)
    assert again == out
    other = G.score_item(_Asker(["garbage"], [GOOD_PQ]), official_random=True, seed=1)
    assert other["sc_scores"] == [random.Random(1).randint(0, 10)]
    ok = G.score_item(_Asker(["7"], ["[6, 0]"]), official_random=True, seed=42)  # the first try parses them
    assert (ok["sc_scores"], ok["pq_scores"], ok["guessed"]) == ([7], [6, 0], [])


def test_official_random_loops_on_broken_braces_and_restarts_after_a_raise():
    # braces that never parse: the official loop never ends (__init__.py:76); capped here, unparsed
    out = G.score_item(_Asker(["{broken}"], [GOOD_PQ]), official_random=True, seed=42, max_rounds=5)
    assert out["parsed"] is False and out["rounds"] == 5 and out["guessed"] == []
    # a bare list json.loads rejects raises out of evaluate: the item starts again (tries = 0), so
    # round 2 does not guess and the guess comes in round 3
    out = G.score_item(_Asker(["[\u0663, 4]", "garbage"], [GOOD_PQ]), official_random=True, seed=42)
    assert out["rounds"] == 3 and out["guessed"] == ["sc"]
    for bad in [dict(seed=None), dict(seed=True), dict(seed=1, max_rounds=1)]:
        with pytest.raises(G.GEditError):
            G.score_item(_Asker([GOOD_SC], [GOOD_PQ]), official_random=True, **bad)


# --- aggregation -----------------------------------------------------------------------------
def _official_statistics(df: pd.DataFrame, language: str) -> tuple[list[float], list[float]]:
    """calculate_statistics.py:29-117 restated: ([sc, pq, overall], the same for intersection)."""
    full, inter = {k: [] for k in "spo"}, {k: [] for k in "spo"}
    for group in G.OFFICIAL_TASK_TYPES:
        rows = df[(df.task_type == group) & (df.instruction_language == language)]
        s, q = list(rows.sc), list(rows.pq)
        o = [math.sqrt(a * b) for a, b in zip(s, q)]
        mask = list(rows.Intersection_exist)
        for target, keep in ((full, [True] * len(s)), (inter, mask)):
            target["s"].append(np.mean([v for v, k in zip(s, keep) if k]))
            target["p"].append(np.mean([v for v, k in zip(q, keep) if k]))
            target["o"].append(np.mean([v for v, k in zip(o, keep) if k]))
    return [np.mean(full[k]) for k in "spo"], [np.mean(inter[k]) for k in "spo"]


def _table(seed=0) -> pd.DataFrame:
    rng = random.Random(seed)
    rows = []
    for t, group in enumerate(G.OFFICIAL_TASK_TYPES):
        for lang in ("en", "cn"):
            for i in range(2 + (t % 4) * 3):  # unequal task-type sizes
                rows.append({"task_type": group, "instruction_language": lang, "Intersection_exist": i % 3 != 1,
                             "sc": float(rng.randint(0, 10)), "pq": float(rng.randint(1, 10))})
    return pd.DataFrame(rows)


def test_aggregate_matches_calculate_statistics():
    df = _table()
    out = G.aggregate(df)
    for lang in ("en", "cn"):
        full, inter = _official_statistics(df, lang)
        assert [out[lang][k] for k in ("sc", "pq", "overall")] == pytest.approx(full, abs=1e-12)
        assert [out[f"{lang}_i"][k] for k in ("sc", "pq", "overall")] == pytest.approx(inter, abs=1e-12)
        assert out[lang]["items"] == int((df.instruction_language == lang).sum()) and out[lang]["unparsed"] == 0
    assert out["other_languages"] == {} and out["other_task_types"] == {}


def _rows(spec):
    """(task_type, language, intersection, sc, pq) -> rows with edits.parquet's ``language``."""
    return [{"item_id": str(i), "task_type": t, "language": lang, "Intersection_exist": x, "sc": s, "pq": q}
            for i, (t, lang, x, s, q) in enumerate(spec)]


def test_macro_mean_over_task_types_and_the_intersection_subset():
    rows = _rows([("a", "en", True, 8, 2), ("a", "en", False, 2, 8),  # a: SC 5, PQ 5, O (4 + 4) / 2 = 4
                  ("a", "en", False, 9, 1), ("a", "en", False, 1, 9),  # a: 4 items
                  ("b", "en", True, 10, 10),  # b: one item, weighs as much as a's four
                  ("a", "cn", True, 3, 3), ("b", "cn", False, 6, 6), ("b", "cn", True, 4, 9)])
    out = G.aggregate(rows, task_types=["a", "b"])
    en = out["en"]
    assert en["task_types"]["a"] == {"sc": 5.0, "pq": 5.0, "overall": 3.5, "items": 4, "unparsed": 0}
    assert (en["sc"], en["pq"], en["overall"]) == ((5 + 10) / 2, (5 + 10) / 2, (3.5 + 10) / 2)
    en_i = out["en_i"]  # a: the (8, 2) row only; b: (10, 10)
    assert (en_i["sc"], en_i["pq"], en_i["overall"], en_i["items"]) == ((8 + 10) / 2, (2 + 10) / 2, (4 + 10) / 2, 2)
    cn, cn_i = out["cn"], out["cn_i"]
    assert (cn["sc"], cn["overall"]) == ((3 + 5) / 2, (3 + 6) / 2)  # b: O = sqrt(36), sqrt(36)
    assert (cn_i["sc"], cn_i["pq"], cn_i["overall"]) == ((3 + 4) / 2, (3 + 9) / 2, (3 + 6) / 2)


def test_unparsed_rows_are_excluded_and_counted():
    rows = _rows([("a", "en", True, 6, 6), ("a", "en", True, None, None), ("b", "en", False, 4, 9),
                  ("b", "en", False, float("nan"), float("nan"))])
    for row, parsed in zip(rows, [True, False, True, False]):
        row["parsed"] = parsed
    out = G.aggregate(pd.DataFrame(rows), task_types=["a", "b"], languages=["en"], require_all_task_types=False)
    assert out["en"]["missing_task_types"] == [] and out["en_i"]["missing_task_types"] == ["b"]
    assert (out["en"]["sc"], out["en"]["overall"]) == (5.0, 6.0)
    assert (out["en"]["items"], out["en"]["unparsed"]) == (2, 2)
    assert out["en"]["task_types"]["b"]["unparsed"] == 1
    assert out["en_i"]["unparsed"] == 1 and out["en_i"]["task_types"]["a"]["items"] == 1
    with pytest.raises(G.MissingTaskTypeError):  # b has no intersection row: the official mean is NaN
        G.aggregate(rows, task_types=["a", "b"], languages=["en"], intersection=True, require_all_task_types=True)


def test_missing_task_types_raise_or_are_listed():
    rows = _rows([("a", "en", True, 6, 6), ("a", "cn", True, 2, 8), ("c", "en", True, 1, 1), ("a", "de", True, 1, 1)])
    with pytest.raises(G.MissingTaskTypeError, match="'b'"):
        G.aggregate(rows, task_types=["a", "b"])
    out = G.aggregate(rows, task_types=["a", "b"], require_all_task_types=False)
    assert out["en"]["sc"] == 6.0 and out["en"]["missing_task_types"] == ["b"]
    assert out["en"]["task_types"]["b"]["sc"] is None
    assert out["other_task_types"] == {"c": 1} and out["other_languages"] == {"de": 1}
    only_b = G.aggregate(rows[:1], task_types=["b"], languages=["en"], require_all_task_types=False)
    assert only_b["en"]["sc"] is None and only_b["en"]["items"] == 0  # no score made up


@pytest.mark.parametrize("change", [
    {"Intersection_exist": "False"},  # a string would be truthy officially
    {"sc": None},  # sc without pq
    {"parsed": False},  # disagrees with the scores
    {"sc": -1.0},  # SC x PQ < 0
    {"language": None},
    {"instruction_language": "cn"},  # the two spellings disagree
])
def test_aggregate_rejects_bad_rows(change):
    row = {**_rows([("a", "en", True, 6, 6)])[0], **change}
    with pytest.raises(G.GEditError):
        G.aggregate([row], task_types=["a"], languages=["en", "cn"])
    assert issubclass(G.GEditError, ArtifactError)


def test_aggregate_needs_every_field():
    row = _rows([("a", "en", True, 6, 6)])[0]
    for key in ("sc", "task_type", "language", "Intersection_exist"):
        with pytest.raises(G.GEditError, match="no "):
            G.aggregate([{k: v for k, v in row.items() if k != key}], task_types=["a"], languages=["en"])
    no_i = {k: v for k, v in row.items() if k != "Intersection_exist"}
    assert set(G.aggregate([no_i], task_types=["a"], languages=["en"], intersection=False)) == {
        "en", "other_task_types", "other_languages"}


# --- the expected score ----------------------------------------------------------------------
def test_expected_score_renormalises_over_score_tokens():
    top = {"7": math.log(0.5), "8": math.log(0.25), "{": math.log(0.2), "x": math.log(0.05)}
    assert G.expected_score(top) == pytest.approx((7 * 0.5 + 8 * 0.25) / 0.75, rel=1e-15)
    entries = [{"token": " 7", "logprob": math.log(0.3)}, {"token": "7", "logprob": math.log(0.2)},
               {"token": "10", "logprob": math.log(0.25)}, {"token": "0", "logprob": math.log(0.25)}]
    assert G.expected_score(entries) == pytest.approx((7 * 0.5 + 10 * 0.25 + 0) / 1.0, rel=1e-15)
    far = {"3": -1000.0, "5": -1000.0 + math.log(3)}  # no underflow to "no score"
    assert G.expected_score(far) == pytest.approx((3 * 1 + 5 * 3) / 4, rel=1e-12)
    assert G.expected_score({"9": 0.0, "2": -math.inf}) == 9.0


def test_expected_score_ten_as_two_tokens():
    top = {"1": math.log(0.6), "8": math.log(0.4)}
    assert G.expected_score(top) == pytest.approx((1 * 0.6 + 8 * 0.4) / 1.0)  # "1" wholly 1
    after = [{"token": "0", "logprob": math.log(0.75)}, {"token": ",", "logprob": math.log(0.25)}]
    # P(10) = 0.6 * 0.75 = 0.45, P(1) = 0.15, P(8) = 0.4
    assert G.expected_score(top, after_one=after) == pytest.approx(10 * 0.45 + 1 * 0.15 + 8 * 0.4, rel=1e-15)
    assert G.expected_score(top, after_one={" 0": -0.1}) == pytest.approx(0.6 + 3.2)  # " 0" is not "10"


def test_expected_score_errors():
    with pytest.raises(G.NoScoreTokenError, match="none of the score tokens"):
        G.expected_score({"{": -0.1, "The": -2.0, "11": -3.0, "7.": -4.0})
    with pytest.raises(G.NoScoreTokenError):
        G.expected_score({"5": -math.inf})
    for bad in [{"5": 0.5}, {"5": float("nan")}, {"5": True}, [{"token": None, "logprob": -1.0}], ["5"]]:
        with pytest.raises(G.GEditError):
            G.expected_score(bad)
    with pytest.raises(G.GEditError):
        G.expected_score({"1": -0.1}, after_one={"0": 0.3})


def _plan_and_answers(types, unparsed=()):
    """A GEdit plan of one EN item per task type (both variants) and scripted results."""
    from paco.benchmark.gedit_run import GEditPlan

    plan = GEditPlan(intersection=False, task_types=list(G.OFFICIAL_TASK_TYPES))
    results = []
    for n, t in enumerate(types):
        for v in ("base", "lora"):
            plan.units.append({"sample_id": f"{t}-{v}", "case_id": t, "variant": v, "task_type": t, "language": "en",
                               "intersection": None, "requests": {"sc": ([], "sc?"), "pq": ([], "pq?")}})
            ok = t not in unparsed
            sc, pq = float(n % 9 + 1), float(9 - (v == "lora") * (n % 3))
            results.append({"sc": sc if ok else None, "pq": pq if ok else None,
                            "overall": math.sqrt(sc * pq) if ok else None, "parsed": ok, "rounds": 1, "guessed": [],
                            "sc_scores": [sc] if ok else None, "pq_scores": [pq] if ok else None, "replies": {}})
    return plan, {"ev": results}


def test_score_gedit_flags_cells_averaged_over_fewer_than_the_official_task_types():
    from types import SimpleNamespace

    from paco.benchmark.gedit_run import score_gedit

    cfg = SimpleNamespace(scoring="reply")
    plan, answers = _plan_and_answers(G.OFFICIAL_TASK_TYPES)
    _, metrics, report = score_gedit(plan, answers, cfg)
    assert report["official_task_types"] is True and report["partial_cells"] == {}
    assert metrics["scores"]["base"]["ev"]["en"]["missing_task_types"] == []
    assert metrics["scores"]["base"]["ev"]["en_i"]["missing_task_types"] is None  # not computed
    # one task type with no scored item: the EN cell is a mean over 10, flagged in metrics and report
    lost = G.OFFICIAL_TASK_TYPES[3]
    plan, answers = _plan_and_answers(G.OFFICIAL_TASK_TYPES, unparsed={lost})
    _, metrics, report = score_gedit(plan, answers, cfg)
    assert report["official_task_types"] is False and report["partial_cells"] == {"en": [lost]}
    for v in ("base", "lora"):
        en = metrics["scores"][v]["ev"]["en"]
        assert en["missing_task_types"] == [lost]
        kept = [n for n, t in enumerate(G.OFFICIAL_TASK_TYPES) if t != lost]
        assert en["sc"] == pytest.approx(float(np.mean([n % 9 + 1 for n in kept])), abs=1e-12)
    # only some task types present, all scored: still flagged (the official mean would be NaN)
    plan, answers = _plan_and_answers(G.OFFICIAL_TASK_TYPES[:2])
    _, metrics, report = score_gedit(plan, answers, cfg)
    assert report["official_task_types"] is False
    assert report["partial_cells"] == {"en": sorted(G.OFFICIAL_TASK_TYPES[2:])}
