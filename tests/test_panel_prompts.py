"""paco.data.panel_prompts: grid layouts and panel tags (every tag family, order, tolerance, errors)."""

from __future__ import annotations

import itertools
import random

import pytest

from paco.data import panel_prompts as P
from paco.data.panel_prompts import PromptFormatError

TAGS_2X2 = ["[TOP]-[LEFT]", "[TOP]-[RIGHT]", "[BOTTOM]-[LEFT]", "[BOTTOM]-[RIGHT]"]
TAGS_2X3 = ["[TOP]-[LEFT]", "[TOP]-[MIDDLE]", "[TOP]-[RIGHT]",
            "[BOTTOM]-[LEFT]", "[BOTTOM]-[MIDDLE]", "[BOTTOM]-[RIGHT]"]


def grid(tags: list[str], head: str = "FOUR-PANEL Images of a cat.") -> str:
    """A grid prompt whose k-th tag (in the given list order) carries text 'p<k>'."""
    return head + " " + " ".join(f"{t}:p{k} text." for k, t in enumerate(tags))



# --------------------------------------------------------------------------------------------
# layout
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "s, expected",
    [("2x2", (2, 2)), ("1x3", (1, 3)), ("3x1", (3, 1)), ("2x3", (2, 3)), (" 2 X 4 ", (2, 4)),
     ("1×5", (1, 5)), ("3⨉3", (3, 3))],
)
def test_parse_layout_is_rows_by_cols(s, expected):
    assert P.parse_layout(s) == expected


@pytest.mark.parametrize("s", ["2x", "x2", "2*2", "0x3", "2x0", "1x1", "two by two", "", 4, None])
def test_parse_layout_rejects(s):
    with pytest.raises(PromptFormatError):
        P.parse_layout(s)


# --------------------------------------------------------------------------------------------
# panel tags
# --------------------------------------------------------------------------------------------

FAMILIES = {
    "2x2": (2, 2, TAGS_2X2),
    "1x3": (1, 3, ["[LEFT]", "[MIDDLE]", "[RIGHT]"]),
    "3x1": (3, 1, ["[TOP]", "[MIDDLE]", "[BOTTOM]"]),
    "2x3": (2, 3, TAGS_2X3),
    "2x4": (2, 4, ["[TOP]-[LEFT]", "[TOP]-[MIDDLE-LEFT]", "[TOP]-[MIDDLE-RIGHT]", "[TOP]-[RIGHT]",
                   "[BOTTOM]-[LEFT]", "[BOTTOM]-[MIDDLE-LEFT]", "[BOTTOM]-[MIDDLE-RIGHT]",
                   "[BOTTOM]-[RIGHT]"]),
    "1x4": (1, 4, ["[LEFT]", "[MIDDLE-LEFT]", "[MIDDLE-RIGHT]", "[RIGHT]"]),
    "3x2": (3, 2, ["[TOP]-[LEFT]", "[TOP]-[RIGHT]", "[MIDDLE]-[LEFT]", "[MIDDLE]-[RIGHT]",
                   "[BOTTOM]-[LEFT]", "[BOTTOM]-[RIGHT]"]),
    "3x3": (3, 3, [f"[{r}]-[{c}]" for r in ("TOP", "MIDDLE", "BOTTOM")
                   for c in ("LEFT", "MIDDLE", "RIGHT")]),
    "1x5 PANEL-k": (1, 5, [f"PANEL-{k}" for k in range(1, 6)]),
    "2x2 PANEL-k": (2, 2, [f"PANEL-{k}" for k in range(1, 5)]),
    "2x2 single bracket": (2, 2, ["[TOP-LEFT]", "[TOP-RIGHT]", "[BOTTOM-LEFT]", "[BOTTOM-RIGHT]"]),
    "1x3 CENTER": (1, 3, ["[LEFT]", "[CENTER]", "[RIGHT]"]),
    "2x4 single bracket": (2, 4, ["[TOP-LEFT]", "[TOP-MIDDLE-LEFT]", "[TOP-MIDDLE-RIGHT]",
                                  "[TOP-RIGHT]", "[BOTTOM-LEFT]", "[BOTTOM-MIDDLE-LEFT]",
                                  "[BOTTOM-MIDDLE-RIGHT]", "[BOTTOM-RIGHT]"]),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_tag_family_in_row_major_order(name):
    rows, cols, tags = FAMILIES[name]
    head = "Images of a cat. All share one style."
    g, panels = P.parse_panel_prompts(grid(tags, head), rows, cols)
    assert g == head
    assert panels == [f"p{k} text." for k in range(rows * cols)]


@pytest.mark.parametrize("name", ["2x2", "2x3", "3x1", "2x4", "1x5 PANEL-k", "2x2 single bracket"])
def test_tag_order_does_not_matter(name):
    rows, cols, tags = FAMILIES[name]
    rng = random.Random(0)
    perms = (list(itertools.permutations(range(len(tags)))) if len(tags) <= 4
             else [rng.sample(range(len(tags)), len(tags)) for _ in range(20)])
    for perm in perms:
        shuffled = [tags[i] for i in perm]
        text = "Head. " + " ".join(f"{tags[i]}:panel {i}" for i in perm)
        g, panels = P.parse_panel_prompts(text, rows, cols)
        assert g == "Head."
        assert panels == [f"panel {i}" for i in range(len(tags))], shuffled


def test_whitespace_and_case_tolerance():
    text = ("Global  text.\n[ top ] - [ Left ] : one \n[Top]-[RIGHT]:two\t"
            "[bottom]  [left]:three [BOTTOM]-[right]  :  four")
    g, panels = P.parse_panel_prompts(text, 2, 2)
    assert g == "Global  text."
    assert panels == ["one", "two", "three", "four"]
    g, panels = P.parse_panel_prompts("x [ middle   left ]: b [left]: a [Middle-Right]: c "
                                      "[RIGHT]: d", 1, 4)
    assert panels == ["a", "b", "c", "d"]
    g, panels = P.parse_panel_prompts("x panel 2: b Panel-1: a [panel-3]: c", 1, 3)
    assert panels == ["a", "b", "c"]


def test_reversed_words_and_multiline_panels():
    text = "G. [LEFT]-[TOP]: a\nstill a. [RIGHT]-[TOP]: b [LEFT]-[BOTTOM]: c [RIGHT]-[BOTTOM]: d"
    g, panels = P.parse_panel_prompts(text, 2, 2)
    assert panels == ["a\nstill a.", "b", "c", "d"]


def test_bracketed_prose_is_not_a_tag():
    text = "A sign reads [OPEN]: welcome. [sic]: x [LEFT]: a [MIDDLE]: b [RIGHT]: c"
    g, panels = P.parse_panel_prompts(text, 1, 3)
    assert g == "A sign reads [OPEN]: welcome. [sic]: x"
    assert panels == ["a", "b", "c"]


def test_no_global_text_is_empty_string():
    assert P.parse_panel_prompts("[TOP]: a [BOTTOM]: b", 2, 1) == ("", ["a", "b"])


@pytest.mark.parametrize(
    "text, rows, cols, match",
    [
        (grid(TAGS_2X2[:3]), 2, 2, "found 3 panel tag"),
        (grid(TAGS_2X2 + ["PANEL-1"]), 2, 2, "duplicate panel position"),
        ("G. [TOP]-[LEFT]: a [TOP]-[LEFT]: b [BOTTOM]-[LEFT]: c [BOTTOM]-[RIGHT]: d", 2, 2,
         "duplicate panel position row 1, col 1"),
        ("G. [LEFT]: a [MIDDLE]: b [RIGHT]: c", 2, 2, "does not fit layout 2x2"),
        (grid(TAGS_2X2), 1, 3, "does not fit layout 1x3"),
        ("G. PANEL-1: a PANEL-2: b PANEL-4: c", 1, 3, "does not fit"),
        ("G. [TOP]-[LEFT]: a [TOP]-[RIGHT]:   [BOTTOM]-[LEFT]: c [BOTTOM]-[RIGHT]: d", 2, 2,
         "empty panel prompt"),
        ("no tags at all", 2, 2, "found 0 panel tag"),
        ("G. [TOP]: a [MIDDLE]: b [BOTTOM]: c", 3, 2, "does not fit"),
    ],
)
def test_panel_errors(text, rows, cols, match):
    with pytest.raises(PromptFormatError, match=match):
        P.parse_panel_prompts(text, rows, cols)
