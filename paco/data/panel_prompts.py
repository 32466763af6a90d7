"""Grid layouts and panel tags of T2IS prompts: ``"<ROWS>x<COLS>"`` and the tagged panel prompts.

The layout string is ROWS x COLS (:func:`parse_layout`); a grid prompt is a global description
followed by one ``<panel tag>: <panel prompt>`` per panel (:func:`parse_panel_prompts`). The
jsonl rows these come from: :mod:`paco.data.prompts`.

Panel tags
----------
A tag is one or two bracketed position words followed by ``:``, or ``PANEL-<k>:``.
Matching ignores case and whitespace (``[ top ] - [ Left ] :`` is ``[TOP]-[LEFT]:``).

* two rows or columns: ``TOP``/``BOTTOM``, ``LEFT``/``RIGHT`` -> ``[TOP]-[LEFT]:`` (2x2)
* three: ``TOP``/``MIDDLE``/``BOTTOM``, ``LEFT``/``MIDDLE``/``RIGHT`` -> ``[LEFT]:``,
  ``[MIDDLE]:``, ``[RIGHT]:`` (1x3), ``[TOP]:``, ``[MIDDLE]:``, ``[BOTTOM]:`` (3x1),
  ``[BOTTOM]-[MIDDLE]:`` (2x3)
* four: ``LEFT``, ``MIDDLE-LEFT``, ``MIDDLE-RIGHT``, ``RIGHT`` (rows: ``TOP``,
  ``MIDDLE-TOP``, ``MIDDLE-BOTTOM``, ``BOTTOM``) -> ``[TOP]-[MIDDLE-LEFT]:`` (2x4)
* five: ``LEFT``, ``MIDDLE-LEFT``, ``MIDDLE``, ``MIDDLE-RIGHT``, ``RIGHT`` (rows alike)
* any layout: ``PANEL-<k>:`` (also ``PANEL <k>:``, ``[PANEL-<k>]:``), k = 1 .. rows*cols in
  row-major order; the released 1x5 prompts use it.

An axis of size 1 is left out of the tag (``[LEFT]:`` in 1x3). ``CENTER``/``CENTRE`` mean
``MIDDLE``; a single bracket may hold both words (``[TOP-LEFT]:``); the row word comes first
but ``[LEFT]-[TOP]:`` is read too. Bracketed text made of other words (``[sic]:``) is prose.
Panel prompts are returned in row-major order of their tags' positions, not in text order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from paco.core.io import ArtifactError

__all__ = ["PromptFormatError", "parse_layout", "parse_panel_prompts"]


class PromptFormatError(ArtifactError):
    """A malformed prompt row (or layout string): says where (file, 1-based line) and why."""

    def __init__(self, reason: str, *, line: int | None = None, path: str | None = None):
        self.reason = reason
        self.line = line
        self.path = path
        where = [str(path)] if path is not None else []
        if line is not None:
            where.append(f"line {line}")
        super().__init__(f"{', '.join(where)}: {reason}" if where else reason)


_LAYOUT_RE = re.compile(r"^\s*(\d+)\s*[xX×⨉]\s*(\d+)\s*$")


def parse_layout(s: str) -> tuple[int, int]:
    """Parse ``"<ROWS>x<COLS>"`` into ``(rows, cols)``.

    ``x`` may also be ``X``, ``×`` or ``⨉``, with spaces around. Rows come first, as in
    T2IS-Bench: ``"1x3"`` is one row of three panels (a 512 x 1536 image).

    Raises:
        PromptFormatError: not a string, not of that form, a zero, or a single panel.
    """
    if not isinstance(s, str):
        raise PromptFormatError(f"layout must be a string like '2x2', got {type(s).__name__}")
    m = _LAYOUT_RE.match(s)
    if not m:
        raise PromptFormatError(f"bad layout {s!r}: expected '<rows>x<cols>' such as '2x2'")
    rows, cols = int(m.group(1)), int(m.group(2))
    if rows < 1 or cols < 1:
        raise PromptFormatError(f"bad layout {s!r}: rows and cols must be >= 1")
    if rows * cols < 2:
        raise PromptFormatError(f"bad layout {s!r}: an image set needs at least 2 panels")
    return rows, cols


_POSITION_TOKENS = frozenset({"TOP", "BOTTOM", "LEFT", "RIGHT", "MIDDLE", "CENTER", "CENTRE"})

_ROW_WORDS = {
    2: ("TOP", "BOTTOM"),
    3: ("TOP", "MIDDLE", "BOTTOM"),
    4: ("TOP", "MIDDLE-TOP", "MIDDLE-BOTTOM", "BOTTOM"),
    5: ("TOP", "MIDDLE-TOP", "MIDDLE", "MIDDLE-BOTTOM", "BOTTOM"),
}
_COL_WORDS = {
    2: ("LEFT", "RIGHT"),
    3: ("LEFT", "MIDDLE", "RIGHT"),
    4: ("LEFT", "MIDDLE-LEFT", "MIDDLE-RIGHT", "RIGHT"),
    5: ("LEFT", "MIDDLE-LEFT", "MIDDLE", "MIDDLE-RIGHT", "RIGHT"),
}

_BRACKET = r"\[\s*[A-Za-z0-9]+(?:[\s\-]+[A-Za-z0-9]+)*\s*\]"
_TAG_RE = re.compile(
    rf"(?P<br>{_BRACKET}(?:\s*-?\s*{_BRACKET})?)\s*:"
    r"|(?P<panel>\bPANEL[\s_\-#]*(?P<num>\d+))\s*:",
    re.IGNORECASE,
)
_PANEL_WORD_RE = re.compile(r"^PANEL-?(\d+)$")


def _norm_word(text: str) -> str:
    """``' middle  left '`` -> ``'MIDDLE-LEFT'``; CENTER/CENTRE -> MIDDLE."""
    tokens = [t for t in re.split(r"[\s\-]+", text.strip().upper()) if t]
    return "-".join("MIDDLE" if t in ("CENTER", "CENTRE") else t for t in tokens)


def _axis_index(word: str, n: int, words: Mapping[int, tuple[str, ...]]) -> int | None:
    names = words.get(n)
    if names is None or word not in names:
        return None
    return names.index(word)


def _split_compound(word: str, rows: int, cols: int) -> tuple[int, int] | None:
    """``'TOP-MIDDLE-LEFT'`` -> (row, col) by trying each hyphen split, row word first."""
    parts = word.split("-")
    for k in range(1, len(parts)):
        a, b = "-".join(parts[:k]), "-".join(parts[k:])
        r, c = _axis_index(a, rows, _ROW_WORDS), _axis_index(b, cols, _COL_WORDS)
        if r is not None and c is not None:
            return r, c
    for k in range(1, len(parts)):
        a, b = "-".join(parts[:k]), "-".join(parts[k:])
        c, r = _axis_index(a, cols, _COL_WORDS), _axis_index(b, rows, _ROW_WORDS)
        if r is not None and c is not None:
            return r, c
    return None


def _tag_position(groups: list[str], rows: int, cols: int) -> tuple[int, int] | None:
    """Position of a bracketed tag, or None when it does not fit the layout."""
    if len(groups) == 1:
        word = groups[0]
        m = _PANEL_WORD_RE.match(word)
        if m:
            return _panel_number_position(int(m.group(1)), rows, cols)
        if rows == 1:
            c = _axis_index(word, cols, _COL_WORDS)
            return None if c is None else (0, c)
        if cols == 1:
            r = _axis_index(word, rows, _ROW_WORDS)
            return None if r is None else (r, 0)
        return _split_compound(word, rows, cols)
    a, b = groups
    if rows == 1 or cols == 1:
        return None
    r, c = _axis_index(a, rows, _ROW_WORDS), _axis_index(b, cols, _COL_WORDS)
    if r is not None and c is not None:
        return r, c
    c, r = _axis_index(a, cols, _COL_WORDS), _axis_index(b, rows, _ROW_WORDS)
    if r is not None and c is not None:
        return r, c
    return None


def _panel_number_position(k: int, rows: int, cols: int) -> tuple[int, int] | None:
    if not 1 <= k <= rows * cols:
        return None
    return divmod(k - 1, cols)


def _is_tag_candidate(groups: list[str]) -> bool:
    """Bracketed text is a tag only if made of position words (or PANEL-k)."""
    for g in groups:
        if _PANEL_WORD_RE.match(g):
            continue
        if not g or any(t not in _POSITION_TOKENS for t in g.split("-")):
            return False
    return True


def parse_panel_prompts(prompt: str, rows: int, cols: int) -> tuple[str, list[str]]:
    """Split a grid prompt into its global description and rows*cols panel prompts.

    The global description is the text before the first panel tag; each panel prompt is the
    text after its tag up to the next tag, both stripped of surrounding whitespace. Panel
    prompts come back in row-major order of their tags' (row, col) positions, whatever order
    the tags appear in. Tag families and tolerance: see the module docstring.

    Raises:
        PromptFormatError: a tag that does not fit the layout, two tags for one position, a
            number of tags other than rows*cols, or an empty panel prompt.
    """
    if not isinstance(prompt, str):
        raise PromptFormatError(f"prompt must be a string, got {type(prompt).__name__}")
    tags: list[tuple[int, int, tuple[int, int], str]] = []  # (start, end, position, tag text)
    for m in _TAG_RE.finditer(prompt):
        text = re.sub(r"\s+", " ", m.group(0)).strip()
        if m.group("panel") is not None:
            pos = _panel_number_position(int(m.group("num")), rows, cols)
        else:
            groups = [_norm_word(g) for g in re.findall(r"\[([^\]]*)\]", m.group("br"))]
            if not _is_tag_candidate(groups):
                continue  # bracketed prose such as "[sic]:"
            pos = _tag_position(groups, rows, cols)
        if pos is None:
            raise PromptFormatError(f"panel tag {text!r} does not fit layout {rows}x{cols}")
        tags.append((m.start(), m.end(), pos, text))

    seen: dict[tuple[int, int], str] = {}
    for _, _, pos, text in tags:
        if pos in seen:
            raise PromptFormatError(
                f"duplicate panel position row {pos[0] + 1}, col {pos[1] + 1}: "
                f"tags {seen[pos]!r} and {text!r}"
            )
        seen[pos] = text

    need = rows * cols
    if len(tags) != need:
        raise PromptFormatError(
            f"found {len(tags)} panel tag(s), layout {rows}x{cols} needs {need}"
        )
    global_prompt = prompt[: tags[0][0]].strip()
    by_pos: dict[tuple[int, int], str] = {}
    for i, (_, end, pos, text) in enumerate(tags):
        stop = tags[i + 1][0] if i + 1 < len(tags) else len(prompt)
        body = prompt[end:stop].strip()
        if not body:
            raise PromptFormatError(f"empty panel prompt after tag {text!r}")
        by_pos[pos] = body
    return global_prompt, [by_pos[(r, c)] for r in range(rows) for c in range(cols)]

