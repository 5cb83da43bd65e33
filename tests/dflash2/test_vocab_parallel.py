"""dflash2.vocab_parallel (K18): simulated 2 and 4 vocab shards equal the full-vocabulary computation."""

from __future__ import annotations

import math

import pytest
import torch

from dflash2.vocab_parallel import (
    RejectionBatch,
    draft_sample_full,
    draft_shard_payload,
    gumbel_noise,
    merge_draft_payloads,
    murmur3_hash32,
    rejection_sample_full,
    rejection_sample_sharded,
    shard_ranges,
    split_logits,
)

TEMPERATURES = [0.0, 0.6, 0.8, 1.0, 1.3]


def murmur3_reference(seed: int, pos: int, key: int) -> int:
    """Stock's murmur3_hash32 on Python ints (written from vllm/v1/worker/gpu/sample/gumbel.py)."""
    m = 0xFFFFFFFF

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & m

    def mix(h: int, k: int) -> int:
        k = (k * 0xCC9E2D51) & m
        k = rotl(k, 15)
        k = (k * 0x1B873593) & m
        h ^= k
        h = rotl(h, 13)
        return (h * 5 + 0xE6546B64) & m

    h = 0
    for part in (seed & m, (seed >> 32) & m, pos & m, key & m):
        h = mix(h, part)
    h ^= 16
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def test_murmur3_matches_the_scalar_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    seeds = torch.randint(0, 2**62, (16,), generator=gen)
    pos = torch.randint(0, 2**31, (16,), generator=gen)
    keys = torch.randint(0, 2**32, (64,), generator=gen)
    got = murmur3_hash32(seeds[:, None], pos[:, None], keys[None, :])
    for r in range(16):
        for c in range(64):
            assert int(got[r, c]) == murmur3_reference(int(seeds[r]), int(pos[r]), int(keys[c]))


def test_gumbel_noise_is_gumbel_and_keyed_by_absolute_token_id() -> None:
    ids = torch.arange(200_000)
    noise = gumbel_noise(torch.tensor([7]), torch.tensor([123]), ids, drafting=True)[0]
    assert abs(float(noise.mean()) - 0.5772) < 0.01  # Euler-Mascheroni
    assert abs(float(noise.std()) - math.pi / math.sqrt(6)) < 0.01
    part = gumbel_noise(torch.tensor([7]), torch.tensor([123]), ids[150_000:150_010], drafting=True)[0]
    assert torch.equal(part, noise[150_000:150_010])  # a shard draws exactly its columns' noise
    target = gumbel_noise(torch.tensor([7]), torch.tensor([123]), ids[:10], drafting=False)[0]
    assert not torch.equal(target, noise[:10])  # drafting noise is salted away from the target's


@pytest.mark.parametrize("num_shards", [2, 4])
def test_sharded_drafting_equals_full_vocabulary(num_shards: int) -> None:
    vocab = 248_320 - 7  # not a multiple of the padding: the last shard ends in padding
    gen = torch.Generator().manual_seed(num_shards)
    rows = 10
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(torch.bfloat16)
    temperature = torch.tensor(TEMPERATURES * 2)
    seed = torch.randint(0, 2**40, (rows,), generator=gen)
    pos = torch.randint(0, 100_000, (rows,), generator=gen)
    full = draft_sample_full(logits, temperature, seed, pos)
    ranges = shard_ranges(vocab, num_shards)
    assert ranges[-1][1] >= vocab and len({end - start for start, end in ranges}) == 1
    payloads = torch.stack(
        [
            draft_shard_payload(shard, start, temperature, seed, pos)
            for shard, (start, _) in zip(split_logits(logits, ranges), ranges, strict=True)
        ]
    )
    assert payloads.shape == (num_shards, rows, 5)  # what each rank sends: 5 numbers a row
    merged = merge_draft_payloads(payloads)
    assert torch.equal(merged.tokens, full.tokens)
    assert torch.equal(merged.token_logit, full.token_logit)
    scaled64 = logits.double() / torch.where(temperature > 0, temperature, 1).double()[:, None]
    exact = torch.logsumexp(scaled64, dim=-1)
    assert float((merged.logsumexp.double() - exact).abs().max()) < 1e-5
    assert float((full.logsumexp.double() - exact).abs().max()) < 1e-5
    greedy = temperature == 0
    assert torch.equal(full.tokens[greedy], logits[greedy].float().argmax(dim=-1))
    assert not torch.equal(full.tokens[~greedy], logits[~greedy].float().argmax(dim=-1))  # it samples


def test_drafting_samples_the_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(40_000, 1)
    temperature = torch.full((40_000,), 0.8)
    draws = draft_sample_full(logits, temperature, torch.full((40_000,), 11), torch.arange(40_000)).tokens
    freq = torch.bincount(draws, minlength=6).double() / 40_000
    assert float((freq - torch.softmax(logits[0].double() / 0.8, dim=0)).abs().max()) < 0.01


def random_batch(seed: int, vocab: int, *, with_draft_logits: bool, num_reqs: int = 40, k: int = 7) -> RejectionBatch:
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(num_reqs, k + 1, vocab, generator=gen) * 2.5
    # a drafter close to the target, so drafts are accepted as often as rejected
    draft_logits = target[:, :k] + torch.randn(num_reqs, k, vocab, generator=gen) * 0.7
    temperature = torch.tensor([TEMPERATURES[i % len(TEMPERATURES)] for i in range(num_reqs)])
    seeds = torch.randint(0, 2**40, (num_reqs,), generator=gen)
    positions = torch.randint(0, 10_000, (num_reqs, 1), generator=gen) + torch.arange(k + 1)
    drafted = draft_sample_full(
        draft_logits.reshape(-1, vocab),
        temperature.repeat_interleave(k),
        seeds.repeat_interleave(k),
        positions[:, :k].reshape(-1),
    ).tokens.view(num_reqs, k)
    num_drafts = torch.tensor([(i * 3) % (k + 1) for i in range(num_reqs)])  # depths 0..7
    num_drafts[5] = num_drafts[17] = -1  # CUDA-graph pad rows
    drafted[8, 2] = drafted[21, 0] = -1  # placeholder drafts (invalidated by a grammar)
    for i in range(num_reqs):
        drafted[i, max(int(num_drafts[i]), 0) :] = -1
    return RejectionBatch(
        target_logits=target.to(torch.bfloat16),
        draft_logits=draft_logits.to(torch.bfloat16) if with_draft_logits else None,
        draft_tokens=drafted,
        num_drafts=num_drafts,
        temperature=temperature,
        seed=seeds,
        positions=positions,
    )


@pytest.mark.parametrize("with_draft_logits", [True, False], ids=["probabilistic-drafts", "one-hot-drafts"])
def test_sharded_rejection_sampling_equals_full_vocabulary(with_draft_logits: bool) -> None:
    vocab = 1000  # padded to 1024: 4 shards of 256, the last with 24 padding columns
    outcomes = set()
    for seed in range(2):
        batch = random_batch(seed, vocab, with_draft_logits=with_draft_logits)
        full = rejection_sample_full(batch)
        for num_shards in (1, 2, 4):
            sharded = rejection_sample_sharded(batch, shard_ranges(vocab, num_shards))
            assert torch.equal(sharded.num_accepted, full.num_accepted), num_shards
            assert torch.equal(sharded.tokens, full.tokens), num_shards
        for i in range(len(batch.num_drafts)):
            n, a = int(batch.num_drafts[i]), int(full.num_accepted[i])
            if n < 0:
                assert a == -1 and bool((full.tokens[i] == -1).all())
                continue
            kind = "bonus" if a == n else ("partial" if a else "first-rejected")
            outcomes.add((float(batch.temperature[i]) == 0.0, kind))
            assert bool((full.tokens[i, : a + 1] >= 0).all()) and bool((full.tokens[i, a + 1 :] == -1).all())
    # every kind of outcome happened, greedy and sampled, so the equality above means something
    assert outcomes == {(g, kind) for g in (True, False) for kind in ("bonus", "partial", "first-rejected")}


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """The first emitted token follows softmax(target / T) whatever the drafter proposes."""
    vocab, draws, temp = 6, 8_000, 0.9
    target_row = torch.tensor([1.5, 1.0, 0.2, 0.0, -0.5, -2.0])
    draft_row = torch.tensor([-1.0, 0.5, 1.5, 0.0, 0.8, 0.3])  # a poor drafter
    seeds = torch.arange(draws)
    positions = torch.zeros(draws, 2, dtype=torch.long)
    drafted = draft_sample_full(
        draft_row.repeat(draws, 1), torch.full((draws,), temp), seeds, positions[:, 0]
    ).tokens.view(draws, 1)
    batch = RejectionBatch(
        target_logits=target_row.repeat(draws, 2, 1),
        draft_logits=draft_row.repeat(draws, 1, 1),
        draft_tokens=drafted,
        num_drafts=torch.ones(draws, dtype=torch.long),
        temperature=torch.full((draws,), temp),
        seed=seeds,
        positions=positions,
    )
    result = rejection_sample_sharded(batch, shard_ranges(vocab, 2, pad_to=2))
    freq = torch.bincount(result.tokens[:, 0], minlength=vocab).double() / draws
    expected = torch.softmax(target_row.double() / temp, dim=0)
    assert float((freq - expected).abs().max()) < 0.02, (freq, expected)  # 3.5 standard errors
    assert 0.2 < float((result.num_accepted == 1).double().mean()) < 0.9  # both paths were taken
