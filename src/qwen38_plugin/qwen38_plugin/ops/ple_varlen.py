"""PLE of a whole engine step on vLLM's state slots: batched, and safe inside a CUDA graph.

Per request this is exactly `ops.ple.ple` continuing from the request's states; here every
token of a step (``[N, ...]``, request after request, as vLLM lays them out) is done at once.
The model runs the projections with its own linear layers and may keep the embedding table in
host memory, so the op comes in stages:

1. `token_requests(query_start_loc, N)` -> token_req ``[N]``: each token's request row (-1 past
   the step's tokens), once per step;
2. `ngram_rows_varlen` -> the table rows ``[N, (n - 1) * heads_per_ngram]`` of every token, and
   the requests' n-gram contexts move on;
3. the caller looks the rows up and projects: ``embedded = table[rows].flatten(-2)`` ``[N, E]``,
   ``key = key_proj(embedded)`` ``[N, hc * H]``, ``value = value_proj(embedded)`` ``[N, H]``;
4. `ple_mix_varlen` -> the term ``[N, hc * H]`` to add to the streams, and the requests' conv
   states move on.

States live in the request's `linear_attention` slot (`vllm_model.state_shapes`):
- n-gram context ``[S, n - 1]`` int64: each slot's last n - 1 token ids (EOS for a fresh one);
- conv state ``[S, hc * H, (K - 1) * n]``: each slot's last (K - 1) * n conv inputs (the
  normalised gated values), model dtype.
Either cache may be a strided view into a larger buffer; both are updated in place.

Speculative decoding: a verify row of 1 + drafts tokens reads its states from the slot of the
last token the previous step kept and writes the states after each of its tokens j to its own
slot j (``write_indices``, vLLM's per-draft-position GDN slots, `write_per_position_`), so a
rejected draft costs nothing to undo.

Request r's tokens are the rows t with ``token_req[t] == r``, contiguous from
``query_start[r]``; token t sits at offset ``o = t - query_start[r]`` of the step. What lies
``s`` tokens back is row ``t - s`` when ``o >= s``, else the request's state. Everything is a
gather over such indices, so the work is the same tensor ops whatever the requests: no host
synchronisation, no shape that depends on values, no Python loop over requests or tokens (the
loops run over the n-gram orders and the conv taps, both fixed by the config). That lets the ops
run inside vLLM's CUDA-graph-captured decode steps and on CPU alike.

On CUDA the per-token part of stage 4 (`gated_conv_inputs`: both norms, the signed-sqrt gate,
the conv input's norm) is one Triton kernel, the conv and the state update two more
(`conv_term_triton`), the n-gram rows and the context update two (`ngram_rows_triton`), with or
without speculative verify rows (until 2026-12-03 a verify step ran PLE's torch ops on CUDA,
hundreds of small kernels a layer); each is checked against the torch ops here,
which stay the CPU path and the reference (``QWEN38_PLE_REFERENCE=1`` keeps them on CUDA).

Padding: a token with ``token_req = -1``, or of a request whose slot is negative (vLLM's
PAD_SLOT_ID), gets zero rows and a zero term. A slot is written only for a request with a
non-negative slot and at least one token this step, so vLLM's padded requests (no tokens, slot
0, the null block) leave their slots as they are (`common.write_slots_` says how, with static shapes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from qwen38_plugin.ops import triton_dispatch
from qwen38_plugin.ops.common import rms_norm, write_slots_
from qwen38_plugin.ops.ple import gated_values
from qwen38_plugin.ops.triton_dispatch import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

REFERENCE_ENV = "QWEN38_PLE_REFERENCE"


def token_requests(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The request row of every token of a step, -1 for the rows past the step's tokens.

    query_start_loc: ``[R + 1]`` int (vLLM's, zero-length padded requests included); num_tokens:
    N, the step's (possibly padded) token count. Returns ``[N]`` int32. Graph-safe (a search, no sync).
    """
    tokens = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    # ends <= t: the request after the last one that ended at or before t
    request = torch.searchsorted(query_start_loc[1:].contiguous(), tokens, right=True)
    return torch.where(request < query_start_loc.shape[0] - 1, request, -1).to(torch.int32)


class _StepIndex(NamedTuple):
    """Where each token and request of a step lives (all tensors; valid or clamped to be safe to gather)."""

    request: torch.Tensor  # [N] long: the token's request row, 0 for padding tokens
    is_token: torch.Tensor  # [N] bool: a real token of a request with a slot
    offset: torch.Tensor  # [N] long: offset of the token in its request's step (garbage for padding)
    slots: torch.Tensor  # [R] long: the request's slot, 0 for negative slots
    continues: torch.Tensor  # [R] bool: starts from its slot's states (else fresh ones)
    new_tokens: torch.Tensor  # [R] long: the request's tokens this step
    written: torch.Tensor  # [R] bool: its slot is written (a slot and at least one token)


def _step_index(
    token_req: torch.Tensor,
    query_start: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
) -> _StepIndex:
    num_tokens, num_requests = token_req.shape[0], query_start.shape[0]
    device = token_req.device
    request = token_req.long()
    has_slot = state_indices.long() >= 0
    is_token = request >= 0
    request = request.clamp_min(0)
    is_token = is_token & has_slot.index_select(0, request)
    offset = torch.arange(num_tokens, device=device) - query_start.long().index_select(0, request)
    new_tokens = torch.zeros(num_requests, dtype=torch.long, device=device).index_add_(0, request, is_token.long())
    if has_initial_state is None:  # vLLM's "no prefill in this step": every request continues
        continues = torch.ones(num_requests, dtype=torch.bool, device=device)
    else:
        continues = has_initial_state.to(device=device, dtype=torch.bool)
    return _StepIndex(
        request=request,
        is_token=is_token,
        offset=offset,
        slots=state_indices.long().clamp_min(0),
        continues=continues,
        new_tokens=new_tokens,
        written=has_slot & (new_tokens > 0),
    )


def write_per_position_(
    cache: torch.Tensor,
    write_indices: torch.Tensor,
    step: _StepIndex,
    state_after: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Speculative verify rows: the state after each token j of request r into slot ``write_indices[r, j]``.

    write_indices ``[R, P]`` int; ``state_after(count [R])`` -> the requests' states ``[R, ...]``
    after their first ``count`` tokens of the step. Slot j is written where the request has a
    slot, more than j tokens this step and ``write_indices[r, j] >= 0``; one write of ``R * P`` rows
    (the loop runs over the P draft positions, fixed by the config), so the next step rolls back
    by reading the slot of its last kept token.
    """
    slots, written, values = [], [], []
    for j in range(write_indices.shape[1]):
        slot = write_indices[:, j].long()
        slots.append(slot.clamp_min(0))
        written.append(step.written & (step.new_tokens > j) & (slot >= 0))
        values.append(state_after(torch.full_like(step.new_tokens, j + 1)))
    write_slots_(cache, torch.cat(slots), torch.cat(written), torch.cat(values))


def ngram_rows_varlen(
    token_ids: torch.Tensor,
    token_req: torch.Tensor,
    query_start: torch.Tensor,
    context_cache: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    multipliers: torch.Tensor,
    head_vocab_sizes: torch.Tensor,
    head_offsets: torch.Tensor,
    *,
    heads_per_ngram: int,
    eos_token_id: int,
    write_indices: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Embedding-table rows of every (token, n-gram head) of a step; moves the n-gram contexts on.

    token_ids: ``[N]`` int; token_req: ``[N]`` int (`token_requests`); query_start: ``[R]`` int,
    the first token row of each request (vLLM's ``query_start_loc[:-1]``); context_cache:
    ``[S, n - 1]`` int64; state_indices: ``[R]`` int, the slot of each request; has_initial_state:
    ``[R]`` bool (False: a fresh request, its context is all EOS) or None (all continue);
    multipliers: ``[n]`` int64; head_vocab_sizes, head_offsets: ``[(n - 1) * heads_per_ngram]`` int64.
    Returns rows ``[N, (n - 1) * heads_per_ngram]`` int64 (0 for padding tokens), as
    `ple.ngram_ids` per request: wrapping int64 hashes, and an n-gram never reaches back across
    an EOS (a token before the latest EOS reads as EOS). Each written slot's context becomes the
    request's last n - 1 token ids.

    ``write_indices`` ``[R, P]`` int (speculative verify rows, vLLM's ``spec_state_indices_tensor``):
    read each request's context from ``state_indices`` (the slot of the last kept token) and write
    the context after its token j into ``write_indices[r, j]`` (`write_per_position_`).
    ``query_start_loc``: ``query_start`` with the end appended (``[R + 1]``); given, CUDA runs two
    Triton kernels (`ngram_rows_triton`), with or without ``write_indices``.
    """
    ngram_size = multipliers.shape[0]
    if ngram_size < 2:
        raise ValueError(f"ngram_rows_varlen: ngram_size {ngram_size}; PLE hashes n-grams of orders 2..n, n >= 2")
    context_len = ngram_size - 1
    num_tokens, num_requests = token_ids.shape[0], query_start.shape[0]
    if query_start_loc is not None and triton_dispatch.use_triton(
        token_ids.is_cuda, backend, reference_env=REFERENCE_ENV, op="ple"
    ):
        return ngram_rows_triton(
            token_ids, token_req, query_start_loc, context_cache, state_indices, has_initial_state, multipliers,
            head_vocab_sizes, head_offsets, heads_per_ngram=heads_per_ngram, eos_token_id=eos_token_id,
            write_indices=write_indices,
        )  # fmt: skip
    rows = torch.zeros(num_tokens, head_vocab_sizes.shape[0], dtype=torch.long, device=token_ids.device)
    if num_tokens == 0 or num_requests == 0:
        return rows
    step = _step_index(token_req, query_start, state_indices, has_initial_state)
    ids = token_ids.long()
    positions = torch.arange(num_tokens, device=ids.device)
    context = context_cache.index_select(0, step.slots)  # [R, n - 1]
    context = torch.where(step.continues[:, None], context, eos_token_id)
    token_context = context.index_select(0, step.request)  # [N, n - 1]

    mixed = ids * multipliers[0]
    # Since the earlier tokens are taken nearest first, "no EOS in [t - s, t - 1]" is "none of the
    # tokens 1..s back is EOS": one running flag instead of the reference's EOS counts.
    eos_seen = torch.zeros(num_tokens, dtype=torch.bool, device=ids.device)
    pieces = []
    for shift in range(1, ngram_size):
        from_step = ids.index_select(0, (positions - shift).clamp_min(0))
        # the context holds the n - 1 ids before the step, oldest first
        at = (step.offset + context_len - shift).clamp(0, context_len - 1)
        from_context = token_context.gather(1, at[:, None])[:, 0]
        earlier = torch.where(step.offset >= shift, from_step, from_context)
        eos_seen = eos_seen | (earlier == eos_token_id)
        earlier = torch.where(eos_seen, eos_token_id, earlier)
        mixed = torch.bitwise_xor(mixed, earlier * multipliers[shift])
        heads = slice((shift - 1) * heads_per_ngram, shift * heads_per_ngram)
        pieces.append(torch.remainder(mixed[:, None], head_vocab_sizes[heads]) + head_offsets[heads])
    rows = torch.where(step.is_token[:, None], torch.cat(pieces, dim=-1), 0)

    def new_context(count: torch.Tensor) -> torch.Tensor:
        # The context after `count [R]` tokens: entries [c, c + n - 1) of [context | the c new tokens].
        history = count[:, None] + torch.arange(context_len, device=ids.device)  # [R, n - 1]
        from_context = context.gather(1, history.clamp_max(context_len - 1))
        token_rows = (query_start.long()[:, None] + history - context_len).clamp(0, num_tokens - 1)
        from_step = ids.index_select(0, token_rows.flatten()).view(num_requests, context_len)
        return torch.where(history < context_len, from_context, from_step)

    if write_indices is None:
        write_slots_(context_cache, step.slots, step.written, new_context(step.new_tokens))
    else:
        write_per_position_(context_cache, write_indices, step, new_context)
    return rows


def ple_mix_varlen(
    streams: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    norm_key: torch.Tensor,
    norm_query: torch.Tensor,
    norm_conv: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state_cache: torch.Tensor,
    token_req: torch.Tensor,
    query_start: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    *,
    hc_count: int,
    ngram_size: int,
    eps: float,
    write_indices: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The PLE term of every token of a step (to add to the streams); moves the conv states on.

    streams: ``[N, hc * H]``; key: ``[N, hc * H]``, ``key_proj(embedded)`` before its norm;
    value: ``[N, H]``, ``value_proj(embedded)``; norm_key, norm_query, norm_conv: ``[hc * H]``;
    conv_weight: ``[hc * H, K]``; conv_state_cache: ``[S, hc * H, (K - 1) * n]``; token_req,
    query_start, state_indices, has_initial_state: as in `ngram_rows_varlen`.
    Returns ``[N, hc * H]`` in the dtype of key and value (zeros for padding tokens), as `ple.ple` per
    request: ``gated + silu(conv(norm(gated)))`` with the per-stream gated value and a causal
    depthwise conv of kernel K and dilation n continuing from the request's conv state (zeros
    for a fresh request). Each written slot's conv state becomes the last (K - 1) * n conv inputs.
    ``write_indices``: as in `ngram_rows_varlen` (the conv state after each verified token j goes
    to ``write_indices[r, j]``). ``query_start_loc``: ``query_start`` with the end appended
    (``[R + 1]``); given, CUDA runs the conv and the state update as two Triton kernels, with or
    without ``write_indices`` (`conv_term_triton`; ``QWEN38_PLE_REFERENCE=1`` or
    ``backend="torch"`` keep the torch ops).
    """
    num_tokens, width = streams.shape
    num_requests = query_start.shape[0]
    kernel = conv_weight.shape[-1]
    span = (kernel - 1) * ngram_size
    if tuple(conv_state_cache.shape[1:]) != (width, span):
        raise ValueError(
            f"ple_mix_varlen: conv_state_cache {tuple(conv_state_cache.shape)} has slots "
            f"{tuple(conv_state_cache.shape[1:])}, expected (hc * H, (K - 1) * n) = {(width, span)}"
        )
    gated, conv_inputs = gated_conv_inputs(
        streams, key, value, norm_key, norm_query, norm_conv, hc_count=hc_count, eps=eps,
        conv_dtype=conv_weight.dtype, backend=backend,
    )  # fmt: skip
    if num_tokens == 0 or num_requests == 0:
        return torch.zeros_like(gated)
    if query_start_loc is not None and triton_dispatch.use_triton(
        streams.is_cuda, backend, reference_env=REFERENCE_ENV, op="ple"
    ):
        return conv_term_triton(
            gated, conv_inputs, conv_weight, conv_state_cache, token_req, query_start_loc, state_indices,
            has_initial_state, ngram_size=ngram_size, write_indices=write_indices,
        )  # fmt: skip
    return conv_term_torch(
        gated, conv_inputs, conv_weight, conv_state_cache, token_req, query_start, state_indices, has_initial_state,
        ngram_size=ngram_size, write_indices=write_indices,
    )  # fmt: skip


def conv_term_torch(
    gated: torch.Tensor,
    conv_inputs: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state_cache: torch.Tensor,
    token_req: torch.Tensor,
    query_start: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    *,
    ngram_size: int,
    write_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """`ple_mix_varlen` after the gate: the dilated causal conv over the conv inputs continuing
    from each request's state, the term ``gated + silu(conv)``, and the states moved on."""
    num_tokens, width = gated.shape
    num_requests = query_start.shape[0]
    kernel = conv_weight.shape[-1]
    span = (kernel - 1) * ngram_size
    step = _step_index(token_req, query_start, state_indices, has_initial_state)
    positions = torch.arange(num_tokens, device=gated.device)

    # The requests' states as rows: row r * span + j is the input span - j steps before request
    # r's first token. A fresh request's slot holds garbage (possibly NaN): select, not multiply.
    state = conv_state_cache.index_select(0, step.slots).to(conv_weight.dtype)
    state = torch.where(step.continues[:, None, None], state, 0)
    state_rows = state.transpose(1, 2).reshape(num_requests * span, width)

    # The conv as a sum over its K taps, tap k reaching (K - 1 - k) * n inputs back. Accumulated
    # in fp32 and rounded once to the weight dtype, as F.conv1d does in the reference.
    acc = torch.zeros(num_tokens, width, dtype=torch.float32, device=gated.device)
    for tap in range(kernel):
        back = (kernel - 1 - tap) * ngram_size
        if back == 0:
            taken = conv_inputs
        else:
            from_step = conv_inputs.index_select(0, (positions - back).clamp_min(0))
            at = (step.request * span + span - back + step.offset).clamp(0, num_requests * span - 1)
            taken = torch.where((step.offset >= back)[:, None], from_step, state_rows.index_select(0, at))
        acc = acc + taken.float() * conv_weight[:, tap].float()
    conv = F.silu(acc.to(conv_weight.dtype)).to(gated.dtype)
    term = torch.where(step.is_token[:, None], gated + conv, 0)

    def new_state(count: torch.Tensor) -> torch.Tensor:
        # The state after `count [R]` tokens: entries [c, c + span) of [state | the c new inputs],
        # as [R, hc * H, span].
        history = count[:, None] + torch.arange(span, device=gated.device)  # [R, span]
        own_rows = torch.arange(num_requests, device=gated.device)[:, None] * span
        from_state = state_rows.index_select(0, (own_rows + history.clamp_max(span - 1)).flatten())
        token_rows = (query_start.long()[:, None] + history - span).clamp(0, num_tokens - 1)
        from_step = conv_inputs.index_select(0, token_rows.flatten())
        state = torch.where((history < span).flatten()[:, None], from_state, from_step)
        return state.view(num_requests, span, width).transpose(1, 2)

    if write_indices is None:
        write_slots_(conv_state_cache, step.slots, step.written, new_state(step.new_tokens))
    else:
        write_per_position_(conv_state_cache, write_indices, step, new_state)
    return term


# ---------------------------------------------------------------------------------------------
# The per-token part of the mix: gate and conv input of every (token, stream) in one kernel
# ---------------------------------------------------------------------------------------------


def gated_conv_inputs_torch(
    streams: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    norm_key: torch.Tensor,
    norm_query: torch.Tensor,
    norm_conv: torch.Tensor,
    *,
    hc_count: int,
    eps: float,
    conv_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    gated = gated_values(streams, key, value, norm_key, norm_query, hc_count=hc_count, eps=eps)
    return gated, rms_norm(gated, norm_conv, eps, group_size=streams.shape[-1] // hc_count).to(conv_dtype)


def gated_conv_inputs(
    streams: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    norm_key: torch.Tensor,
    norm_query: torch.Tensor,
    norm_conv: torch.Tensor,
    *,
    hc_count: int,
    eps: float,
    conv_dtype: torch.dtype,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gated values ``[N, hc * H]`` in the dtype of key and value, the conv inputs: their
    per-stream RMSNorm in ``conv_dtype``): `ple.gated_values` and the norm of `ple_mix_varlen`.

    On CUDA one Triton kernel (about thirty torch kernels otherwise), rounding wherever the
    reference rounds; ``QWEN38_PLE_REFERENCE=1`` keeps the reference."""
    if not triton_dispatch.use_triton(streams.is_cuda, backend, reference_env=REFERENCE_ENV, op="ple"):
        return gated_conv_inputs_torch(
            streams, key, value, norm_key, norm_query, norm_conv, hc_count=hc_count, eps=eps, conv_dtype=conv_dtype
        )
    tokens, width = streams.shape
    hidden = width // hc_count
    dtype = torch.promote_types(key.dtype, value.dtype)
    gated = torch.empty(tokens, width, dtype=dtype, device=streams.device)
    conv_inputs = torch.empty(tokens, width, dtype=conv_dtype, device=streams.device)
    if tokens:
        for name, x in (("streams", streams), ("key", key), ("value", value)):
            if x.stride(-1) != 1:
                raise ValueError(f"gated_conv_inputs: {name} must be contiguous in its last dimension")
        _gated_conv_inputs_kernel[(tokens, hc_count)](
            streams, key, value, norm_key, norm_query, norm_conv, gated, conv_inputs,
            streams.stride(0), key.stride(0), value.stride(0), width, hidden, eps, 1.0 / math.sqrt(hidden),
            BLOCK_H=triton.next_power_of_2(hidden),
        )  # fmt: skip
    return gated, conv_inputs


if HAVE_TRITON:

    @triton.jit
    def _gated_conv_inputs_kernel(  # type: ignore[no-untyped-def]
        streams_ptr,
        key_ptr,
        value_ptr,
        norm_key_ptr,
        norm_query_ptr,
        norm_conv_ptr,
        gated_ptr,
        conv_ptr,
        stride_streams,
        stride_key,
        stride_value,
        width,
        hidden,
        eps,
        inv_sqrt_hidden,
        BLOCK_H: tl.constexpr,
    ):
        # One program per (token, stream). Every intermediate is rounded to the model dtype
        # where `ple.gated_values` rounds it (the norms, the products, the score and its
        # signed square root, the gate), so only the sums' order differs from the reference.
        token = tl.program_id(0)
        stream = tl.program_id(1)
        cols = tl.arange(0, BLOCK_H)
        ok = cols < hidden
        feature = stream * hidden + cols
        key = tl.load(key_ptr + token * stride_key + feature, mask=ok, other=0.0)
        dtype = key.dtype
        kf = key.to(tl.float32)
        qf = tl.load(streams_ptr + token * stride_streams + feature, mask=ok, other=0.0).to(tl.float32)
        wk = tl.load(norm_key_ptr + feature, mask=ok, other=0.0).to(tl.float32)
        wq = tl.load(norm_query_ptr + feature, mask=ok, other=0.0).to(tl.float32)
        kn = (kf * (1.0 / tl.sqrt(tl.sum(kf * kf, axis=0) / hidden + eps)) * (1.0 + wk)).to(dtype).to(tl.float32)
        qn = (qf * (1.0 / tl.sqrt(tl.sum(qf * qf, axis=0) / hidden + eps)) * (1.0 + wq)).to(dtype).to(tl.float32)
        score = tl.sum((kn * qn).to(dtype).to(tl.float32), axis=0).to(dtype).to(tl.float32)
        score = (score * inv_sqrt_hidden).to(dtype).to(tl.float32)
        magnitude = tl.maximum(tl.abs(score), 1e-6).to(dtype).to(tl.float32)
        root = tl.sqrt(magnitude).to(dtype).to(tl.float32)
        sign = tl.where(score > 0, 1.0, tl.where(score < 0, -1.0, 0.0))
        signed = (root * sign).to(dtype).to(tl.float32)
        gate = (1.0 / (1.0 + tl.exp(-signed))).to(dtype).to(tl.float32)
        value = tl.load(value_ptr + token * stride_value + cols, mask=ok, other=0.0).to(tl.float32)
        gated = (gate * value).to(dtype)
        tl.store(gated_ptr + token * width + feature, gated, mask=ok)
        gf = gated.to(tl.float32)
        wc = tl.load(norm_conv_ptr + feature, mask=ok, other=0.0).to(tl.float32)
        conv = (gf * (1.0 / tl.sqrt(tl.sum(gf * gf, axis=0) / hidden + eps)) * (1.0 + wc)).to(dtype)
        tl.store(conv_ptr + token * width + feature, conv.to(conv_ptr.dtype.element_ty), mask=ok)


def conv_term_triton(
    gated: torch.Tensor,
    conv_inputs: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state_cache: torch.Tensor,
    token_req: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    *,
    ngram_size: int,
    write_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """`conv_term_torch` in two kernels: the term of every (token, channel block), reading the
    states before they move, then each written slot's new state; with ``write_indices`` ``[R, P]``
    (speculative verify rows) the state after each token j goes to ``write_indices[r, j]``, all P
    of a request's states read before any is written (one of them may be the slot read from).
    ``query_start_loc``: ``[R + 1]`` (each request's token count is the difference). The same
    values as the reference up to the fp32 sum of the taps (CUDA may fuse a tap's product into
    the sum)."""
    num_tokens, width = gated.shape
    num_requests = query_start_loc.shape[0] - 1
    kernel = conv_weight.shape[-1]
    span = (kernel - 1) * ngram_size
    if conv_inputs.stride(0) != width or gated.stride(0) != width:
        raise ValueError("conv_term_triton: gated and conv_inputs must be contiguous [N, hc * H]")
    term = torch.empty_like(gated)
    continues = has_initial_state if has_initial_state is not None else state_indices  # unread when None
    block_c = 128
    strides = (conv_state_cache.stride(0), conv_state_cache.stride(1), conv_state_cache.stride(2))
    # vLLM's state indices are a column of its block table (``block_table[:, 0]``: strided when a
    # request holds several slots, as with speculative decoding): indexed with their stride
    per_request = (state_indices.stride(0), continues.stride(0))
    if num_tokens:
        _conv_term_kernel[(num_tokens, triton.cdiv(width, block_c))](
            gated, conv_inputs, conv_weight, conv_state_cache, term, token_req, query_start_loc, state_indices,
            continues, width, span, ngram_size, *strides, conv_weight.stride(0), conv_weight.stride(1), *per_request,
            KERNEL=kernel, HAS_INITIAL=has_initial_state is not None, BLOCK_C=block_c,
        )  # fmt: skip
    if num_requests:
        # with speculative verify rows, P states a request: a narrower channel block keeps the tile near
        # the plain kernel's
        spec = write_indices is not None
        writes = write_indices if write_indices is not None else state_indices[:, None]  # (narrows the type)
        block_p = triton.next_power_of_2(writes.shape[1])
        block_cs = max(16, block_c // block_p)
        _conv_state_kernel[(num_requests, triton.cdiv(width, block_cs))](
            conv_inputs, conv_state_cache, query_start_loc, state_indices, continues, writes, width, span,
            writes.shape[1], *strides, *per_request, writes.stride(0), writes.stride(1),
            HAS_INITIAL=has_initial_state is not None, SPEC=spec, BLOCK_C=block_cs,
            BLOCK_S=triton.next_power_of_2(span), BLOCK_P=block_p,
        )  # fmt: skip
    return term


if HAVE_TRITON:

    @triton.jit
    def _conv_term_kernel(  # type: ignore[no-untyped-def]
        gated_ptr,
        conv_in_ptr,
        weight_ptr,
        state_ptr,
        term_ptr,
        token_req_ptr,
        qsl_ptr,
        state_indices_ptr,
        continues_ptr,
        width,
        span,
        dilation,
        stride_state_slot,
        stride_state_channel,
        stride_state_pos,
        stride_weight_channel,
        stride_weight_tap,
        stride_slot_index,
        stride_continues,
        KERNEL: tl.constexpr,
        HAS_INITIAL: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # One program per (token, channel block): tap k reaches (K - 1 - k) * dilation inputs
        # back, into this step's conv inputs or, before the request's first token, its state
        # (zeros for a fresh request). Padding tokens and requests without a slot get zeros.
        token = tl.program_id(0)
        cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = cs < width
        req = tl.load(token_req_ptr + token)
        r = tl.maximum(req, 0)
        slot = tl.load(state_indices_ptr + r * stride_slot_index)
        is_token = (req >= 0) & (slot >= 0)
        offset = token - tl.load(qsl_ptr + r)
        reads_state = is_token
        if HAS_INITIAL:
            reads_state = reads_state & (tl.load(continues_ptr + r * stride_continues) != 0)
        slot_row = state_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_state_slot
        acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for tap in tl.static_range(KERNEL):
            back = (KERNEL - 1 - tap) * dilation
            in_step = offset >= back
            from_step = tl.load(conv_in_ptr + (token - back) * width + cs, mask=ok & in_step, other=0.0)
            from_state = tl.load(
                slot_row + cs * stride_state_channel + (span - back + offset) * stride_state_pos,
                mask=ok & (offset < back) & reads_state,
                other=0.0,
            ).to(conv_in_ptr.dtype.element_ty)
            x = tl.where(in_step, from_step, from_state).to(tl.float32)
            w = tl.load(weight_ptr + cs * stride_weight_channel + tap * stride_weight_tap, mask=ok, other=0.0)
            acc += x * w.to(tl.float32)
        wdtype = weight_ptr.dtype.element_ty
        conv = acc.to(wdtype).to(tl.float32)
        conv = (conv / (1.0 + tl.exp(-conv))).to(wdtype)  # silu, rounded to the conv dtype
        gated = tl.load(gated_ptr + token * width + cs, mask=ok, other=0.0)
        dtype = gated.dtype
        term = (gated.to(tl.float32) + conv.to(dtype).to(tl.float32)).to(dtype)
        tl.store(term_ptr + token * width + cs, tl.where(is_token, term, 0.0).to(dtype), mask=ok)

    @triton.jit
    def _states_written(  # type: ignore[no-untyped-def]
        write_ptr,
        r,
        stride_write_req,
        stride_write_pos,
        positions,
        slot,
        count,
        SPEC: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        # The states a state kernel stores for request r: (slot [P], stored? [P], tokens taken [P]).
        # Without SPEC one, after all `count` tokens, into the slot read from; with SPEC the one
        # after each of its first j + 1 tokens into write slot j, where it has more than j tokens
        # and the slot is not negative.
        ps = tl.arange(0, BLOCK_P)
        if SPEC:
            dest = tl.load(write_ptr + r * stride_write_req + ps * stride_write_pos, mask=ps < positions, other=-1)
            writes = (ps < positions) & (ps < count) & (dest >= 0)
            ends = ps + 1
        else:
            dest = tl.zeros((BLOCK_P,), dtype=slot.dtype) + slot
            writes = ps < 1
            ends = tl.zeros((BLOCK_P,), dtype=count.dtype) + count
        return dest, writes, ends

    @triton.jit
    def _conv_state_kernel(  # type: ignore[no-untyped-def]
        conv_in_ptr,
        state_ptr,
        qsl_ptr,
        state_indices_ptr,
        continues_ptr,
        write_ptr,
        width,
        span,
        positions,
        stride_state_slot,
        stride_state_channel,
        stride_state_pos,
        stride_slot_index,
        stride_continues,
        stride_write_req,
        stride_write_pos,
        HAS_INITIAL: tl.constexpr,
        SPEC: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        # One program per (request, channel block): after c of its new tokens the state is
        # entries [c, c + span) of [old state | the new conv inputs]. Without SPEC, c is all of
        # them and the state goes back to the slot read from; with SPEC (speculative verify rows)
        # the state after each of its first j + 1 tokens goes to write slot j (where the request
        # has more than j tokens and the slot is not negative), and the slot read from is usually
        # one of those. Either way every state is loaded, as one [P, C, S] tile, before any is
        # stored (the barrier).
        r = tl.program_id(0)
        slot = tl.load(state_indices_ptr + r * stride_slot_index)
        first = tl.load(qsl_ptr + r)
        count = tl.load(qsl_ptr + r + 1) - first
        if (slot >= 0) & (count > 0):
            cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
            js = tl.arange(0, BLOCK_S)
            dest, writes, ends = _states_written(
                write_ptr, r, stride_write_req, stride_write_pos, positions, slot, count, SPEC, BLOCK_P
            )
            ok = writes[:, None, None] & (cs < width)[None, :, None] & (js < span)[None, None, :]
            history = ends[:, None, None] + js[None, None, :]
            keeps_old = history < span
            keeps_old_read = keeps_old
            if HAS_INITIAL:
                keeps_old_read = keeps_old & (tl.load(continues_ptr + r * stride_continues) != 0)
            channels = cs[None, :, None] * stride_state_channel
            row = state_ptr + slot.to(tl.int64) * stride_state_slot + channels
            old = tl.load(row + history * stride_state_pos, mask=ok & keeps_old_read, other=0.0)
            new = tl.load(
                conv_in_ptr + (first + history - span) * width + cs[None, :, None],
                mask=ok & (history >= span),
                other=0.0,
            )
            value = tl.where(keeps_old, old.to(conv_in_ptr.dtype.element_ty), new)
            tl.debug_barrier()
            out = state_ptr + tl.maximum(dest, 0).to(tl.int64)[:, None, None] * stride_state_slot + channels
            tl.store(out + js[None, None, :] * stride_state_pos, value.to(state_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------
# The n-gram rows and the context update in two kernels
# ---------------------------------------------------------------------------------------------


def ngram_rows_triton(
    token_ids: torch.Tensor,
    token_req: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_cache: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    multipliers: torch.Tensor,
    head_vocab_sizes: torch.Tensor,
    head_offsets: torch.Tensor,
    *,
    heads_per_ngram: int,
    eos_token_id: int,
    write_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """`ngram_rows_varlen` in two kernels: the rows of every token (reading the contexts before
    they move), then each written slot's new context (with ``write_indices`` ``[R, P]``, the
    context after each token j into ``write_indices[r, j]``, all read before any is written). The
    same int64 arithmetic (wrapping products, xor, a non-negative remainder), so the same rows
    bit for bit."""
    num_tokens = token_ids.shape[0]
    num_requests = query_start_loc.shape[0] - 1
    ngram_size = multipliers.shape[0]
    heads = head_vocab_sizes.shape[0]
    rows = torch.empty(num_tokens, heads, dtype=torch.long, device=token_ids.device)
    continues = has_initial_state if has_initial_state is not None else state_indices  # unread when None
    # state_indices: a strided column of vLLM's block table where a request holds several slots (`conv_term_triton`)
    common = (context_cache, state_indices, continues, context_cache.stride(0), context_cache.stride(1),
              state_indices.stride(0), continues.stride(0))  # fmt: skip
    if num_tokens:
        _ngram_rows_kernel[(num_tokens,)](
            token_ids, token_req, query_start_loc, *common, multipliers, head_vocab_sizes, head_offsets, rows,
            eos_token_id, NGRAM=ngram_size, HEADS_PER_NGRAM=heads_per_ngram, HAS_INITIAL=has_initial_state is not None,
            BLOCK_HEADS=triton.next_power_of_2(heads_per_ngram),
        )  # fmt: skip
    if num_requests:
        writes = write_indices if write_indices is not None else state_indices[:, None]
        _ngram_context_kernel[(num_requests,)](
            token_ids, query_start_loc, *common, writes, writes.shape[1], writes.stride(0), writes.stride(1),
            eos_token_id, CONTEXT=ngram_size - 1, HAS_INITIAL=has_initial_state is not None,
            SPEC=write_indices is not None, BLOCK=triton.next_power_of_2(ngram_size - 1),
            BLOCK_P=triton.next_power_of_2(writes.shape[1]),
        )  # fmt: skip
    return rows


if HAVE_TRITON:

    @triton.jit
    def _ngram_rows_kernel(  # type: ignore[no-untyped-def]
        ids_ptr,
        token_req_ptr,
        qsl_ptr,
        context_ptr,
        state_indices_ptr,
        continues_ptr,
        stride_context_slot,
        stride_context_pos,
        stride_slot_index,
        stride_continues,
        multipliers_ptr,
        sizes_ptr,
        offsets_ptr,
        rows_ptr,
        eos,
        NGRAM: tl.constexpr,
        HEADS_PER_NGRAM: tl.constexpr,
        HAS_INITIAL: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
    ):
        # One program per token: the hash of the n-grams ending at it, nearest earlier token
        # first; a token before the latest EOS reads as EOS; earlier tokens come from this step
        # or, before the request's first token, from its context (all EOS for a fresh request).
        token = tl.program_id(0)
        req = tl.load(token_req_ptr + token)
        r = tl.maximum(req, 0)
        slot = tl.load(state_indices_ptr + r * stride_slot_index)
        is_token = (req >= 0) & (slot >= 0)
        offset = token - tl.load(qsl_ptr + r)
        reads_context = tl.load(continues_ptr + r * stride_continues) != 0 if HAS_INITIAL else True
        context_row = context_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_context_slot
        hs = tl.arange(0, BLOCK_HEADS)
        hs_ok = hs < HEADS_PER_NGRAM
        mixed = tl.load(ids_ptr + token).to(tl.int64) * tl.load(multipliers_ptr)
        eos_seen = offset < -(1 << 40)  # False, as a tensor (offsets are small)
        for shift in tl.static_range(1, NGRAM):
            from_step = tl.load(ids_ptr + tl.maximum(token - shift, 0)).to(tl.int64)
            at = tl.minimum(tl.maximum(offset + (NGRAM - 1) - shift, 0), NGRAM - 2)
            from_context = tl.load(context_row + at * stride_context_pos)
            from_context = tl.where(reads_context, from_context, eos)
            earlier = tl.where(offset >= shift, from_step, from_context)
            eos_seen = eos_seen | (earlier == eos)
            earlier = tl.where(eos_seen, eos, earlier)
            mixed = mixed ^ (earlier * tl.load(multipliers_ptr + shift))
            head = (shift - 1) * HEADS_PER_NGRAM + hs
            size = tl.load(sizes_ptr + head, mask=hs_ok, other=1)
            rest = mixed % size
            rest = tl.where(rest < 0, rest + size, rest)  # torch.remainder: the divisor's sign
            row = rest + tl.load(offsets_ptr + head, mask=hs_ok, other=0)
            tl.store(rows_ptr + token * ((NGRAM - 1) * HEADS_PER_NGRAM) + head, tl.where(is_token, row, 0), mask=hs_ok)

    @triton.jit
    def _ngram_context_kernel(  # type: ignore[no-untyped-def]
        ids_ptr,
        qsl_ptr,
        context_ptr,
        state_indices_ptr,
        continues_ptr,
        stride_context_slot,
        stride_context_pos,
        stride_slot_index,
        stride_continues,
        write_ptr,
        positions,
        stride_write_req,
        stride_write_pos,
        eos,
        CONTEXT: tl.constexpr,
        HAS_INITIAL: tl.constexpr,
        SPEC: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        # One program per request: after c of its tokens the context is entries [c, c + n - 1) of
        # [old context | the new ids]; without SPEC c is all of them, back into the slot read from,
        # with SPEC the context after each of its first j + 1 tokens goes to write slot j (as in
        # _conv_state_kernel); every context is loaded before any is stored.
        r = tl.program_id(0)
        slot = tl.load(state_indices_ptr + r * stride_slot_index)
        first = tl.load(qsl_ptr + r)
        count = tl.load(qsl_ptr + r + 1) - first
        if (slot >= 0) & (count > 0):
            js = tl.arange(0, BLOCK)
            dest, writes, ends = _states_written(
                write_ptr, r, stride_write_req, stride_write_pos, positions, slot, count, SPEC, BLOCK_P
            )
            ok = writes[:, None] & (js < CONTEXT)[None, :]
            history = ends[:, None] + js[None, :]
            keeps_old = history < CONTEXT
            row = context_ptr + slot.to(tl.int64) * stride_context_slot
            old = tl.load(row + history * stride_context_pos, mask=ok & keeps_old, other=0)
            if HAS_INITIAL:
                old = tl.where(tl.load(continues_ptr + r * stride_continues) != 0, old, eos)
            new = tl.load(ids_ptr + first + history - CONTEXT, mask=ok & (history >= CONTEXT), other=0).to(tl.int64)
            value = tl.where(keeps_old, old, new)
            tl.debug_barrier()
            out = context_ptr + tl.maximum(dest, 0).to(tl.int64)[:, None] * stride_context_slot
            tl.store(out + js[None, :] * stride_context_pos, value, mask=ok)
