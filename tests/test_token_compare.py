"""tools.token_compare: where two greedy token sequences part."""

from __future__ import annotations

import pytest

from tools.token_compare import first_difference, first_differences


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
