"""paco.judge.templates: reference template strings, formatting errors, chat layout, response format."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from paco.judge import templates as T
from paco.judge.templates import (
    TEMPLATES,
    Template,
    build_messages,
    build_openai_messages,
    format_response,
    is_canonical,
    judge_instruction,
    parse_response,
    png_bytes,
    sanitize_reason,
    teacher_instruction,
)

# ---------------------------------------------------------------------------------------------
# The reference strings, copied from X-GenGroup/PaCo-RL (commit cd3c428). They are written out
# here independently of paco/judge/templates.py so that an edit there cannot silently change them.
# ---------------------------------------------------------------------------------------------

# PaCo-GRPO/paco_grpo/rewards/consistency_scorer.py, prompt_template_version == 1 (f-string with
# main_prompt = divide_prompt(prompt)[0]).
REF_T2IS_THEME = (
    "Given two subfigures generated based on the theme: \"{main_prompt}\", "
    "do the two images maintain consistency in terms of style, logic and identity? "
    "Answer \"Yes\" and \"No\" first, and then provide detailed reasons."
)
# same file, prompt_template_version == 2 ("# Not good").
REF_T2IS_THEME_NODUP = (
    "Given two subfigures generated based on the theme: \"{main_prompt}\", "
    "do the two images maintain consistency in terms of style, logic, and identity? "
    "If the two images look almost identical or duplicated, answer \"No\". "
    "Otherwise, answer \"Yes\" or \"No\" first, and then provide detailed reasons."
)
# PaCo-Reward/evaluation/Consistency_Rank/consistency_scorer_vllm.py (and consistency_scorer.py),
# prompt_template == 3 (eval_vllm.py default) and == 2.
REF_RANK_COT = (
    "Do the two images maintain consistency in terms of style, logic and identity? "
    "Answer \"Yes\" and \"No\" first, and then provide detailed reasons."
)
REF_RANK_BINARY = (
    "Do the two images maintain consistency in terms of style, logic and identity? "
    "Answer \"Yes\" and \"No\" only."
)
# PaCo-GRPO/paco_grpo/rewards/consistency_scorer.py, prompt_template_version == 0.
REF_CRITERIA_COT = (
    "Do images meet the following criteria? {criteria} Please answer Yes or No first, "
    "then provide detailed reasons."
)
# PaCo-Reward/evaluation/Consistency_Rank/consistency_scorer_vllm.py, prompt_template == 1.
REF_CRITERIA_BINARY = "Do images meet the following criteria? {criteria} Please answer Yes or No."
# PaCo-GRPO/paco_grpo/rewards/consistency_for_editing.py.
REF_EDIT_SC = (
    "Compare the edited image (second) with the original image (first). "
    "Instruction: '{prompt}'. "
    "Except for the parts that are intentionally changed according to the instruction, "
    "does the edited image remain consistent with the original in style, logic, and identity? "
    "Answer 'Yes' or 'No' first, then provide detailed reasons."
)
REF_EDIT_PF = (
    "Compare the edited image (second) with the original image (first). "
    "Instruction: '{prompt}'. "
    "Does the edited image accurately follow this instruction? "
    "Answer 'Yes' or 'No' first, then provide detailed reasons."
)
# PaCo-Reward/evaluation/Edit-Bench/editscore/__init__.py, class ConsistencyScore.
REF_EDIT_SC_BENCH = (
    "Given two images after an edit with instruction '{prompt}', do they maintain consistency in "
    "terms of style, logic and identity? Answer 'Yes' or 'No' only."
)
REF_EDIT_PF_BENCH = (
    "Given two images after an edit with instruction '{prompt}', is the edit following the "
    "instruction well? Answer 'Yes' or 'No' only."
)

REFERENCE = {
    "t2is_theme": (REF_T2IS_THEME, ("main_prompt",), "consistency_scorer.py"),
    "t2is_theme_nodup": (REF_T2IS_THEME_NODUP, ("main_prompt",), "consistency_scorer.py"),
    "rank_cot": (REF_RANK_COT, (), "consistency_scorer_vllm.py"),
    "rank_binary": (REF_RANK_BINARY, (), "consistency_scorer_vllm.py"),
    "criteria_cot": (REF_CRITERIA_COT, ("criteria",), "consistency_scorer.py"),
    "criteria_binary": (REF_CRITERIA_BINARY, ("criteria",), "consistency_scorer_vllm.py"),
    "edit_sc": (REF_EDIT_SC, ("prompt",), "consistency_for_editing.py"),
    "edit_pf": (REF_EDIT_PF, ("prompt",), "consistency_for_editing.py"),
    "edit_sc_bench": (REF_EDIT_SC_BENCH, ("prompt",), "editscore/__init__.py"),
    "edit_pf_bench": (REF_EDIT_PF_BENCH, ("prompt",), "editscore/__init__.py"),
}


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_template_text_equals_reference(name):
    text, fields, src = REFERENCE[name]
    t = TEMPLATES[name]
    assert t.text == text
    assert t.fields == fields
    assert t.name == name and t.version >= 1 and t.id == f"{name}@v{t.version}"
    assert src in t.source and "X-GenGroup/PaCo-RL" in t.source


def test_registry_is_complete_and_consistent():
    assert set(TEMPLATES) == set(REFERENCE) | {"teacher_cot"}
    for name, t in TEMPLATES.items():
        assert t.name == name and isinstance(t, Template)
        assert T.get_template(name) is t
    with pytest.raises(KeyError, match="unknown template"):
        T.get_template("nope")


def test_filled_reference_strings():
    theme = "Four panels of the same red fox in a snowy forest"
    assert T.T2IS_THEME.format(main_prompt=theme) == (
        'Given two subfigures generated based on the theme: "Four panels of the same red fox in a '
        'snowy forest", do the two images maintain consistency in terms of style, logic and '
        'identity? Answer "Yes" and "No" first, and then provide detailed reasons.'
    )
    assert T.RANK_COT.format() == REF_RANK_COT
    assert T.CRITERIA_COT.format(criteria="The fox is the same.") == (
        "Do images meet the following criteria? The fox is the same. Please answer Yes or No "
        "first, then provide detailed reasons."
    )
    assert T.EDIT_PF.format(prompt="make it blue").startswith(
        "Compare the edited image (second) with the original image (first). Instruction: 'make it blue'. Does"
    )


def test_format_errors():
    t = T.T2IS_THEME
    with pytest.raises(KeyError, match="main_prompt"):
        t.format()
    with pytest.raises(ValueError, match="unexpected"):
        t.format(main_prompt="x", theme="y")
    with pytest.raises(ValueError, match="unexpected"):
        T.RANK_COT.format(main_prompt="x")
    with pytest.raises(ValueError, match="blank"):
        t.format(main_prompt="   ")
    with pytest.raises(TypeError):
        t.format(main_prompt=None)
    with pytest.raises(TypeError):
        t.format(main_prompt=True)
    assert T.TEACHER_COT.format(question="Q?", answer="Yes", max_reasons=3).count("3") >= 1


def test_template_construction_checks_fields():
    with pytest.raises(ValueError, match="declared fields"):
        Template("x", 1, "a {b} c", ())
    with pytest.raises(ValueError, match="declared fields"):
        Template("x", 1, "a c", ("b",))
    with pytest.raises(ValueError, match="unsupported"):
        Template("x", 1, "a {} c", ())
    with pytest.raises(ValueError, match="unsupported"):
        Template("x", 1, "a {b!r} c", ("b",))
    with pytest.raises(Exception):
        T.RANK_COT.text = "changed"  # frozen


def test_judge_and_teacher_instruction():
    assert judge_instruction(None) == REF_RANK_COT
    assert judge_instruction("  ") == REF_RANK_COT
    assert judge_instruction(" a fox ") == REF_T2IS_THEME.format(main_prompt="a fox")
    q = judge_instruction("a fox")
    yes = teacher_instruction(q, True, 3)
    no = teacher_instruction(q, False, 2)
    assert yes.startswith(q) and no.startswith(q)
    assert 'The correct answer to this question is "Yes"' in yes and 'starts with "Yes."' in yes
    assert 'The correct answer to this question is "No"' in no and "1 to 2" in no
    assert "<reason>" in yes and "</reason>" in yes
    with pytest.raises(ValueError):
        teacher_instruction(q, True, 0)


def _img(seed: int, size=(24, 16)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def test_build_messages_layout():
    a, b = _img(0), _img(1)
    msgs = build_messages(a, b, "Question?")
    assert msgs == [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": a},
                {"type": "image", "image": b},
                {"type": "text", "text": "Question?"},
            ],
        }
    ]
    assert msgs[0]["content"][0]["image"] is a and msgs[0]["content"][1]["image"] is b
    assert build_messages(a, b, "Q") is not build_messages(a, b, "Q")
    with pytest.raises(ValueError):
        build_messages(a, None, "Q")
    with pytest.raises(ValueError):
        build_messages(a, b, "")


def test_build_openai_messages_layout():
    a, b = _img(0), _img(1)
    pa, pb = png_bytes(a), png_bytes(b)
    msgs = build_openai_messages(pa, pb, "Question?")
    assert len(msgs) == 1 and msgs[0]["role"] == "user"
    content = msgs[0]["content"]
    assert [c["type"] for c in content] == ["image_url", "image_url", "text"]
    assert content[2]["text"] == "Question?"
    for c, raw, img in zip(content[:2], (pa, pb), (a, b)):
        url = c["image_url"]["url"]
        assert url.startswith("data:image/png;base64,")
        data = base64.b64decode(url.split(",", 1)[1])
        assert data == raw
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")), np.asarray(img))
    buf = io.BytesIO()
    a.save(buf, format="JPEG")
    assert T.image_data_url(buf.getvalue()).startswith("data:image/jpeg;base64,")
    with pytest.raises(ValueError):
        build_openai_messages(b"not an image", pb, "Q")
    with pytest.raises(TypeError):
        build_openai_messages(a, pb, "Q")


def test_format_response():
    assert format_response(True, None) == "Yes."
    assert format_response(False, None) == "No."
    assert format_response(True, ["Same fox.", "Same palette"]) == (
        "Yes. <reason>1. Same fox. 2. Same palette.</reason>"
    )
    assert format_response(np.bool_(False), ["Different  \n subject."]) == "No. <reason>1. Different subject.</reason>"
    with pytest.raises(ValueError):
        format_response(True, [])
    with pytest.raises(ValueError):
        format_response(True, ["  "])
    with pytest.raises(TypeError):
        format_response(1, None)
    with pytest.raises(TypeError):
        format_response("Yes", ["x"])


@pytest.mark.parametrize(
    "label,reasons",
    [
        (True, None),
        (False, None),
        (True, ["The fox has the same fur and face."]),
        (False, ["Style: palettes differ (overlap 0.12).", "Identity: SSIM 0.05, L* 48 vs 16.", "Logic: 3 vs 4 panels?"]),
        (True, ["Numbers like 0.82 and 1.0 and 2x2 stay intact!"]),
    ],
)
def test_round_trip(label, reasons):
    text = format_response(label, reasons)
    got_label, got_reasons = parse_response(text)
    assert got_label is label
    assert got_reasons == (reasons or [])
    assert is_canonical(text)


def test_parse_rejects_wrong_start():
    for bad in ["yes. <reason>1. a.</reason>", "The answer is Yes.", "Yesterday it was fine.",
                "Not consistent.", "", "   ", "<reason>1. a</reason> Yes", "YES.", "- Yes"]:
        assert parse_response(bad) == (None, []), bad
    assert parse_response(None) == (None, [])


def test_parse_lenient_bodies():
    assert parse_response("  Yes") == (True, [])
    assert parse_response("No") == (False, [])
    assert parse_response("Yes, they match in style.") == (True, ["they match in style."])
    assert parse_response("No.\n1. The face differs.\n2. The palette differs\n") == (
        False, ["The face differs.", "The palette differs."])
    assert parse_response("Yes. <reason>1. a 2. b") == (True, ["a.", "b."])  # unclosed tag
    assert parse_response("Yes. <reason>\n1. a.\n2. b.\n</reason> trailing") == (True, ["a.", "b."])
    # markers must count up from 1: a stray "3. " inside reason 1 is not a split point
    label, reasons = parse_response("No. <reason>1. It has 3. parts 2. b.</reason>")
    assert label is False and reasons == ["It has 3 parts.", "b."]
    assert not is_canonical("Yes.\n<reason>1. a.</reason>")
    assert not is_canonical("yes.")


def test_sanitize_reason():
    assert sanitize_reason("  2. the <reason>palette</reason> differs ") == "the palette differs."
    assert sanitize_reason("it has 3. parts!") == "it has 3 parts!"
    assert sanitize_reason("- bullet") == "bullet."
    assert sanitize_reason("</reason>") == ""
    assert sanitize_reason("SSIM 0.82") == "SSIM 0.82."
