"""The Gated DeltaNet core of a whole engine step on vLLM's state slots, in plain torch.

This is the CPU path of the vLLM GDN layer: it takes every token of a step (``[N, ...]``,
request after request, as vLLM lays them out) and the state caches vLLM allocates, and does
per request exactly what `ops.gdn.gated_delta_net` does between the input projections and the
gated RMSNorm: the causal conv continuing from the conv state, q/k/v, the decay ``g`` and
``beta``, and the gated delta rule continuing from the recurrent state. Unlike stock vLLM's
CPU GDN op it runs in any dtype (fp32, fp16, bf16).

vLLM's layout of one slot (`mamba_utils.MambaStateShapeCalculator.gated_delta_net_state_shape`):
- conv state ``[K - 1, C]`` ("SD", vLLM's default) or ``[C, K - 1]`` ("DS",
  `mamba_utils.is_conv_state_dim_first()`), the last K - 1 conv inputs, model dtype;
- recurrent state ``[Hv, Dv, Dk]``: the transpose of `ops.gdn`'s ``[Hv, Dk, Dv]`` per head
  (vLLM's kernels keep V before K), fp32 by default (`mamba_ssm_cache_dtype` may make it
  the model dtype: then it is rounded to it after every step, as vLLM's kernels do).

Batching: decodes (one new token) run together through `gdn.gated_delta_rule_recurrent`;
longer requests run together through `gdn.gated_delta_rule_chunked`, padded to the longest
one with ``beta = 0`` and ``g = 0`` on the padding, which leaves the recurrent state as it is
(the padded positions add ``k u^T`` with ``u = 0`` and decay by ``exp(0)``). This is the
same decode/prefill split as `model.Qwen4ExpCore.forward_step`, so the results match the
reference op run per request.

Speculative decoding (`gdn_core_spec`, `gdn_core_step`) follows vLLM's GDN layout: a verify row
of request r (``1 + drafts`` tokens) has ``P = k + 1`` state slots ``spec_state_indices[r, 0..k]``;
it starts from the recurrent state in slot ``num_accepted[r] - 1`` (the last token the previous
step accepted) and writes the state after its token j into slot j, so the next step rolls back by
choosing a slot. The conv state is one wide buffer of ``K - 1 + k`` inputs in slot column 0: a
verify row reads its K - 1 prior inputs at column ``num_accepted - 1`` and leaves
``[prior[1:], x_0 .. x_{q-1}]`` at the front, so the window ending at any of its tokens starts
at that token's index. Prefills (and steps without verify rows) use the first K - 1 columns.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

from qwen38_plugin.ops import gdn
from qwen38_plugin.ops.common import causal_conv1d, write_slots_

# The reference's prefill chunk (`model.GatedDeltaNet.core`).
CHUNK_SIZE = 64


def gdn_core_varlen(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_state_cache: torch.Tensor,
    ssm_state_cache: torch.Tensor,
    state_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    *,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_state_dim_first: bool,
) -> torch.Tensor:
    """The GDN core output of every token of a step; updates the requests' state slots in place.

    mixed_qkv: ``[N, C]`` with ``C = 2 * Hk * Dk + Hv * Dv`` (q, k, v; the conv input);
    a, b: ``[N, Hv]``; conv_weight: ``[C, K]``; a_log (the checkpoint's ``A_log``; named as
    in `gdn.gated_delta_net`), dt_bias: ``[Hv]``.
    conv_state_cache: ``[S, K - 1, C]`` (``conv_state_dim_first=False``, vLLM's "SD") or
    ``[S, C, K - 1]`` ("DS"); ssm_state_cache: ``[S, Hv, Dv, Dk]``. Either may be a strided
    view into a larger buffer; both are updated in place.
    state_indices: ``[R]`` int, the slot of each request (vLLM's ``non_spec_state_indices_tensor``);
    query_start_loc: ``[R + 1]`` int, request r's tokens are rows ``[qsl[r], qsl[r + 1])``
    (``non_spec_query_start_loc``); has_initial_state: ``[R]`` bool, False where a request
    starts from zero states (its slot holds garbage), or None: every request continues from
    its slot. That is vLLM's meaning: `GDNAttentionMetadata.has_initial_state` is None exactly
    when the step has no prefill, and decodes always continue.

    Requests with a negative slot (vLLM's PAD_SLOT_ID) or no tokens (vLLM's padded requests,
    which point at the null block 0) are skipped: their slots are not written and their rows
    (like rows at or past ``qsl[R]``) get zeros.
    Returns o ``[N, Hv, Dv]`` in mixed_qkv.dtype, for the gated RMSNorm.

    CPU path: ``query_start_loc`` and ``state_indices`` are read on the host (``tolist``) to
    split decodes from prefills and to size the padded prefill batch; on CPU that is free.
    Speculative decoding (vLLM's spec metadata): `gdn_core_step` splits the step and runs the
    verify rows through `gdn_core_spec`.
    """
    num_tokens, channels = mixed_qkv.shape
    num_v_heads = a.shape[-1]
    kernel = conv_weight.shape[-1]
    conv_slot_shape = (channels, kernel - 1) if conv_state_dim_first else (kernel - 1, channels)
    _check_slots(
        "gdn_core_varlen", conv_state_cache, conv_slot_shape, ssm_state_cache, (num_v_heads, head_v_dim, head_k_dim),
        f"(conv_state_dim_first={conv_state_dim_first})",
    )  # fmt: skip
    out = mixed_qkv.new_zeros(num_tokens, num_v_heads, head_v_dim)
    starts: list[int] = query_start_loc.tolist()
    slots: list[int] = state_indices.tolist()
    lengths = [end - start for start, end in itertools.pairwise(starts)]
    active = [r for r, (slot, length) in enumerate(zip(slots, lengths, strict=True)) if slot >= 0 and length > 0]
    decodes = [r for r in active if lengths[r] == 1]
    prefills = [r for r in active if lengths[r] > 1]
    for requests, recurrent in ((decodes, True), (prefills, False)):
        if requests:
            _run_requests(
                requests, recurrent, starts, lengths, out, mixed_qkv, a, b, conv_weight, a_log, dt_bias,
                conv_state_cache, ssm_state_cache, state_indices, has_initial_state,
                num_k_heads=num_k_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
                conv_state_dim_first=conv_state_dim_first,
            )  # fmt: skip
    return out


def _run_requests(
    requests: list[int],
    recurrent: bool,
    starts: list[int],
    lengths: list[int],
    out: torch.Tensor,
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_state_cache: torch.Tensor,
    ssm_state_cache: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    *,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_state_dim_first: bool,
) -> None:
    """One batch of B requests padded to the longest, T tokens: writes their rows of ``out`` and their slots."""
    device = mixed_qkv.device
    batch, seq_len = len(requests), max(lengths[r] for r in requests)
    request_rows = torch.tensor(requests, dtype=torch.long, device=device)
    slots = state_indices.to(device=device, dtype=torch.long).index_select(0, request_rows)
    offsets = torch.arange(seq_len, device=device)
    token_rows = torch.tensor([starts[r] for r in requests], device=device)[:, None] + offsets  # [B, T]
    request_lengths = torch.tensor([lengths[r] for r in requests], device=device)
    inside = offsets < request_lengths[:, None]  # [B, T]: a real token, not padding
    token_rows = token_rows.masked_fill(~inside, 0)

    # States of the batch: copies gathered from the slots (the ops may update them in place),
    # zeros for requests that start fresh (their slot holds garbage, possibly NaN: select, not multiply).
    conv_state = conv_state_cache.index_select(0, slots)
    if not conv_state_dim_first:
        conv_state = conv_state.transpose(1, 2)  # [B, C, K - 1]
    ssm_state = ssm_state_cache.index_select(0, slots).transpose(-1, -2)  # [B, Hv, Dk, Dv]
    if has_initial_state is not None:
        continues = has_initial_state.to(device).index_select(0, request_rows)
    else:
        continues = torch.ones(batch, dtype=torch.bool, device=device)
    conv_state = torch.where(continues[:, None, None], conv_state, 0)
    # fp32 and contiguous: the recurrent form then updates it in place (it is our copy).
    ssm_state = torch.where(continues[:, None, None, None], ssm_state.float(), 0).contiguous()

    def take(x: torch.Tensor) -> torch.Tensor:
        # [N, F] -> [B, T, F], zeros on the padding
        return torch.where(inside[..., None], x[token_rows], 0)

    x, a_b, b_b = take(mixed_qkv), take(a), take(b)
    x_conv, _ = causal_conv1d(x, conv_weight, conv_state)
    # The final conv state is the last K - 1 inputs before each request's true end: positions
    # [L, L + K - 1) of [state | inputs] (causal_conv1d's own state would end at the padding).
    window = torch.cat([conv_state.to(conv_weight.dtype), x.transpose(1, 2).to(conv_weight.dtype)], dim=-1)
    tail = request_lengths[:, None] + torch.arange(conv_weight.shape[-1] - 1, device=device)  # [B, K - 1]
    new_conv_state = window.gather(-1, tail[:, None, :].expand(-1, window.shape[1], -1))  # [B, C, K - 1]

    key_dim = num_k_heads * head_k_dim
    q, k, v = torch.split(x_conv, [key_dim, key_dim, x_conv.shape[-1] - 2 * key_dim], dim=-1)
    q = q.reshape(batch, seq_len, num_k_heads, head_k_dim)
    k = k.reshape(batch, seq_len, num_k_heads, head_k_dim)
    v = v.reshape(batch, seq_len, -1, head_v_dim)
    # As `gdn.gated_delta_net` (beta in the input dtype, g in fp32); the padding neither decays
    # nor writes the state.
    beta = torch.where(inside[..., None], b_b.sigmoid(), 0)
    g = torch.where(inside[..., None], -a_log.float().exp() * F.softplus(a_b.float() + dt_bias), 0)
    repeat = v.shape[2] // num_k_heads
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
    if recurrent:
        o, new_ssm_state = gdn.gated_delta_rule_recurrent(q, k, v, g, beta, ssm_state, in_place=True)
    else:
        o, new_ssm_state = gdn.gated_delta_rule_chunked(q, k, v, g, beta, ssm_state, CHUNK_SIZE)

    out.index_copy_(0, token_rows[inside], o[inside].to(out.dtype))
    if not conv_state_dim_first:
        new_conv_state = new_conv_state.transpose(1, 2)
    conv_state_cache.index_copy_(0, slots, new_conv_state.to(conv_state_cache.dtype))
    ssm_state_cache.index_copy_(0, slots, new_ssm_state.transpose(-1, -2).to(ssm_state_cache.dtype))


def _check_slots(
    op: str,
    conv_state_cache: torch.Tensor,
    conv_slot: tuple[int, ...],
    ssm_state_cache: torch.Tensor,
    ssm_slot: tuple[int, ...],
    conv_note: str,
) -> None:
    """Refuse state caches whose slots are not the shapes the op computes, naming both."""
    if tuple(conv_state_cache.shape[1:]) != conv_slot:
        raise ValueError(
            f"{op}: conv_state_cache {tuple(conv_state_cache.shape)} has slots "
            f"{tuple(conv_state_cache.shape[1:])}, expected {conv_slot} {conv_note}"
        )
    if tuple(ssm_state_cache.shape[1:]) != ssm_slot:
        raise ValueError(
            f"{op}: ssm_state_cache {tuple(ssm_state_cache.shape)} has slots "
            f"{tuple(ssm_state_cache.shape[1:])}, expected (Hv, Dv, Dk) = {ssm_slot}"
        )


def _narrow_conv(conv_state_cache: torch.Tensor, kernel: int, conv_state_dim_first: bool) -> torch.Tensor:
    """The first K - 1 columns of a (possibly wide, speculative) conv buffer: a prefill's conv state."""
    return conv_state_cache[..., : kernel - 1] if conv_state_dim_first else conv_state_cache[:, : kernel - 1]


def gdn_core_spec(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_state_cache: torch.Tensor,
    ssm_state_cache: torch.Tensor,
    spec_state_indices: torch.Tensor,
    spec_query_start_loc: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    *,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_state_dim_first: bool,
) -> torch.Tensor:
    """The GDN core of a step's verify rows (speculative decoding); updates their slots in place.

    mixed_qkv ``[N, C]``, a, b ``[N, Hv]``: the verify rows' tokens, request after request
    (vLLM's ``spec_token_indx`` order); conv_weight, a_log, dt_bias as in `gdn_core_varlen`.
    conv_state_cache: ``[S, K - 1 + k, C]`` ("SD") or ``[S, C, K - 1 + k]`` ("DS"), the wide
    buffer; ssm_state_cache ``[S, Hv, Dv, Dk]``.
    spec_state_indices ``[R, k + 1]`` int (vLLM's ``spec_state_indices_tensor``),
    spec_query_start_loc ``[R + 1]`` int (request r's tokens are rows ``[qsl[r], qsl[r + 1])``,
    at most k + 1), num_accepted_tokens ``[R]`` int (1..k + 1: how many tokens of the previous
    step were kept, 1 after a prefill).
    Request r runs its tokens as one recurrent step each from slot ``num_accepted - 1`` and writes
    the state after token j into slot j (j < its token count). Requests without tokens or with
    a negative slot write nothing; their rows, and rows past ``qsl[R]``, get zeros.
    Returns o ``[N, Hv, Dv]`` in mixed_qkv.dtype.

    Static shapes and no host reads: the loop runs over the k + 1 draft positions (fixed by the
    config), every request of the step at once.
    """
    num_tokens, channels = mixed_qkv.shape
    num_requests, positions = spec_state_indices.shape
    num_v_heads = a.shape[-1]
    kernel = conv_weight.shape[-1]
    state_len = kernel - 1 + positions - 1
    conv_slot_shape = (channels, state_len) if conv_state_dim_first else (state_len, channels)
    _check_slots(
        "gdn_core_spec", conv_state_cache, conv_slot_shape, ssm_state_cache, (num_v_heads, head_v_dim, head_k_dim),
        f"for kernel {kernel} and {positions - 1} speculative tokens (conv_state_dim_first={conv_state_dim_first})",
    )  # fmt: skip
    out = mixed_qkv.new_zeros(num_tokens + 1, num_v_heads, head_v_dim)  # row N: where padding goes
    if num_tokens == 0 or num_requests == 0:
        return out[:num_tokens]
    device = mixed_qkv.device
    qsl = spec_query_start_loc[: num_requests + 1].to(device=device, dtype=torch.long)
    lengths = qsl[1:] - qsl[:-1]
    offsets = torch.arange(positions, device=device)
    slot_table = spec_state_indices.to(device=device, dtype=torch.long)
    active = (lengths > 0) & (slot_table[:, 0] >= 0)
    inside = (offsets[None, :] < lengths[:, None]) & active[:, None]  # [R, P]: a real token
    token_rows = (qsl[:-1, None] + offsets).clamp(0, num_tokens - 1)
    start_col = (num_accepted_tokens[:num_requests].to(device=device, dtype=torch.long) - 1).clamp(0, positions - 1)
    buffer_slot = slot_table[:, 0].clamp_min(0)
    start_slot = slot_table.gather(1, start_col[:, None])[:, 0].clamp_min(0)

    def take(x: torch.Tensor) -> torch.Tensor:
        # [N, F] -> [R, P, F], zeros on the padding
        return torch.where(inside[..., None], x[token_rows], 0)

    # The conv: K - 1 prior inputs from column `num_accepted - 1` of the buffer.
    buffer = conv_state_cache.index_select(0, buffer_slot)
    if not conv_state_dim_first:
        buffer = buffer.transpose(1, 2)  # [R, C, L]
    buffer = torch.where(active[:, None, None], buffer, 0)  # a padded request's slot may hold NaN
    prior_cols = start_col[:, None] + torch.arange(kernel - 1, device=device)  # [R, K - 1]
    prior = buffer.gather(2, prior_cols[:, None, :].expand(-1, channels, -1))
    x = take(mixed_qkv)
    x_conv, _ = causal_conv1d(x, conv_weight, prior)
    # The new buffer: [prior[1:], x_0 .. x_{q-1}, the old columns after them].
    source = torch.cat([buffer, x.transpose(1, 2).to(buffer.dtype)], dim=-1)  # [R, C, L + P]
    cols = torch.arange(state_len, device=device)[None, :]
    fresh = cols - (kernel - 2)  # the index of the token a column holds, when it holds one
    source_col = torch.where(
        cols < kernel - 2,
        start_col[:, None] + 1 + cols,
        torch.where(fresh < lengths[:, None], state_len + fresh, cols),
    )
    new_buffer = source.gather(2, source_col[:, None, :].expand(-1, channels, -1))
    if not conv_state_dim_first:
        new_buffer = new_buffer.transpose(1, 2)
    write_slots_(conv_state_cache, buffer_slot, active, new_buffer)

    key_dim = num_k_heads * head_k_dim
    q, k, v = torch.split(x_conv, [key_dim, key_dim, x_conv.shape[-1] - 2 * key_dim], dim=-1)
    q = q.reshape(num_requests, positions, num_k_heads, head_k_dim)
    k = k.reshape(num_requests, positions, num_k_heads, head_k_dim)
    v = v.reshape(num_requests, positions, -1, head_v_dim)
    a_b, b_b = take(a), take(b)
    beta = torch.where(inside[..., None], b_b.sigmoid(), 0)
    g = torch.where(inside[..., None], -a_log.float().exp() * F.softplus(a_b.float() + dt_bias), 0)
    repeat = v.shape[2] // num_k_heads
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)

    state = ssm_state_cache.index_select(0, start_slot).transpose(-1, -2)  # [R, Hv, Dk, Dv]
    state = torch.where(active[:, None, None, None], state.float(), 0).contiguous()
    round_state = ssm_state_cache.dtype != torch.float32
    outputs, states = [], []
    for j in range(positions):
        step = slice(j, j + 1)
        o_j, state = gdn.gated_delta_rule_recurrent(
            q[:, step], k[:, step], v[:, step], g[:, step], beta[:, step], state, in_place=True
        )
        if round_state:  # the state is stored after every token in the cache dtype, then read back
            state = state.to(ssm_state_cache.dtype).float()
        outputs.append(o_j)
        states.append(state.transpose(-1, -2).clone())
    new_states = torch.stack(states, dim=1)  # [R, P, Hv, Dv, Dk]
    write_slots_(ssm_state_cache, slot_table.clamp_min(0).flatten(), inside.flatten(), new_states.flatten(0, 1))
    o = torch.cat(outputs, dim=1)  # [R, P, Hv, Dv]
    target = torch.where(inside, token_rows, num_tokens).flatten()
    out.index_copy_(0, target, o.flatten(0, 1).to(out.dtype))
    return out[:num_tokens]


def gdn_core_step(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_state_cache: torch.Tensor,
    ssm_state_cache: torch.Tensor,
    meta: Any,
    *,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_state_dim_first: bool,
) -> torch.Tensor:
    """The GDN core of a whole engine step as vLLM's GDN metadata (`GDNAttentionMetadata`) lays it out.

    Without verify rows (``meta.spec_sequence_masks`` None) every request goes through
    `gdn_core_varlen`; with them, the verify rows (``spec_token_indx``) go through `gdn_core_spec`
    and the others (prefills: vLLM counts a one-token row as a prefill next to verify rows,
    ``non_spec_token_indx``) through `gdn_core_varlen`. The conv cache may be the wide buffer of
    speculative decoding: non-verify rows use its first K - 1 columns. Returns o ``[N, Hv, Dv]``.
    """
    kernel = conv_weight.shape[-1]
    heads: dict[str, Any] = {"num_k_heads": num_k_heads, "head_k_dim": head_k_dim, "head_v_dim": head_v_dim}
    narrow = _narrow_conv(conv_state_cache, kernel, conv_state_dim_first)
    weights = (conv_weight, a_log, dt_bias)
    if meta.spec_sequence_masks is None:
        return gdn_core_varlen(
            mixed_qkv, a, b, *weights, narrow, ssm_state_cache, meta.non_spec_state_indices_tensor,
            meta.non_spec_query_start_loc, meta.has_initial_state, conv_state_dim_first=conv_state_dim_first, **heads,
        )  # fmt: skip
    num_tokens = mixed_qkv.shape[0]
    out = mixed_qkv.new_zeros(num_tokens, a.shape[-1], head_v_dim)
    spec_rows = meta.spec_token_indx.long()
    spec_out = gdn_core_spec(
        mixed_qkv.index_select(0, spec_rows), a.index_select(0, spec_rows), b.index_select(0, spec_rows), *weights,
        conv_state_cache, ssm_state_cache, meta.spec_state_indices_tensor, meta.spec_query_start_loc,
        meta.num_accepted_tokens, conv_state_dim_first=conv_state_dim_first, **heads,
    )  # fmt: skip
    out.index_copy_(0, spec_rows, spec_out)
    if meta.num_prefills > 0 or meta.num_decodes > 0:
        rows = meta.non_spec_token_indx.long()
        other = gdn_core_varlen(
            mixed_qkv.index_select(0, rows), a.index_select(0, rows), b.index_select(0, rows), *weights, narrow,
            ssm_state_cache, meta.non_spec_state_indices_tensor, meta.non_spec_query_start_loc,
            meta.has_initial_state, conv_state_dim_first=conv_state_dim_first, **heads,
        )  # fmt: skip
        out.index_copy_(0, rows, other)
    return out
