"""Where two greedy token sequences part, for the checks that compare runs token by token.

The soak driver, the CSF GPU session, the served speculative check and the K20 engine check all
report the first position at which a run's tokens leave the reference's; this is the one definition.
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
