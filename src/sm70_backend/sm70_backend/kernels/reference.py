"""Plain-torch references of the FLASH_ATTN_V100 kernels (any device, fp32 arithmetic).

They are the oracle of the kernel tests and the portable path of the backend on CPU. The cache
layout is vLLM's logical ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (K then V in
the last dimension), any strides.

Masking of query token i of a request (position ``p = seq_len - q_len + i``) and key ``j``:
``j < seq_len``; causal: ``j <= p``; ``window_left >= 0``: ``j >= p - window_left``;
``window_right >= 0``: ``j <= p + window_right``. vLLM's ``sliding_window = W`` is
``window_left = W - 1`` (flash-attn's convention). A query row that sees no key gets zeros.
"""

from __future__ import annotations

import torch


def write_kv_reference(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write K/V of each token at its slot (``slot < 0``: a padding token, skipped)."""
    head_size = key.shape[-1]
    block_size = kv_cache.shape[2]
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    # [tokens, heads, D] -> kv_cache[block, :, offset, :D]
    kv_cache[blocks, :, offsets, :head_size] = key[keep].to(kv_cache.dtype)
    kv_cache[blocks, :, offsets, head_size:] = value[keep].to(kv_cache.dtype)


def visible_keys(q_len: int, seq_len: int, causal: bool, window_left: int, window_right: int) -> torch.Tensor:
    """[q_len, seq_len] bool: which keys each query token of a request sees."""
    positions = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
    keys = torch.arange(seq_len).unsqueeze(0)
    mask = torch.ones(q_len, seq_len, dtype=torch.bool)
    if causal:
        mask &= keys <= positions
    if window_left >= 0:
        mask &= keys >= positions - window_left
    if window_right >= 0:
        mask &= keys <= positions + window_right
    return mask


def gather_kv(kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request's first ``seq_len`` positions: two [num_kv_heads, seq_len, D] tensors."""
    head_size = kv_cache.shape[-1] // 2
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = kv_cache[block_table_row[:num_blocks].to(torch.int64)]  # [nb, H, bs, 2D]
    flat = blocks.permute(1, 0, 2, 3).reshape(kv_cache.shape[1], num_blocks * block_size, 2 * head_size)
    return flat[:, :seq_len, :head_size], flat[:, :seq_len, head_size:]


def paged_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    causal: bool = True,
    window_left: int = -1,
    window_right: int = -1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every query token ``q [tokens, num_q_heads, D]`` over its request's paged K/V."""
    num_q_heads = q.shape[1]
    num_kv_heads = kv_cache.shape[1]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        q_lo, q_hi = starts[r], starts[r + 1]
        if q_hi == q_lo:
            continue
        k, v = gather_kv(kv_cache, block_table[r], seq_len)
        k = k.float().repeat_interleave(group, dim=0)  # [Hq, S, D]
        v = v.float().repeat_interleave(group, dim=0)
        queries = q[q_lo:q_hi].float().transpose(0, 1)  # [Hq, L, D]
        scores = torch.matmul(queries, k.transpose(1, 2)) * scale
        mask = visible_keys(q_hi - q_lo, seq_len, causal, window_left, window_right).to(scores.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows without a visible key: zeros
        out[q_lo:q_hi] = torch.matmul(probs, v).transpose(0, 1).to(out.dtype)
    return out
