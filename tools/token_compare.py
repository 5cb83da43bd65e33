"""Where two greedy token sequences part, for the checks that compare runs token by token.

The soak driver, the CSF GPU session, the served speculative check and the K20 engine check all
report the first position at which a run's tokens leave the reference's; this is the one definition.
Where the reference recorded its top-two logprob gap per token, `margins_at` and `only_near_ties` say
whether each difference lies at a near tie of it (the K20 engine check's verdict).
"""

from __future__ import annotations

from collections.abc import Sequence


def first_difference(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """The first index where ``tokens`` and ``reference`` differ; a sequence that stops early differs at
    its end (the shorter length); None when they are equal."""
    at = next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b), None)
    if at is None and len(tokens) != len(reference):
        return min(len(tokens), len(reference))
    return at


def first_differences(runs: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> list[int | None]:
    """`first_difference` per request, pairing ``runs`` with ``references`` in order (same count)."""
    return [first_difference(tokens, reference) for tokens, reference in zip(runs, references, strict=True)]


def margins_at(first: Sequence[int | None], margins: Sequence[Sequence[float | None]]) -> list[float | None]:
    """Per request, the reference's top-two logprob gap at its first difference (``margins[r][i]``);
    None where the request does not differ, or differs past the recorded gaps (a run that ran on)."""
    return [None if i is None or i >= len(m) else m[i] for m, i in zip(margins, first, strict=True)]


def only_near_ties(first: Sequence[int | None], at: Sequence[float | None], bound: float) -> bool:
    """Whether every request that differs does so where the reference's top-two gap is below ``bound``
    (a difference without a recorded gap is not a near tie)."""
    return all(i is None or (m is not None and m < bound) for i, m in zip(first, at, strict=True))
