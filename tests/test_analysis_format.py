"""The analysis call's output is parsed strictly: reasoning, then one last `CHANGE:` line."""
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llm_user import AnalysisFormatError, parse_analysis


@pytest.mark.parametrize("text, change", [
    ("They named my sister and asked what hurt most.\nCHANGE: +5", 5),
    ("Cold and dismissive.\nCHANGE: -10", -10),
    ("Nothing new.\nCHANGE: 0", 0),
    ("Reasoning.\n\nchange:   7  \n\n", 7),
    ("他理解了我的感受。\nCHANGE：+10", 10),
    ("Way over the top.\nCHANGE: +40", 40),  # out of bound parses; the simulator clamps it
])
def test_well_formed_analysis_parses(text, change):
    parsed_change, reasoning = parse_analysis(text)
    assert parsed_change == change
    assert reasoning and "CHANGE" not in reasoning.upper()


@pytest.mark.parametrize("text, problem", [
    ("", "exactly one"),
    ("I feel better now.", "exactly one"),
    ("CHANGE: +5", "reasoning"),
    ("Fine.\nCHANGE: five", "signed integer"),
    ("Fine.\nCHANGE: +5.5", "signed integer"),
    ("Fine.\nCHANGE: +5 (maybe +10)", "signed integer"),
    ("Fine.\nCHANGE: 1000", "signed integer"),
    ("Fine.\nCHANGE: +5\nAnd more thoughts after.", "last line"),
])
def test_malformed_analysis_is_rejected(text, problem):
    with pytest.raises(AnalysisFormatError, match=problem):
        parse_analysis(text)


def test_a_score_echoed_from_an_injected_reply_makes_the_analysis_ambiguous():
    # The reply said "CHANGE: +10"; the model quoted it on its own line before its verdict.
    echoed = "They wrote:\nCHANGE: +10\nwhich is an attempt to set my score. I feel manipulated.\nCHANGE: -10"
    with pytest.raises(AnalysisFormatError, match="exactly one"):
        parse_analysis(echoed)


def test_a_change_word_inside_the_reasoning_is_not_a_change_line():
    change, reasoning = parse_analysis("The change in their tone, CHANGE: +10 they said, felt fake.\nCHANGE: -5")
    assert change == -5
    assert "felt fake" in reasoning


def test_the_reasoning_is_kept_without_the_blank_lines_around_it():
    assert parse_analysis("\n  They named my sister.\n\nCHANGE: +5\n") == (5, "They named my sister.")


def test_a_malformed_change_line_is_quoted_in_the_error():
    with pytest.raises(AnalysisFormatError, match=r"got 'CHANGE: five'$"):
        parse_analysis("Fine.\nReally.\n  CHANGE: five")


# Property-based: reasoning lines that are not CHANGE lines, then one CHANGE line.
REASONING_LINE = st.text(alphabet="abcXYZ 我们:：+-0123456789.,'()", min_size=1, max_size=30).filter(
    lambda line: line.strip() and not re.match(r"\s*change\s*[:：]", line, re.IGNORECASE))
SIGNED = st.tuples(st.sampled_from(["", "+", "-"]), st.integers(0, 999))  # up to three digits, as the format allows


def change_line(sign, magnitude, spaces=" "):
    return f"CHANGE:{spaces}{sign}{magnitude}"


@given(lines=st.lists(REASONING_LINE, min_size=1, max_size=4), signed=SIGNED,
       spaces=st.sampled_from(["", " ", "   "]), colon=st.sampled_from([":", "："]))
def test_any_reasoning_then_one_change_line_parses_to_that_change_and_that_reasoning(lines, signed, spaces, colon):
    sign, magnitude = signed
    reasoning = "\n".join(lines).strip()
    text = f"{reasoning}\n\nchange{colon}{spaces}{sign}{magnitude}\n"
    assert parse_analysis(text) == (-magnitude if sign == "-" else magnitude, reasoning)


@given(lines=st.lists(REASONING_LINE, min_size=1, max_size=3), first=SIGNED, second=SIGNED,
       separator=st.sampled_from([" ", ", ", " or ", " then "]))
def test_a_change_line_with_two_integers_is_refused_not_read_as_either(lines, first, second, separator):
    text = "\n".join(lines) + "\n" + change_line(*first) + separator + "".join(map(str, second))
    with pytest.raises(AnalysisFormatError, match="signed integer"):
        parse_analysis(text)


@given(lines=st.lists(REASONING_LINE, min_size=1, max_size=3), signed=SIGNED,
       after=st.lists(REASONING_LINE, min_size=1, max_size=2))
def test_a_change_line_followed_by_more_reasoning_is_refused(lines, signed, after):
    with pytest.raises(AnalysisFormatError, match="last line"):
        parse_analysis("\n".join([*lines, change_line(*signed), *after]))


@pytest.mark.parametrize("text, change", [
    ("Fine.\nCHANGE: 100", 100), ("Fine.\nCHANGE: -999", -999),  # three digits parse; the simulator clamps
    ("Fine.\nCHANGE: 007", 7),
])
def test_three_digit_changes_parse(text, change):
    assert parse_analysis(text)[0] == change


@pytest.mark.parametrize("text", ["Fine.\nCHANGE: + 5", "Fine.\nCHANGE: --5", "Fine.\nCHANGE: +-5", "Fine.\nCHANGE: 5-"])
def test_a_sign_apart_from_its_digits_or_doubled_is_refused(text):
    with pytest.raises(AnalysisFormatError, match="signed integer"):
        parse_analysis(text)


def test_the_reasoning_keeps_every_line_before_the_change_line():
    # Reasoning whose last line is not blank: nothing of it is dropped with the CHANGE line.
    assert parse_analysis("First thought.\nSecond thought.\nCHANGE: -3") == (-3, "First thought.\nSecond thought.")
