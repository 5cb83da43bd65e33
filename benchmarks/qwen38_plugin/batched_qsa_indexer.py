"""transformers' QSA indexer, batched, for training the target in bench_mtp_trained.py.

transformers' ``Qwen4ExpTextQSAIndexer.forward`` chooses each query's key blocks in a Python loop
over (sequence, query), with a ``torch.nonzero`` host sync per query: a training step of 16 x 256
tokens runs 8,192 such iterations per QSA layer, forward and backward. On the H200 that made the
medium target's pretraining take 5 s a step (60 steps in the 300 s of 2026-12-02), which is why
its greedy text was degenerate (a newline repeated after the first few tokens).

`batched_selection` computes the same mask for every query at once, for the case training has: no
KV cache and a plain causal mask (no padding), so that query ``q`` sees tokens ``0 .. q``. The
selection is not differentiable (top-k indices), so training sees the same function as with the
loop, up to the choice among blocks of equal score at the top-k boundary, which top-k leaves to its
implementation in both. Other masks are refused rather than approximated.
tests/qwen38_plugin/test_batched_qsa_indexer.py holds it to transformers' loop.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch


class UnsupportedMask(ValueError):
    """The batched selection covers causal masks without padding or cache only."""


def batched_selection(
    indexer: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor,
    past_key_values: Any,
) -> torch.Tensor:
    """``Qwen4ExpTextQSAIndexer.forward``'s result (the selected-token mask ``[B, 1, L, L]``, bool
    or additive float like ``attention_mask``) computed for all queries at once."""
    if past_key_values is not None:
        raise UnsupportedMask("past_key_values: the batched QSA selection is for training without a KV cache")
    batch, length, _ = hidden_states.shape
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    causal = torch.ones(length, length, dtype=torch.bool, device=hidden_states.device).tril()
    if visible.shape[-2:] != (length, length) or not torch.equal(visible, causal.expand_as(visible)):
        raise UnsupportedMask("attention_mask: the batched QSA selection needs a causal mask without padding")

    ratio, topk = indexer.compress_ratio, indexer.block_topk
    blocks = length // ratio
    mask = torch.zeros(batch, length, length, dtype=torch.bool, device=hidden_states.device)
    positions = torch.arange(length, device=hidden_states.device)
    complete = (positions + 1) // ratio  # each query's complete blocks
    if blocks:
        scores = block_scores(indexer, hidden_states, position_embeddings)
        reachable = torch.arange(blocks, device=hidden_states.device)[None, :] < complete[:, None]  # [L, G]
        scores = scores.masked_fill(~reachable, float("-inf"))
        # Among equal scores (relu makes zeros common) the loop's top-k over a query's own blocks and
        # this top-k over all blocks may keep different ones: an equally valid selection.
        chosen = scores.topk(min(topk, blocks), dim=-1).indices
        selected = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, chosen, True) & reachable
        token_block = (positions // ratio).clamp(max=blocks - 1)
        in_blocks = positions[None, :] < (complete * ratio)[:, None]  # [L(query), L(token)]
        mask = selected.gather(-1, token_block.expand(batch, length, length)) & in_blocks
    tail = (positions[None, :] >= (complete * ratio)[:, None]) & (positions[None, :] <= positions[:, None])
    mask = (mask | tail).unsqueeze(1)
    if attention_mask.is_floating_point():
        return torch.where(mask, attention_mask.new_zeros(()), torch.finfo(attention_mask.dtype).min)
    return mask


def block_scores(
    indexer: Any, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Every query's score of every complete key block, ``[B, L, L // compress_ratio]`` (fp32), as
    transformers' loop computes them for the blocks a query sees."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

    batch, length, _ = hidden_states.shape
    ratio, dim = indexer.compress_ratio, indexer.index_head_dim
    blocks = length // ratio
    cos, sin = position_embeddings
    qk = indexer.index_qk_proj(hidden_states)
    q, token_k = torch.split(qk, [indexer.index_n_heads * dim, indexer.index_kv_heads * dim], dim=-1)
    q = indexer.q_layernorm(q.reshape(batch, length, -1, dim))
    q = hf.apply_rotary_pos_emb(q, cos=cos, sin=sin, unsqueeze_dim=2)  # [B, L, H, d]
    raw_keys = token_k.reshape(batch, length, -1, dim).squeeze(2)  # [B, L, d]
    # the loop's dtype path: the mean in fp32, back to the keys' dtype, norm, RoPE at the block's start
    pooled = raw_keys[:, : blocks * ratio].reshape(batch, blocks, ratio, dim).float().mean(dim=2)
    pooled = indexer.k_layernorm(pooled.to(raw_keys.dtype))
    starts = torch.arange(blocks, device=hidden_states.device) * ratio
    block_keys = hf.apply_rotary_pos_emb(
        pooled.unsqueeze(2), cos=cos[:, starts], sin=sin[:, starts], unsqueeze_dim=2
    ).squeeze(2)  # [B, G, d]
    scores = torch.einsum("blhd,bgd->blgh", q.float(), block_keys.float())
    return torch.relu(scores).sum(dim=-1) / math.sqrt(dim)


@contextlib.contextmanager
def batched_qsa_indexer() -> Iterator[None]:
    """transformers' QSA indexer runs `batched_selection` for as long as the context lasts."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

    looped = hf.Qwen4ExpTextQSAIndexer.forward
    hf.Qwen4ExpTextQSAIndexer.forward = batched_selection  # type: ignore[method-assign]
    try:
        yield
    finally:
        hf.Qwen4ExpTextQSAIndexer.forward = looped  # type: ignore[method-assign]
