"""The concurrency ladder: `dflash_concurrency_drafts` (ReVolta 0.1.2), as a plain module.

The ladder maps a number of running requests (the threshold) to the number of drafts the target
verifies per request (the width). The drafter's `num_speculative_tokens` stays the configured
value; only the verified width changes. Semantics, exactly as the seed states them:

- the entry with the largest threshold that is not above the number of running requests sets
  the width;
- below the lowest threshold, all `num_speculative_tokens` drafts are verified;
- a higher entry may widen again (``{"4": 3, "5": 4}`` with 7 drafts: one to three requests
  verify 7, four verify 3, five or more verify 4);
- thresholds are 2 or more, widths 1 to `num_speculative_tokens`.

Stock vLLM has the same shape of feature keyed by batch size:
`SpeculativeConfig.num_speculative_tokens_per_batch_size`, a list of inclusive
``(range_start, range_end, num_speculative_tokens)`` ranges that must start at 1.
`Ladder.stock_schedule()` writes the ladder as that list; stock's own lookup
(`vllm.v1.spec_decode.dynamic.utils.build_dynamic_sd_schedule_lookup`) then gives the ladder's
width for every batch size (tests/dflash2/test_ladder.py checks this for every count up to 256).

Nothing here imports vLLM.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

LADDER_KEY = "dflash_concurrency_drafts"
STOCK_SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"
FIELD = f"speculative_config.{LADDER_KEY}"
EXAMPLE = '{"4": 3, "5": 4}'
# The last range of the stock schedule is open-ended; stock clamps it to --max-num-seqs.
OPEN_END = 2**31 - 1

_DECIMAL = re.compile(r"[0-9]+")


class LadderError(ValueError):
    """A bad `dflash_concurrency_drafts`, or a setting it cannot run with; names the field and the fix."""


@dataclass(frozen=True)
class Ladder:
    """A validated ladder: ``steps`` are ``(threshold, width)`` pairs, thresholds ascending."""

    num_speculative_tokens: int
    steps: tuple[tuple[int, int], ...]

    def width(self, running: int) -> int:
        """Drafts verified per request while `running` requests run."""
        if running < 1:
            raise ValueError(f"running must be at least 1, got {running}")
        width = self.num_speculative_tokens
        for threshold, step_width in self.steps:
            if threshold > running:
                break
            width = step_width
        return width

    def stock_schedule(self) -> list[tuple[int, int, int]]:
        """The ladder as stock vLLM's `num_speculative_tokens_per_batch_size` (inclusive ranges from 1)."""
        ranges: list[tuple[int, int, int]] = []
        start, width = 1, self.num_speculative_tokens
        for threshold, step_width in self.steps:
            ranges.append((start, threshold - 1, width))
            start, width = threshold, step_width
        ranges.append((start, OPEN_END, width))
        return ranges

    def describe(self) -> str:
        """One line: which running counts verify how many drafts."""
        parts = []
        bounds = [threshold for threshold, _ in self.steps]
        for (start, end, width), upper in zip(self.stock_schedule(), [*bounds, None], strict=True):
            span = f"{start}+" if upper is None else (f"{start}" if start == end else f"{start}-{end}")
            parts.append(f"{span} running: {width}")
        return f"verify width by running requests ({self.num_speculative_tokens} drafted): " + ", ".join(parts)


def _threshold_of(key: object) -> int | None:
    """The threshold a ladder key names: an integer or a string of decimal digits; None otherwise."""
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key
    if isinstance(key, str) and _DECIMAL.fullmatch(key):
        return int(key)
    return None


def parse_ladder(raw: object, num_speculative_tokens: int) -> Ladder:
    """Validate `raw` (the value of `dflash_concurrency_drafts`) for `num_speculative_tokens` drafts."""
    if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int):
        raise LadderError(
            f"speculative_config.num_speculative_tokens must be an integer, got {num_speculative_tokens!r}"
        )
    if num_speculative_tokens < 1:
        raise LadderError(f"speculative_config.num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
    k = num_speculative_tokens
    if not isinstance(raw, Mapping):
        raise LadderError(
            f"{FIELD} must be a JSON object mapping running-request thresholds to verify widths, "
            f"e.g. {EXAMPLE}; got {type(raw).__name__} {raw!r}"
        )
    if not raw:
        raise LadderError(f"{FIELD} is empty: give at least one threshold, e.g. {EXAMPLE}, or drop the key")
    seen: dict[int, object] = {}
    steps: list[tuple[int, int]] = []
    for key, width in raw.items():
        threshold = _threshold_of(key)
        if threshold is None:
            raise LadderError(
                f"{FIELD}: unknown key {key!r}: keys are numbers of running requests written as integers "
                f"(2 or more), e.g. {EXAMPLE}"
            )
        if threshold in seen:
            raise LadderError(
                f"{FIELD}: keys {seen[threshold]!r} and {key!r} both name threshold {threshold}; keep one"
            )
        seen[threshold] = key
        if threshold < 2:
            raise LadderError(
                f"{FIELD}[{key!r}]: threshold {threshold} is below 2 (below the lowest threshold every "
                f"request verifies all {k} drafts); use thresholds of 2 or more"
            )
        if isinstance(width, bool) or not isinstance(width, int):
            raise LadderError(
                f"{FIELD}[{key!r}]: the width must be an integer from 1 to num_speculative_tokens={k}, got {width!r}"
            )
        if not 1 <= width <= k:
            raise LadderError(
                f"{FIELD}[{key!r}]: width {width} is outside 1..num_speculative_tokens={k}; "
                f"use a width from 1 to {k} (or raise num_speculative_tokens)"
            )
        steps.append((threshold, width))
    return Ladder(k, tuple(sorted(steps)))


def check_settings(
    *,
    async_scheduling: bool | None,
    pipeline_parallel_size: int,
    data_parallel_size: int,
    has_stock_schedule: bool,
) -> None:
    """Refuse what the ladder cannot run with (each error names the setting and the fix).

    `async_scheduling` is the user's setting (None: unset, which the ladder turns off).
    """
    if async_scheduling:
        raise LadderError(
            f"{FIELD} turns off async scheduling, and --async-scheduling together with it is an error: "
            "drop --async-scheduling (or pass --no-async-scheduling), or drop the ladder"
        )
    if has_stock_schedule:
        raise LadderError(
            f"{FIELD} and speculative_config.{STOCK_SCHEDULE_KEY} both set the verify width: keep one "
            f"({LADDER_KEY} is written as {STOCK_SCHEDULE_KEY} for stock vLLM)"
        )
    if pipeline_parallel_size > 1:
        raise LadderError(
            f"{FIELD} with pipeline_parallel_size={pipeline_parallel_size}: speculative decoding with pipeline "
            "parallelism is not supported here; use --pipeline-parallel-size 1"
        )
    if data_parallel_size > 1:
        raise LadderError(
            f"{FIELD} with data_parallel_size={data_parallel_size}: data-parallel ranks could pick different "
            "widths, and stock vLLM drops a per-batch-size schedule under data parallelism; use "
            "--data-parallel-size 1 or drop the ladder"
        )
