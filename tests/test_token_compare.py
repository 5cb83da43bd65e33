"""tools.token_compare: where two greedy token sequences part."""

from __future__ import annotations

import pytest

from tools.token_compare import first_difference, first_differences, margins_at, only_near_ties


def test_first_difference_positions() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([], []) is None
    # a run that stops early (or runs on) differs where the shorter one ends
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([1, 2, 3, 4], [1, 2, 3]) == 3
    assert first_difference([], [5]) == 0
    # a difference before the end wins over the length
    assert first_difference([7, 2], [1, 2, 3]) == 0


def test_first_differences_pairs_in_order() -> None:
    assert first_differences([[1, 2], [3, 4], [5]], [[1, 2], [3, 5], [5, 6]]) == [None, 1, 1]
    with pytest.raises(ValueError):
        first_differences([[1]], [[1], [2]])  # a missing run is an error, not a silent pass


def test_differences_judged_by_the_reference_gap() -> None:
    margins = [[0.5, 0.5, 0.5], [0.5, 1e-5, 0.5], [0.5, 0.5, 0.01]]
    first = first_differences([[1, 2, 3], [1, 7, 3], [1, 2, 8]], [[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    assert first == [None, 1, 2]
    at = margins_at(first, margins)
    assert at == [None, 1e-5, 0.01]
    assert only_near_ties(first, at, 2**-12) is False  # request 2's gap, 0.01, is no near tie
    assert only_near_ties(first, at, 2**-6) is True
    assert only_near_ties([None, None], [None, None], 2**-12) is True  # nothing differs
    # a run that ran past the recorded gaps differs where nothing was recorded: not a near tie
    assert margins_at([3], [[0.5, 0.5, 0.5]]) == [None]
    assert only_near_ties([3], [None], 1.0) is False
    with pytest.raises(ValueError):
        margins_at([None], [[0.5], [0.5]])  # a request without its gaps is an error
