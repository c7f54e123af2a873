"""``tiers.slow_beyond``: the default tier keeps exactly the named combinations."""

from __future__ import annotations

import pytest
from tiers import slow_beyond


def test_only_the_named_combinations_stay_fast_and_tuples_fill_several_arguments():
    params = slow_beyond({"a": (1, 2), "b": (3, 4)}, {"x": "x", "y": "y"}, fast={("b", "x")})
    assert [p.id for p in params] == ["a-x", "a-y", "b-x", "b-y"]
    assert [p.values for p in params] == [(1, 2, "x"), (1, 2, "y"), (3, 4, "x"), (3, 4, "y")]
    fast = [p.id for p in params if not any(m.name == "slow" for m in p.marks)]
    assert fast == ["b-x"]


def test_a_fast_name_outside_the_axes_is_refused():
    with pytest.raises(ValueError, match=r"not in the axes: \[\('a', 'z'\)\]"):
        slow_beyond({"a": 1}, {"x": 2}, fast={("a", "z")})
