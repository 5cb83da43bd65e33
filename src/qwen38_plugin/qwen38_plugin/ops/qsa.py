"""QSA indexed attention (the `indexed_attention` layers).

A query at position p may attend to:
- the tokens of the ``budget // ratio`` best *complete* key blocks among positions 0..p,
  where block j holds positions ``[j * ratio, (j + 1) * ratio)`` and is complete once
  ``(j + 1) * ratio <= p + 1``; blocks are scored by the indexer (below);
- every token of the *open group*, the incomplete block ``[(p + 1) // ratio * ratio, p]``.
When there are at most ``budget // ratio`` complete blocks, that is all of 0..p (dense causal).

Indexer: the index projection gives ``Hi`` query heads and one key per token (the raw key,
which is what a cache keeps). A block's key is the fp32 mean of its raw keys, rounded to the
model dtype, RMS-normalised and rotated at the block's first position; a block's score for a
query is ``sum_h relu(q_h . key_block) / sqrt(Di)`` in fp32.

The attention itself is Qwen's gated attention: per-head RMSNorm on q and k, partial RoPE,
softmax attention restricted to the selected tokens, then ``* sigmoid(gate)`` per feature.
Positions are absolute token positions within the sequence (text-only: 0, 1, 2, ...).

Two forms of the same layer:
- `qsa_attention` (the reference, tested against transformers) takes every past raw key and
  recomputes every complete block's key at each step;
- the ring form, `prepare_tokens` then `attend_ring`, takes what a serving cache keeps
  (`IndexerPast`): one key per complete group, computed once when the group closes, and the raw
  keys of the open group only. It returns the keys of the groups the step closed and the step's
  raw keys (`IndexerStep`).
Both give the same selection: a block key depends only on its own group's raw keys.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from qwen38_plugin.ops.common import apply_partial_rope, rms_norm, rotary_cos_sin


def split_index_projection(
    index_qk: torch.Tensor, num_index_heads: int, index_head_dim: int
) -> tuple[torch.Tensor, ...]:
    """index_qk ``[T, (Hi + 1) * Di]`` -> (queries ``[T, Hi, Di]``, raw keys ``[T, Di]``)."""
    q, key = torch.split(index_qk, [num_index_heads * index_head_dim, index_head_dim], dim=-1)
    return q.unflatten(-1, (num_index_heads, index_head_dim)), key


def block_keys(
    raw_keys: torch.Tensor,
    num_blocks: int,
    ratio: int,
    k_norm_weight: torch.Tensor,
    eps: float,
    rope_theta: float,
    rotary_dim: int,
    first_block: int = 0,
) -> torch.Tensor:
    """Keys ``[num_blocks, Di]`` of the first ``num_blocks`` blocks of raw_keys ``[N, Di]``.

    raw_keys[0] is the first position of block ``first_block`` (its RoPE position is
    ``first_block * ratio``).
    """
    groups = raw_keys[: num_blocks * ratio].unflatten(0, (num_blocks, ratio))
    pooled = groups.float().mean(dim=1).to(raw_keys.dtype)
    pooled = rms_norm(pooled, k_norm_weight, eps)
    starts = (first_block + torch.arange(num_blocks, device=raw_keys.device)) * ratio
    cos, sin = rotary_cos_sin(starts, rotary_dim, rope_theta, raw_keys.dtype)
    return apply_partial_rope(pooled.unsqueeze(1), cos, sin).squeeze(1)


def select_tokens(
    index_q: torch.Tensor,
    raw_keys: torch.Tensor,
    query_positions: torch.Tensor,
    *,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    rope_theta: float,
    rotary_dim: int,
    budget: int,
    ratio: int,
) -> torch.Tensor:
    """The QSA token mask of one sequence, from every raw key (the reference form).

    index_q: ``[T, Hi, Di]`` raw index queries of the new tokens; raw_keys: ``[N, Di]`` raw
    index keys of positions 0..N-1 (the new tokens included); query_positions: ``[T]``.
    Returns a bool mask ``[T, N]``: True where the query attends to the key position.
    """
    max_blocks = (int(query_positions.max()) + 1) // ratio if index_q.shape[0] else 0
    keys = block_keys(raw_keys, max_blocks, ratio, k_norm_weight, eps, rope_theta, rotary_dim)
    return select_from_block_keys(
        index_q, keys, raw_keys.shape[0], query_positions, q_norm_weight=q_norm_weight, eps=eps,
        rope_theta=rope_theta, rotary_dim=rotary_dim, budget=budget, ratio=ratio,
    )  # fmt: skip


def select_from_block_keys(
    index_q: torch.Tensor,
    keys: torch.Tensor,
    num_keys: int,
    query_positions: torch.Tensor,
    *,
    q_norm_weight: torch.Tensor,
    eps: float,
    rope_theta: float,
    rotary_dim: int,
    budget: int,
    ratio: int,
) -> torch.Tensor:
    """The QSA token mask ``[T, num_keys]`` of one sequence, from its block keys.

    keys: ``[C, Di]`` keys of blocks 0..C-1 (`block_keys`), C at least the number of blocks
    complete at the last query; num_keys: positions 0..num_keys-1 the queries may see.
    """
    q = index_queries(index_q, query_positions, q_norm_weight, eps, rope_theta, rotary_dim)
    return select_with_index_queries(q, keys, num_keys, query_positions, budget=budget, ratio=ratio)


def index_queries(
    index_q: torch.Tensor, positions: torch.Tensor, q_norm_weight: torch.Tensor, eps: float, rope_theta: float,
    rotary_dim: int,
) -> torch.Tensor:  # fmt: skip
    """Raw index queries ``[T, Hi, Di]`` -> normed, rotated, fp32 (row by row: any tokens at once)."""
    cos, sin = rotary_cos_sin(positions, rotary_dim, rope_theta, index_q.dtype)
    return apply_partial_rope(rms_norm(index_q, q_norm_weight, eps), cos, sin).float()


def select_with_index_queries(
    q: torch.Tensor, keys: torch.Tensor, num_keys: int, query_positions: torch.Tensor, *, budget: int, ratio: int
) -> torch.Tensor:
    """`select_from_block_keys` from `index_queries`' output ``q``."""
    num_queries, _, head_dim = q.shape
    device = q.device
    keys = keys.float()
    block_topk = budget // ratio
    key_positions = torch.arange(num_keys, device=device)
    mask = key_positions.unsqueeze(0) <= query_positions.unsqueeze(1)  # causal
    for i in range(num_queries):
        position = int(query_positions[i])
        complete = (position + 1) // ratio
        if complete <= block_topk:
            continue  # every visible token is selected
        scores = torch.relu(keys[:complete] @ q[i].transpose(0, 1)).sum(-1) / math.sqrt(head_dim)
        # topk over exactly the complete blocks, in block order: equal scores (relu zeros) then
        # resolve the way the reference resolves them.
        chosen = scores.topk(block_topk, dim=0).indices
        allowed = torch.zeros(num_keys, dtype=torch.bool, device=device)
        allowed[complete * ratio : position + 1] = True  # the open group
        allowed[(chosen.unsqueeze(1) * ratio + torch.arange(ratio, device=chosen.device)).flatten()] = True
        mask[i] &= allowed
    return mask


class IndexerPast(NamedTuple):
    """What a cache keeps of one sequence's indexer keys after P positions (C = P // ratio)."""

    block_keys: torch.Tensor  # [C, Di]: keys of the complete groups 0..C-1 (`block_keys`)
    open_keys: torch.Tensor  # [P - C * ratio, Di]: raw keys of the open group


class IndexerStep(NamedTuple):
    """The indexer keys one step of T new tokens (positions P..P+T-1) adds."""

    block_keys: torch.Tensor  # [G, Di]: keys of the groups C..C+G-1 this step completed
    raw_keys: torch.Tensor  # [T, Di]: raw keys of the new tokens (what the ring stores)
    open_keys: torch.Tensor  # [(P + T) % ratio, Di]: raw keys of the open group after the step


def close_groups(
    past: IndexerPast | None,
    new_raw_keys: torch.Tensor,
    start: int,
    ratio: int,
    k_norm_weight: torch.Tensor,
    eps: float,
    rope_theta: float,
    rotary_dim: int,
) -> IndexerStep:
    """Add the raw keys ``[T, Di]`` of positions start..start+T-1 to `past`: the keys of the
    groups they complete (each computed once, from its own raw keys) and the new open group."""
    first_group = start // ratio
    open_keys = past.open_keys if past is not None else new_raw_keys[:0]
    if open_keys.shape[0] != start - first_group * ratio:
        raise ValueError(
            f"QSA open group: {open_keys.shape[0]} raw keys cached for position {start} with ratio {ratio}; "
            f"expected {start - first_group * ratio}"
        )
    pending = torch.cat([open_keys, new_raw_keys])  # positions first_group * ratio ..
    closed = (start + new_raw_keys.shape[0]) // ratio - first_group
    if closed == 0:  # most decode steps: nothing to pool
        return IndexerStep(pending[:0], new_raw_keys, pending)
    keys = block_keys(pending, closed, ratio, k_norm_weight, eps, rope_theta, rotary_dim, first_block=first_group)
    return IndexerStep(keys, new_raw_keys, pending[closed * ratio :])


class RingCapacityError(ValueError):
    """A block size no QSA key ring of whole groups divides; the message names the fix."""


RING_MAX_WIDENING = 4


def ring_base_capacity(ratio: int, num_speculative_tokens: int = 0) -> int:
    """The smallest QSA key ring, in whole groups: the open group plus every draft row a
    speculative step stores before acceptance is known."""
    return ratio * math.ceil((ratio + num_speculative_tokens) / ratio)


def ring_capacity(ratio: int, num_speculative_tokens: int, block_size: int) -> int:
    """The QSA key ring capacity for an attention block size (rule R38, ReVolta 0.1.2).

    The ring must divide the block size. Starting from `ring_base_capacity`, it widens by whole
    groups (``ratio`` at a time) up to ``RING_MAX_WIDENING`` times the base until it does;
    beyond that `RingCapacityError` names the block-size multiple to use.
    """
    if ratio <= 0 or num_speculative_tokens < 0 or block_size <= 0:
        raise ValueError(
            f"QSA key ring: ratio {ratio}, speculative tokens {num_speculative_tokens} and block size "
            f"{block_size} must be positive (speculative tokens may be 0)"
        )
    base = ring_base_capacity(ratio, num_speculative_tokens)
    for capacity in range(base, RING_MAX_WIDENING * base + 1, ratio):
        if block_size % capacity == 0:
            return capacity
    raise RingCapacityError(
        f"QSA key ring: no ring of whole {ratio}-token groups from {base} tokens (indexer_compress_ratio {ratio} "
        f"+ {num_speculative_tokens} speculative tokens) up to {RING_MAX_WIDENING * base} tokens "
        f"({RING_MAX_WIDENING}x) divides the attention block size {block_size}; use a --block-size that is a "
        f"multiple of {base}"
    )


def gated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Masked softmax attention with a sigmoid output gate, for one sequence.

    q: ``[T, Hq, D]``; k, v: ``[N, Hkv, D]`` (Hq a multiple of Hkv; query head h reads kv head
    ``h // (Hq / Hkv)``); gate: ``[T, Hq * D]``; mask: ``[T, N]`` bool. Scores and softmax in
    fp32. Returns ``[T, Hq * D]`` in q.dtype.
    """
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    # query heads grouped by the KV head they read: [T, Hkv, G, D] (no copies of k and v per head)
    qg = q.float().view(tokens, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("tkgd,nkd->kgtn", qg, k.float()) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("kgtn,nkd->tkgd", probs, v.float()).to(q.dtype).reshape(tokens, heads * dim)
    return out * torch.sigmoid(gate)


def split_gated_query(q_proj: torch.Tensor, num_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q_proj ``[T, Hq * 2 * D]`` (per head: D query features then D gate features) ->
    (q ``[T, Hq, D]``, gate ``[T, Hq * D]``)."""
    per_head = q_proj.unflatten(-1, (num_heads, 2 * head_dim))
    q, gate = per_head.split(head_dim, dim=-1)
    return q, gate.flatten(1)


def _queries_and_new_keys(
    q_proj: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    positions: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    rope_theta: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normed, rotated q ``[T, Hq, D]``, its gate ``[T, Hq * D]``, normed, rotated k and v ``[T, Hkv, D]``."""
    q, gate = split_gated_query(q_proj, num_heads, head_dim)
    q = rms_norm(q, q_norm_weight, eps)
    k = rms_norm(k_new.unflatten(-1, (num_kv_heads, head_dim)), k_norm_weight, eps)
    v = v_new.unflatten(-1, (num_kv_heads, head_dim))
    cos, sin = rotary_cos_sin(positions, rotary_dim, rope_theta, q.dtype)
    return apply_partial_rope(q, cos, sin), gate, apply_partial_rope(k, cos, sin), v


def qsa_attention(
    q_proj: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    index_qk: torch.Tensor,
    positions: torch.Tensor,
    *,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    index_q_norm_weight: torch.Tensor | None,
    index_k_norm_weight: torch.Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    rope_theta: float,
    eps: float,
    num_index_heads: int | None,
    index_head_dim: int | None,
    budget: int | None,
    ratio: int | None,
    past_k: torch.Tensor | None = None,
    past_v: torch.Tensor | None = None,
    past_index_keys: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One QSA attention layer of one sequence, between its projections and o_proj.

    q_proj: ``[T, Hq * 2 * D]``; k_new, v_new: ``[T, Hkv * D]``; index_qk: ``[T, (Hi + 1) * Di]``
    (ignored without an indexer, i.e. when ``budget`` is None: plain gated attention);
    positions: ``[T]``, continuing the past. past_k/past_v ``[P, Hkv, D]`` (k normed and rotated)
    and past_index_keys ``[P, Di]`` hold positions 0..P-1 (None: P = 0).
    Returns (out ``[T, Hq * D]``, all k ``[P + T, Hkv, D]``, all v, all raw index keys or None).
    """
    q, gate, k, v = _queries_and_new_keys(
        q_proj, k_new, v_new, positions, q_norm_weight, k_norm_weight, num_heads, num_kv_heads, head_dim,
        rotary_dim, rope_theta, eps,
    )  # fmt: skip
    if past_k is not None and past_v is not None:
        k, v = torch.cat([past_k, k]), torch.cat([past_v, v])
    key_positions = torch.arange(k.shape[0], device=q.device)
    index_keys = None
    if budget is None:
        mask = key_positions.unsqueeze(0) <= positions.unsqueeze(1)
    else:
        assert num_index_heads and index_head_dim and ratio and index_q_norm_weight is not None
        assert index_k_norm_weight is not None
        index_q, new_index_keys = split_index_projection(index_qk, num_index_heads, index_head_dim)
        index_keys = new_index_keys if past_index_keys is None else torch.cat([past_index_keys, new_index_keys])
        mask = select_tokens(
            index_q,
            index_keys,
            positions,
            q_norm_weight=index_q_norm_weight,
            k_norm_weight=index_k_norm_weight,
            eps=eps,
            rope_theta=rope_theta,
            rotary_dim=rotary_dim,
            budget=budget,
            ratio=ratio,
        )
    out = gated_attention(q, k, v, gate, mask, head_dim**-0.5)
    return out, k, v, index_keys


class PreparedTokens(NamedTuple):
    """A step's tokens made ready for attention, row by row (`prepare_tokens`)."""

    q: torch.Tensor  # [T, Hq, D] normed, rotated
    gate: torch.Tensor  # [T, Hq * D]
    k: torch.Tensor  # [T, Hkv, D] normed, rotated
    v: torch.Tensor  # [T, Hkv, D]
    index_q: torch.Tensor | None  # [T, Hi, Di] fp32, normed, rotated (None without an indexer)
    index_keys: torch.Tensor | None  # [T, Di] raw index keys

    def rows(self, rows: slice) -> PreparedTokens:
        """The same for some of the tokens (one sequence's)."""
        index_q = None if self.index_q is None else self.index_q[rows]
        index_keys = None if self.index_keys is None else self.index_keys[rows]
        return PreparedTokens(self.q[rows], self.gate[rows], self.k[rows], self.v[rows], index_q, index_keys)


def prepare_tokens(
    q_proj: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    index_qk: torch.Tensor,
    positions: torch.Tensor,
    *,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    index_q_norm_weight: torch.Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    rope_theta: float,
    eps: float,
    num_index_heads: int | None,
    index_head_dim: int | None,
    budget: int | None,
) -> PreparedTokens:
    """Everything `attend_ring` needs that depends on one token only: norms, rotations, splits.

    Works on any tokens at once (every token of a step, of all its sequences): a model runs
    it once per layer and step, then `attend_ring` per sequence on its rows (`PreparedTokens.rows`).
    """
    q, gate, k, v = _queries_and_new_keys(
        q_proj, k_new, v_new, positions, q_norm_weight, k_norm_weight, num_heads, num_kv_heads, head_dim,
        rotary_dim, rope_theta, eps,
    )  # fmt: skip
    if budget is None:
        return PreparedTokens(q, gate, k, v, None, None)
    assert num_index_heads and index_head_dim and index_q_norm_weight is not None
    index_q, raw_keys = split_index_projection(index_qk, num_index_heads, index_head_dim)
    index_q = index_queries(index_q, positions, index_q_norm_weight, eps, rope_theta, rotary_dim)
    return PreparedTokens(q, gate, k, v, index_q, raw_keys)


def attend_ring(
    prepared: PreparedTokens,
    positions: torch.Tensor,
    *,
    index_k_norm_weight: torch.Tensor | None,
    rotary_dim: int,
    rope_theta: float,
    eps: float,
    budget: int | None,
    ratio: int | None,
    past_k: torch.Tensor | None = None,
    past_v: torch.Tensor | None = None,
    past_indexer: IndexerPast | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, IndexerStep | None]:
    """`qsa_attention` over a serving cache, for one sequence from its `PreparedTokens`: block keys
    of complete groups plus the open group.

    Arguments as `qsa_attention`, except past_indexer (None: P = 0) in place of every past raw
    key. Returns (out ``[T, Hq * D]``, new k ``[T, Hkv, D]``, new v, `IndexerStep` or None
    without an indexer).
    """
    q, gate, k, v, index_q, raw_keys = prepared
    k_all, v_all = (k, v) if past_k is None or past_v is None else (torch.cat([past_k, k]), torch.cat([past_v, v]))
    num_keys = k_all.shape[0]
    step = None
    if budget is None:
        mask = torch.arange(num_keys, device=q.device).unsqueeze(0) <= positions.unsqueeze(1)
    else:
        assert ratio and index_q is not None and raw_keys is not None and index_k_norm_weight is not None
        step = close_groups(
            past_indexer, raw_keys, num_keys - positions.shape[0], ratio, index_k_norm_weight, eps, rope_theta,
            rotary_dim,
        )  # fmt: skip
        keys = step.block_keys if past_indexer is None else torch.cat([past_indexer.block_keys, step.block_keys])
        mask = select_with_index_queries(index_q, keys, num_keys, positions, budget=budget, ratio=ratio)
    out = gated_attention(q, k_all, v_all, gate, mask, q.shape[-1] ** -0.5)
    return out, k, v, step
