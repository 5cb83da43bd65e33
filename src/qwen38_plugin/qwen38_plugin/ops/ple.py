"""PLE: per-layer hashed n-gram embeddings added to the hyper-connection streams.

For every token, n-grams of orders 2..n (n = ``ngram_size``) ending at it are hashed by
``heads_per_ngram`` heads each into prime-sized tables (one shared embedding table, each head
at its own offset). An n-gram never reaches back across an EOS token: a token before the
latest EOS (or before the start of the sequence) reads as EOS. The concatenated embedding
``[E]`` is projected to one value ``[H]`` and one key per stream ``[hc * H]``; a signed-sqrt
dot product of the key with the normalised stream gates the value per stream, and a dilated
depthwise convolution (dilation n) over the normalised gated values adds local context.

State per sequence:
- n-gram context ``[n - 1]`` (int64): the previous n - 1 token ids (EOS at the start);
- conv state ``[hc * H, (K - 1) * n]``: the last (K - 1) * n normalised gated values (zeros).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from qwen38_plugin.ops.common import causal_conv1d, rms_norm


def _nth_prime_after(start: int, count: int) -> int:
    value = start
    for _ in range(count):
        value += 1
        while value < 2 or any(value % d == 0 for d in range(2, math.isqrt(value) + 1)):
            value += 1
    return value


def ngram_head_sizes(ngram_size: int, heads_per_ngram: int, vocab_size_base: int, ple_layer_index: int) -> list[int]:
    """Table rows of each n-gram head of one PLE layer: consecutive primes after the base, each
    layer continuing where the previous one stopped (as transformers sizes them)."""
    heads = (ngram_size - 1) * heads_per_ngram
    return [_nth_prime_after(vocab_size_base - 1, ple_layer_index * heads + h + 1) for h in range(heads)]


def table_rows(head_sizes: list[int], divisible_by: int) -> int:
    """Rows of a PLE layer's table: its heads' rows side by side, padded to ``divisible_by``."""
    return math.ceil(sum(head_sizes) / divisible_by) * divisible_by


def initial_context(batch: int, ngram_size: int, eos_token_id: int, device: torch.device | None = None) -> torch.Tensor:
    """The n-gram context of a fresh sequence: ``[B, n - 1]`` filled with EOS."""
    return torch.full((batch, ngram_size - 1), eos_token_id, dtype=torch.long, device=device)


def ngram_ids(
    token_ids: torch.Tensor,
    context: torch.Tensor,
    multipliers: torch.Tensor,
    head_vocab_sizes: torch.Tensor,
    head_offsets: torch.Tensor,
    *,
    heads_per_ngram: int,
    eos_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Embedding-table rows of every (token, n-gram head).

    token_ids: ``[B, T]``; context: ``[B, n - 1]`` (the tokens before them); multipliers:
    ``[n]`` int64; head_vocab_sizes, head_offsets: ``[(n - 1) * heads_per_ngram]`` int64,
    heads ordered by n-gram order then head. Returns (rows ``[B, T, (n - 1) * heads_per_ngram]``,
    the new context ``[B, n - 1]``). Hashes use wrapping int64 arithmetic, as the reference.
    """
    ngram_size = multipliers.shape[0]
    seq_len = token_ids.shape[1]
    history = torch.cat([context.to(token_ids.device), token_ids.long()], dim=1)  # [B, n - 1 + T]
    is_eos = (history == eos_token_id).long()
    eos_before = torch.cat([is_eos.new_zeros(is_eos.shape[0], 1), is_eos.cumsum(dim=1)], dim=1)  # eos in [0, i)
    positions = torch.arange(ngram_size - 1, history.shape[1], device=history.device)  # the new tokens
    mixed = history[:, positions] * multipliers[0]
    rows = []
    for shift in range(1, ngram_size):
        # The token `shift` back is kept only if no EOS lies in positions [t - shift, t - 1].
        eos_between = eos_before[:, positions] - eos_before[:, positions - shift]
        earlier = torch.where(eos_between == 0, history[:, positions - shift], eos_token_id)
        mixed = torch.bitwise_xor(mixed, earlier * multipliers[shift])
        heads = slice((shift - 1) * heads_per_ngram, shift * heads_per_ngram)
        rows.append(torch.remainder(mixed.unsqueeze(-1), head_vocab_sizes[heads]) + head_offsets[heads])
    new_context = history[:, history.shape[1] - (ngram_size - 1) :]
    assert rows[0].shape[1] == seq_len
    return torch.cat(rows, dim=-1), new_context


def gated_values(
    streams: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    norm_key: torch.Tensor,
    norm_query: torch.Tensor,
    *,
    hc_count: int,
    eps: float,
) -> torch.Tensor:
    """The value gated per stream by the signed-sqrt score of its key against the stream.

    streams, key: ``[..., hc * H]`` (key: the key projection of the embedding, before its norm);
    value: ``[..., H]``; norm_key, norm_query: ``[hc * H]``. Returns ``[..., hc * H]`` (in the dtype of key and value).
    Token by token, so shared by `ple` and the batched `ple_varlen`.
    """
    hidden = streams.shape[-1] // hc_count
    key = rms_norm(key, norm_key, eps, group_size=hidden).unflatten(-1, (hc_count, hidden))
    query = rms_norm(streams, norm_query, eps, group_size=hidden).unflatten(-1, (hc_count, hidden))
    score = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(hidden)
    score = score.abs().clamp_min(1e-6).sqrt() * score.sign()
    return (torch.sigmoid(score) * value.unsqueeze(-2)).flatten(-2)


def ple(
    streams: torch.Tensor,
    token_ids: torch.Tensor,
    embedding: torch.Tensor,
    multipliers: torch.Tensor,
    head_vocab_sizes: torch.Tensor,
    head_offsets: torch.Tensor,
    key_proj: torch.Tensor,
    value_proj: torch.Tensor,
    norm_key: torch.Tensor,
    norm_query: torch.Tensor,
    norm_conv: torch.Tensor,
    conv_weight: torch.Tensor,
    *,
    hc_count: int,
    heads_per_ngram: int,
    eos_token_id: int,
    eps: float,
    context: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    lookup: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The PLE term to add to the streams.

    streams: ``[B, T, hc * H]``; token_ids: ``[B, T]``; embedding: ``[V, E / heads]`` (the table);
    key_proj: ``[hc * H, E]``; value_proj: ``[H, E]``; norm_*: ``[hc * H]``; conv_weight: ``[hc * H, K]``.
    States as in the module docstring (None: fresh). ``lookup`` maps table rows to embeddings in
    place of indexing ``embedding`` (a tensor-parallel table split over ranks).
    Returns (term ``[B, T, hc * H]``, context, conv state).
    """
    ngram_size = multipliers.shape[0]
    hidden = streams.shape[-1] // hc_count
    if context is None:
        context = initial_context(token_ids.shape[0], ngram_size, eos_token_id, token_ids.device)
    rows, context = ngram_ids(
        token_ids,
        context,
        multipliers,
        head_vocab_sizes,
        head_offsets,
        heads_per_ngram=heads_per_ngram,
        eos_token_id=eos_token_id,
    )
    found = lookup(rows) if lookup is not None else F.embedding(rows.to(embedding.device), embedding)
    embedded = found.to(streams.device).flatten(-2)  # [B, T, E]
    key, value = F.linear(embedded, key_proj), F.linear(embedded, value_proj)
    gated = gated_values(streams, key, value, norm_key, norm_query, hc_count=hc_count, eps=eps)  # [B, T, hc * H]
    gated_normed = rms_norm(gated, norm_conv, eps, group_size=hidden)
    conv, conv_state = causal_conv1d(gated_normed, conv_weight, conv_state, "silu", dilation=ngram_size)
    return gated + conv, context, conv_state
