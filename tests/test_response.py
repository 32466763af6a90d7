"""paco.judge.response: the judge's response format, its parsing and reason sanitising."""

from __future__ import annotations

import numpy as np
import pytest

from paco.judge.response import format_response, is_canonical, parse_response, sanitize_reason


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
