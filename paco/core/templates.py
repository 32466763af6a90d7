"""The judge's and teacher's prompt templates, verbatim from the reference.

A leaf module (it imports nothing from ``paco``): the data stages that write judge questions
(:mod:`paco.data.edit_pairs`) and the judge (:mod:`paco.judge`) both read it, and the import
direction stays ``core <- data, models <- judge``. The chat layout that carries a question to the
judge is :mod:`paco.judge.chat`; the answer format is :mod:`paco.judge.response`.

Every string the judge (PaCo-Reward) is asked lives here as a named, versioned
:class:`Template`, with the text reproduced *exactly* from the authors' released code
(``X-GenGroup/PaCo-RL``, commit ``cd3c428``); each constant's ``source`` names the file. The
paper (arXiv 2512.04784 v2, App. 8 "Prompt Templates") prints slightly different strings; the
differences are listed below and in each constant's docstring. Where they differ, we use the
code's string, because that is what the released PaCo-Reward-7B was trained and evaluated with.

Templates (registry :data:`TEMPLATES`, by name; paths relative to the reference repository):

* ``t2is_theme`` (``main_prompt``): PaCo-GRPO/paco_grpo/rewards/consistency_scorer.py,
  ``prompt_template_version == 1``, the default of ``rewards.consistency_score`` and so the T2IS
  GRPO reward prompt. Paper App. 8 calls it "v2".
* ``t2is_theme_nodup`` (``main_prompt``): same file, ``prompt_template_version == 2`` (marked
  "# Not good" there).
* ``rank_cot`` (no fields): PaCo-Reward/evaluation/Consistency_Rank/consistency_scorer_vllm.py
  and consistency_scorer.py, ``prompt_template == 3``, the default of ``eval_vllm.py``: the
  theme-free ConsistencyRank prompt.
* ``rank_binary`` (no fields): same files, ``prompt_template == 2``.
* ``criteria_cot`` (``criteria``): PaCo-GRPO/paco_grpo/rewards/consistency_scorer.py,
  ``prompt_template_version == 0`` (and its ``else`` branch). Paper App. 8 "v1".
* ``criteria_binary`` (``criteria``): the ConsistencyRank scorers, ``prompt_template == 1``.
* ``edit_sc`` / ``edit_pf`` (``prompt``): PaCo-GRPO/paco_grpo/rewards/consistency_for_editing.py
  (``consistency_text_prompt`` / ``prompt_following_text_prompt``); the editing reward is
  ``sqrt(P_yes(SC) * P_yes(PF))`` (same file). Paper App. 8 "Image Editing (SC)/(PF)".
* ``edit_sc_bench`` / ``edit_pf_bench`` (``prompt``):
  PaCo-Reward/evaluation/Edit-Bench/editscore/__init__.py, class ``ConsistencyScore``
  (EditReward-Bench evaluation, paper Table 1).
* ``teacher_cot`` (``question``, ``answer``, ``max_reasons``): ours, the instruction given to a
  CoT teacher (the paper's GPT-5 annotation prompt is not released).

Paper vs code (noted, code wins):

* theme template: the paper prints ``... the theme: {main_prompt}`` (no quotes, no comma, a
  line break) and ``Answer "Yes" or "No" first``; the code has ``the theme: "{main_prompt}", do
  ...`` and ``Answer "Yes" and "No" first``. The paper calls it "v2", the code version 1.
* criteria template: paper ``Please answer "Yes" or "No" first, then ...`` (quoted); GRPO code
  ``Please answer Yes or No first, then ...`` (unquoted); the ConsistencyRank evaluation uses
  ``Please answer Yes or No.`` (no reasons).
* editing templates: paper ``Instruction: {prompt}.``; code ``Instruction: '{prompt}'.``
  (single quotes). EditReward-Bench evaluation uses the different ``*_bench`` wording.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Template",
    "TEMPLATES",
    "T2IS_THEME",
    "T2IS_THEME_NODUP",
    "RANK_COT",
    "RANK_BINARY",
    "CRITERIA_COT",
    "CRITERIA_BINARY",
    "EDIT_SC",
    "EDIT_PF",
    "EDIT_SC_BENCH",
    "EDIT_PF_BENCH",
    "TEACHER_COT",
    "get_template",
    "judge_instruction",
    "teacher_instruction",
]

_REPO = "X-GenGroup/PaCo-RL@cd3c428"

# The answer words every template asks for; the judge's response format
# (``paco.judge.response.YES`` / ``NO``) starts with one of them (a test checks they agree).
_YES = "Yes"
_NO = "No"


@dataclass(frozen=True)
class Template:
    """A named, versioned prompt template.

    Attributes:
        name: registry key, e.g. ``"t2is_theme"``.
        version: our version of this template (bump when the text changes; artifacts record
            :attr:`id`).
        text: the template, ``str.format`` syntax with named fields only.
        fields: the field names, exactly those that occur in ``text``.
        source: where the text comes from (repository path and branch of the reference code).

    Raises:
        ValueError: at construction, if ``fields`` differs from the fields in ``text`` or the
            text uses positional fields, conversions or format specs.
    """

    name: str
    version: int
    text: str
    fields: tuple[str, ...]
    source: str = ""

    def __post_init__(self) -> None:
        found: list[str] = []
        for _literal, field, spec, conv in string.Formatter().parse(self.text):
            if field is None:
                continue
            if not field.isidentifier() or spec or conv:
                raise ValueError(f"template {self.name!r}: unsupported field {{{field}}}")
            found.append(field)
        if set(found) != set(self.fields) or len(set(self.fields)) != len(self.fields):
            raise ValueError(
                f"template {self.name!r}: declared fields {self.fields} != fields in text {tuple(found)}"
            )

    @property
    def id(self) -> str:
        """``"<name>@v<version>"``, the identifier artifacts record."""
        return f"{self.name}@v{self.version}"

    def format(self, **kw: Any) -> str:
        """Fill the template.

        Args:
            **kw: exactly :attr:`fields`; values are ``str`` (or ``int``, converted with
                ``str``) and must not be blank.

        Returns:
            The filled text.

        Raises:
            KeyError: a field is missing.
            ValueError: an unexpected field is given, or a value is blank.
            TypeError: a value is not ``str``/``int``.
        """
        missing = [f for f in self.fields if f not in kw]
        if missing:
            raise KeyError(f"template {self.id}: missing field(s) {missing}")
        unexpected = sorted(set(kw) - set(self.fields))
        if unexpected:
            raise ValueError(f"template {self.id}: unexpected field(s) {unexpected}; expects {list(self.fields)}")
        values: dict[str, str] = {}
        for k, v in kw.items():
            if isinstance(v, bool) or not isinstance(v, (str, int)):
                raise TypeError(f"template {self.id}: field {k!r} must be str, got {type(v).__name__}")
            v = str(v)
            if not v.strip():
                raise ValueError(f"template {self.id}: field {k!r} is blank")
            values[k] = v
        return self.text.format(**values)


# --------------------------------------------------------------------------------------------
# the reference templates (verbatim)
# --------------------------------------------------------------------------------------------

#: T2IS pairwise consistency with the set's theme (the GRPO reward prompt for text-to-image-set).
#: ``main_prompt`` is the theme: the text before the first panel tag of the grid prompt
#: (``divide_prompt(prompt)[0]`` in PaCo-GRPO/paco_grpo/utils.py).
T2IS_THEME = Template(
    "t2is_theme",
    1,
    'Given two subfigures generated based on the theme: "{main_prompt}", do the two images '
    'maintain consistency in terms of style, logic and identity? Answer "Yes" and "No" first, '
    "and then provide detailed reasons.",
    ("main_prompt",),
    f"{_REPO} PaCo-GRPO/paco_grpo/rewards/consistency_scorer.py (prompt_template_version=1); "
    "paper App. 8 'Text-to-ImageSet (v2)'",
)

#: Variant 2 of the GRPO theme prompt, which penalises duplicates; the code marks it "Not good".
T2IS_THEME_NODUP = Template(
    "t2is_theme_nodup",
    1,
    'Given two subfigures generated based on the theme: "{main_prompt}", do the two images '
    "maintain consistency in terms of style, logic, and identity? If the two images look almost "
    'identical or duplicated, answer "No". Otherwise, answer "Yes" or "No" first, and then '
    "provide detailed reasons.",
    ("main_prompt",),
    f"{_REPO} PaCo-GRPO/paco_grpo/rewards/consistency_scorer.py (prompt_template_version=2)",
)

#: Theme-free pairwise consistency with reasons: the ConsistencyRank evaluation prompt (default).
RANK_COT = Template(
    "rank_cot",
    1,
    'Do the two images maintain consistency in terms of style, logic and identity? Answer "Yes" '
    'and "No" first, and then provide detailed reasons.',
    (),
    f"{_REPO} PaCo-Reward/evaluation/Consistency_Rank/consistency_scorer_vllm.py and "
    "consistency_scorer.py (prompt_template=3, default of eval_vllm.py)",
)

#: Theme-free pairwise consistency, binary answer only.
RANK_BINARY = Template(
    "rank_binary",
    1,
    'Do the two images maintain consistency in terms of style, logic and identity? Answer "Yes" '
    'and "No" only.',
    (),
    f"{_REPO} PaCo-Reward/evaluation/Consistency_Rank/consistency_scorer_vllm.py and "
    "consistency_scorer.py (prompt_template=2)",
)

#: Criteria prompt with reasons (one call per criterion text of the T2IS ``criteria`` JSON).
CRITERIA_COT = Template(
    "criteria_cot",
    1,
    "Do images meet the following criteria? {criteria} Please answer Yes or No first, then "
    "provide detailed reasons.",
    ("criteria",),
    f"{_REPO} PaCo-GRPO/paco_grpo/rewards/consistency_scorer.py (prompt_template_version=0); "
    "paper App. 8 'Text-to-ImageSet (v1)'",
)

#: Criteria prompt, binary answer (ConsistencyRank evaluation, template 1).
CRITERIA_BINARY = Template(
    "criteria_binary",
    1,
    "Do images meet the following criteria? {criteria} Please answer Yes or No.",
    ("criteria",),
    f"{_REPO} PaCo-Reward/evaluation/Consistency_Rank/consistency_scorer_vllm.py and "
    "consistency_scorer.py (prompt_template=1)",
)

#: Editing reward, semantic consistency (SC). Image 1 = original, image 2 = edited.
EDIT_SC = Template(
    "edit_sc",
    1,
    "Compare the edited image (second) with the original image (first). Instruction: "
    "'{prompt}'. Except for the parts that are intentionally changed according to the "
    "instruction, does the edited image remain consistent with the original in style, logic, "
    "and identity? Answer 'Yes' or 'No' first, then provide detailed reasons.",
    ("prompt",),
    f"{_REPO} PaCo-GRPO/paco_grpo/rewards/consistency_for_editing.py (consistency_text_prompt); "
    "paper App. 8 'Image Editing (SC)'",
)

#: Editing reward, prompt following (PF). Reward = sqrt(P_yes(SC) * P_yes(PF)).
EDIT_PF = Template(
    "edit_pf",
    1,
    "Compare the edited image (second) with the original image (first). Instruction: "
    "'{prompt}'. Does the edited image accurately follow this instruction? Answer 'Yes' or 'No' "
    "first, then provide detailed reasons.",
    ("prompt",),
    f"{_REPO} PaCo-GRPO/paco_grpo/rewards/consistency_for_editing.py "
    "(prompt_following_text_prompt); paper App. 8 'Image Editing (PF)'",
)

#: EditReward-Bench evaluation, consistency (overall = sqrt(PF * C)).
EDIT_SC_BENCH = Template(
    "edit_sc_bench",
    1,
    "Given two images after an edit with instruction '{prompt}', do they maintain consistency "
    "in terms of style, logic and identity? Answer 'Yes' or 'No' only.",
    ("prompt",),
    f"{_REPO} PaCo-Reward/evaluation/Edit-Bench/editscore/__init__.py (ConsistencyScore, "
    "consistency_text_prompt)",
)

#: EditReward-Bench evaluation, prompt following.
EDIT_PF_BENCH = Template(
    "edit_pf_bench",
    1,
    "Given two images after an edit with instruction '{prompt}', is the edit following the "
    "instruction well? Answer 'Yes' or 'No' only.",
    ("prompt",),
    f"{_REPO} PaCo-Reward/evaluation/Edit-Bench/editscore/__init__.py (ConsistencyScore, "
    "prompt_following_text_prompt)",
)

#: Our instruction for a CoT teacher (OpenAI-compatible or local VLM): the judge question, the
#: known answer, and the required response format. Not from the reference (not released).
TEACHER_COT = Template(
    "teacher_cot",
    1,
    "{question}\n\n"
    'The correct answer to this question is "{answer}". Do not change it. Write a response that '
    'starts with "{answer}." and then gives 1 to {max_reasons} short numbered reasons that justify '
    "this answer, based only on what is visible in the two images (identity, style, logic). Put "
    "the reasons inside <reason></reason> tags, exactly like this: "
    "{answer}. <reason>1. First reason. 2. Second reason.</reason>",
    ("question", "answer", "max_reasons"),
    "paco-pipeline (ours; the paper's GPT-5 annotation prompt is not released)",
)

#: All templates by name.
TEMPLATES: dict[str, Template] = {
    t.name: t
    for t in (
        T2IS_THEME,
        T2IS_THEME_NODUP,
        RANK_COT,
        RANK_BINARY,
        CRITERIA_COT,
        CRITERIA_BINARY,
        EDIT_SC,
        EDIT_PF,
        EDIT_SC_BENCH,
        EDIT_PF_BENCH,
        TEACHER_COT,
    )
}


def get_template(name: str) -> Template:
    """Return ``TEMPLATES[name]``.

    Raises:
        KeyError: unknown name (the message lists the known names).
    """
    try:
        return TEMPLATES[name]
    except KeyError:
        raise KeyError(f"unknown template {name!r}; known: {sorted(TEMPLATES)}") from None


def judge_instruction(theme: str | None) -> str:
    """The pairwise consistency question for a panel pair.

    Args:
        theme: the set's theme (main prompt); ``None`` or blank selects the theme-free
            ConsistencyRank prompt.

    Returns:
        ``T2IS_THEME.format(main_prompt=theme)`` or ``RANK_COT.format()``. The theme is used
        whole, as in the reference (``divide_prompt(prompt)[0]``); a theme too long for the
        judge's context is not truncated here but refused when scored
        (:class:`paco.judge.model.JudgeContextError` in process, a 400 /
        :class:`paco.serving.judge_client.JudgeContextLengthError` when served).
    """
    if theme is None or not str(theme).strip():
        return RANK_COT.format()
    return T2IS_THEME.format(main_prompt=str(theme).strip())


def teacher_instruction(question: str, label: bool, max_reasons: int = 3) -> str:
    """The instruction sent to a CoT teacher: ``question`` plus the known answer (``"Yes"`` for
    ``label`` true, else ``"No"``: the answer words of :mod:`paco.judge.response`) and format.

    Raises:
        ValueError: ``max_reasons`` < 1, or a blank ``question``.
    """
    if int(max_reasons) < 1:
        raise ValueError(f"max_reasons must be >= 1, got {max_reasons}")
    return TEACHER_COT.format(question=question, answer=_YES if label else _NO, max_reasons=int(max_reasons))
