"""The QSA layer of a whole engine step over vLLM's paged caches: batched, sync-free, graph-safe.

`ops.qsa` is the per-sequence reference (the oracle); this module does the same work for every
token of every request of a step at once, reading and writing vLLM's caches in place. Each op is
a plain-torch reference (the spec and the CPU path) plus, where it matters, a Triton fast path,
behind one dispatcher that picks Triton for CUDA tensors and torch otherwise
(``backend="torch"`` or ``QWEN38_QSA_PAGED_REFERENCE=1`` force the reference, for comparison;
``backend="triton"`` forces Triton, which on CPU tensors runs under ``TRITON_INTERPRET=1``).
On CUDA, nothing here reads a device value back to the host and every shape is fixed by the
arguments' shapes and ints, so a decode step can be captured in a CUDA graph. The torch
references may sync (boolean-mask writes; the dense attention reads the longest position).

Caches (the views vLLM binds; dim 0 may be strided past one page because vLLM interleaves other
layers' pages, so everything indexes through strides):
- ``kv_cache [NB, Hkv, BS, 2 * D]``: K (normed, rotated) in ``[..., :D]``, V in ``[..., D:]``;
  position p of request r at block ``kv_block_table[r, p // BS]``, row ``p % BS``;
- ``key_cache [NBk, 1, BS // ratio, Di]``: one compressed indexer key per complete group
  g (positions ``[g * ratio, (g + 1) * ratio)``), at block ``key_block_table[r, g // (BS // ratio)]``,
  row ``g % (BS // ratio)``;
- ``ring_cache [NBr, 1, cap, Di]``: the raw indexer keys of request r's last ``cap`` positions,
  position p at block ``ring_block[r]``, row ``p % cap`` (cap a multiple of ratio, >= ratio).
Block 0 is vLLM's null block: the writes here never touch it (the slot mappings never point at it).

Per-step inputs (device tensors): ``token_req [T] int32`` (the request row of each token; rows
0..R-1, each request's tokens contiguous and in row order; -1 for CUDA-graph padding tokens, which
write nothing and whose outputs are don't-care but finite), ``positions [T] int64``,
``step_start [R] int32`` (position of the request's first token of this step), block tables
``[R, max_blocks] int32``, ``ring_block [R] int32``, and the slot mappings of `slot_mappings`.

One step of a layer, in order (the order matters where one op reads what another writes):
1. `write_kv` (K/V of the step's tokens: a token attends to itself and to earlier tokens of the step);
2. `group_keys` (reads the ring of earlier steps: before the ring write), then `write_rows` into
   the key cache at the ``key`` slots and into the ring at the ``ring`` slots;
3. `index_topk` (reads the key cache, including the groups this step closed);
4. `sparse_attention`.
`slot_mappings` runs once per step (the metadata builder), not per layer.

With decode context parallelism each rank's ``kv_cache`` holds only its share of the positions
(`DcpShard`, vLLM's layout: a block-table entry spans ``BS * world`` positions); the key cache and
the ring stay whole. Step 4 is then `sparse_attention_partials` over the group's query heads on
every rank, gathered, and `merge_partials` (`vllm_qsa.PortableQSAAttention` does the gathering).

The Triton path runs wherever Triton does: fp16 and fp32 on sm_70 (FMA only), and bf16 from
sm_80. Measured on the H200 (benchmarks/qwen38_plugin/results/bench_qsa_paged_h200.txt and
qsa_paged_notes.md): a decode layer of 256 requests at a 32K context in 0.63 ms, 0.61 of the
copy ceiling on the bytes it must move; one request in 0.047 ms.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any, NamedTuple

import torch

from qwen38_plugin.ops import triton_dispatch
from qwen38_plugin.ops.common import apply_partial_rope, rms_norm, rotary_cos_sin
from qwen38_plugin.ops.triton_dispatch import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

REFERENCE_ENV = "QWEN38_QSA_PAGED_REFERENCE"

# Temporary memory bounds (bytes). Scores of `index_topk` are computed for this many bytes of
# [query rows, max_groups] fp32 at a time; the torch references gather at most about this much.
INDEX_SCORE_BYTES = 64 << 20
REFERENCE_GATHER_BYTES = 64 << 20


def use_triton(x: torch.Tensor, backend: str = "auto") -> bool:
    """Whether an op runs its Triton path: "auto" picks it for CUDA tensors unless
    ``QWEN38_QSA_PAGED_REFERENCE=1``; "torch" never; "triton" always (CPU needs TRITON_INTERPRET=1)."""
    return triton_dispatch.use_triton(x.is_cuda, backend, reference_env=REFERENCE_ENV, op="qsa_paged")


def _rows(n: int, bytes_per_row: int, budget: int) -> int:
    """Rows per chunk so that a chunk holds at most ``budget`` bytes (at least one row)."""
    return max(1, min(n, budget // max(1, bytes_per_row)))


# ---------------------------------------------------------------------------------------------
# Slot mappings
# ---------------------------------------------------------------------------------------------


class SlotMappings(NamedTuple):
    """Where each token of a step writes (``-1``: nowhere); `slot_mappings`."""

    kv: torch.Tensor  # [T] int64: block * BS + row in kv_cache
    key: torch.Tensor | None  # [T] int64: block * (BS // ratio) + row in key_cache, closing tokens only
    ring: torch.Tensor | None  # [T] int64: ring_block * cap + p % cap, the request's last cap tokens only


def _lookup(table: torch.Tensor, req: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
    """``table[req, logical]`` as int64, the logical index clamped into the table (padding rows)."""
    return table[req, logical.clamp(0, table.shape[1] - 1)].long()


class DcpShard(NamedTuple):
    """One rank's share of a K/V cache split by decode context parallelism, in vLLM's layout: a
    block-table entry spans ``BS * world`` positions, position p of it (offset ``o = p % (BS *
    world)``) lives on rank ``(o // interleave) % world``, at row ``o // (world * interleave) *
    interleave + o % interleave`` of that rank's block (vLLM's slot mapping writes it there)."""

    world: int
    rank: int
    interleave: int = 1


def kv_rows(
    key_pos: torch.Tensor, table: torch.Tensor, req: torch.Tensor, block_size: int, shard: DcpShard | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Where K/V position ``key_pos`` of request row ``req`` lies: (block, row, on this rank),
    int64 / int64 / bool (None: every position is, without decode context parallelism)."""
    pos = key_pos.long().clamp(min=0)
    if shard is None or shard.world == 1:
        return _lookup(table, req, pos // block_size), pos % block_size, None
    span = block_size * shard.world
    offset = pos % span
    local = (offset // shard.interleave) % shard.world == shard.rank
    row = offset // (shard.world * shard.interleave) * shard.interleave + offset % shard.interleave
    return _lookup(table, req, pos // span), row, local


def slot_mappings(
    token_req: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_block_table: torch.Tensor,
    *,
    block_size: int,
    key_block_table: torch.Tensor | None = None,
    ring_block: torch.Tensor | None = None,
    ratio: int | None = None,
    ring_capacity: int | None = None,
) -> SlotMappings:
    """The three slot mappings of a step, on the tensors' device, without host syncs.

    token_req ``[T] int32`` (-1: padding), positions ``[T] int64``, seq_lens ``[R]`` (each
    request's length after this step), kv_block_table / key_block_table ``[R, max_blocks] int32``,
    ring_block ``[R] int32``. ``block_size`` is the KV block size BS; the key cache holds
    ``BS // ratio`` rows per block and the ring ``ring_capacity`` rows. Without an indexer
    (key_block_table None) the key and ring mappings are None.
    - kv: every real token;
    - key: tokens that close a group (``(p + 1) % ratio == 0``), at group ``p // ratio``;
    - ring: the request's last ``ring_capacity`` tokens of the step (``p >= seq_len - cap``), so no
      two tokens of a step write the same ring row.
    """
    kv = kv_slots(token_req, positions, kv_block_table, block_size=block_size)
    if key_block_table is None:
        return SlotMappings(kv, None, None)
    if ratio is None or ring_block is None or ring_capacity is None:
        raise ValueError("slot_mappings: an indexer needs key_block_table, ring_block, ratio and ring_capacity")
    key = key_slots(token_req, positions, key_block_table, block_size=block_size, ratio=ratio)
    ring = ring_slots(token_req, positions, seq_lens, ring_block, ring_capacity=ring_capacity, ratio=ratio)
    return SlotMappings(kv, key, ring)


def _request_and_position(token_req: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(real token mask, request row clamped for gathers, position clamped, -1 of the same shape)."""
    pos = positions.long().clamp(min=0)
    return token_req >= 0, token_req.clamp(min=0).long(), pos, torch.full_like(pos, -1)


def kv_slots(
    token_req: torch.Tensor, positions: torch.Tensor, kv_block_table: torch.Tensor, *, block_size: int
) -> torch.Tensor:
    """`SlotMappings.kv`: every real token's K/V row (vLLM's own slot mapping equals it)."""
    real, req, pos, none = _request_and_position(token_req, positions)
    block, row, _ = kv_rows(pos, kv_block_table, req, block_size)
    return torch.where(real, block * block_size + row, none)


def key_slots(
    token_req: torch.Tensor, positions: torch.Tensor, key_block_table: torch.Tensor, *, block_size: int, ratio: int
) -> torch.Tensor:
    """`SlotMappings.key`: a token that completes a group writes that group's key, no other token."""
    if block_size % ratio:
        raise ValueError(f"key_slots: block size {block_size} must be a multiple of the ratio {ratio}")
    real, req, pos, none = _request_and_position(token_req, positions)
    per_block = block_size // ratio
    group = pos // ratio
    closing = real & ((pos + 1) % ratio == 0)
    return torch.where(closing, _lookup(key_block_table, req, group // per_block) * per_block + group % per_block, none)


def ring_slots(
    token_req: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    ring_block: torch.Tensor,
    *,
    ring_capacity: int,
    ratio: int,
) -> torch.Tensor:
    """`SlotMappings.ring`: each request's last ``ring_capacity`` tokens of the step (earlier ones
    would be overwritten in the same step, and two writes to one row would race)."""
    if ring_capacity % ratio or ring_capacity < ratio:
        raise ValueError(
            f"ring_slots: ring capacity {ring_capacity} must be a multiple of the ratio {ratio} (at least one group)"
        )
    real, req, pos, none = _request_and_position(token_req, positions)
    last = real & (pos >= seq_lens.long()[req] - ring_capacity)
    return torch.where(last, ring_block.long()[req] * ring_capacity + pos % ring_capacity, none)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

if HAVE_TRITON:

    @triton.jit
    def _write_kv_kernel(  # type: ignore[no-untyped-def]
        kv_ptr,
        slots_ptr,
        k_ptr,
        v_ptr,
        stride_cache_block,
        stride_cache_head,
        stride_cache_row,
        stride_cache_feature,
        stride_k_token,
        stride_k_head,
        stride_k_dim,
        stride_v_token,
        stride_v_head,
        stride_v_dim,
        BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # One program per (token, KV head): K and V of one head, D contiguous features each.
        token = tl.program_id(0)
        head = tl.program_id(1)
        slot = tl.load(slots_ptr + token)
        if slot >= 0:
            dims = tl.arange(0, BLOCK_D)
            ok = dims < HEAD_DIM
            row = (
                kv_ptr
                + (slot // BLOCK_SIZE) * stride_cache_block
                + head * stride_cache_head
                + (slot % BLOCK_SIZE) * stride_cache_row
            )
            k = tl.load(k_ptr + token * stride_k_token + head * stride_k_head + dims * stride_k_dim, mask=ok)
            v = tl.load(v_ptr + token * stride_v_token + head * stride_v_head + dims * stride_v_dim, mask=ok)
            tl.store(row + dims * stride_cache_feature, k.to(kv_ptr.dtype.element_ty), mask=ok)
            tl.store(row + (HEAD_DIM + dims) * stride_cache_feature, v.to(kv_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _write_rows_kernel(  # type: ignore[no-untyped-def]
        cache_ptr,
        slots_ptr,
        values_ptr,
        stride_cache_block,
        stride_cache_row,
        stride_cache_feature,
        stride_values_token,
        stride_values_feature,
        ROWS_PER_BLOCK: tl.constexpr,
        FEATURES: tl.constexpr,
        BLOCK_F: tl.constexpr,
    ):
        token = tl.program_id(0)
        slot = tl.load(slots_ptr + token)
        if slot >= 0:
            features = tl.arange(0, BLOCK_F)
            ok = features < FEATURES
            value = tl.load(values_ptr + token * stride_values_token + features * stride_values_feature, mask=ok)
            row = cache_ptr + (slot // ROWS_PER_BLOCK) * stride_cache_block + (slot % ROWS_PER_BLOCK) * stride_cache_row
            tl.store(row + features * stride_cache_feature, value.to(cache_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _group_keys_kernel(  # type: ignore[no-untyped-def]
        raw_ptr,
        ring_ptr,
        ring_block_ptr,
        req_ptr,
        pos_ptr,
        step_start_ptr,
        weight_ptr,
        inv_freq_ptr,
        out_ptr,
        stride_raw_token,
        stride_raw_dim,
        stride_ring_block,
        stride_ring_row,
        stride_ring_dim,
        stride_ring_block_req,
        stride_out_token,
        eps,
        RATIO: tl.constexpr,
        CAPACITY: tl.constexpr,
        DIM: tl.constexpr,
        ROTARY_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # One program per token. A closing token pools its group's raw keys (this step's rows or
        # the ring), then RMSNorm and RoPE as `ops.common` computes them: each elementwise step in
        # fp32, rounded to the model dtype where torch rounds. Every feature is computed twice, at
        # d and at its rotate-half partner, so RoPE needs no exchange between lanes.
        token = tl.program_id(0)
        req = tl.load(req_ptr + token)
        position = tl.load(pos_ptr + token).to(tl.int64)
        dims = tl.arange(0, BLOCK_D)
        ok = dims < DIM
        dtype = out_ptr.dtype.element_ty
        out = out_ptr + token * stride_out_token + dims
        if (req >= 0) & ((position + 1) % RATIO == 0):
            HALF: tl.constexpr = ROTARY_DIM // 2
            rotated = dims < ROTARY_DIM
            partner = tl.where(rotated, tl.where(dims < HALF, dims + HALF, dims - HALF), dims)
            first = position - (RATIO - 1)
            step_start = tl.load(step_start_ptr + req).to(tl.int64)
            ring = ring_ptr + tl.load(ring_block_ptr + req * stride_ring_block_req).to(tl.int64) * stride_ring_block
            total = tl.zeros([BLOCK_D], tl.float32)
            total_partner = tl.zeros([BLOCK_D], tl.float32)
            for i in range(RATIO):
                member = first + i
                in_step = member >= step_start
                step_row = raw_ptr + (token - (position - member)) * stride_raw_token
                ring_row = ring + (member % CAPACITY) * stride_ring_row
                from_step = ok & in_step
                from_ring = ok & (member < step_start)
                total += tl.load(step_row + dims * stride_raw_dim, mask=from_step, other=0.0).to(tl.float32)
                total += tl.load(ring_row + dims * stride_ring_dim, mask=from_ring, other=0.0).to(tl.float32)
                total_partner += tl.load(step_row + partner * stride_raw_dim, mask=from_step, other=0.0).to(tl.float32)
                total_partner += tl.load(ring_row + partner * stride_ring_dim, mask=from_ring, other=0.0).to(tl.float32)
            # torch's mean multiplies the sum by 1 / n; the pooled key is rounded to the model dtype
            pooled = (total * (1.0 / RATIO)).to(dtype).to(tl.float32)
            pooled_partner = (total_partner * (1.0 / RATIO)).to(dtype).to(tl.float32)
            inv_rms = 1.0 / tl.sqrt(tl.sum(pooled * pooled, axis=0) * (1.0 / DIM) + eps)
            scale = 1.0 + tl.load(weight_ptr + dims, mask=ok, other=0.0).to(tl.float32)
            scale_partner = 1.0 + tl.load(weight_ptr + partner, mask=ok, other=0.0).to(tl.float32)
            x = (pooled * inv_rms * scale).to(dtype).to(tl.float32)
            x_partner = (pooled_partner * inv_rms * scale_partner).to(dtype).to(tl.float32)
            freq = tl.load(inv_freq_ptr + dims % HALF, mask=rotated, other=0.0)
            angle = first.to(tl.float32) * freq
            cos = tl.cos(angle).to(dtype).to(tl.float32)
            sin = tl.sin(angle).to(dtype).to(tl.float32)
            half_rotated = tl.where(dims < HALF, -x_partner, x_partner)
            rope = (x * cos).to(dtype).to(tl.float32) + (half_rotated * sin).to(dtype).to(tl.float32)
            tl.store(out, tl.where(rotated, rope, x).to(dtype), mask=ok)
        else:
            tl.store(out, tl.zeros([BLOCK_D], tl.float32).to(dtype), mask=ok)

    @triton.jit
    def _index_scores_kernel(  # type: ignore[no-untyped-def]
        q_ptr,
        key_ptr,
        table_ptr,
        req_ptr,
        complete_ptr,
        scores_ptr,
        stride_q_token,
        stride_q_head,
        stride_q_dim,
        stride_key_block,
        stride_key_row,
        stride_key_dim,
        stride_table_req,
        stride_table_block,
        stride_scores_token,
        max_groups,
        table_width,
        score_divisor,
        TOPK: tl.constexpr,
        NUM_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        ROWS_PER_BLOCK: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        SPLIT_PARTS: tl.constexpr,
    ):
        # One program per (query row, tile of BLOCK_G groups). Rows with at most TOPK complete
        # groups select all of them (no scores needed) and tiles past the complete groups hold
        # only -inf: neither loads anything.
        # SPLIT_PARTS 0: fp32 FMA, one index head at a time (sm_70, fp32 keys). SPLIT_PARTS n > 0:
        # tensor cores (sm_80+) on the half-precision keys, with the fp32 queries split into n parts
        # in the keys' dtype (q = q1 + q2 + ..., each part the rounding of what is left): every
        # product is exact in fp32, so 2 fp16 or 3 bf16 parts give fp32-accurate dots (an fp32
        # tl.dot, IEEE, ran 10x slower on the H200).
        token = tl.program_id(0)
        groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
        out = scores_ptr + token * stride_scores_token + groups
        in_row = groups < max_groups
        complete = tl.load(complete_ptr + token)
        if (complete <= TOPK) | (tl.program_id(1) * BLOCK_G >= complete):
            tl.store(out, tl.full([BLOCK_G], float("-inf"), tl.float32), mask=in_row)
        else:
            req = tl.load(req_ptr + token).to(tl.int64)
            valid = groups < complete
            logical = tl.minimum(groups // ROWS_PER_BLOCK, table_width - 1)
            block = tl.load(table_ptr + req * stride_table_req + logical * stride_table_block, mask=valid, other=0)
            dims = tl.arange(0, BLOCK_D)
            dims_ok = dims < HEAD_DIM
            keys = tl.load(
                key_ptr
                + block.to(tl.int64)[:, None] * stride_key_block
                + (groups % ROWS_PER_BLOCK)[:, None] * stride_key_row
                + dims[None, :] * stride_key_dim,
                mask=valid[:, None] & dims_ok[None, :],
                other=0.0,
            )
            q_row = q_ptr + token * stride_q_token
            if SPLIT_PARTS == 0:
                keys_f32 = keys.to(tl.float32)
                score = tl.zeros([BLOCK_G], tl.float32)
                for head in range(NUM_HEADS):  # a loop, not unrolled: 16 copies made a 44 s compile
                    q = tl.load(q_row + head * stride_q_head + dims * stride_q_dim, mask=dims_ok, other=0.0)
                    score += tl.maximum(tl.sum(keys_f32 * q.to(tl.float32)[None, :], axis=1), 0.0)
            else:
                # Heads past NUM_HEADS are zero queries: relu(0) adds nothing. BLOCK_H >= 16 for tl.dot.
                heads = tl.arange(0, BLOCK_H)
                left = tl.load(
                    q_row + heads[:, None] * stride_q_head + dims[None, :] * stride_q_dim,
                    mask=(heads < NUM_HEADS)[:, None] & dims_ok[None, :],
                    other=0.0,
                ).to(tl.float32)
                part = left.to(keys.dtype)
                dots = tl.dot(keys, tl.trans(part))  # [BLOCK_G, BLOCK_H]
                for _ in tl.static_range(SPLIT_PARTS - 1):
                    left = left - part.to(tl.float32)
                    part = left.to(keys.dtype)
                    dots = tl.dot(keys, tl.trans(part), dots)
                score = tl.sum(tl.maximum(dots, 0.0), axis=1)
            tl.store(out, tl.where(valid, score / score_divisor, float("-inf")), mask=in_row)

    @triton.jit
    def _order_key(scores):  # type: ignore[no-untyped-def]
        """int32 keys that order like the fp32 scores (-0.0 counted as +0.0, as float compares do)."""
        bits = tl.where(scores == 0.0, 0.0, scores).to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _emit_chunk(out, key, key_ok, groups, threshold, ties_taken, ties_seen, taken):  # type: ignore[no-untyped-def]
        """Store the chunk's chosen groups (keys above the threshold, and ties while fewer than
        ``ties_taken`` were seen) at their ranks among all chosen so far; returns the new counts."""
        tie = (key_ok & (key == threshold)).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(tie, axis=0)  # 1-based among the row's ties so far
        take = (key_ok & ((key > threshold) | ((tie == 1) & (tie_rank <= ties_taken)))).to(tl.int32)
        rank = taken + tl.cumsum(take, axis=0) - take
        tl.store(out + rank, groups.to(tl.int32), mask=take == 1)
        return ties_seen + tl.sum(tie, axis=0), taken + tl.sum(take, axis=0)

    @triton.jit
    def _select_groups_kernel(  # type: ignore[no-untyped-def]
        scores_ptr,
        complete_ptr,
        threshold_ptr,
        out_ptr,
        stride_scores_token,
        stride_out_token,
        TOPK: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GIVEN_THRESHOLD: tl.constexpr,
    ):
        # One program per query row: the TOPK best of its `complete` scores, in ascending group
        # order; at the TOPK-th score's ties, the lowest groups. Without GIVEN_THRESHOLD the row
        # (at most BLOCK scores) is held in registers and the TOPK-th largest score is found by
        # bisection on its 32-bit order key (32 counting passes: a radix select with tl.histogram
        # ran slower on the H200, its scores sharing a few top-digit bins); with it, the TOPK-th largest
        # score comes from threshold_ptr and the row is read in BLOCK chunks, only as far as its
        # complete groups. Then one pass emits the chosen groups, each at its rank among the
        # chosen (a running prefix sum), so they come out sorted without a sort.
        token = tl.program_id(0)
        complete = tl.load(complete_ptr + token)
        out = out_ptr + token * stride_out_token
        if complete <= TOPK:
            ranks = tl.arange(0, BLOCK_K)
            tl.store(out + ranks, tl.where(ranks < complete, ranks, -1).to(tl.int32), mask=ranks < TOPK)
        else:
            row = scores_ptr + token * stride_scores_token
            offsets = tl.arange(0, BLOCK)
            above = tl.zeros([], tl.int32)
            ties_seen = tl.zeros([], tl.int32)
            taken = tl.zeros([], tl.int32)
            if GIVEN_THRESHOLD:
                threshold = _order_key(tl.load(threshold_ptr + token))
                for chunk in range(tl.cdiv(complete, BLOCK)):
                    groups = chunk * BLOCK + offsets
                    key_ok = groups < complete
                    key = _order_key(tl.load(row + groups, mask=key_ok, other=0.0))
                    above += tl.sum((key_ok & (key > threshold)).to(tl.int32), axis=0)
                for chunk in range(tl.cdiv(complete, BLOCK)):
                    groups = chunk * BLOCK + offsets
                    key_ok = groups < complete
                    key = _order_key(tl.load(row + groups, mask=key_ok, other=0.0))
                    ties_seen, taken = _emit_chunk(out, key, key_ok, groups, threshold, TOPK - above, ties_seen, taken)
            else:
                key_ok = offsets < complete
                key = _order_key(tl.load(row + offsets, mask=key_ok, other=0.0))
                # Bisection on the key: count(key >= low) >= TOPK > count(key >= high).
                low = tl.full([], -(2**31), tl.int64)
                high = tl.full([], 2**31, tl.int64)
                for _ in range(32):
                    mid = ((low + high) // 2).to(tl.int32)
                    count = tl.sum((key_ok & (key >= mid)).to(tl.int32), axis=0)
                    low = tl.where(count >= TOPK, mid.to(tl.int64), low)
                    high = tl.where(count >= TOPK, high, mid.to(tl.int64))
                threshold = low.to(tl.int32)  # the TOPK-th largest key
                above = tl.sum((key_ok & (key > threshold)).to(tl.int32), axis=0)
                _emit_chunk(out, key, key_ok, offsets, threshold, TOPK - above, ties_seen, taken)

    @triton.jit
    def _gated_output(acc, normalizer, gate_ptr, out_ptr, heads_ok, head_index, dims, HEAD_DIM: tl.constexpr):  # type: ignore[no-untyped-def]
        """acc / normalizer rounded to the output dtype, times sigmoid(gate) rounded likewise
        (what `ops.qsa.gated_attention` computes in the model dtype), stored at [head, dim]."""
        dtype = out_ptr.dtype.element_ty
        attended = (acc / tl.maximum(normalizer, 1e-30)[:, None]).to(dtype).to(tl.float32)
        where = head_index[:, None] * HEAD_DIM + dims[None, :]
        ok = heads_ok[:, None] & (dims < HEAD_DIM)[None, :]
        gate = tl.load(gate_ptr + where, mask=ok, other=0.0).to(tl.float32)
        sigmoid = (1.0 / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + where, (attended * sigmoid).to(dtype), mask=ok)

    @triton.jit
    def _sparse_attention_kernel(  # type: ignore[no-untyped-def]
        q_ptr,
        gate_ptr,
        kv_ptr,
        table_ptr,
        req_ptr,
        pos_ptr,
        selected_ptr,
        out_ptr,
        partial_acc_ptr,
        partial_ml_ptr,
        stride_q_token,
        stride_q_head,
        stride_q_dim,
        stride_gate_token,
        stride_cache_block,
        stride_cache_head,
        stride_cache_row,
        stride_cache_feature,
        stride_table_req,
        stride_table_block,
        stride_selected_token,
        stride_out_token,
        num_tokens,
        table_width,
        scale_log2,
        RATIO: tl.constexpr,
        TOPK: tl.constexpr,
        HEADS_PER_KV: tl.constexpr,
        NUM_Q_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        FP32_DOT: tl.constexpr,
        PARTIAL: tl.constexpr = 0,
        DCP_WORLD: tl.constexpr = 1,
        DCP_RANK: tl.constexpr = 0,
        DCP_INTERLEAVE: tl.constexpr = 1,
    ):
        # PARTIAL: store the unnormalised partials even with one split (`sparse_attention_partials`);
        # DCP_*: the cache holds this rank's share of the positions only (`DcpShard`), the others masked.
        # One program per (token, KV head, split): the query heads of that KV head (padded to
        # BLOCK_H >= 16 rows for tl.dot) against a contiguous share of the token's key list.
        # The key list of a token at p: with TOPK > 0, slot j < n_sel * RATIO is position
        # selected[j // RATIO] * RATIO + j % RATIO (n_sel = min(complete, TOPK)), then the open
        # group complete * RATIO .. p; with TOPK == 0 (dense), position j for j in 0..p. Each key
        # row is read once, through the block table; the softmax is online, in fp32 (log2 domain).
        token = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        req = tl.load(req_ptr + token)
        position = tl.load(pos_ptr + token).to(tl.int64)
        if TOPK > 0:
            complete = (position + 1) // RATIO
            n_sel = tl.minimum(complete, TOPK)
            n_keys = n_sel * RATIO + (position + 1 - complete * RATIO)
        else:
            complete = position * 0
            n_sel = position * 0
            n_keys = position + 1
        n_keys = tl.where(req >= 0, n_keys, 0)
        n_tiles = tl.cdiv(n_keys, BLOCK_N)
        tile_begin = split * n_tiles // NUM_SPLITS
        tile_end = (split + 1) * n_tiles // NUM_SPLITS
        table_row = table_ptr + tl.maximum(req, 0).to(tl.int64) * stride_table_req

        heads = tl.arange(0, BLOCK_H)
        heads_ok = heads < HEADS_PER_KV
        head_index = kv_head * HEADS_PER_KV + heads
        dims = tl.arange(0, BLOCK_D)
        dims_ok = dims < HEAD_DIM
        q = tl.load(
            q_ptr + token * stride_q_token + head_index[:, None] * stride_q_head + dims[None, :] * stride_q_dim,
            mask=heads_ok[:, None] & dims_ok[None, :],
            other=0.0,
        )
        # A finite floor instead of -inf: exp2(m_old - m_new) stays defined while all keys seen
        # so far are masked (masked scores are -inf, so they still add exactly 0).
        m = tl.full([BLOCK_H], -1.0e30, tl.float32)
        normalizer = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for tile in range(tile_begin, tile_end):
            j = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = j < n_keys
            if TOPK > 0:
                in_selection = j < n_sel * RATIO
                group = tl.load(
                    selected_ptr + token * stride_selected_token + j // RATIO, mask=ok & in_selection, other=-1
                ).to(tl.int64)
                key_pos = tl.where(in_selection, group * RATIO + j % RATIO, complete * RATIO + j - n_sel * RATIO)
                ok = ok & ((group >= 0) | ~in_selection)
            else:
                key_pos = j
            ok = ok & (key_pos >= 0) & (key_pos <= position)
            if DCP_WORLD > 1:
                offset = tl.maximum(key_pos, 0) % (BLOCK_SIZE * DCP_WORLD)
                ok = ok & ((offset // DCP_INTERLEAVE) % DCP_WORLD == DCP_RANK)
                logical = tl.minimum(tl.maximum(key_pos, 0) // (BLOCK_SIZE * DCP_WORLD), table_width - 1)
                row_index = offset // (DCP_WORLD * DCP_INTERLEAVE) * DCP_INTERLEAVE + offset % DCP_INTERLEAVE
            else:
                logical = tl.minimum(tl.maximum(key_pos, 0) // BLOCK_SIZE, table_width - 1)
                row_index = key_pos % BLOCK_SIZE
            block = tl.load(table_row + logical * stride_table_block, mask=ok, other=0).to(tl.int64)
            row = kv_ptr + block * stride_cache_block + kv_head * stride_cache_head + row_index * stride_cache_row
            row_ok = ok[:, None] & dims_ok[None, :]
            k = tl.load(row[:, None] + dims[None, :] * stride_cache_feature, mask=row_ok, other=0.0)
            v = tl.load(row[:, None] + (HEAD_DIM + dims)[None, :] * stride_cache_feature, mask=row_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") if FP32_DOT else tl.dot(q, tl.trans(k))
            s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            normalizer = normalizer * alpha + tl.sum(p, axis=1)
            if FP32_DOT:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                # Half-precision probabilities into the tensor-core product, as flash attention does.
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        if NUM_SPLITS == 1 and PARTIAL == 0:
            _gated_output(
                acc, normalizer, gate_ptr + token * stride_gate_token, out_ptr + token * stride_out_token, heads_ok,
                head_index, dims, HEAD_DIM,
            )  # fmt: skip
        else:
            # Unnormalised partials [split, token, q head, D] and (max, sum) [split, token, q head, 2].
            part = (split * num_tokens + token) * NUM_Q_HEADS + head_index
            tl.store(
                partial_acc_ptr + part.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :],
                acc,
                mask=heads_ok[:, None] & dims_ok[None, :],
            )
            tl.store(partial_ml_ptr + part * 2, m, mask=heads_ok)
            tl.store(partial_ml_ptr + part * 2 + 1, normalizer, mask=heads_ok)

    @triton.jit
    def _merge_splits_kernel(  # type: ignore[no-untyped-def]
        partial_acc_ptr,
        partial_ml_ptr,
        gate_ptr,
        out_ptr,
        stride_acc_split,
        stride_acc_token,
        stride_acc_head,
        stride_ml_split,
        stride_ml_token,
        stride_ml_head,
        stride_gate_token,
        stride_out_token,
        HEAD_DIM: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # One program per (token, query head): rescale each split's partial to the common max. The
        # partials are strided (dim and the (max, sum) pair contiguous), so a rank's heads sliced out
        # of the gathered decode-context-parallel partials merge in place, as the kernel's own splits.
        token = tl.program_id(0)
        head = tl.program_id(1)
        splits = tl.arange(0, BLOCK_S)
        splits_ok = splits < NUM_SPLITS
        split_at = splits.to(tl.int64)
        ml_at = split_at * stride_ml_split + token.to(tl.int64) * stride_ml_token + head * stride_ml_head
        m = tl.load(partial_ml_ptr + ml_at, mask=splits_ok, other=-1.0e30)
        normalizer = tl.load(partial_ml_ptr + ml_at + 1, mask=splits_ok, other=0.0)
        m_all = tl.max(m, axis=0)
        weight = tl.where(splits_ok, tl.exp2(m - m_all), 0.0)
        dims = tl.arange(0, BLOCK_D)
        acc_at = split_at * stride_acc_split + token.to(tl.int64) * stride_acc_token + head * stride_acc_head
        acc = tl.load(
            partial_acc_ptr + acc_at[:, None] + dims[None, :],
            mask=splits_ok[:, None] & (dims < HEAD_DIM)[None, :],
            other=0.0,
        )
        merged = tl.sum(acc * weight[:, None], axis=0)[None, :]
        total = tl.sum(normalizer * weight, axis=0) + tl.zeros([1], tl.float32)
        _gated_output(
            merged, total, gate_ptr + token * stride_gate_token, out_ptr + token * stride_out_token,
            tl.full([1], 1, tl.int1), head + tl.zeros([1], tl.int32), dims, HEAD_DIM,
        )  # fmt: skip


def _block(n: int, floor: int = 16) -> int:
    """A power-of-two tile of at least ``floor`` covering n (tl.arange and tl.dot need them)."""
    return max(floor, 1 << max(0, (n - 1).bit_length()))


# ---------------------------------------------------------------------------------------------
# 1. Cache writes
# ---------------------------------------------------------------------------------------------


def write_kv_torch(kv_cache: torch.Tensor, kv_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Reference of `write_kv` (a boolean mask: syncs on CUDA)."""
    block_size = kv_cache.shape[2]
    keep = kv_slots >= 0
    slots = kv_slots[keep]
    # Index the cache view itself: a reshaped copy of a strided view would drop the write.
    kv_cache[slots // block_size, :, slots % block_size] = torch.cat([k[keep], v[keep]], dim=-1).to(kv_cache.dtype)


def write_kv(
    kv_cache: torch.Tensor, kv_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str = "auto"
) -> None:
    """Store K and V ``[T, Hkv, D]`` of a step into ``kv_cache [NB, Hkv, BS, 2 * D]`` at
    ``kv_slots [T] int64`` (block * BS + row; < 0: skipped), cast to the cache dtype."""
    tokens, heads, dim = k.shape
    if v.shape != k.shape or kv_cache.shape[1] != heads or kv_cache.shape[3] != 2 * dim or kv_slots.shape != (tokens,):
        raise ValueError(
            f"write_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(kv_slots.shape)} do not fit the "
            f"cache {tuple(kv_cache.shape)} ([NB, Hkv, BS, 2 * D])"
        )
    if not use_triton(kv_cache, backend):
        write_kv_torch(kv_cache, kv_slots, k, v)
        return
    if tokens == 0:
        return
    _write_kv_kernel[(tokens, heads)](
        kv_cache, kv_slots.contiguous(), k, v, *kv_cache.stride(), *k.stride(), *v.stride(),
        BLOCK_SIZE=kv_cache.shape[2], HEAD_DIM=dim, BLOCK_D=_block(dim, 1),
    )  # fmt: skip


def write_rows_torch(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """Reference of `write_rows` (a boolean mask: syncs on CUDA)."""
    rows_per_block = cache.shape[2]
    keep = slots >= 0
    kept = slots[keep]
    cache[kept // rows_per_block, 0, kept % rows_per_block] = values[keep].to(cache.dtype)


def write_rows(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, *, backend: str = "auto") -> None:
    """Store ``values [T, F]`` into a one-head cache ``[NB, 1, rows, F]`` (the key cache or the
    ring) at ``slots [T] int64`` (block * rows + row; < 0: skipped), cast to the cache dtype."""
    tokens, features = values.shape
    if cache.shape[1] != 1 or cache.shape[3] != features or slots.shape != (tokens,):
        raise ValueError(
            f"write_rows: values {tuple(values.shape)}, slots {tuple(slots.shape)} do not fit the cache "
            f"{tuple(cache.shape)} ([NB, 1, rows, F])"
        )
    if not use_triton(cache, backend):
        write_rows_torch(cache, slots, values)
        return
    if tokens == 0:
        return
    _write_rows_kernel[(tokens,)](
        cache, slots.contiguous(), values, cache.stride(0), cache.stride(2), cache.stride(3), *values.stride(),
        ROWS_PER_BLOCK=cache.shape[2], FEATURES=features, BLOCK_F=_block(features, 1),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 2. Group keys
# ---------------------------------------------------------------------------------------------


def group_keys_torch(
    raw_keys: torch.Tensor,
    ring_cache: torch.Tensor,
    ring_block: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
    step_start: torch.Tensor,
    *,
    ratio: int,
    k_norm_weight: torch.Tensor,
    eps: float,
    rope_theta: float,
    rotary_dim: int,
    start_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Reference of `group_keys`: gathers ``[T, ratio, Di]`` members (tokens in chunks to bound it)
    and runs `ops.qsa.block_keys`' arithmetic on them. Any device, no host syncs."""
    tokens, dim = raw_keys.shape
    capacity = ring_cache.shape[2]
    device = raw_keys.device
    out = torch.empty_like(raw_keys)
    offsets = torch.arange(1 - ratio, 1, device=device)  # member q = p + offset, row t + offset
    step = _rows(tokens, ratio * dim * (raw_keys.element_size() + 4), REFERENCE_GATHER_BYTES)
    for begin in range(0, tokens, step):
        end = min(tokens, begin + step)
        req = token_req[begin:end].long()
        real = req >= 0
        req = req.clamp(min=0)
        pos = positions[begin:end].long()
        member = pos[:, None] + offsets  # [C, ratio] positions
        row = (torch.arange(begin, end, device=device)[:, None] + offsets).clamp(0, max(tokens - 1, 0))
        from_step = member >= step_start.long()[req][:, None]
        ring = ring_cache[ring_block.long()[req][:, None], 0, member % capacity]  # [C, ratio, Di]
        members = torch.where(from_step[..., None], raw_keys[row], ring)
        # Positions before 0 (tokens that close no group) and padding tokens: zeros, not whatever
        # the ring row holds (it may never have been written).
        members = members.masked_fill(~((member >= 0) & real[:, None])[..., None], 0)
        pooled = members.float().mean(dim=1).to(raw_keys.dtype)
        pooled = rms_norm(pooled, k_norm_weight, eps)
        if start_cos_sin is None:
            cos, sin = rotary_cos_sin((pos - (ratio - 1)).clamp(min=0), rotary_dim, rope_theta, raw_keys.dtype)
        else:
            cos, sin = start_cos_sin[0][begin:end], start_cos_sin[1][begin:end]
        out[begin:end] = apply_partial_rope(pooled.unsqueeze(1), cos, sin).squeeze(1)
    return out


@cache
def _inv_freq(theta: float, rotary_dim: int, device: torch.device) -> torch.Tensor:
    """RoPE's inverse frequencies exactly as `ops.common.rotary_cos_sin` computes them (fp32), made
    once per device. It must be made outside CUDA-graph capture (a capture records kernels without
    running them, so a tensor first made there would hold garbage in eager steps): `prepare`."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float, device=device) / rotary_dim
    return 1.0 / (theta**exponents)


def group_keys_triton(
    raw_keys: torch.Tensor,
    ring_cache: torch.Tensor,
    ring_block: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
    step_start: torch.Tensor,
    *,
    ratio: int,
    k_norm_weight: torch.Tensor,
    eps: float,
    rope_theta: float,
    rotary_dim: int,
) -> torch.Tensor:
    """`group_keys` through `_group_keys_kernel` (rows of tokens that close no group are zeros)."""
    tokens, dim = raw_keys.shape
    out = torch.empty_like(raw_keys)
    if tokens == 0:
        return out
    inv_freq = _inv_freq(float(rope_theta), rotary_dim, raw_keys.device)
    _group_keys_kernel[(tokens,)](
        raw_keys, ring_cache, ring_block, token_req.contiguous(), positions.contiguous(), step_start.contiguous(),
        k_norm_weight.contiguous(), inv_freq, out,
        *raw_keys.stride(), ring_cache.stride(0), ring_cache.stride(2), ring_cache.stride(3), ring_block.stride(0),
        out.stride(0), eps,
        RATIO=ratio, CAPACITY=ring_cache.shape[2], DIM=dim, ROTARY_DIM=rotary_dim, BLOCK_D=_block(dim, 1), num_warps=1,
    )  # fmt: skip
    return out


def group_keys(
    raw_keys: torch.Tensor,
    ring_cache: torch.Tensor,
    ring_block: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
    step_start: torch.Tensor,
    *,
    ratio: int,
    k_norm_weight: torch.Tensor,
    eps: float,
    rope_theta: float,
    rotary_dim: int,
    start_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """For every token, the compressed key of the group ending at it, as if it closed the group.

    raw_keys ``[T, Di]`` (this step's raw indexer keys), ring_cache ``[NBr, 1, cap, Di]``,
    ring_block ``[R] int32``, token_req ``[T] int32``, positions ``[T] int64``, step_start
    ``[R] int32``, k_norm_weight ``[Di]``. Returns ``[T, Di]`` in raw_keys.dtype: `ops.qsa.block_keys`
    of positions ``p - ratio + 1 .. p`` (fp32 mean rounded to the model dtype, RMS-normed with
    ``1 + w``, rotated at the group's first position, ``rotary_dim`` <= Di features). Member q is
    this step's row ``t - (p - q)`` when ``q >= step_start[req]``, else ring row ``q % cap`` (an
    earlier step wrote it): call this before the step's ring write. Rows of tokens that close a
    group (``(p + 1) % ratio == 0``) are the keys to store; other rows (and padding tokens) are
    finite but meaningless. No host syncs on either path; the Triton path computes cos/sin in the
    kernel from the same fp32 angles (libdevice cos/sin: within an fp32 ulp of torch's).

    ``start_cos_sin`` (cos, sin ``[T, rotary_dim]`` in raw_keys.dtype): the rotation of each
    token's group start, given by the caller instead of computed from ``p - ratio + 1`` (M-RoPE,
    whose positions are not the sequence index); it runs the torch path on every device.
    """
    dim = raw_keys.shape[1]
    if ring_cache.shape[1] != 1 or ring_cache.shape[3] != dim or ring_cache.shape[2] < ratio or rotary_dim > dim:
        raise ValueError(
            f"group_keys: ring {tuple(ring_cache.shape)} does not hold {ratio}-key groups of {dim} features "
            f"(rotary dim {rotary_dim})"
        )
    if start_cos_sin is not None:
        return group_keys_torch(
            raw_keys, ring_cache, ring_block, token_req, positions, step_start, ratio=ratio,
            k_norm_weight=k_norm_weight, eps=eps, rope_theta=rope_theta, rotary_dim=rotary_dim,
            start_cos_sin=start_cos_sin,
        )  # fmt: skip
    fn = group_keys_triton if use_triton(raw_keys, backend) else group_keys_torch
    return fn(
        raw_keys, ring_cache, ring_block, token_req, positions, step_start, ratio=ratio, k_norm_weight=k_norm_weight,
        eps=eps, rope_theta=rope_theta, rotary_dim=rotary_dim,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 3. Index top-k
# ---------------------------------------------------------------------------------------------


def index_scores_torch(
    index_q: torch.Tensor,
    key_cache: torch.Tensor,
    key_block_table: torch.Tensor,
    token_req: torch.Tensor,
    complete: torch.Tensor,
    *,
    topk: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Reference of the group scores: ``out [C, max_groups]`` fp32 gets ``sum_h relu(q_h . key_g)
    / sqrt(Di)`` for g < complete and -inf elsewhere; rows with ``complete <= topk`` (which select
    every complete group without scores) are all -inf."""
    rows, max_groups = out.shape
    dim = index_q.shape[-1]
    per_block = key_cache.shape[2]
    req = token_req.long().clamp(min=0)
    q = index_q.float()
    chunk = _rows(max_groups, rows * dim * (key_cache.element_size() + 4), REFERENCE_GATHER_BYTES)
    for begin in range(0, max_groups, chunk):
        groups = torch.arange(begin, min(max_groups, begin + chunk), device=out.device)
        blocks = _lookup(key_block_table, req[:, None], (groups // per_block)[None, :])  # [C, G]
        keys = key_cache[blocks, 0, (groups % per_block)[None, :]].float()  # [C, G, Di]
        scores = torch.relu(torch.einsum("chd,cgd->cgh", q, keys)).sum(-1) / math.sqrt(dim)
        scored = (groups[None, :] < complete[:, None]) & (complete[:, None] > topk)
        out[:, begin : begin + groups.shape[0]] = torch.where(scored, scores, -math.inf)
    return out


def prepare(device: torch.device, *, rope_theta: float, rotary_dim: int) -> None:
    """Make, eagerly, what the ops cache per device (the RoPE frequencies of `group_keys`, the
    compute capability): a model calls it when it is built, before any step can be captured."""
    if device.type == "cuda":
        _inv_freq(float(rope_theta), rotary_dim, device)
        _capability(device)


@cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


def score_split_parts(key_dtype: torch.dtype, capability: tuple[int, int]) -> int:
    """How `_index_scores_kernel` computes its dots on a device of this compute capability ((0, 0):
    CPU, the interpreter): 0 (fp32 FMA) for fp32 keys and below sm_80; else tensor cores with the
    queries split into 2 (fp16) or 3 (bf16) parts of the keys' dtype, fp32-accurate dots."""
    if key_dtype == torch.float32 or capability < (8, 0):
        return 0
    return 2 if key_dtype == torch.float16 else 3


def index_scores_triton(
    index_q: torch.Tensor,
    key_cache: torch.Tensor,
    key_block_table: torch.Tensor,
    token_req: torch.Tensor,
    complete: torch.Tensor,
    *,
    topk: int,
    out: torch.Tensor,
    split_parts: int | None = None,
) -> torch.Tensor:
    """`index_scores_torch` through `_index_scores_kernel` (which loads nothing for -inf tiles);
    ``split_parts`` None: `score_split_parts`."""
    rows, max_groups = out.shape
    if rows == 0 or max_groups == 0:
        return out
    heads, dim = index_q.shape[1:]
    if split_parts is None:
        split_parts = score_split_parts(key_cache.dtype, _capability(key_cache.device))
    block_g = 128 if split_parts else 64  # the faster tile of each form on the H200
    _index_scores_kernel[(rows, triton.cdiv(max_groups, block_g))](
        index_q, key_cache, key_block_table, token_req.contiguous(), complete.contiguous(), out, *index_q.stride(),
        key_cache.stride(0),
        key_cache.stride(2), key_cache.stride(3), *key_block_table.stride(), out.stride(0), max_groups,
        key_block_table.shape[1], math.sqrt(dim),
        TOPK=topk, NUM_HEADS=heads, HEAD_DIM=dim, ROWS_PER_BLOCK=key_cache.shape[2], BLOCK_G=block_g,
        BLOCK_H=_block(heads), BLOCK_D=_block(dim), SPLIT_PARTS=split_parts, num_warps=4,
    )  # fmt: skip
    return out


def select_groups_torch(scores: torch.Tensor, complete: torch.Tensor, topk: int) -> torch.Tensor:
    """Reference of the selection: ``[C, topk]`` int64, for each row with ``complete > topk`` the
    ``topk`` highest of its scores ``[C, G]`` (-inf past complete) in ascending group order;
    ``0 .. complete - 1`` then -1 for the others.

    It selects exactly as transformers' indexer does: ``torch.topk`` over exactly the row's
    complete groups (rows of equal length together), so on exact ties (several groups whose heads
    all score below zero, say) it picks the same groups as the oracle, and the CPU model
    reproduces transformers token for token. That needs each distinct length on the host: this is
    the CPU path (and the reference of the tests), where reading it costs nothing.
    """
    ranks = torch.arange(topk, device=scores.device)
    chosen = torch.where(ranks[None, :] < complete[:, None], ranks[None, :], -1)
    longer = complete > topk
    for length in torch.unique(complete[longer]).tolist():
        rows = (complete == length).nonzero().flatten()
        chosen[rows] = scores[rows, :length].topk(topk, dim=1).indices.sort(dim=1).values
    return chosen


def select_groups_lowest_torch(scores: torch.Tensor, complete: torch.Tensor, topk: int) -> torch.Tensor:
    """`select_groups_triton`'s reference: as `select_groups_torch`, except that ties at the topk-th
    score go to the lowest groups (a rule a kernel can follow without host reads)."""
    rows, groups = scores.shape
    device = scores.device
    threshold = scores.topk(topk, dim=1).values[:, -1:]  # the topk-th largest score
    above = scores > threshold
    tie = scores == threshold
    ties_taken = topk - above.sum(1, keepdim=True)
    take = above | (tie & (tie.cumsum(1) <= ties_taken))  # exactly topk per row
    rank = torch.where(take, take.cumsum(1) - 1, topk)  # column topk collects the others
    chosen = torch.full((rows, topk + 1), -1, dtype=torch.long, device=device)
    chosen.scatter_(1, rank, torch.arange(groups, device=device).expand(rows, groups))
    ranks = torch.arange(topk, device=device)
    all_groups = torch.where(ranks[None, :] < complete[:, None], ranks[None, :], -1)
    return torch.where(complete[:, None] > topk, chosen[:, :topk], all_groups)


# A row of up to this many scores is held in registers by `_select_groups_kernel`, which then finds
# the topk-th score itself (0.025 ms for one row of 8192 on the H200, against 0.067 ms for
# torch.topk and a sort); longer rows take it from torch.topk's values (bisecting over 8 chunks
# reloaded 32 times took 0.55 ms for one row of 65536, torch.topk 0.05 ms).
SELECT_IN_REGISTERS = 8192


def select_groups_triton(
    scores: torch.Tensor,
    complete: torch.Tensor,
    topk: int,
    out: torch.Tensor,
    block: int | None = None,
) -> torch.Tensor:
    """`select_groups_torch` through `_select_groups_kernel`, into ``out [C, topk] int32``. Rows of
    more than ``block`` (default `SELECT_IN_REGISTERS`) scores take the topk-th largest score from
    torch.topk (its value is unique, whichever tied groups torch.topk picks) and are read in chunks."""
    rows, groups = scores.shape
    if rows == 0:
        return out
    block = SELECT_IN_REGISTERS if block is None else block
    given = groups > block
    threshold = scores.topk(topk, dim=1, sorted=False).values.amin(dim=1) if given else scores  # else unread
    tile = block if given else _block(groups)
    _select_groups_kernel[(rows,)](
        scores, complete.contiguous(), threshold, out, scores.stride(0), out.stride(0),
        TOPK=topk, BLOCK=tile, BLOCK_K=_block(topk), GIVEN_THRESHOLD=given, num_warps=8 if tile >= 4096 else 4,
    )  # fmt: skip
    return out


def index_topk(
    index_q: torch.Tensor,
    key_cache: torch.Tensor,
    key_block_table: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
    *,
    ratio: int,
    topk: int,
    max_groups: int,
    backend: str = "auto",
    max_score_bytes: int = INDEX_SCORE_BYTES,
) -> torch.Tensor:
    """The complete groups each token attends to: ``selected [T, topk] int32``.

    index_q ``[T, Hi, Di]`` fp32 (normed, rotated: `ops.qsa.index_queries`), key_cache
    ``[NBk, 1, BS // ratio, Di]``, key_block_table ``[R, max_blocks] int32``, token_req ``[T]``,
    positions ``[T]``; ``topk`` = indexer_budget // ratio groups; ``max_groups`` a static bound on
    any token's complete groups (e.g. max_model_len // ratio; shapes depend on it, not on data).
    For a token at p, ``complete = (p + 1) // ratio``: if complete <= topk the row is
    ``0 .. complete - 1`` then -1; else the topk groups among 0..complete-1 with the highest
    ``sum_h relu(q_h . key_g) / sqrt(Di)`` (fp32, keys upcast), in ascending order: the groups of
    `ops.qsa.select_with_index_queries`. Padding tokens get -1 rows.

    Ties: groups scoring strictly above the topk-th score are always chosen. Among groups that tie
    exactly at it (e.g. several all-relu-zero groups) the torch path chooses as transformers does
    (`select_groups_torch`), the Triton path the lowest, so there the two may choose different
    groups of equal score.
    The Triton scores and torch's differ by rounding (summation order), so two groups within
    about an fp32 ulp of each other at the budget's edge may also be chosen differently.

    Memory: scores of at most ``max_score_bytes // (4 * max_groups)`` query rows at a time (the
    torch path also takes about 7x that in temporaries).
    """
    tokens = index_q.shape[0]
    device = index_q.device
    if index_q.shape[2] != key_cache.shape[3] or key_cache.shape[1] != 1:
        raise ValueError(f"index_topk: queries {tuple(index_q.shape)} do not fit key cache {tuple(key_cache.shape)}")
    complete = torch.where(token_req >= 0, (positions.long() + 1) // ratio, 0).clamp(max=max_groups)
    if max_groups <= topk or tokens == 0:  # every row selects all its complete groups
        ranks = torch.arange(topk, device=device)
        return torch.where(ranks[None, :] < complete[:, None], ranks[None, :], -1).to(torch.int32)
    triton_path = use_triton(index_q, backend)
    selected = torch.empty(tokens, topk, dtype=torch.int32, device=device)
    step = _rows(tokens, 4 * max_groups, max_score_bytes)
    scores = torch.empty(step, max_groups, dtype=torch.float32, device=device)
    for begin in range(0, tokens, step):
        end = min(tokens, begin + step)
        rows, row_complete = scores[: end - begin], complete[begin:end]
        args = (index_q[begin:end], key_cache, key_block_table, token_req[begin:end], row_complete)
        if triton_path:
            index_scores_triton(*args, topk=topk, out=rows)
            select_groups_triton(rows, row_complete, topk, selected[begin:end])
        else:
            index_scores_torch(*args, topk=topk, out=rows)
            selected[begin:end] = select_groups_torch(rows, row_complete, topk)
    return selected


# ---------------------------------------------------------------------------------------------
# 4. Sparse attention
# ---------------------------------------------------------------------------------------------


def key_positions(
    positions: torch.Tensor, token_req: torch.Tensor, selected: torch.Tensor | None, *, ratio: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key list of each token: (positions ``[T, width]`` int64, valid ``[T, width]`` bool).

    With ``selected``: slot j < n_sel * ratio (n_sel = min(complete, topk)) is position
    ``selected[t, j // ratio] * ratio + j % ratio`` (valid where that group is >= 0), then the open
    group ``complete * ratio .. p``; without: positions 0..p. Only the first n_sel entries of a
    selection row are read (`index_topk` puts its groups there). Padding tokens: nothing valid.
    """
    pos = positions.long()
    j = torch.arange(width, device=pos.device)[None, :]
    if selected is None:
        n_keys = pos + 1
        key_pos = j.expand(pos.shape[0], width)
        valid = j < n_keys[:, None]
    else:
        topk = selected.shape[1]
        complete = (pos + 1) // ratio
        n_sel = complete.clamp(max=topk)[:, None]
        n_keys = n_sel * ratio + (pos + 1 - complete * ratio)[:, None]
        in_selection = j < n_sel * ratio
        group = selected.long().gather(1, (j // ratio).clamp(max=topk - 1).expand(pos.shape[0], width))
        key_pos = torch.where(in_selection, group * ratio + j % ratio, complete[:, None] * ratio + j - n_sel * ratio)
        valid = (j < n_keys) & (group.ge(0) | ~in_selection)
    valid = valid & (key_pos >= 0) & (key_pos <= pos[:, None]) & (token_req >= 0)[:, None]
    return key_pos, valid


def sparse_attention_torch(
    q: torch.Tensor,
    gate: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_block_table: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
    selected: torch.Tensor | None,
    *,
    ratio: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of `sparse_attention`: gathers each token's keys (`key_positions`) in chunks of
    tokens. Dense (``selected=None``) reads the longest position back to size its gather (a sync)."""
    tokens, heads, dim = q.shape
    if out is None:
        out = torch.empty(tokens, heads * dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    for begin, end, qg, k, v, valid in _gathered_keys(q, kv_cache, kv_block_table, token_req, positions, selected,
                                                        ratio=ratio, shard=None):  # fmt: skip
        scores = torch.einsum("ckgd,clkd->ckgl", qg, k) * scale
        scores = scores.masked_fill(~valid[:, None, None, :], -math.inf)
        probs = torch.softmax(scores, dim=-1).masked_fill(~valid[:, None, None, :], 0.0)  # no NaN rows
        attended = torch.einsum("ckgl,clkd->ckgd", probs, v).to(q.dtype).flatten(1)
        out[begin:end] = attended * torch.sigmoid(gate[begin:end])
    return out


def _gathered_keys(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_block_table: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
    selected: torch.Tensor | None,
    *,
    ratio: int,
    shard: DcpShard | None,
) -> Any:
    """The torch references' key gather, in chunks of tokens: (begin, end, q ``[C, Hkv, G, D]``,
    K and V ``[C, L, Hkv, D]`` fp32, valid ``[C, L]``: the token's keys that this rank holds).
    Dense (``selected=None``) reads the longest position back to size the gather (a sync)."""
    tokens, heads, dim = q.shape
    kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[2]
    width = int(positions.max()) + 1 if selected is None else (selected.shape[1] + 1) * ratio
    step = _rows(tokens, width * kv_heads * 2 * dim * (kv_cache.element_size() + 4), REFERENCE_GATHER_BYTES)
    for begin in range(0, tokens, step):
        end = min(tokens, begin + step)
        req = token_req[begin:end]
        key_pos, valid = key_positions(
            positions[begin:end], req, None if selected is None else selected[begin:end], ratio=ratio, width=width
        )
        blocks, rows, local = kv_rows(key_pos, kv_block_table, req.long().clamp(min=0)[:, None], block_size, shard)
        if local is not None:
            valid = valid & local
        kv = kv_cache[blocks, :, rows].float()  # [C, L, Hkv, 2D]
        kv = kv.masked_fill(~valid[..., None, None], 0.0)  # unwritten rows may hold NaN
        qg = q[begin:end].float().unflatten(1, (kv_heads, heads // kv_heads))  # [C, Hkv, G, D]
        yield begin, end, qg, kv[..., :dim], kv[..., dim:], valid


# The floor of a partial's running maximum (log2 domain) where it saw no key, as the kernel keeps it.
NO_KEYS_MAX = -1.0e30


def sparse_attention_partials_torch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_block_table: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
    selected: torch.Tensor | None,
    *,
    ratio: int,
    scale: float,
    shard: DcpShard | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `sparse_attention_partials`."""
    tokens, heads, dim = q.shape
    acc = torch.zeros(1, tokens, heads, dim, dtype=torch.float32, device=q.device)
    ml = torch.zeros(1, tokens, heads, 2, dtype=torch.float32, device=q.device)
    ml[..., 0] = NO_KEYS_MAX
    if tokens == 0:
        return acc, ml
    for begin, end, qg, k, v, valid in _gathered_keys(q, kv_cache, kv_block_table, token_req, positions, selected,
                                                        ratio=ratio, shard=shard):  # fmt: skip
        scores = torch.einsum("ckgd,clkd->ckgl", qg, k) * (scale * math.log2(math.e))
        scores = scores.masked_fill(~valid[:, None, None, :], -math.inf)
        top = scores.amax(dim=-1).clamp(min=NO_KEYS_MAX)  # [C, Hkv, G]
        weights = torch.exp2(scores - top[..., None])  # masked keys: exactly 0
        acc[0, begin:end] = torch.einsum("ckgl,clkd->ckgd", weights, v).flatten(1, 2)
        ml[0, begin:end, :, 0] = top.flatten(1)
        ml[0, begin:end, :, 1] = weights.sum(dim=-1).flatten(1)
    return acc, ml


def merge_partials_torch(acc: torch.Tensor, ml: torch.Tensor, gate: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Reference of `merge_partials`."""
    tokens, heads, dim = acc.shape[1:]
    top = ml[..., 0].amax(dim=0)  # [T, H]
    weight = torch.exp2(ml[..., 0] - top)  # [S, T, H]
    merged = (acc * weight[..., None]).sum(dim=0)
    total = (ml[..., 1] * weight).sum(dim=0).clamp(min=1e-30)
    attended = (merged / total[..., None]).to(out.dtype).float()
    sigmoid = torch.sigmoid(gate.float().reshape(tokens, heads, dim)).to(out.dtype).float()
    out.copy_((attended * sigmoid).to(out.dtype).flatten(1))
    return out


@cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def attention_splits(tokens: int, kv_heads: int, max_keys: int | None, device: torch.device, block_n: int) -> int:
    """How many programs share one (token, KV head)'s keys: enough programs for two waves over
    the device's multiprocessors (decode of few requests), at most one tile of keys each and 64."""
    programs = max(1, tokens * kv_heads)
    wanted = -(-2 * _multiprocessors(device) // programs)
    tiles = 64 if max_keys is None else -(-max_keys // block_n)
    return max(1, min(wanted, tiles, 64))


def sparse_attention_triton(
    q: torch.Tensor,
    gate: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_block_table: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
    selected: torch.Tensor | None,
    *,
    ratio: int,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """`sparse_attention` through `_sparse_attention_kernel` (plus `_merge_splits_kernel` when a
    token's keys are split over several programs; ``num_splits`` None: `attention_splits`;
    ``block_n`` (keys per tile), ``num_warps``, ``num_stages``: launch tuning)."""
    tokens, heads, dim = q.shape
    kv_heads = kv_cache.shape[1]
    if out is None:
        out = torch.empty(tokens, heads * dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    topk = 0 if selected is None else selected.shape[1]
    gate = gate if gate.stride(1) == 1 else gate.contiguous()  # the kernel reads a token's gate row flat
    if num_splits is None:
        max_keys = None if selected is None else (topk + 1) * ratio
        num_splits = attention_splits(tokens, kv_heads, max_keys, q.device, 32)
    # Measured on the H200 (bf16, D 256, 12 heads per KV head): 64-key tiles where every program
    # walks a token's whole key list (many tokens), 32-key tiles without software pipelining
    # where the keys are split over programs (few tokens). Elsewhere 32 (64 takes 80 KiB of
    # shared memory at D 256 on sm_70, where a V100 has 96).
    if block_n is None:
        block_n = 64 if num_splits == 1 and _capability(q.device) >= (9, 0) else 32
    if num_stages is None and num_splits > 1:
        num_stages = 1
    if num_splits > 1:
        partial_acc = torch.empty(num_splits, tokens, heads, dim, dtype=torch.float32, device=q.device)
        partial_ml = torch.empty(num_splits, tokens, heads, 2, dtype=torch.float32, device=q.device)
    else:
        partial_acc = partial_ml = out  # never touched: NUM_SPLITS == 1 compiles their stores out
    # the kernel reads a token's selection row flat; any int tensor when TOPK == 0 (never read)
    sel = token_req if selected is None else selected.contiguous()
    block_d = _block(dim)
    _sparse_attention_kernel[(tokens, kv_heads, num_splits)](
        q, gate, kv_cache, kv_block_table, token_req.contiguous(), positions.contiguous(), sel, out, partial_acc,
        partial_ml,
        *q.stride(), gate.stride(0), *kv_cache.stride(), *kv_block_table.stride(),
        0 if selected is None else sel.stride(0), out.stride(0), tokens, kv_block_table.shape[1],
        scale * math.log2(math.e),
        RATIO=ratio, TOPK=topk, HEADS_PER_KV=heads // kv_heads, NUM_Q_HEADS=heads, HEAD_DIM=dim,
        BLOCK_SIZE=kv_cache.shape[2], BLOCK_H=_block(heads // kv_heads), BLOCK_D=block_d, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, FP32_DOT=q.dtype == torch.float32, num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )  # fmt: skip
    if num_splits > 1:
        merge_partials_triton(partial_acc, partial_ml, gate, out)
    return out


def sparse_attention_partials_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_block_table: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
    selected: torch.Tensor | None,
    *,
    ratio: int,
    scale: float,
    shard: DcpShard | None = None,
    num_splits: int | None = None,
    block_n: int = 32,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_attention_partials` through `_sparse_attention_kernel` (its split partials kept)."""
    tokens, heads, dim = q.shape
    kv_heads = kv_cache.shape[1]
    topk = 0 if selected is None else selected.shape[1]
    if num_splits is None:
        max_keys = None if selected is None else (topk + 1) * ratio
        num_splits = attention_splits(tokens, kv_heads, max_keys, q.device, block_n)
    acc = torch.empty(num_splits, tokens, heads, dim, dtype=torch.float32, device=q.device)
    ml = torch.empty(num_splits, tokens, heads, 2, dtype=torch.float32, device=q.device)
    if tokens == 0:
        return acc, ml
    shard = shard or DcpShard(1, 0)
    sel = token_req if selected is None else selected.contiguous()
    _sparse_attention_kernel[(tokens, kv_heads, num_splits)](
        q, q, kv_cache, kv_block_table, token_req.contiguous(), positions.contiguous(), sel, q, acc, ml,
        *q.stride(), 0, *kv_cache.stride(), *kv_block_table.stride(),
        0 if selected is None else sel.stride(0), 0, tokens, kv_block_table.shape[1], scale * math.log2(math.e),
        RATIO=ratio, TOPK=topk, HEADS_PER_KV=heads // kv_heads, NUM_Q_HEADS=heads, HEAD_DIM=dim,
        BLOCK_SIZE=kv_cache.shape[2], BLOCK_H=_block(heads // kv_heads), BLOCK_D=_block(dim), BLOCK_N=block_n,
        NUM_SPLITS=num_splits, FP32_DOT=q.dtype == torch.float32, PARTIAL=1, DCP_WORLD=shard.world,
        DCP_RANK=shard.rank, DCP_INTERLEAVE=shard.interleave, num_warps=num_warps,
        **({"num_stages": 1} if num_splits > 1 else {}),
    )  # fmt: skip
    return acc, ml


def merge_partials_triton(acc: torch.Tensor, ml: torch.Tensor, gate: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`merge_partials` in one launch (`_merge_splits_kernel`, which also merges the attention
    kernel's own splits). ``acc`` and ``ml`` may be strided views (a rank's heads of the gathered
    partials) as long as their last dim is contiguous."""
    splits, tokens, heads, dim = acc.shape
    if acc.stride(-1) != 1 or ml.stride(-1) != 1 or gate.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("merge_partials_triton: acc, ml, gate and out need a contiguous last dim")
    if tokens == 0:
        return out
    _merge_splits_kernel[(tokens, heads)](
        acc, ml, gate, out, *acc.stride()[:3], *ml.stride()[:3], gate.stride(0), out.stride(0),
        HEAD_DIM=dim, NUM_SPLITS=splits, BLOCK_S=_block(splits, 1), BLOCK_D=_block(dim), num_warps=4,
    )  # fmt: skip
    return out


def merge_partials(
    acc: torch.Tensor, ml: torch.Tensor, gate: torch.Tensor, out: torch.Tensor, *, backend: str = "auto"
) -> torch.Tensor:
    """The gated attention output ``out [T, H * D]`` from partials over disjoint shares of each
    token's keys (`sparse_attention_partials`: ``acc [S, T, H, D]`` unnormalised, ``ml [S, T, H, 2]``
    each share's log2-domain maximum and sum): rescaled to the common maximum and summed, divided,
    rounded to ``out``'s dtype and times ``sigmoid(gate)`` rounded likewise, as the unsplit kernel.
    A token no share saw (padding) gets zeros. One launch on CUDA (about a dozen torch ops took
    0.04 ms a QSA layer on the H100, 2026-12-05), torch elsewhere."""
    if acc.dim() != 4 or ml.shape != (*acc.shape[:3], 2) or out.shape != (acc.shape[1], acc.shape[2] * acc.shape[3]):
        raise ValueError(
            f"merge_partials: acc {tuple(acc.shape)}, ml {tuple(ml.shape)} and out {tuple(out.shape)} do not fit "
            "(acc [S, T, H, D], ml [S, T, H, 2], out [T, H * D])"
        )
    fn: Any = merge_partials_triton if use_triton(acc, backend) else merge_partials_torch
    result: torch.Tensor = fn(acc, ml, gate, out)
    return result


def sparse_attention_partials(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_block_table: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
    selected: torch.Tensor | None,
    *,
    ratio: int,
    scale: float,
    shard: DcpShard | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_attention` before its normalisation and gate, over the keys this rank holds: with
    decode context parallelism (``shard``) each rank of a group holds a share of every request's
    K/V positions; its partials over the group's query heads, gathered from every rank, give the
    attention through `merge_partials`. Returns ``acc [S, T, Hq, D]`` (unnormalised, fp32) and
    ``ml [S, T, Hq, 2]`` (the log2-domain maximum of each share's scores, `NO_KEYS_MAX` where it
    saw none, and the sum of their exp2 below it), S >= 1 shares of each token's keys (the
    kernel's splits). Arguments as `sparse_attention`'s."""
    _, heads, dim = q.shape
    kv_heads = kv_cache.shape[1]
    if kv_cache.shape[3] != 2 * dim or heads % kv_heads or q.dtype != kv_cache.dtype:
        raise ValueError(
            f"sparse_attention_partials: q {tuple(q.shape)} {q.dtype} and cache {tuple(kv_cache.shape)} "
            f"{kv_cache.dtype} do not fit (Hq a multiple of Hkv, cache [NB, Hkv, BS, 2 * D], one dtype)"
        )
    if shard is not None and not (shard.world >= 1 and 0 <= shard.rank < shard.world and shard.interleave >= 1):
        raise ValueError(f"sparse_attention_partials: {shard} is not a rank of a decode-context-parallel group")
    fn: Any = sparse_attention_partials_triton if use_triton(q, backend) else sparse_attention_partials_torch
    result: tuple[torch.Tensor, torch.Tensor] = fn(
        q, kv_cache, kv_block_table, token_req, positions, selected, ratio=ratio, scale=scale, shard=shard
    )
    return result


def sparse_attention(
    q: torch.Tensor,
    gate: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_block_table: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
    selected: torch.Tensor | None,
    *,
    ratio: int,
    scale: float,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Gated attention of every token of a step over its selected groups and its open group.

    q ``[T, Hq, D]`` (normed, rotated), gate ``[T, Hq * D]``, kv_cache ``[NB, Hkv, BS, 2 * D]``
    (the step's K/V already written), kv_block_table ``[R, max_blocks] int32``, token_req ``[T]``,
    positions ``[T]``, selected ``[T, topk] int32`` from `index_topk` (None: a layer without an
    indexer, dense causal over 0..p). The token at p attends to the positions of its selected
    groups (``g * ratio .. g * ratio + ratio - 1``; only the first min(complete, topk) entries are
    read, -1 entries skipped) and to its open group ``complete * ratio .. p``. Query head h reads KV
    head ``h // (Hq // Hkv)``. Scores and softmax in fp32; the result, rounded to q.dtype, times
    ``sigmoid(gate)``, as `ops.qsa.gated_attention`. Returns (or fills ``out``) ``[T, Hq * D]`` in
    q.dtype; padding tokens get zeros.

    The Triton path runs on any CUDA device Triton supports, in fp16, bf16 (sm_80+) and fp32: fp32
    dots are IEEE fp32 (no tf32); fp16/bf16 dots take the model-dtype q and K and, for P @ V, the
    probabilities rounded to the model dtype (as flash attention does: a few ulps of the format).
    """
    tokens, heads, dim = q.shape
    kv_heads = kv_cache.shape[1]
    if (
        kv_cache.shape[3] != 2 * dim
        or heads % kv_heads
        or gate.shape != (tokens, heads * dim)
        or q.dtype != kv_cache.dtype
        or (selected is not None and selected.shape[0] != tokens)
    ):
        raise ValueError(
            f"sparse_attention: q {tuple(q.shape)} {q.dtype}, gate {tuple(gate.shape)} and cache "
            f"{tuple(kv_cache.shape)} {kv_cache.dtype} do not fit (Hq a multiple of Hkv, cache [NB, Hkv, BS, 2 * D], "
            "one dtype)"
        )
    if out is not None and (out.shape != (tokens, heads * dim) or out.dtype != q.dtype or out.stride(1) != 1):
        raise ValueError(f"sparse_attention: out must be a row-contiguous [{tokens}, {heads * dim}] {q.dtype} tensor")
    fn: Any = sparse_attention_triton if use_triton(q, backend) else sparse_attention_torch
    result: torch.Tensor = fn(
        q, gate, kv_cache, kv_block_table, token_req, positions, selected, ratio=ratio, scale=scale, out=out
    )
    return result


__all__ = [
    "HAVE_TRITON",
    "NO_KEYS_MAX",
    "REFERENCE_ENV",
    "DcpShard",
    "SlotMappings",
    "attention_splits",
    "group_keys",
    "index_scores_torch",
    "index_scores_triton",
    "index_topk",
    "key_positions",
    "key_slots",
    "kv_rows",
    "kv_slots",
    "merge_partials",
    "merge_partials_torch",
    "merge_partials_triton",
    "prepare",
    "ring_slots",
    "slot_mappings",
    "sparse_attention",
    "sparse_attention_partials",
    "sparse_attention_partials_torch",
    "sparse_attention_partials_triton",
    "sparse_attention_torch",
    "sparse_attention_triton",
    "use_triton",
    "write_kv",
    "write_kv_torch",
    "write_rows",
    "write_rows_torch",
]
