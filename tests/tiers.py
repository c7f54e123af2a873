"""The default tier and the slow tier of a parametrized test (see pyproject's ``-m 'not slow'``).

A kernel test's full cross product (heads x splits x dtypes, say) mostly runs the same code paths
again; :func:`slow_beyond` keeps a covering subset in the default tier and marks the rest
``slow``, so the slow tier (run by CI) still checks every combination.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import pytest


def slow_beyond(*axes: dict[str, object], fast: Iterable[tuple[str, ...]]) -> list:
    """``pytest.param`` for each combination of ``axes`` (each ``{id: value}``; a tuple value
    fills several arguments), id ``a-b-c``; combinations whose id tuple is not in ``fast`` are
    marked ``slow``. Every name in ``fast`` must be a combination, so a typo cannot empty the
    default tier."""
    fast = set(fast)
    combos = list(itertools.product(*(a.items() for a in axes)))
    unknown = fast - {tuple(k for k, _ in c) for c in combos}
    if unknown:
        raise ValueError(f"fast names combinations that are not in the axes: {sorted(unknown)}")
    params = []
    for combo in combos:
        key = tuple(k for k, _ in combo)
        values: list = []
        for _, v in combo:
            values.extend(v if isinstance(v, tuple) else (v,))
        marks = () if key in fast else (pytest.mark.slow,)
        params.append(pytest.param(*values, id="-".join(key), marks=marks))
    return params
