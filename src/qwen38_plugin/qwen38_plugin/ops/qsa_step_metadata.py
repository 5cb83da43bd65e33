"""A QSA cache group's per-step metadata (request of each token, step starts, positions, slots),
built into persistent buffers by one kernel on CUDA.

vLLM calls each KV-cache group's metadata builder once per step, outside the CUDA graph, so on
CUDA every small torch op the builder runs costs a kernel launch of host time each step (about
twenty-five per QSA group, three or more groups a step). The torch reference here is what the
builder computed before; the Triton kernel writes the same values in one launch. On CPU the
reference runs. ``QWEN38_QSA_PAGED_REFERENCE=1`` (the QSA ops' switch) keeps the reference on
CUDA too.

Inputs are vLLM's device tensors for the step: ``query_start_loc [R + 1]``, ``seq_lens [R]``
(after the step), the group's ``block_table [R, max_blocks]`` and, for the K/V group, vLLM's
``slot_mapping [T]``. Outputs (the builder's buffers, each at least as long as the largest step):
``token_req`` (-1 for padding tokens and for every row past the step's T tokens: a CUDA graph
captured for more tokens replays over them), ``step_start [R]``, ``positions [T]`` (padding
tokens read request 0's, as the reference does; they are masked by ``token_req``) and ``slots``
(-1 where a token writes nothing, and past T).
"""

from __future__ import annotations

import enum

import torch

from qwen38_plugin.ops import ple_varlen, qsa_paged
from qwen38_plugin.ops.triton_dispatch import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl


class CacheKind(enum.IntEnum):
    """Which of a QSA layer's three caches a KV-cache group holds (each has its own block table)."""

    KV = 0
    BLOCK_KEYS = 1
    KEY_RING = 2


def step_metadata_torch(
    kind: CacheKind,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor | None,
    num_tokens: int,
    *,
    block_size: int,
    ratio: int,
    token_req: torch.Tensor,
    step_start: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    num_reqs = seq_lens.shape[0]
    qsl = query_start_loc[: num_reqs + 1]
    req_of_token = token_req[:num_tokens]
    req_of_token.copy_(ple_varlen.token_requests(qsl, num_tokens))
    starts = step_start[:num_reqs]
    starts.copy_(seq_lens - (qsl[1:] - qsl[:-1]))
    req = req_of_token.clamp(min=0).long()
    arange = torch.arange(num_tokens, device=qsl.device)
    pos = positions[:num_tokens]
    pos.copy_(starts.long()[req] + (arange - qsl.long()[req]))
    out = slots[:num_tokens]
    if kind is CacheKind.KV:
        assert slot_mapping is not None
        out.copy_(slot_mapping[:num_tokens])
    elif kind is CacheKind.BLOCK_KEYS:
        out.copy_(qsa_paged.key_slots(req_of_token, pos, block_table, block_size=block_size, ratio=ratio))
    else:
        out.copy_(
            qsa_paged.ring_slots(req_of_token, pos, seq_lens, block_table[:, 0], ring_capacity=block_size, ratio=ratio)
        )
    slots[num_tokens:].fill_(-1)
    token_req[num_tokens:].fill_(-1)


def step_metadata(
    kind: CacheKind,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor | None,
    num_tokens: int,
    *,
    block_size: int,
    ratio: int,
    token_req: torch.Tensor,
    step_start: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    max_reqs: int | None = None,
    backend: str = "auto",
) -> None:
    """Fill the buffers for one step (see the module docstring). ``block_size``: the group's (for
    the key ring, its capacity); ``ratio``: indexer_compress_ratio; ``max_reqs``: the most requests
    a step can have (fixes the kernel's search depth, so one compiled kernel serves every step)."""
    if kind is CacheKind.KV and slot_mapping is None:
        raise ValueError("step_metadata: the K/V group needs vLLM's slot_mapping")
    if kind is CacheKind.BLOCK_KEYS and block_size % ratio:
        raise ValueError(f"step_metadata: block size {block_size} must be a multiple of the ratio {ratio}")
    if kind is CacheKind.KEY_RING and (block_size % ratio or block_size < ratio):
        raise ValueError(f"step_metadata: ring capacity {block_size} must be a multiple of the ratio {ratio}")
    if not qsa_paged.use_triton(query_start_loc, backend):
        step_metadata_torch(
            kind, query_start_loc, seq_lens, block_table, slot_mapping, num_tokens, block_size=block_size,
            ratio=ratio, token_req=token_req, step_start=step_start, positions=positions, slots=slots,
        )  # fmt: skip
        return
    num_reqs = seq_lens.shape[0]
    rows = token_req.shape[0]
    block = 256
    search = max(num_reqs, max_reqs or 0)
    _step_metadata_kernel[(triton.cdiv(max(rows, num_reqs, 1), block),)](
        query_start_loc, seq_lens, block_table, slot_mapping if slot_mapping is not None else slots,
        token_req, step_start, positions, slots, block_table.stride(0), block_table.shape[1], num_reqs, num_tokens,
        rows, block_size, ratio, KIND=int(kind), SEARCH_STEPS=max(1, search.bit_length()), BLOCK=block,
    )  # fmt: skip


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["num_reqs", "num_tokens", "rows"])
    def _step_metadata_kernel(  # type: ignore[no-untyped-def]
        qsl_ptr,
        seq_lens_ptr,
        table_ptr,
        slot_mapping_ptr,
        token_req_ptr,
        step_start_ptr,
        positions_ptr,
        slots_ptr,
        stride_table,
        table_width,
        num_reqs,
        num_tokens,
        rows,
        block_size,
        ratio,
        KIND: tl.constexpr,
        SEARCH_STEPS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One program per BLOCK rows: the rows' tokens (and, for rows < R, the requests' step starts).
        t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        is_req = t < num_reqs
        first = tl.load(qsl_ptr + t, mask=is_req, other=0)
        last = tl.load(qsl_ptr + t + 1, mask=is_req, other=0)
        length = tl.load(seq_lens_ptr + t, mask=is_req, other=0)
        tl.store(step_start_ptr + t, (length - (last - first)).to(tl.int32), mask=is_req)
        # request of token t: the number of requests that ended at or before t (binary search over
        # the ends query_start_loc[1:]); R when t is past them (padding)
        in_step = t < num_tokens
        lo = tl.zeros((BLOCK,), dtype=tl.int32)
        hi = tl.zeros((BLOCK,), dtype=tl.int32) + num_reqs
        for _ in tl.static_range(SEARCH_STEPS):
            open_ = lo < hi
            mid = (lo + hi) // 2
            end = tl.load(qsl_ptr + 1 + mid, mask=open_ & in_step, other=0)
            right = open_ & (end <= t)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(open_ & (end > t), mid, hi)
        real = in_step & (lo < num_reqs)
        tl.store(token_req_ptr + t, tl.where(real, lo, -1), mask=t < rows)
        req = tl.where(real, lo, 0)
        q0 = tl.load(qsl_ptr + req, mask=in_step, other=0).to(tl.int64)
        q1 = tl.load(qsl_ptr + req + 1, mask=in_step, other=0).to(tl.int64)
        seq = tl.load(seq_lens_ptr + req, mask=in_step, other=0).to(tl.int64)
        pos = seq - (q1 - q0) + (t.to(tl.int64) - q0)
        tl.store(positions_ptr + t, pos, mask=in_step)
        none = tl.full((BLOCK,), -1, dtype=tl.int64)
        if KIND == 0:
            slot = tl.load(slot_mapping_ptr + t, mask=in_step, other=-1).to(tl.int64)
        elif KIND == 1:
            per_block = block_size // ratio
            group = pos // ratio
            closing = real & ((pos + 1) % ratio == 0)
            logical = tl.minimum(group // per_block, table_width - 1)  # clamped into the table, as the reference
            block = tl.load(table_ptr + req.to(tl.int64) * stride_table + logical, mask=closing, other=0)
            slot = tl.where(closing, block.to(tl.int64) * per_block + group % per_block, none)
        else:
            newest = real & (pos >= seq - block_size)
            block = tl.load(table_ptr + req.to(tl.int64) * stride_table, mask=newest, other=0)
            slot = tl.where(newest, block.to(tl.int64) * block_size + pos % block_size, none)
        tl.store(slots_ptr + t, tl.where(in_step, slot, none), mask=t < rows)
