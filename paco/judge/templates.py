"""Judge prompt templates, the one chat layout, and the judge's response format.

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
* chat layout: the GRPO reward (OpenAI client to vLLM) sends one user turn ``[image, image,
  text]`` through the server's chat template; the offline vLLM evaluators hand-write the prompt
  and prefix the images with ``<img1>: `` / ``<img2>: `` labels (``apply_chat_template`` in
  consistency_scorer_vllm.py and editscore/mllm_tools/qwen25vl_vllm.py). We use the unlabelled
  layout everywhere (train, eval, reward): one layout for the whole pipeline.
* image encoding: the reference sends JPEG data URLs (``pil_image_to_base64`` always saves JPEG,
  whatever its ``format`` argument says); we send lossless PNG.

Chat layout (one user turn ``[image A, image B, text]``): :func:`build_messages` (transformers /
Qwen format, PIL images) and :func:`build_openai_messages` (OpenAI-compatible servers, base64
data URLs).

Response format (the SFT target; paper §3.2 and Fig. 2: the first token is the answer,
``Yes``/``No``, followed by CoT reasons; §7: the Fast variant is trained on ``"Yes."``/``"No."``)::

    Yes. <reason>1. first reason. 2. second reason.</reason>
    No.                                   # fast variant: reasons=None

The ``<reason>`` tag layout is the task statement's (``Yes. <reason>...</reason>``); the released
repository does not ship the PaCo-Dataset CoT files (they are on the Hugging Face hub), so the
exact tag/spacing convention
could not be checked against the authors' data. The first token (``Yes``/``No``), which is all
the reward reads, is certain.
"""

from __future__ import annotations

import base64
import io
import re
import string
from dataclasses import dataclass
from typing import Any

from PIL import Image

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
    "YES",
    "NO",
    "REASON_OPEN",
    "REASON_CLOSE",
    "get_template",
    "judge_instruction",
    "teacher_instruction",
    "build_messages",
    "build_openai_messages",
    "openai_error_message",
    "openai_retries",
    "image_data_url",
    "png_bytes",
    "format_response",
    "parse_response",
    "is_canonical",
    "sanitize_reason",
]

_REPO = "X-GenGroup/PaCo-RL@cd3c428"


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
        :class:`paco.judge.client.JudgeContextLengthError` when served).
    """
    if theme is None or not str(theme).strip():
        return RANK_COT.format()
    return T2IS_THEME.format(main_prompt=str(theme).strip())


def teacher_instruction(question: str, label: bool, max_reasons: int = 3) -> str:
    """The instruction sent to a CoT teacher: ``question`` plus the known answer and format.

    Raises:
        ValueError: ``max_reasons`` < 1, or a blank ``question``.
    """
    if int(max_reasons) < 1:
        raise ValueError(f"max_reasons must be >= 1, got {max_reasons}")
    return TEACHER_COT.format(question=question, answer=YES if label else NO, max_reasons=int(max_reasons))


# --------------------------------------------------------------------------------------------
# chat layout
# --------------------------------------------------------------------------------------------


def _check_text(text: Any) -> str:
    if not isinstance(text, str) or not text.strip():
        raise ValueError("the text item must be a non-empty str")
    return text


def build_messages(image_a: Any, image_b: Any, text: str) -> list[dict[str, Any]]:
    """The judge's chat layout for transformers / Qwen2.5-VL processors.

    One user turn ``[image A, image B, text]``; no system turn (the Qwen2.5-VL chat template adds
    its default ``"You are a helpful assistant."``).

    Args:
        image_a, image_b: PIL images (or anything the processor accepts as an image item).
        text: the question (e.g. :func:`judge_instruction`).

    Returns:
        ``[{"role": "user", "content": [{"type": "image", "image": image_a}, {"type": "image",
        "image": image_b}, {"type": "text", "text": text}]}]`` (a new list each call).

    Raises:
        ValueError: an image is ``None`` or the text is empty.
    """
    if image_a is None or image_b is None:
        raise ValueError("build_messages needs two images")
    return [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image_a},
                {"type": "image", "image": image_b},
                {"type": "text", "text": _check_text(text)},
            ],
        }
    ]


_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_JPEG_MAGIC = b"\xff\xd8\xff"


def image_data_url(data: bytes) -> str:
    """``data:image/png;base64,...`` (or ``image/jpeg``) for encoded image bytes.

    Raises:
        TypeError: ``data`` is not bytes.
        ValueError: ``data`` is neither PNG nor JPEG (checked by magic number).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"image data must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if data.startswith(_PNG_MAGIC):
        mime = "image/png"
    elif data.startswith(_JPEG_MAGIC):
        mime = "image/jpeg"
    else:
        raise ValueError("image data is neither PNG nor JPEG")
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def png_bytes(image: Image.Image, compress_level: int = 1) -> bytes:
    """Encode a PIL image as PNG (RGB, RGBA and L kept, other modes converted to RGB).

    ``compress_level`` 1 (zlib's fastest): lossless like any level, about 4x faster to encode
    than Pillow's default 6 for ~10% more bytes (a 128 px panel: 1.0 vs 3.8 ms), which matters
    because every judge request carries two images encoded on the trainer's CPU.
    """
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL image, got {type(image).__name__}")
    if image.mode not in ("RGB", "RGBA", "L"):
        image = image.convert("RGB")
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=compress_level)
    return buf.getvalue()


def build_openai_messages(png_a: bytes, png_b: bytes, text: str) -> list[dict[str, Any]]:
    """The judge's chat layout for OpenAI-compatible servers (vLLM, the CPU judge server).

    Args:
        png_a, png_b: encoded images (PNG; JPEG is also recognised).
        text: the question.

    Returns:
        ``[{"role": "user", "content": [{"type": "image_url", "image_url": {"url":
        "data:image/png;base64,..."}}, {... image B ...}, {"type": "text", "text": text}]}]``.

    Raises:
        TypeError, ValueError: see :func:`image_data_url`; empty text.
    """
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_data_url(png_a)}},
                {"type": "image_url", "image_url": {"url": image_data_url(png_b)}},
                {"type": "text", "text": _check_text(text)},
            ],
        }
    ]


# --------------------------------------------------------------------------------------------
# response format
# --------------------------------------------------------------------------------------------

YES = "Yes"
NO = "No"
REASON_OPEN = "<reason>"
REASON_CLOSE = "</reason>"

# A list marker "k. " at the start or after whitespace (not "0.82": no space after the dot).
_MARKER = re.compile(r"(?:(?<=\s)|^)(\d+)\.\s")
_TAGS = re.compile(r"</?\s*reason\s*>", re.IGNORECASE)
_ANSWER = re.compile(r"(Yes|No)\b")
_END_PUNCT = (".", "!", "?", '"', "'", ")")


def openai_error_message(exc: Any) -> str:
    """The server's own message of an ``openai.APIStatusError``: ``body.error.message`` (OpenAI,
    newer vLLM) or ``body.message`` (older vLLM), else the client's message."""
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if isinstance(body.get("message"), str):
            return body["message"]
    return str(getattr(exc, "message", exc))


def openai_retries(status: int | None) -> bool:
    """Whether the official ``openai`` client retries a failure with this HTTP status (``None``:
    no response, i.e. a connection error or a timeout): 408, 409, 429 and 5xx."""
    return status is None or status in (408, 409, 429) or status >= 500


def sanitize_reason(text: str) -> str:
    """Normalise one reason so that it survives :func:`format_response` / :func:`parse_response`.

    Removes ``<reason>`` tags, collapses whitespace, drops a leading list marker (``"2. "``,
    ``"- "``), rewrites an inner ``"<int>. "`` (which would read as a list marker) as
    ``"<int> "``, and ends the reason with a full stop if it has no closing punctuation.
    Returns ``""`` for a reason with no content.
    """
    s = _TAGS.sub(" ", str(text))
    s = " ".join(s.split())
    s = re.sub(r"^(?:\d+[.)]|[-*\u2022])\s*", "", s)
    s = re.sub(r"(?<=\s)(\d+)\.(?=\s)", r"\1", s)
    s = s.strip()
    if not s:
        return ""
    if not s.endswith(_END_PUNCT):
        s += "."
    return s


def format_response(label: bool, reasons: list[str] | None) -> str:
    """The judge's target response.

    Args:
        label: ``True`` -> ``"Yes"``, ``False`` -> ``"No"``.
        reasons: 1+ reasons, or ``None`` for the fast variant (bare answer).

    Returns:
        ``"Yes."`` / ``"No."`` (fast), or ``"Yes. <reason>1. r1 2. r2</reason>"`` with each
        reason passed through :func:`sanitize_reason`.

    Raises:
        TypeError: ``label`` is not a bool (numpy bools are accepted).
        ValueError: ``reasons`` is an empty list or a reason is empty after sanitising.
    """
    label = _as_bool(label)
    head = f"{YES if label else NO}."
    if reasons is None:
        return head
    if isinstance(reasons, str) or len(reasons) == 0:
        raise ValueError("reasons must be a non-empty list of str (use None for a bare answer)")
    items = []
    for i, r in enumerate(reasons, 1):
        s = sanitize_reason(r)
        if not s:
            raise ValueError(f"reason {i} is empty")
        items.append(f"{i}. {s}")
    return f"{head} {REASON_OPEN}{' '.join(items)}{REASON_CLOSE}"


def _as_bool(label: Any) -> bool:
    if isinstance(label, bool):
        return label
    import numpy as np

    if isinstance(label, np.bool_):
        return bool(label)
    raise TypeError(f"label must be a bool, got {type(label).__name__}")


def _split_numbered(body: str) -> list[str]:
    """Split ``"1. a 2. b"`` into ``["a", "b"]`` (markers must count up from 1)."""
    m = _MARKER.match(body)
    if not m or m.group(1) != "1":
        return [body] if body.strip() else []
    parts: list[str] = []
    start = m.end()
    k = 2
    while True:
        nxt = None
        for cand in _MARKER.finditer(body, start):
            if cand.group(1) == str(k):
                nxt = cand
                break
        if nxt is None:
            parts.append(body[start:])
            break
        parts.append(body[start:nxt.start()])
        start = nxt.end()
        k += 1
    return parts


def parse_response(text: str) -> tuple[bool | None, list[str]]:
    """Read a judge / teacher response.

    The answer is the first word after leading whitespace and must be exactly ``Yes`` or ``No``
    (case-sensitive, as the reward reads the ``Yes``/``No`` tokens): ``"yes"``, ``"Yesterday"``,
    ``"The answer is Yes"`` and ``"Not really"`` all give ``None``. Reasons are taken from the
    ``<reason>...</reason>`` block when present (a missing close tag reads to the end), else from
    the text after the answer; a ``1. ... 2. ...`` list is split into items; each item is
    passed through :func:`sanitize_reason`.

    Returns:
        ``(label, reasons)``: ``label`` is ``True``/``False`` or ``None`` when the response does
        not start with an answer (then ``reasons`` is ``[]``).
    """
    if not isinstance(text, str):
        return None, []
    s = text.strip()
    m = _ANSWER.match(s)
    if not m:
        return None, []
    label = m.group(1) == YES
    rest = s[m.end():]
    o = rest.find(REASON_OPEN)
    if o >= 0:
        c = rest.find(REASON_CLOSE, o)
        body = rest[o + len(REASON_OPEN): c if c >= 0 else len(rest)]
    else:
        body = re.sub(r"^[\s.,:;!\-]+", "", rest)
    body = " ".join(_TAGS.sub(" ", body).split())
    reasons = [r for r in (sanitize_reason(p) for p in _split_numbered(body)) if r]
    return label, reasons


def is_canonical(text: str) -> bool:
    """Whether ``text`` is exactly what :func:`format_response` writes for its own parse."""
    label, reasons = parse_response(text)
    if label is None:
        return False
    return text == format_response(label, reasons or None)
