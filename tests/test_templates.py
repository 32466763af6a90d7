"""paco.core.templates: reference template strings, formatting errors, the judge and teacher instructions."""

from __future__ import annotations

import pytest

from paco.core import templates as T
from paco.core.templates import TEMPLATES, Template, judge_instruction, teacher_instruction
from paco.judge.response import NO, YES, parse_response

# ---------------------------------------------------------------------------------------------
# The reference strings, copied from X-GenGroup/PaCo-RL (commit cd3c428). They are written out
# here independently of paco/core/templates.py so that an edit there cannot silently change them.
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


def test_teacher_instruction_asks_for_the_answer_words_of_the_response_format():
    q = judge_instruction("a fox")
    for label, word in ((True, YES), (False, NO)):
        text = teacher_instruction(q, label, 2)
        assert f'The correct answer to this question is "{word}"' in text
        # the example response the teacher is shown reads as that answer
        example = text.rsplit("exactly like this: ", 1)[1]
        assert parse_response(example) == (label, ["First reason.", "Second reason."])


def test_the_templates_module_is_a_leaf():
    """paco.core.templates imports nothing from paco, so the data stages can use it and rewording a
    template reruns only the stages that ask the judge (their code dependencies)."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(T.__file__).read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert imported and not [m for m in imported if m.split(".")[0] == "paco"], imported
