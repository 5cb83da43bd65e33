"""dflash2.ladder: the seed's `dflash_concurrency_drafts` semantics and stock vLLM's schedule."""

from __future__ import annotations

import random

import pytest

from dflash2.ladder import OPEN_END, Ladder, LadderError, check_settings, parse_ladder


def seed_width(raw: dict[str, int], k: int, running: int) -> int:
    """The seed's rule, written from its text independently of dflash2.ladder."""
    below = [int(t) for t in raw if int(t) <= running]
    return raw[str(max(below))] if below else k


def test_the_seeds_worked_example() -> None:
    # "With {"4": 3, "5": 4}, one to three running requests verify all 7 drafts, four verify 3,
    # and five or more verify 4."
    ladder = parse_ladder({"4": 3, "5": 4}, 7)
    assert [ladder.width(n) for n in range(1, 10)] == [7, 7, 7, 3, 4, 4, 4, 4, 4]
    assert ladder.stock_schedule() == [(1, 3, 7), (4, 4, 3), (5, OPEN_END, 4)]
    assert ladder.describe() == (
        "verify width by running requests (7 drafted): 1-3 running: 7, 4 running: 3, 5+ running: 4"
    )


def test_below_the_lowest_threshold_all_drafts_are_verified_and_a_higher_entry_widens_again() -> None:
    ladder = parse_ladder({"3": 3, "8": 4, "16": 2}, 5)
    assert [ladder.width(n) for n in (1, 2, 3, 7, 8, 15, 16, 1000)] == [5, 5, 3, 3, 4, 4, 2, 2]
    # "{"3": 3} verifies 3 drafts from three requests on" and "{"8": 4}" (the seed's other examples)
    assert [parse_ladder({"3": 3}, 7).width(n) for n in (2, 3, 64)] == [7, 3, 3]
    assert [parse_ladder({"8": 4}, 7).width(n) for n in (7, 8)] == [7, 4]


def test_integer_keys_and_key_order_do_not_matter() -> None:
    assert parse_ladder({5: 4, 4: 3}, 7) == parse_ladder({"4": 3, "5": 4}, 7)


@pytest.mark.parametrize("max_num_seqs", [1, 3, 4, 5, 17, 256])
def test_stock_vllm_reads_the_schedule_as_the_ladder(max_num_seqs: int) -> None:
    """Stock's own lookup (what its scheduler uses per batch size) gives the ladder's width everywhere."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    rng = random.Random(max_num_seqs)
    for _ in range(200):
        k = rng.randint(1, 8)
        thresholds = rng.sample(range(2, 40), rng.randint(1, 5))
        raw = {str(t): rng.randint(1, k) for t in thresholds}
        ladder = parse_ladder(raw, k)
        lookup = build_dynamic_sd_schedule_lookup(ladder.stock_schedule(), max_num_seqs, k)
        widths = [ladder.width(n) for n in range(1, max_num_seqs + 1)]
        assert lookup[1:] == widths, raw
        assert widths == [seed_width(raw, k, n) for n in range(1, max_num_seqs + 1)], raw


@pytest.mark.parametrize(
    ("raw", "k", "message"),
    [
        ({"four": 3}, 7, r"unknown key 'four': keys are numbers of running requests written as integers"),
        ({"4.5": 3}, 7, r"unknown key '4.5'"),
        ({" 4": 3}, 7, r"unknown key ' 4'"),
        ({"": 3}, 7, r"unknown key ''"),
        ({"-3": 3}, 7, r"unknown key '-3'"),
        ({True: 3}, 7, r"unknown key True"),
        ({"1": 3}, 7, r"\['1'\]: threshold 1 is below 2 .* use thresholds of 2 or more"),
        ({"0": 3}, 7, r"threshold 0 is below 2"),
        ({"4": 8}, 7, r"\['4'\]: width 8 is outside 1..num_speculative_tokens=7; use a width from 1 to 7"),
        ({"4": 0}, 7, r"width 0 is outside 1..num_speculative_tokens=7"),
        ({"4": "3"}, 7, r"the width must be an integer from 1 to num_speculative_tokens=7, got '3'"),
        ({"4": True}, 7, r"the width must be an integer"),
        ({"4": 3.0}, 7, r"the width must be an integer"),
        ({"4": 3, "04": 2}, 7, r"keys '4' and '04' both name threshold 4; keep one"),
        ({}, 7, r"is empty: give at least one threshold"),
        ([[4, 3]], 7, r"must be a JSON object mapping running-request thresholds to verify widths"),
        ('{"4": 3}', 7, r"must be a JSON object"),
    ],
)
def test_bad_ladders_name_the_field_and_the_fix(raw: object, k: int, message: str) -> None:
    with pytest.raises(LadderError, match=message) as error:
        parse_ladder(raw, k)
    assert "speculative_config.dflash_concurrency_drafts" in str(error.value)


def test_num_speculative_tokens_must_be_a_positive_integer() -> None:
    with pytest.raises(LadderError, match="num_speculative_tokens must be at least 1"):
        parse_ladder({"4": 1}, 0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"async_scheduling": True}, r"--async-scheduling together with it is an error: drop --async-scheduling"),
        ({"has_stock_schedule": True}, r"num_speculative_tokens_per_batch_size both set the verify width: keep one"),
        ({"pipeline_parallel_size": 2}, r"pipeline_parallel_size=2.*use --pipeline-parallel-size 1"),
        ({"data_parallel_size": 2}, r"data_parallel_size=2.*use --data-parallel-size 1"),
    ],
)
def test_settings_the_ladder_cannot_run_with(settings: dict[str, object], message: str) -> None:
    base: dict[str, object] = {
        "async_scheduling": None,
        "pipeline_parallel_size": 1,
        "data_parallel_size": 1,
        "has_stock_schedule": False,
    }
    check_settings(**base)  # type: ignore[arg-type]  # unset async scheduling is fine: the ladder turns it off
    check_settings(**{**base, "async_scheduling": False})  # type: ignore[arg-type]
    with pytest.raises(LadderError, match=message):
        check_settings(**{**base, **settings})  # type: ignore[arg-type]


def test_width_needs_a_running_request() -> None:
    with pytest.raises(ValueError, match="running must be at least 1"):
        Ladder(7, ((4, 3),)).width(0)
