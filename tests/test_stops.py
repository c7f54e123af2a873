"""Stop strings cut a continuation exactly where lm-eval's post-hoc split would."""

from __future__ import annotations

import pytest

from nakta_model.generation import StopStrings

WORDS = {1: "The", 2: " cat", 3: "\n", 4: "\n", 5: " sat", 6: ".", 7: " Q:"}


def decode(tokens):
    return "".join(WORDS[t] for t in tokens)


def lm_eval_split(text, until):
    for term in until:
        if term:
            text = text.split(term)[0]
    return text


@pytest.mark.parametrize(
    "tokens, until",
    [
        ([1, 2, 5, 6], ["\n\n"]),
        ([1, 2, 3, 4, 5], ["\n\n"]),
        ([1, 2, 7, 3, 4], ["\n\n", " Q:"]),
        ([1, 2, 6, 7, 3, 4], [" Q:", "."]),
        ([1, 2], ["", "x"]),
    ],
)
def test_cut_matches_lm_eval(tokens, until):
    text, stopped = StopStrings(until, decode).cut(tokens)
    want = lm_eval_split(decode(tokens), until)
    assert text == want
    assert stopped == (want != decode(tokens))


def test_a_stop_split_over_two_tokens_is_found():
    assert StopStrings(["\n\n"], decode).cut([1, 3]) == ("The\n", False)
    assert StopStrings(["\n\n"], decode).cut([1, 3, 4, 5]) == ("The", True)


def test_bad_stops():
    with pytest.raises(TypeError, match="strings"):
        StopStrings(["a", 3], decode)
    assert StopStrings("\n", decode).stops == ["\n"]
