"""Stop strings (services/router/flow/stop.py): held-back prefixes, matches across deltas, and a
property test that any split of the text gives the unsplit result."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.flow.stop import StopStringMatcher, first_stop_match


def _run_matcher(deltas: list[str], stop: list[str]) -> tuple[str, bool]:
    matcher, out, stopped = StopStringMatcher(stop), [], False
    for delta in deltas:
        text, stopped = matcher.add(delta)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(matcher.flush())
    return "".join(out), stopped


def test_possible_stop_prefix_is_held_back_until_it_cannot_match():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.add("abc S") == ("abc ", False)  # "S" might start "STOP": held back
    assert matcher.held_back == "S"
    assert matcher.add("T") == ("", False)
    assert matcher.add("Ox") == ("STOx", False)  # cannot be "STOP" any more: released
    assert matcher.held_back == ""


def test_stop_string_across_three_deltas_stops_and_drops_the_rest():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.add("say S") == ("say ", False)
    assert matcher.add("T") == ("", False)
    assert matcher.add("OP and more") == ("", True)
    assert matcher.add("anything") == ("", True)
    assert matcher.flush() == ""


def test_held_back_text_is_released_by_flush():
    matcher = StopStringMatcher(["</end>"])
    assert matcher.add("value </e") == ("value ", False)
    assert matcher.flush() == "</e"


def test_false_start_is_released_as_soon_as_it_cannot_match():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.add("ST") == ("", False)
    assert matcher.add("ART") == ("START", False)


def test_multiple_stop_strings_first_to_complete_wins():
    assert _run_matcher(["xabcd"], ["abcd", "bc"]) == ("xa", True)
    assert _run_matcher(["xab", "cd"], ["abcd", "bc"]) == ("xa", True)
    assert _run_matcher(["one\n\ntwo"], ["two", "\n\n"]) == ("one", True)
    assert _run_matcher(["no match here"], ["zz", "qq"]) == ("no match here", False)


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="stop"):
        StopStringMatcher(["ok", ""])


def _reference(text: str, stop: list[str]) -> tuple[str, bool]:
    start = first_stop_match(text, stop)
    return (text, False) if start is None else (text[:start], True)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abST \n", max_size=40),
    stop=st.lists(st.text(alphabet="abST \n", min_size=1, max_size=5), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=10),
)
def test_property_any_split_gives_the_unsplit_result_and_only_appends(text, stop, cuts):
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    matcher, emitted = StopStringMatcher(stop), ""
    for delta in deltas:
        out, stopped = matcher.add(delta)
        emitted += out
        assert text.startswith(emitted)  # only appends, never ahead of the input
        if stopped:
            break
    emitted += matcher.flush()
    assert (emitted, matcher.stopped) == _reference(text, stop)
    assert not any(s in emitted for s in stop)
