"""Plain-torch reference of AWQ W4A16 (any device): the oracle of the kernel tests and the CPU path.

AWQ's checkpoint layout for a linear layer ``y = x @ W`` with ``W`` of shape ``[K, N]`` (input K,
output N) and group size ``g``:
- ``qweight [K, N // 8]`` int32: word ``j`` of row ``k`` holds the 4-bit values of columns
  ``8j .. 8j + 7``; nibble ``i`` (bits ``4i .. 4i + 3``) holds column ``8j + AWQ_ORDER[i]``,
  ``AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``;
- ``qzeros [K // g, N // 8]`` int32, packed the same way;
- ``scales [K // g, N]`` fp16.

``W[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]``, computed in fp16 (``q - z`` is an exact
integer in [-15, 15], so the only rounding is the product's), then ``x @ W`` with fp32
accumulation. The kernels dequantize the same way (the fp16 ``1024 + q`` magic-number trick gives
the same exact integers), so they equal this reference up to the order of the fp32 sums.

MoE: ``w13`` / ``w2`` are stacked per expert (``[E, K, N // 8]`` and so on, the layout vLLM's AWQ
MoE method creates), ``align_block_size`` sorts the routed (token, slot) pairs by expert into
blocks of ``block_m`` rows, the format of vLLM's ``moe_align_block_size``. Nothing here imports vLLM.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i] of its 8
PACK = 8
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """``[R, C // 8]`` int32 AWQ words -> ``[R, C]`` int32 values in 0..15, in column order."""
    # Column c of a word is nibble AWQ_ORDER.index(c) = c // 2 + 4 * (c % 2). The shifts are made
    # on the word's device (no host tensor is copied, so this also runs inside a CUDA-graph capture).
    c = torch.arange(PACK, dtype=torch.int32, device=packed.device)
    columns = (packed.unsqueeze(-1) >> (4 * (c // 2 + 4 * (c % 2)))) & 0xF  # [R, C/8, column]
    return columns.reshape(*packed.shape[:-1], packed.shape[-1] * PACK)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """Inverse of `unpack_awq`: ``[R, C]`` integers in 0..15 -> ``[R, C // 8]`` int32 AWQ words."""
    if values.shape[-1] % PACK:
        raise ValueError(f"pack_awq: {values.shape[-1]} columns is not a multiple of {PACK}")
    grouped = values.to(torch.int64).reshape(*values.shape[:-1], values.shape[-1] // PACK, PACK)
    nibbles = grouped[..., list(AWQ_ORDER)]  # nibble i <- column AWQ_ORDER[i]
    words = (nibbles << _SHIFTS.to(torch.int64).to(values.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``W [K, N]`` in the dtype of ``scales`` (fp16): ``(q - z) * s`` per group of rows."""
    q = unpack_awq(qweight)
    z = unpack_awq(qzeros)
    group = q.shape[-2] // z.shape[-2]
    z = z.repeat_interleave(group, dim=-2)
    s = scales.repeat_interleave(group, dim=-2)
    return (q - z).to(scales.dtype) * s


def awq_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x [..., K] @ W`` with fp32 accumulation, rounded to ``out_dtype`` (``x``'s dtype by default)."""
    w = dequantize(qweight, qzeros, scales)
    y = x.to(torch.float32) @ w.to(torch.float32)
    return y.to(out_dtype or x.dtype)


def quantize_awq(
    w: torch.Tensor, group_size: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ-style asymmetric 4-bit quantization of ``w [K, N]`` per group of ``group_size`` rows.

    Independent of `dequantize`: per group and column, scale = (max - min) / 15 (fp16), zero =
    round(-min / scale) clamped to 0..15, q = clamp(round(w / scale) + zero, 0, 15). Returns
    (qweight, qzeros, scales) in AWQ's packed layout.
    """
    k, n = w.shape
    if k % group_size:
        raise ValueError(f"quantize_awq: K={k} is not a multiple of group size {group_size}")
    grouped = w.to(torch.float32).reshape(k // group_size, group_size, n)
    lo = grouped.amin(1).clamp(max=0.0)
    hi = grouped.amax(1).clamp(min=0.0)
    scale = ((hi - lo) / 15.0).clamp(min=1e-5).to(torch.float16)
    zero = torch.round(-lo / scale.float()).clamp(0, 15)
    q = (torch.round(grouped / scale.float().unsqueeze(1)) + zero.unsqueeze(1)).clamp(0, 15)
    return pack_awq(q.reshape(k, n).to(torch.int32)), pack_awq(zero.to(torch.int32)), scale


def align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routed rows sorted by expert, each expert's rows padded to whole blocks of ``block_m``.

    ``topk_ids [T, top_k]`` -> (``sorted_ids [T * top_k + E * (block_m - 1)]`` int32: flat (token,
    slot) indices, ``T * top_k`` for padding; ``expert_ids [len // block_m]`` int32, -1 for blocks
    past the last used one; ``num_post_padded [1]`` int32) - the format of vLLM's
    ``moe_align_block_size``, with sizes that depend on the shapes only (CUDA-graph friendly).
    An id outside ``0 .. E - 1`` (an expert of another rank) is dropped.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    numel = flat.numel()
    capacity = numel + num_experts * (block_m - 1)
    capacity = (capacity + block_m - 1) // block_m * block_m
    device = topk_ids.device
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))  # num_experts: dropped
    # No data-dependent shapes and no host syncs (no bincount, no boolean indexing): capturable.
    counts_all = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(
        0, key, torch.ones_like(key)
    )
    counts = counts_all[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    rank = torch.arange(numel, device=device) - (torch.cumsum(counts_all, 0) - counts_all)[sorted_key]
    dest = torch.where(
        sorted_key < num_experts, starts[sorted_key.clamp(max=num_experts - 1)] + rank, torch.full_like(rank, capacity)
    )  # a dropped row goes to a spare slot past the end
    buffer = torch.full((capacity + 1,), numel, dtype=torch.int32, device=device)
    buffer.scatter_(0, dest, order.to(torch.int32))
    sorted_ids = buffer[:capacity]
    num_blocks = capacity // block_m
    block_starts = torch.arange(num_blocks, device=device) * block_m
    ends = starts + padded
    owner = torch.searchsorted(ends, block_starts, right=True)
    expert_ids = torch.where(owner < num_experts, owner, torch.full_like(owner, -1)).to(torch.int32)
    total = padded.sum().reshape(1).to(torch.int32)
    return sorted_ids, expert_ids, total


def moe_reference(
    x: torch.Tensor,
    w13: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    w2: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """SiLU-gated MoE with AWQ experts: per routed (token, slot) ``down(silu(gate) * up)``, summed
    with the router weights. ``w13 = (qweight [E, H, 2I/8], qzeros [E, H/g, 2I/8], scales [E, H/g, 2I])``
    (gate columns then up columns), ``w2 = (.. [E, I, H/8], .. [E, I/g, H/8], .. [E, I/g, H])``.
    fp32 accumulation, the intermediate rounded to ``x``'s dtype as the kernels do."""
    num_tokens = topk_ids.shape[0]
    out = torch.zeros(num_tokens, x.shape[-1], dtype=torch.float32, device=x.device)
    num_experts = w13[0].shape[0]
    for e in range(num_experts):
        token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        weight = topk_weights[token, slot].to(torch.float32)
        xe = x[token]
        if apply_router_weight_on_input:
            xe = (xe.to(torch.float32) * weight[:, None]).to(x.dtype)
        gate_up = awq_matmul(xe, w13[0][e], w13[1][e], w13[2][e])
        inter = gate_up.shape[-1] // 2
        act = (torch.nn.functional.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()).to(x.dtype)
        down = awq_matmul(act, w2[0][e], w2[1][e], w2[2][e]).to(torch.float32)
        if not apply_router_weight_on_input:
            down = down * weight[:, None]
        out.index_add_(0, token, down)
    return out.to(x.dtype)
