"""The GEdit-Bench / VIEScore protocol (paper Table 4: SC, PQ, Overall for EN, EN-I, CN, CN-I),
exact to stepfun-ai/Step1X-Edit ``GEdit-Bench/`` (commit 570eba6e; paths below relative to it):
prompts verbatim from ``viescore/vie_prompts.py`` (:func:`sc_prompt`, :func:`pq_prompt`,
:func:`item_requests`), the edited image's preparation (:func:`prepare_edited`), the reply parser
``viescore/utils.py:mllm_output_to_dict`` (:func:`parse_reply`), SC / PQ / Overall with the
official re-query loop (:func:`item_scores`, :func:`score_item`: by default an item that still
does not parse after one re-query is unparsed, never scored; ``official_random=True`` reproduces
the official random guess) and ``calculate_statistics.py`` (:func:`aggregate`). Plus the
embedded default's stand-in for a reply, :func:`expected_score` (a tiny model writes no JSON).
"""

from __future__ import annotations

import json
import math
import numbers
import random
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
from PIL import Image

from paco.core.io import ArtifactError

#: The 11 task types in the official order (``test_gedit_score.py:14-16``,
#: ``calculate_statistics.py:9-11``).
OFFICIAL_TASK_TYPES: tuple[str, ...] = (
    "background_change", "color_alter", "material_alter", "motion_change", "ps_human", "style_change",
    "subject-add", "subject-remove", "subject-replace", "text_change", "tone_transfer")
#: The benchmark's ``instruction_language`` values (the result folders ``en/`` and ``cn/`` of
#: ``test_gedit_score.py:122-123``).
LANGUAGES: tuple[str, ...] = ("en", "cn")
#: The reply delimiter (``viescore/utils.py:165``).
DELIMITER = "||V^=^V||"

# --- prompts, verbatim (trailing spaces included) --------------------------------------------
#: ``vie_prompts._context_no_delimit`` (``viescore/vie_prompts.py:3-10``), the context that
#: ``viescore/__init__.py:41`` uses.
CONTEXT = (
    'You are a professional digital artist. You will have to evaluate the effectiveness of the AI-generated'
    ' image(s) based on given rules.\n'
    'All the input images are AI-generated. All human in the images are AI-generated too. so you need not worry'
    ' about the privacy confidentials.\n'
    '\n'
    'You will have to give your output in this way (Keep your reasoning concise and short.):\n'
    '{\n'
    '"score" : [...],\n'
    '"reasoning" : "..."\n'
    '}'
)
#: ``vie_prompts._prompts_0shot_two_image_edit_rule`` (``viescore/vie_prompts.py:245-251``).
TWO_IMAGE_EDIT_RULE = (
    'RULES:\n'
    '\n'
    'Two images will be provided: The first being the original AI-generated image and the second being an edited'
    ' version of the first.\n'
    'The objective is to evaluate how successfully the editing instruction has been executed in the second'
    ' image.\n'
    '\n'
    'Note that sometimes the two images might look identical due to the failure of image edit.\n'
)
#: ``vie_prompts._prompts_0shot_tie_rule_SC`` (``viescore/vie_prompts.py:326-333``); the
#: placeholder is :data:`INSTRUCTION_PLACEHOLDER`.
SC_RULE = (
    '\n'
    'From scale 0 to 10: \n'
    'A score from 0 to 10 will be given based on the success of the editing. (0 indicates that the scene in the'
    ' edited image does not follow the editing instruction at all. 10 indicates that the scene in the edited'
    ' image follow the editing instruction text perfectly.)\n'
    'A second score from 0 to 10 will rate the degree of overediting in the second image. (0 indicates that the'
    ' scene in the edited image is completely different from the original. 10 indicates that the edited image'
    ' can be recognized as a minimal edited yet effective version of original.)\n'
    "Put the score in a list such that output score = [score1, score2], where 'score1' evaluates the editing"
    " success and 'score2' evaluates the degree of overediting.\n"
    '\n'
    'Editing instruction: <instruction>\n'
)
#: ``vie_prompts._prompts_0shot_rule_PQ`` (``viescore/vie_prompts.py:359-376``).
PQ_RULE = (
    'RULES:\n'
    '\n'
    'The image is an AI-generated image.\n'
    'The objective is to evaluate how successfully the image has been generated.\n'
    '\n'
    'From scale 0 to 10: \n'
    'A score from 0 to 10 will be given based on image naturalness. \n'
    '(\n'
    '    0 indicates that the scene in the image does not look natural at all or give a unnatural feeling such'
    ' as wrong sense of distance, or wrong shadow, or wrong lighting. \n'
    '    10 indicates that the image looks natural.\n'
    ')\n'
    'A second score from 0 to 10 will rate the image artifacts. \n'
    '(\n'
    '    0 indicates that the image contains a large portion of distortion, or watermark, or scratches, or'
    ' blurred faces, or unusual body parts, or subjects not harmonized. \n'
    '    10 indicates the image has no artifacts.\n'
    ')\n'
    'Put the score in a list such that output score = [naturalness, artifacts]\n'
)
INSTRUCTION_PLACEHOLDER = "<instruction>"


class GEditError(ArtifactError):
    """A GEdit-Bench input (image, reply, score, row) is malformed or inconsistent."""


class MissingTaskTypeError(GEditError):
    """A task type has no scored item in a reported cell, so the macro mean is undefined."""


class NoScoreTokenError(GEditError):
    """None of the score tokens ``0``..``10`` is among a position's top log-probs."""


def sc_prompt(instruction: str) -> str:
    """The SC (semantic consistency) prompt for ``instruction``.

    ``"\\n".join([CONTEXT, TWO_IMAGE_EDIT_RULE, SC_RULE])`` with every ``<instruction>`` replaced
    by ``instruction`` (one ``str.replace`` pass on the joined text), as ``viescore/__init__.py:46``
    and ``:60-61`` do. It is asked with the images ``[input, edited]`` (``:37`` of
    ``test_gedit_score.py``, ``__init__.py:64``). The official GPT backend sends the text before
    the images (``viescore/mllm_tools/openai.py:103-126``), the Qwen2.5-VL backend the images
    before the text (``viescore/mllm_tools/qwen25vl_eval.py:66-73``).

    Raises:
        GEditError: ``instruction`` is not a string.
    """
    if not isinstance(instruction, str):
        raise GEditError(f"a GEdit-Bench instruction is a string, got {type(instruction).__name__}")
    return "\n".join([CONTEXT, TWO_IMAGE_EDIT_RULE, SC_RULE]).replace(INSTRUCTION_PLACEHOLDER, instruction)


def pq_prompt() -> str:
    """The PQ (perceptual quality) prompt: ``"\\n".join([CONTEXT, PQ_RULE])``
    (``viescore/__init__.py:47``), asked with the edited image alone (``__init__.py:65-66``:
    ``image_prompts[-1]``)."""
    return "\n".join([CONTEXT, PQ_RULE])


def prepare_edited(edited: Image.Image, source: Image.Image) -> Image.Image:
    """A new RGB image of ``source.size`` (width, height): ``edited.convert("RGB").resize(source.size)``
    as ``test_gedit_score.py:34``, i.e. PIL's default filter, for RGB ``Image.Resampling.BICUBIC``
    (Pillow >= 7; the official environment pins pillow 11.2.1, ``qwen25vl_environment.yml:129``);
    resized even when the sizes match. ``edited``: any PIL mode; ``source``: only its size is used
    (officially the stored file's, before any EXIF rotation).

    Raises:
        GEditError: either argument is not a PIL image, or the source has a zero side.
    """
    for name, im in (("edited", edited), ("source", source)):
        if not isinstance(im, Image.Image):
            raise GEditError(f"{name} image must be a PIL image, got {type(im).__name__}")
    if min(source.size) < 1:
        raise GEditError(f"source image has an empty size {source.size}")
    return edited.convert("RGB").resize(source.size, Image.Resampling.BICUBIC)


def item_requests(instruction: str, source: Image.Image,
                  edited: Image.Image) -> dict[str, tuple[str, list[Image.Image]]]:
    """``{"sc": (sc_prompt(instruction), [source, edited']), "pq": (pq_prompt(), [edited'])}``,
    ``edited' = prepare_edited(edited, source)``; the source as it is (``test_gedit_score.py:33``).
    Raises GEditError as :func:`sc_prompt` and :func:`prepare_edited`."""
    ready = prepare_edited(edited, source)
    return {"sc": (sc_prompt(instruction), [source, ready]), "pq": (pq_prompt(), [ready])}


# --- the reply parser -------------------------------------------------------------------------
_BARE_LIST = re.compile(r"^\[\d+, ?\d+\]$")  # viescore/utils.py:194 (``regex`` there; same here)


def _fix_json(text: str) -> str:
    """``viescore/utils.py:8-29``: quote ``word:`` keys, wrap number values in ``[]``, quote other
    non-literal values."""
    fixed = re.sub(r"(\w+):", r'"\1":', text)

    def value(m: re.Match[str]) -> str:
        key, val, comma = m.groups()
        val = val.strip()
        if re.match(r"^-?\d+(\.\d+)?$", val):
            val = f"[{val}]"
        elif not re.match(r"^(true|false|null)$", val, re.IGNORECASE):
            val = f'"{val}"'
        return f"{key}: {val}{comma}"

    return re.sub(r'(".*?"):(.*?)(,|})', value, fixed)


class _Raised(Exception):
    """An exception the official parser would let escape (``VIEScore.evaluate`` then fails)."""


def _official_dict(text: str, guess: Callable[[], int] | None) -> Any:
    """``mllm_output_to_dict(text, give_up_parsing=guess is not None)`` (``viescore/utils.py:154-235``).

    Returns what it returns: the parsed object, ``"rate_limit_exceeded"`` or ``False``. Raises
    :class:`_Raised` where it would raise (``json.loads`` of a bare list at ``:195``)."""
    if text == "rate_limit_exceeded":  # :161-162
        return text
    if text.count(DELIMITER) == 2:  # :167-173 (``verify`` repeats the count)
        start, end = text.find(DELIMITER) + len(DELIMITER), text.rfind(DELIMITER)
    else:
        start, end = text.find("{"), text.rfind("}") + 1  # :178-179
        if start == -1 or end == 0:
            start, end = text.find("["), text.rfind("]") + 1  # :184-185
            if guess is not None:  # :186-193: checked before the list and the integer forms
                made = {"score": [guess()], "reasoning": f"guess_if_cannot_parse | {text}"}
            elif _BARE_LIST.match(text[start:end]):  # :194-202
                try:
                    scores = json.loads(text[start:end])
                except ValueError as exc:
                    raise _Raised(f"json.loads of the bare list failed: {exc}") from None
                made = {"score": scores if isinstance(scores, list) else [scores], "reasoning": ""}
            elif _int_0_to_10(text):  # :203-209: ``int()`` of the whole reply
                made = {"score": [int(text)], "reasoning": ""}
            else:
                return False  # :210-212
            text = json.dumps(made)
            start, end = 0, len(text)
    if not (start != -1 and end != -1 and start != end):  # :215, :233-235
        return False
    body = text[start:end].strip().replace("\n", "")  # :217-218
    try:  # :220-223: the score is wrapped in a list only on this path
        data = json.loads(body)
        if not isinstance(data["score"], list):
            data["score"] = [data["score"]]
        return data
    except Exception:  # :224-231: the fallback returns whatever fix_json's text decodes to
        try:
            return json.loads(_fix_json(body))
        except Exception:
            return False


def _int_0_to_10(text: str) -> bool:  # is_int_between_0_and_10, viescore/utils.py:101-106
    try:
        return 0 <= int(text) <= 10
    except ValueError:
        return False


def _usable(obj: Any) -> list[int | float] | None:
    """The score list if ``VIEScore.evaluate`` can take ``min`` of ``obj["score"]``
    (``viescore/__init__.py:84-94``) and get a finite number; else ``None``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("score"), list) or not obj["score"]:
        return None
    scores = obj["score"]
    try:  # a 400-digit integer overflows float(): math.sqrt fails there officially
        ok = all(isinstance(s, numbers.Real) and not isinstance(s, (bool, np.bool_)) and math.isfinite(float(s))
                 for s in scores)
    except OverflowError:
        return None
    return list(scores) if ok else None


def parse_reply(text: str) -> list[int | float] | None:
    """The score list of an evaluator reply, exactly as ``mllm_output_to_dict`` (first try,
    ``give_up_parsing=False``) and then ``VIEScore.evaluate`` read it; ``None``: unparsed.

    Order (``viescore/utils.py:154-235``):

    1. exactly two ``||V^=^V||`` delimiters: the text between them (three or one: not this path);
    2. else from the first ``{`` to the last ``}``; if the text has no ``{`` or no ``}``:
       a bare list, the text from the first ``[`` to the last ``]`` matching
       ``^\\[\\d+, ?\\d+\\]$`` (exactly two non-negative integers, one optional space, any
       other text around them ignored; not range-checked: ``[11, 99]`` parses), else the whole
       reply if ``int()`` reads it as 0..10 (so ``" 7\\n"``, ``"+7"``, ``"1_0"`` -> 10 and
       ``"٧"`` parse; ``"7.0"`` and ``"7/10"`` do not);
    3. the slice is stripped and its ``"\\n"`` removed (``{"score": [7\\n8]}`` reads ``[78]``),
       then ``json.loads``; a non-list ``score`` becomes ``[score]``;
    4. if that fails (bad JSON, no ``score`` key, not an object), ``fix_json`` (quote ``word:``
       keys, wrap bare numbers in ``[]``: ``{score: 7}`` -> ``[7]``) and ``json.loads`` again,
       *without* the list wrapping.

    The result must then be one that ``min`` / ``math.sqrt`` in ``VIEScore.evaluate``
    (``viescore/__init__.py:91-95``) accept; where they would raise (no ``score`` key, a scalar
    from step 4, an empty list, strings, nested lists) the official item is re-evaluated
    (``test_gedit_score.py:31-59``), so here it is unparsed. Scores are not range-checked
    (``{"score": [15, -3]}`` -> ``[15, -3]``, as officially). Two deliberate deviations: a bool
    (``true``) or a non-finite number (``NaN``, ``Infinity``, both accepted by ``json.loads``) in
    the list makes the reply unparsed here, where the official code would score ``True`` as 1
    or propagate NaN into the means. The sentinel reply ``"rate_limit_exceeded"`` (``:161``)
    makes the official ``evaluate`` raise (``__init__.py:84-86``): unparsed here.

    Returns the scores (ints or floats, in reply order, at least one) or ``None``; raises
    :class:`GEditError` when ``text`` is not a string.
    """
    if not isinstance(text, str):
        raise GEditError(f"an evaluator reply is a string, got {type(text).__name__}")
    try:
        return _usable(_official_dict(text, None))
    except _Raised:
        return None


# --- one item's scores ------------------------------------------------------------------------
def item_scores(sc_scores: Sequence[int | float], pq_scores: Sequence[int | float]) -> tuple[float, float, float]:
    """``(SC, PQ, Overall)`` of one item: ``SC = min(sc_scores)``, ``PQ = min(pq_scores)``,
    ``Overall = math.sqrt(SC * PQ)`` (``viescore/__init__.py:91-95``; recomputed the same way by
    ``calculate_statistics.py:56``); no rounding (the official script prints 3 decimals,
    ``calculate_statistics.py:144-153``).

    Returns:
        Three floats; SC and PQ in the replies' own range (0..10 when the evaluator obeys).

    Raises:
        GEditError: an empty list, a value that is not a finite real number (bools excluded), or
            ``SC * PQ < 0`` (``math.sqrt`` fails there officially and the item is re-evaluated).
    """
    out = []
    for name, scores in (("SC", sc_scores), ("PQ", pq_scores)):
        vals = _usable({"score": list(scores)}) if isinstance(scores, (list, tuple)) else None
        if vals is None:
            raise GEditError(f"{name} scores must be a non-empty list of finite numbers, got {scores!r:.80}")
        out.append(min(vals))
    sc, pq = out
    if sc * pq < 0:
        raise GEditError(f"SC {sc} x PQ {pq} is negative: no Overall (math.sqrt fails officially)")
    return float(sc), float(pq), math.sqrt(sc * pq)


def _state(text: str, guess: Callable[[], int] | None) -> tuple[str, Any]:
    """One reply's official outcome: ``("raise", None)``, ``("false", None)`` or ``("done", obj)``."""
    if not isinstance(text, str):
        raise GEditError(f"an evaluator reply is a string, got {type(text).__name__}")
    try:
        obj = _official_dict(text, guess)
    except _Raised:
        return "raise", None
    return ("false", None) if obj is False else ("done", obj)


def score_item(ask: Callable[[str, int], str], *, official_random: bool = False, seed: int | None = None,
               max_rounds: int = 20) -> dict[str, Any]:
    """Ask and score one item with the official re-query loop (``viescore/__init__.py:72-95``).

    Each round asks SC then PQ (``ask("sc", round)``, ``ask("pq", round)``, rounds counted from 0
    so an answer cache can key on them) and parses both, SC first; the last round's two replies
    are the item's (the official loop discards earlier ones even when they parsed).

    * Default (``official_random=False``): one round, and if either reply does not give a usable
      score list (:func:`parse_reply`) or ``SC * PQ < 0``, one more round; then the item is
      unparsed if either still fails: ``sc``, ``pq``, ``overall`` are ``None``, never a score.
    * ``official_random=True``: the official behaviour. From the second round of an
      ``evaluate`` call on, a reply with no ``{`` or no ``}`` scores ``[randint(0, 10)]``,
      even a parseable ``"7"`` or ``"[6, 0]"`` (``viescore/utils.py:186-193`` comes before
      ``:194``); a reply with braces that does not parse asks again (``__init__.py:76``);
      where the official ``evaluate`` raises (a bare list ``json.loads`` rejects, a dict without
      a usable ``score`` once both parsed, ``SC * PQ < 0``), ``test_gedit_score.py:31-59``
      calls it again from scratch, so the guessing starts only on the round after next. Each
      round draws from a fresh ``random.Random(seed)``, SC's guess first, then PQ's: the
      official Qwen2.5-VL backend reseeds Python's ``random`` with 42 before every query
      (``viescore/mllm_tools/qwen25vl_eval.py:31-40,77``), so ``seed=42`` reproduces it (one
      worker thread); the GPT backend draws from the unseeded global generator, which no seed
      reproduces. The official loop is unbounded; after ``max_rounds`` rounds the item is
      unparsed here.

    Args:
        ask: ``(kind, round) -> reply text``, kind ``"sc"`` or ``"pq"`` (see :func:`item_requests`).
        official_random, seed: the official random guess, with an int seed (used only there).
        max_rounds: the cap on rounds with ``official_random`` (>= 2).

    Returns:
        ``{"sc", "pq", "overall"}`` (floats or ``None``), ``"sc_scores"``, ``"pq_scores"`` (lists
        or ``None``), ``"sc_reply"``, ``"pq_reply"`` (the last round's texts), ``"parsed"``
        (bool), ``"rounds"`` (int), ``"guessed"`` (the kinds whose score is a random guess);
        ``*_scores`` is ``None`` where that reply gave no usable list (the item is then unparsed).

    Raises:
        GEditError: ``ask`` returns a non-string; ``official_random`` without an int ``seed``;
            ``max_rounds < 2``.
    """
    if official_random and (isinstance(seed, bool) or not isinstance(seed, int) or max_rounds < 2):
        raise GEditError(f"official_random needs an integer seed and max_rounds >= 2, got {seed!r}, {max_rounds}")
    limit = max_rounds if official_random else 2
    tries = 0  # the official ``tries`` of the current ``evaluate`` call
    result: dict[str, Any] = {}
    for rnd in range(limit):
        tries += 1
        rng = random.Random(seed)  # fresh each round (the Qwen backend's set_seed before each query)
        replies = {kind: ask(kind, rnd) for kind in ("sc", "pq")}
        drawn: list[str] = []  # the kinds guessed this round, SC's draw first (viescore/utils.py:187)
        states: dict[str, tuple[str, Any]] = {}
        for kind in ("sc", "pq"):
            guess = (lambda k=kind: (drawn.append(k), rng.randint(0, 10))[1]) if official_random and tries > 1 else None
            states[kind] = _state(replies[kind], guess)
            if states[kind][0] == "raise":
                break  # the exception leaves ``evaluate`` before PQ is parsed
        lists = {k: (_usable(states[k][1]) if states[k][0] == "done" else None) if k in states
                 else parse_reply(replies[k]) for k in ("sc", "pq")}  # PQ left unparsed by a raise: as on try 1
        result = _item_result(replies, lists, rnd + 1, drawn)
        if result["parsed"]:
            return result
        if any(s[0] == "raise" for s in states.values()) or all(s[0] == "done" for s in states.values()):
            tries = 0  # ``evaluate`` raised: the item is evaluated again from scratch
    return result


def _item_result(replies: dict[str, str], lists: dict[str, Any], rounds: int, drawn: list[str]) -> dict[str, Any]:
    sc_list, pq_list = lists.get("sc"), lists.get("pq")
    sc = pq = overall = None
    if sc_list is not None and pq_list is not None:
        try:
            sc, pq, overall = item_scores(sc_list, pq_list)
        except GEditError:
            sc = pq = overall = None
    return {"sc": sc, "pq": pq, "overall": overall, "sc_scores": sc_list, "pq_scores": pq_list,
            "sc_reply": replies["sc"], "pq_reply": replies["pq"], "parsed": overall is not None,
            "rounds": rounds, "guessed": drawn}


# --- aggregation ------------------------------------------------------------------------------
def _field(row: Mapping[str, Any], names: tuple[str, ...], where: str) -> Any:
    """The value under the first of ``names`` (the benchmark's, ``edits.parquet``'s spelling)."""
    found = [(n, row[n]) for n in names if n in row]
    if not found:
        raise GEditError(f"{where}: no {' / '.join(names)} field")
    if any(bool(v != found[0][1]) for _, v in found[1:]):
        raise GEditError(f"{where}: {found[0][0]} {found[0][1]!r} and {found[1][0]} {found[1][1]!r} disagree")
    return found[0][1]


def _missing(v: Any) -> bool:  # None, or NaN (pandas' None in a float column)
    return v is None or (isinstance(v, float) and math.isnan(v))


def _row_scores(row: Mapping[str, Any], where: str) -> tuple[float, float, float] | None:
    """``(SC, PQ, Overall)`` of a scored row, ``None`` for an unparsed one."""
    sc, pq = _field(row, ("sc",), where), _field(row, ("pq",), where)
    unparsed = _missing(sc)
    if "parsed" in row and (not isinstance(row["parsed"], (bool, np.bool_)) or bool(row["parsed"]) == unparsed):
        raise GEditError(f"{where}: parsed={row['parsed']!r} (a bool) but sc={sc!r}, pq={pq!r}")
    if _missing(sc) != _missing(pq):
        raise GEditError(f"{where}: sc={sc!r} and pq={pq!r}: an item is scored or unparsed as a whole")
    if unparsed:
        return None
    try:
        return item_scores([sc], [pq])
    except GEditError as exc:
        raise GEditError(f"{where}: {exc}") from None


def _intersection(row: Mapping[str, Any], where: str) -> bool:
    v = _field(row, ("Intersection_exist", "intersection_exist"), where)
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    raise GEditError(f"{where}: Intersection_exist must be a bool, got {v!r} (a string is truthy officially)")


def _cell_summary(per_task: dict[str, list[tuple[float, float, float]]], unparsed: Counter, task_types: Sequence[str],
                  cell: str, require_all: bool) -> dict[str, Any]:
    tasks: dict[str, Any] = {}
    means: list[tuple[float, float, float]] = []
    missing = []
    for tt in task_types:
        got = per_task.get(tt, [])
        if not got:
            if require_all:
                raise MissingTaskTypeError(f"{cell}: no scored item of task type {tt!r} ({unparsed[tt]} unparsed); "
                                           f"the official mean over task types would be NaN")
            missing.append(tt)
            tasks[tt] = {"sc": None, "pq": None, "overall": None, "items": 0, "unparsed": unparsed[tt]}
            continue
        m = tuple(float(np.mean([g[i] for g in got])) for i in range(3))  # calculate_statistics.py:66-78
        means.append(m)
        tasks[tt] = {"sc": m[0], "pq": m[1], "overall": m[2], "items": len(got), "unparsed": unparsed[tt]}
    top = [float(np.mean([m[i] for m in means])) if means else None for i in range(3)]  # :84-117
    return {"sc": top[0], "pq": top[1], "overall": top[2], "items": sum(t["items"] for t in tasks.values()),
            "unparsed": sum(t["unparsed"] for t in tasks.values()), "task_types": tasks,
            "missing_task_types": missing}


def aggregate(rows: pd.DataFrame | Iterable[Mapping[str, Any]], *, task_types: Sequence[str] = OFFICIAL_TASK_TYPES,
              languages: Sequence[str] = LANGUAGES, intersection: bool = True,
              require_all_task_types: bool = True) -> dict[str, Any]:
    """GEdit-Bench's reported figures, exact to ``calculate_statistics.py:13-122``: per language
    ``L`` (compared stripped and case-insensitively; officially ``==``, ``:51``) and task type the
    mean SC, PQ and Overall of its scored rows (Overall per row, ``sqrt(SC * PQ)``, then averaged:
    ``:56``, ``:66-68``); the cell's figure is the unweighted ``np.mean`` of the task-type means
    (``:84-117``), so a task type with more items weighs no more. Cell ``L_i``: the same on the
    rows with ``Intersection_exist`` true (``:61-64``, ``:73-78``). Unparsed rows are excluded and
    counted (officially an item that never scores is dropped: ``test_gedit_score.py:57-59``). The
    official CLI offers ``--language en|zh`` (``:130``) while the data say ``cn``.

    Args:
        rows: one per item: ``task_type`` (str), ``instruction_language`` or ``language`` (str),
            ``Intersection_exist`` or ``intersection_exist`` (bool; only with ``intersection``),
            ``sc`` and ``pq`` (numbers, both ``None``/NaN when unparsed) and optionally
            ``parsed`` (bool, must agree), e.g. :func:`score_item`'s output joined with the
            item's fields.
        task_types: the task types averaged, in order (default the official 11).
        languages: the language cells (default ``en``, ``cn``).
        intersection: also report the ``L_i`` cells.
        require_all_task_types: a task type with no scored row in a cell raises (the official
            mean would be NaN); off, it is left out of that cell's mean and listed.

    Returns:
        ``{cell: {"sc", "pq", "overall" (float; None with no scored row), "items", "unparsed",
        "task_types": {task type: the same}, "missing_task_types": [...]}}`` for the cells ``L``
        and ``L_i``; ``"other_task_types"``, ``"other_languages"``: value -> count of unused rows.

    Raises:
        GEditError: a row without a needed field, a non-bool intersection or ``parsed``, ``sc``
            without ``pq``, a negative ``SC * PQ``, or a non-string language / task type.
        MissingTaskTypeError: see ``require_all_task_types``.
    """
    records = rows.to_dict("records") if isinstance(rows, pd.DataFrame) else list(rows)
    wanted = {str(lang).strip().casefold(): str(lang) for lang in languages}
    tasks_set = set(task_types)
    cells = {f"{lang}{suffix}": ({}, Counter()) for lang in wanted.values() for suffix in
             (("", "_i") if intersection else ("",))}
    other_tasks, other_langs = Counter(), Counter()
    for i, row in enumerate(records):
        where = f"row {i}"
        if not isinstance(row, Mapping):
            raise GEditError(f"{where}: not a mapping ({type(row).__name__})")
        lang, tt = _field(row, ("instruction_language", "language"), where), _field(row, ("task_type",), where)
        if not isinstance(lang, str) or not isinstance(tt, str):
            raise GEditError(f"{where}: language {lang!r} and task_type {tt!r} must be strings")
        scores = _row_scores(row, where)
        key = lang.strip().casefold()
        if key not in wanted:
            other_langs[lang] += 1
            continue
        if tt not in tasks_set:
            other_tasks[tt] += 1
            continue
        names = [wanted[key]] + ([f"{wanted[key]}_i"] if intersection and _intersection(row, where) else [])
        for name in names:
            per_task, unparsed = cells[name]
            if scores is None:
                unparsed[tt] += 1
            else:
                per_task.setdefault(tt, []).append(scores)
    out: dict[str, Any] = {name: _cell_summary(per_task, unparsed, list(task_types), name, require_all_task_types)
                           for name, (per_task, unparsed) in cells.items()}
    out["other_task_types"] = dict(sorted(other_tasks.items()))
    out["other_languages"] = dict(sorted(other_langs.items()))
    return out


# --- the embedded default's expected score ------------------------------------------------------
SCORE_TOKENS: tuple[str, ...] = tuple(str(k) for k in range(11))


def _entries(top: Mapping[str, float] | Sequence[Mapping[str, Any]], what: str) -> list[tuple[str, float]]:
    items = list(top.items()) if isinstance(top, Mapping) else [
        (e.get("token"), e.get("logprob")) if isinstance(e, Mapping) else (e, None) for e in top]
    for token, lp in items:
        if not isinstance(token, str):
            raise GEditError(f"{what}: invalid token {token!r:.60} (a top_logprobs entry is {{token: logprob}})")
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or math.isnan(lp) or lp > 0:
            raise GEditError(f"{what}: invalid logprob {lp!r:.60} for token {token!r:.60} (a log-probability is "
                             f"a number <= 0, -inf allowed)")
    return [(t, float(lp)) for t, lp in items]


def expected_score(top_logprobs: Mapping[str, float] | Sequence[Mapping[str, Any]], *,
                   after_one: Mapping[str, float] | Sequence[Mapping[str, Any]] | None = None) -> float:
    """``sum_k k p_k / sum_k p_k`` over the score tokens ``k = 0..10`` among one position's top
    log-probs (``p_k = exp(logprob)``, renormalised over those present): the embedded default's
    stand-in for a VIEScore reply, not the official protocol (which parses text, :func:`parse_reply`).

    A token counts for ``k`` when its text stripped of whitespace is ``str(k)`` (``"7"``, ``" 7"``;
    several add up). ``"10"``: tokenizers with multi-digit number tokens (o200k, Llama 3) have a
    ``"10"`` token, counted for 10; Qwen2.5-VL and Gemma 3 split digits, so a 10 starts with ``"1"``,
    which without ``after_one`` counts wholly for 1 (a downward bias). With ``after_one`` (the top
    log-probs of the position after a ``"1"``), ``P(10) += P("1") q`` and ``P(1) = P("1") (1 - q)``,
    ``q = exp(logprob)`` of the exact token ``"0"`` there (0 if absent).

    Args:
        top_logprobs: ``{token: logprob}`` or the OpenAI / vLLM ``[{"token", "logprob"}, ...]``.
        after_one: the same for the position after a ``"1"`` (optional).

    Returns:
        A float in [0, 10].

    Raises:
        NoScoreTokenError: no score token is present (or all have log-prob ``-inf``).
        GEditError: a malformed entry (non-string token; logprob a bool, NaN or > 0).
    """
    entries = _entries(top_logprobs, "top_logprobs")
    found = [(int(t.strip()), lp) for t, lp in entries if t.strip() in SCORE_TOKENS and lp > -math.inf]
    if not found:
        raise NoScoreTokenError(f"none of the score tokens 0..10 among the top tokens {[t for t, _ in entries][:8]}")
    top = max(lp for _, lp in found)  # weights relative to the largest: no underflow to 0
    mass = [0.0] * 11
    for k, lp in found:
        mass[k] += math.exp(lp - top)
    if after_one is not None:
        q = sum(math.exp(lp) for t, lp in _entries(after_one, "after_one") if t == "0")
        if q > 1 + 1e-9:
            raise GEditError(f"after_one: P('0') = {q} > 1")
        mass[10], mass[1] = mass[10] + mass[1] * min(q, 1.0), mass[1] * (1.0 - min(q, 1.0))
    return sum(k * m for k, m in enumerate(mass)) / sum(mass)
