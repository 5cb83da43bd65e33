"""Vocab-parallel probabilistic drafting and rejection sampling (karmic-kraken K18), in plain torch.

At tensor parallelism the drafter's and the target's logits are split by vocabulary: rank `r`
holds the columns ``[offset_r, offset_r + shard)``. Stock vLLM gathers the full ``[rows, vocab]``
logits before it samples; only its greedy drafting has a vocab-parallel path
(`use_local_argmax_reduction`). This module does the probabilistic path on the shards, exchanging
a few numbers per row instead of the vocabulary:

- **Drafting**: every rank draws Gumbel noise for its own columns keyed by the *absolute* token
  id (``murmur3(seed, position, token id)``, stock Model Runner V2's noise), takes its shard's
  winner and sends ``[rows, 5]``: winner score, winner id, the shard's max and sum of exponentials
  (for the global logsumexp) and the winner's logit. The merged winner is the full-vocabulary
  Gumbel-max token, and ``q(x) = exp(logit_x - logsumexp)`` comes from the same five numbers.
- **Verification**: each rank sends its target (and draft) max / sum-of-exponentials, its target
  argmax, and the target and draft logits of the draft token where it owns that token; every rank
  then makes the same accept decisions (Leviathan et al.: accept x iff ``log p(x) > log u + log q(x)``).
- **Resampling** after a rejection (or the bonus token): each rank samples its shard of the
  residual ``max(p - q, 0)`` by Gumbel-max with the same absolute-id noise and sends ``[reqs, 2]``
  (score, id); the merged winner is the full-vocabulary draw.

`*_full` functions are the full-vocabulary computation written directly; `*_shard` /
`merge_*` are the per-rank halves and the merge that a real implementation would run around an
all-gather (here the "all-gather" is `torch.stack` over simulated ranks). The tests check that 2
and 4 shards give the full computation's draft tokens and rejection outcomes exactly, and
logsumexps within 1e-5 of fp64.

Stock's rejection sampler draws the accept uniform from Philox (`tl.rand`); here it is a
murmur3 draw on a key outside the vocabulary (an equally valid uniform, independent of the
resampling noise). Everything else follows stock's V2 kernels (`rejection_sampler_utils.py`,
`sample/gumbel.py`, fp32 path): temperature divides the logits, temperature 0 is greedy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF
# Stock keeps the draft's noise disjoint from the target's by salting the position.
DRAFT_NOISE_SALT = 1 << 30
# The accept test's uniform uses this key, which no token id reaches.
ACCEPT_KEY = _M32
_TL_RAND_MIN = 4.6566127342e-10
NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------
# Noise keyed by absolute token id: murmur3 on int64 tensors holding uint32 values.


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return ((x * lo) + (((x * hi) & 0xFFFF) << 16)) & _M32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) & _M32) | (x >> (32 - r))


def _mix(h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    key = _mul32(key, 0xCC9E2D51)
    key = _rotl32(key, 15)
    key = _mul32(key, 0x1B873593)
    h = h ^ key
    h = _rotl32(h, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _M32


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur3_hash32(seed: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Stock's `murmur3_hash32(seed, pos, key)`; broadcasts ``seed``/``pos`` [R, 1] against ``keys`` [1, C]."""
    seed, pos, keys = seed.long(), pos.long(), keys.long() & _M32
    h = torch.zeros(torch.broadcast_shapes(seed.shape, pos.shape, keys.shape), dtype=torch.long, device=keys.device)
    h = _mix(h, (seed & _M32).expand_as(h))
    h = _mix(h, ((seed >> 32) & _M32).expand_as(h))
    h = _mix(h, (pos & _M32).expand_as(h))
    h = _mix(h, keys.expand_as(h))
    return _fmix(h ^ 16)


def murmur3_uniform32(seed: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Stock's fp32 uniform in (0, 1) from the hash (both 16-bit halves converted exactly)."""
    random32 = murmur3_hash32(seed, pos, keys)
    hi16 = (random32 >> 16).to(torch.float32)
    lo16 = (random32 & 0xFFFF).to(torch.float32)
    return hi16 * 1.52587890625e-05 + (lo16 + 0.5) * 2.3283064365386963e-10


def _log1p_neg_stable(value: torch.Tensor) -> torch.Tensor:
    polynomial = torch.full_like(value, 1.0 / 8.0)
    for c in (1.0 / 7.0, 1.0 / 6.0, 1.0 / 5.0, 1.0 / 4.0, 1.0 / 3.0, 1.0 / 2.0, 1.0):
        polynomial = c + value * polynomial
    series = -value * polynomial
    direct = torch.log(torch.clamp(1.0 - value, min=5.960464477539063e-08))
    return torch.where(value < 0.25, series, direct)


def gumbel_noise(seed: torch.Tensor, pos: torch.Tensor, token_ids: torch.Tensor, *, drafting: bool) -> torch.Tensor:
    """Gumbel noise [R, C] for rows (seed [R], pos [R]) and absolute token ids [C] (stock's fp32 path)."""
    pos = pos.long() + (DRAFT_NOISE_SALT if drafting else 0)
    u = murmur3_uniform32(seed.long()[:, None], pos[:, None], token_ids.long()[None, :])
    return -torch.log(-_log1p_neg_stable(u))


def accept_uniform(seed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The uniform of the accept test per row, floored as stock's `tl_rand32(includes_zero=False)`."""
    keys = torch.tensor([ACCEPT_KEY], dtype=torch.long, device=seed.device)
    u = murmur3_uniform32(seed.long()[:, None], pos.long()[:, None], keys[None, :])[:, 0]
    return torch.clamp(u, min=_TL_RAND_MIN)


# --------------------------------------------------------------------------------------------
# Shards and logsumexp from per-rank statistics.


def shard_ranges(vocab_size: int, num_shards: int, pad_to: int = 64) -> list[tuple[int, int]]:
    """[start, end) of each rank's columns, as vLLM's vocab-parallel layers split a padded vocabulary.

    The padded vocabulary (a multiple of ``pad_to * num_shards``) is cut into equal shards; columns
    at or beyond `vocab_size` are padding (their logits are -inf).
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    multiple = pad_to * num_shards
    padded = -(-vocab_size // multiple) * multiple
    size = padded // num_shards
    return [(r * size, (r + 1) * size) for r in range(num_shards)]


def split_logits(logits: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """Each rank's shard of full logits [..., V], padded with -inf beyond V."""
    vocab = logits.shape[-1]
    shards = []
    for start, end in ranges:
        shard = torch.full((*logits.shape[:-1], end - start), NEG_INF, dtype=logits.dtype, device=logits.device)
        real = max(0, min(end, vocab) - start)
        if real:
            shard[..., :real] = logits[..., start : start + real]
        shards.append(shard)
    return shards


def max_and_sumexp(scaled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row max and sum of exp(x - max) of fp32 logits [R, C] (0 for an all -inf row)."""
    row_max = scaled.max(dim=-1).values
    safe = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    sumexp = torch.exp(scaled - safe[:, None]).sum(dim=-1)
    return row_max, torch.where(torch.isfinite(row_max), sumexp, torch.zeros_like(sumexp))


def combine_logsumexp(maxes: torch.Tensor, sumexps: torch.Tensor) -> torch.Tensor:
    """Global logsumexp [R] from per-rank (max, sumexp) stacked as [P, R]."""
    global_max = maxes.max(dim=0).values
    return global_max + torch.log((sumexps * torch.exp(maxes - global_max)).sum(dim=0))


def _scale(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """fp32 logits divided by the row's temperature (temperature 0: unscaled, as stock)."""
    t = temperature.to(torch.float32)
    t = torch.where(t > 0, t, torch.ones_like(t))
    return logits.to(torch.float32) / t.view(-1, *([1] * (logits.dim() - 1)))


def _argmax_first(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, index of its first occurrence) along the last dim; NaN counts as -inf."""
    values = torch.where(torch.isnan(values), torch.full_like(values, NEG_INF), values)
    best = values.max(dim=-1).values
    index = (values == best[..., None]).to(torch.int8).argmax(dim=-1)
    return best, index


# --------------------------------------------------------------------------------------------
# Drafting.


@dataclass(frozen=True)
class DraftResult:
    tokens: torch.Tensor  # [R] drafted token ids
    logsumexp: torch.Tensor  # [R] logsumexp of the scaled draft logits
    token_logit: torch.Tensor  # [R] scaled draft logit of the drafted token


def draft_sample_full(
    logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, pos: torch.Tensor
) -> DraftResult:
    """Gumbel-max drafting over the full vocabulary (greedy where temperature is 0)."""
    scaled = _scale(logits, temperature)
    ids = torch.arange(logits.shape[-1], device=logits.device)
    noisy = scaled + gumbel_noise(seed, pos, ids, drafting=True)
    scores = torch.where((temperature > 0)[:, None], noisy, scaled)
    _, tokens = _argmax_first(scores)
    lse = torch.logsumexp(scaled, dim=-1)
    return DraftResult(tokens, lse, scaled.gather(1, tokens[:, None])[:, 0])


def draft_shard_payload(
    shard_logits: torch.Tensor,
    offset: int,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    pos: torch.Tensor,
) -> torch.Tensor:
    """One rank's ``[R, 5]`` drafting message: score, id, max, sumexp, logit of its winner (fp64)."""
    scaled = _scale(shard_logits, temperature)
    ids = torch.arange(offset, offset + shard_logits.shape[-1], device=shard_logits.device)
    noisy = scaled + gumbel_noise(seed, pos, ids, drafting=True)
    scores = torch.where((temperature > 0)[:, None], noisy, scaled)
    best, index = _argmax_first(scores)
    row_max, sumexp = max_and_sumexp(scaled)
    winner_logit = scaled.gather(1, index[:, None])[:, 0]
    columns = (best, (index + offset).to(torch.float32), row_max, sumexp, winner_logit)
    return torch.stack([c.to(torch.float64) for c in columns], dim=-1)


def merge_draft_payloads(payloads: torch.Tensor) -> DraftResult:
    """Merge the gathered ``[P, R, 5]`` messages: the first rank with the best score wins."""
    scores = payloads[..., 0].transpose(0, 1)  # [R, P]
    _, winner = _argmax_first(scores)
    rows = torch.arange(payloads.shape[1], device=payloads.device)
    picked = payloads[winner, rows]  # [R, 5]
    lse = combine_logsumexp(payloads[..., 2].to(torch.float32), payloads[..., 3].to(torch.float32))
    return DraftResult(picked[:, 1].long(), lse, picked[:, 4].to(torch.float32))


# --------------------------------------------------------------------------------------------
# Rejection sampling. A batch of R requests, each with up to K drafts: target logits [R, K+1, V]
# (raw; position j verifies draft j, position K gives the bonus token), draft logits [R, K, V] or None
# (one-hot drafts), draft tokens [R, K] (-1: placeholder), num_drafts [R] (0..K, -1: a padded
# row), temperature / seed [R], positions [R, K+1].


@dataclass(frozen=True)
class RejectionBatch:
    target_logits: torch.Tensor
    draft_logits: torch.Tensor | None
    draft_tokens: torch.Tensor
    num_drafts: torch.Tensor
    temperature: torch.Tensor
    seed: torch.Tensor
    positions: torch.Tensor

    def shard(self, ranges: Sequence[tuple[int, int]]) -> list[RejectionBatch]:
        """Each rank's view: its columns of the target and draft logits, everything else shared."""
        targets = split_logits(self.target_logits, ranges)
        drafts = split_logits(self.draft_logits, ranges) if self.draft_logits is not None else [None] * len(ranges)
        return [
            RejectionBatch(t, d, self.draft_tokens, self.num_drafts, self.temperature, self.seed, self.positions)
            for t, d in zip(targets, drafts, strict=True)
        ]


@dataclass(frozen=True)
class RejectionResult:
    num_accepted: torch.Tensor  # [R] accepted drafts (-1 for a padded row)
    tokens: torch.Tensor  # [R, K+1] accepted drafts then the resampled or bonus token; -1 after


def _accept_logu(batch: RejectionBatch) -> list[list[float]]:
    """log u of every row's accept test, [R][K+1] (fp32 logs, as the kernels compute them)."""
    num_reqs, k_plus_1 = batch.positions.shape
    u = accept_uniform(batch.seed.repeat_interleave(k_plus_1), batch.positions.reshape(-1))
    return torch.log(u).view(num_reqs, k_plus_1).tolist()


def _accept_step(
    greedy: bool, valid: bool, token: int, target_argmax: int, log_p: float, log_q: float, log_u: float
) -> bool:
    if not valid:
        return False
    if greedy:
        return target_argmax == token
    return log_p > log_u + log_q


def _residual_scores(
    target_scaled: torch.Tensor,
    target_lse: float,
    draft_scaled: torch.Tensor | None,
    draft_lse: float,
    rejected: int | None,
    token_offset: int,
) -> torch.Tensor:
    """Log-residual over some columns: log max(p - q, 0), or p without the rejected one-hot draft."""
    if rejected is None:  # bonus token, or a placeholder draft: the target itself
        return target_scaled
    if draft_scaled is not None:
        log_p = target_scaled - target_lse
        log_q = draft_scaled - draft_lse
        ratio = torch.exp(log_q - log_p)
        return torch.where(ratio < 1.0, log_p + torch.log1p(-ratio), torch.full_like(log_p, NEG_INF))
    ids = torch.arange(token_offset, token_offset + target_scaled.shape[-1], device=target_scaled.device)
    return torch.where(ids != rejected, target_scaled, torch.full_like(target_scaled, NEG_INF))


def rejection_sample_full(batch: RejectionBatch) -> RejectionResult:
    """Standard rejection sampling over the full vocabulary, request by request."""
    num_reqs, k_plus_1, vocab = batch.target_logits.shape
    tokens = torch.full((num_reqs, k_plus_1), -1, dtype=torch.long)
    accepted_out = torch.full((num_reqs,), -1, dtype=torch.long)
    ids = torch.arange(vocab)
    log_u = _accept_logu(batch)
    for i in range(num_reqs):
        n = int(batch.num_drafts[i])
        if n < 0:
            continue
        temp = batch.temperature[i : i + 1]
        greedy = float(temp) == 0.0
        target = _scale(batch.target_logits[i, : n + 1], temp.expand(n + 1))
        target_lse = torch.logsumexp(target, dim=-1)
        draft = draft_lse = None
        if batch.draft_logits is not None and n:
            draft = _scale(batch.draft_logits[i, :n], temp.expand(n))
            draft_lse = torch.logsumexp(draft, dim=-1)
        accepted = 0
        for j in range(n):
            x = int(batch.draft_tokens[i, j])
            valid = x >= 0
            argmax = int(_argmax_first(target[j])[1])
            log_p = float(target[j, max(x, 0)] - target_lse[j])
            log_q = float(draft[j, max(x, 0)] - draft_lse[j]) if draft is not None and draft_lse is not None else 0.0
            if _accept_step(greedy, valid, x, argmax, log_p, log_q, log_u[i][j]):
                tokens[i, j] = x
                accepted += 1
                continue
            break
        accepted_out[i] = accepted
        a = accepted
        if greedy:
            tokens[i, a] = int(_argmax_first(target[a])[1])
            continue
        rejected = int(batch.draft_tokens[i, a]) if a < n and int(batch.draft_tokens[i, a]) >= 0 else None
        scores = _residual_scores(
            target[a],
            float(target_lse[a]),
            draft[a] if draft is not None and rejected is not None else None,
            float(draft_lse[a]) if draft_lse is not None and rejected is not None else 0.0,
            rejected,
            0,
        )
        noise = gumbel_noise(batch.seed[i : i + 1], batch.positions[i, a : a + 1], ids, drafting=False)[0]
        tokens[i, a] = int(_argmax_first(scores + noise)[1])
    return RejectionResult(accepted_out, tokens)


def verify_shard_payload(shard: RejectionBatch, offset: int) -> torch.Tensor:
    """One rank's ``[R, K+1, 7]`` verification message (fp64): target max, sumexp, argmax; draft max,
    sumexp; target and draft logits of the draft token verified there where this rank owns it."""
    num_reqs, k_plus_1, width = shard.target_logits.shape
    temp = shard.temperature.repeat_interleave(k_plus_1)
    target = _scale(shard.target_logits.reshape(-1, width), temp)
    t_max, t_sum = max_and_sumexp(target)
    _, t_arg = _argmax_first(target)
    d_max = torch.full_like(t_max, NEG_INF)
    d_sum = torch.zeros_like(t_sum)
    draft = None
    if shard.draft_logits is not None:
        k = shard.draft_logits.shape[1]
        draft_rows = _scale(shard.draft_logits.reshape(-1, width), shard.temperature.repeat_interleave(k))
        dm, ds = max_and_sumexp(draft_rows)
        draft = torch.full((num_reqs, k_plus_1, width), NEG_INF)
        draft[:, :k] = draft_rows.view(num_reqs, k, width)
        d_max = d_max.view(num_reqs, k_plus_1).clone()
        d_sum = d_sum.view(num_reqs, k_plus_1).clone()
        d_max[:, :k], d_sum[:, :k] = dm.view(num_reqs, k), ds.view(num_reqs, k)
        d_max, d_sum = d_max.reshape(-1), d_sum.reshape(-1)
    tokens = torch.full((num_reqs, k_plus_1), -1, dtype=torch.long)
    tokens[:, : shard.draft_tokens.shape[1]] = shard.draft_tokens
    local = tokens.reshape(-1) - offset
    owned = (local >= 0) & (local < width)
    index = torch.where(owned, local, torch.zeros_like(local))
    t_x = torch.where(owned, target.gather(1, index[:, None])[:, 0], torch.full_like(t_max, NEG_INF))
    if draft is not None:
        d_x = draft.reshape(-1, width).gather(1, index[:, None])[:, 0]
        d_x = torch.where(owned, d_x, torch.full_like(d_x, NEG_INF))
    else:
        d_x = torch.full_like(t_max, NEG_INF)
    columns = (t_max, t_sum, (t_arg + offset).to(torch.float32), d_max, d_sum, t_x, d_x)
    return torch.stack([c.to(torch.float64) for c in columns], dim=-1).view(num_reqs, k_plus_1, 7)


@dataclass(frozen=True)
class Verdict:
    """What every rank decides from the gathered verification messages (the same on every rank)."""

    num_accepted: torch.Tensor  # [R]
    tokens: torch.Tensor  # [R, K+1]: accepted drafts, the greedy target argmax at a greedy rejection
    target_lse: torch.Tensor  # [R, K+1]
    draft_lse: torch.Tensor  # [R, K+1]
    needs_resample: torch.Tensor  # [R] bool: a residual (or bonus) draw is still needed


def decide(batch: RejectionBatch, payloads: torch.Tensor) -> Verdict:
    """Accept decisions from the gathered ``[P, R, K+1, 7]`` messages (no vocabulary-sized data)."""
    num_reqs, k_plus_1 = payloads.shape[1:3]
    f32 = payloads.to(torch.float32)
    target_lse = combine_logsumexp(f32[..., 0].flatten(1), f32[..., 1].flatten(1)).view(num_reqs, k_plus_1)
    draft_lse = combine_logsumexp(f32[..., 3].flatten(1), f32[..., 4].flatten(1)).view(num_reqs, k_plus_1)
    _, best_rank = _argmax_first(f32[..., 0].permute(1, 2, 0))  # [R, K+1]: first rank holding the max
    target_argmax = payloads[..., 2].permute(1, 2, 0).gather(-1, best_rank[..., None])[..., 0].long()
    log_p_all = (f32[..., 5].max(dim=0).values - target_lse).tolist()
    log_q_all = (f32[..., 6].max(dim=0).values - draft_lse).tolist()
    argmax_all = target_argmax.tolist()
    draft_tokens = batch.draft_tokens.tolist()
    log_u = _accept_logu(batch)
    tokens = torch.full((num_reqs, k_plus_1), -1, dtype=torch.long)
    accepted_out = torch.full((num_reqs,), -1, dtype=torch.long)
    needs = torch.zeros(num_reqs, dtype=torch.bool)
    for i in range(num_reqs):
        n = int(batch.num_drafts[i])
        if n < 0:
            continue
        greedy = float(batch.temperature[i]) == 0.0
        accepted = 0
        for j in range(n):
            x = draft_tokens[i][j]
            log_q = log_q_all[i][j] if batch.draft_logits is not None else 0.0
            if _accept_step(greedy, x >= 0, x, argmax_all[i][j], log_p_all[i][j], log_q, log_u[i][j]):
                tokens[i, j] = x
                accepted += 1
                continue
            break
        accepted_out[i] = accepted
        if greedy:
            tokens[i, accepted] = target_argmax[i, accepted]
        else:
            needs[i] = True
    return Verdict(accepted_out, tokens, target_lse, draft_lse, needs)


def resample_shard_payload(shard: RejectionBatch, offset: int, verdict: Verdict) -> torch.Tensor:
    """One rank's ``[R, 2]`` resampling message (fp64): best residual score in its columns and its id."""
    num_reqs, _, width = shard.target_logits.shape
    out = torch.full((num_reqs, 2), NEG_INF, dtype=torch.float64)
    rows = torch.nonzero(verdict.needs_resample).flatten()
    if not len(rows):
        return out
    at = verdict.num_accepted[rows]  # the position resampled: the first rejected draft, or the bonus
    temp = shard.temperature[rows]
    target = _scale(shard.target_logits[rows, at], temp)
    target_lse = verdict.target_lse[rows, at]
    k = shard.draft_tokens.shape[1]
    drafted = torch.full((len(rows),), -1, dtype=torch.long)
    inside = at < shard.num_drafts[rows]
    drafted[inside] = shard.draft_tokens[rows[inside], at[inside]]
    rejected = drafted >= 0  # a real draft was rejected (else: bonus or placeholder -> the target)
    ids = torch.arange(offset, offset + width)
    if shard.draft_logits is not None:
        draft = _scale(shard.draft_logits[rows, torch.clamp(at, max=k - 1)], temp) if k else target
        log_p = target - target_lse[:, None]
        log_q = draft - verdict.draft_lse[rows, at][:, None]
        ratio = torch.exp(log_q - log_p)
        residual = torch.where(ratio < 1.0, log_p + torch.log1p(-ratio), torch.full_like(log_p, NEG_INF))
    else:
        residual = torch.where(ids[None, :] != drafted[:, None], target, torch.full_like(target, NEG_INF))
    scores = torch.where(rejected[:, None], residual, target)
    noise = gumbel_noise(shard.seed[rows], shard.positions[rows, at], ids, drafting=False)
    best, index = _argmax_first(scores + noise)
    out[rows, 0] = best.to(torch.float64)
    out[rows, 1] = (index + offset).to(torch.float64)
    return out


def merge_resample_payloads(verdict: Verdict, payloads: torch.Tensor) -> RejectionResult:
    """The final tokens from the verdict and the gathered ``[P, R, 2]`` resampling messages."""
    tokens = verdict.tokens.clone()
    _, winner = _argmax_first(payloads[..., 0].transpose(0, 1))
    rows = torch.arange(payloads.shape[1])
    drawn = payloads[winner, rows, 1].long()
    for i in range(tokens.shape[0]):
        if bool(verdict.needs_resample[i]):
            tokens[i, int(verdict.num_accepted[i])] = drawn[i]
    return RejectionResult(verdict.num_accepted, tokens)


def rejection_sample_sharded(batch: RejectionBatch, ranges: Sequence[tuple[int, int]]) -> RejectionResult:
    """The vocab-parallel path on simulated ranks: two small all-gathers, no vocabulary-sized one."""
    shards = batch.shard(ranges)
    verify = torch.stack([verify_shard_payload(s, start) for s, (start, _) in zip(shards, ranges, strict=True)])
    verdict = decide(batch, verify)
    resample = torch.stack(
        [resample_shard_payload(s, start, verdict) for s, (start, _) in zip(shards, ranges, strict=True)]
    )
    return merge_resample_payloads(verdict, resample)
