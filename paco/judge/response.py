"""The judge's response format (the SFT target) and its parsing.

Response format (the SFT target; paper §3.2 and Fig. 2: the first token is the answer,
``Yes``/``No``, followed by CoT reasons; §7: the Fast variant is trained on ``"Yes."``/``"No."``)::

    Yes. <reason>1. first reason. 2. second reason.</reason>
    No.                                   # fast variant: reasons=None

The ``<reason>`` tag layout is the task statement's (``Yes. <reason>...</reason>``); the released
repository does not ship the PaCo-Dataset CoT files (they are on the Hugging Face hub), so the
exact tag/spacing convention could not be checked against the authors' data. The first token (``Yes``/``No``), which is all
the reward reads, is certain.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "YES",
    "NO",
    "REASON_OPEN",
    "REASON_CLOSE",
    "format_response",
    "parse_response",
    "is_canonical",
    "sanitize_reason",
]

#: the answer words, the first token of every response (the words the templates of
#: :mod:`paco.core.templates` ask for)
YES = "Yes"
NO = "No"
#: the tags around the reasons
REASON_OPEN = "<reason>"
REASON_CLOSE = "</reason>"

# A list marker "k. " at the start or after whitespace (not "0.82": no space after the dot).
_MARKER = re.compile(r"(?:(?<=\s)|^)(\d+)\.\s")
_TAGS = re.compile(r"</?\s*reason\s*>", re.IGNORECASE)
_ANSWER = re.compile(r"(Yes|No)\b")
_END_PUNCT = (".", "!", "?", '"', "'", ")")


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
