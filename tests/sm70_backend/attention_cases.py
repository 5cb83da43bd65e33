"""Random paged-attention batches for the FLASH_ATTN_V100 tests (CPU reference and CUDA kernels).

A batch: requests with a context already in the cache and ``q_len`` new tokens each (decode:
q_len 1; chunked prefill: a context and a chunk; prefill: no context), K/V written into a paged
cache through shuffled blocks, the cache in either of vLLM's physical layouts (NHD or HND,
same logical shape ``[num_blocks, num_kv_heads, block_size, 2 * D]``), unused blocks filled
with NaN so that a read outside a request's blocks shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    q: torch.Tensor  # [tokens, Hq, D]
    k: list[torch.Tensor]  # per request [seq_len, Hkv, D]
    v: list[torch.Tensor]
    kv_cache: torch.Tensor  # logical [num_blocks, Hkv, block_size, 2D]
    block_table: torch.Tensor  # [reqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [reqs + 1] int32
    seq_lens: torch.Tensor  # [reqs] int32
    slot_mapping: torch.Tensor  # [tokens] int64: the new tokens' slots
    scale: float

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.q.to(device),
            [x.to(device) for x in self.k],
            [x.to(device) for x in self.v],
            self.kv_cache.to(device),
            self.block_table.to(device),
            self.query_start_loc.to(device),
            self.seq_lens.to(device),
            self.slot_mapping.to(device),
            self.scale,
        )


def make_batch(
    q_lens: list[int],
    context_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float16,
    layout: str = "NHD",
    seed: int = 0,
    extra_blocks: int = 3,
) -> Batch:
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, q_lens, strict=True)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + extra_blocks
    order = torch.randperm(num_blocks, generator=g)
    shape = [num_blocks, block_size, num_kv_heads, 2 * head_size] if layout == "NHD" else None
    if layout == "NHD":
        storage = torch.full(shape, float("nan"), dtype=dtype)  # type: ignore[arg-type]
        kv_cache = storage.permute(0, 2, 1, 3)
    else:
        kv_cache = torch.full([num_blocks, num_kv_heads, block_size, 2 * head_size], float("nan"), dtype=dtype)
    max_blocks = max(blocks_per_req) + 1
    block_table = torch.zeros(len(q_lens), max_blocks, dtype=torch.int32)
    ks, vs, slots = [], [], []
    used = 0
    for r, seq_len in enumerate(seq_lens):
        ids = order[used : used + blocks_per_req[r]]
        used += blocks_per_req[r]
        block_table[r, : len(ids)] = ids.to(torch.int32)
        block_table[r, len(ids) :] = int(order[-1])  # past the request: a NaN block
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=g).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=g).to(dtype)
        positions = torch.arange(seq_len)
        req_slots = ids.to(torch.int64)[positions // block_size] * block_size + positions % block_size
        # the context is already in the cache; the new tokens' slots go to slot_mapping
        ctx = context_lens[r]
        b, o = req_slots[:ctx] // block_size, req_slots[:ctx] % block_size
        kv_cache[b, :, o, :head_size] = k[:ctx]
        kv_cache[b, :, o, head_size:] = v[:ctx]
        slots.append(req_slots[ctx:])
        ks.append(k)
        vs.append(v)
    q = torch.randn(sum(q_lens), num_q_heads, head_size, generator=g).to(dtype)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return Batch(
        q=q,
        k=ks,
        v=vs,
        kv_cache=kv_cache,
        block_table=block_table,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.cat(slots),
        scale=head_size**-0.5,
    )


def new_kv(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the batch's new tokens, [tokens, Hkv, D], in token order."""
    lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
    k = torch.cat([x[x.shape[0] - n :] for x, n in zip(batch.k, lens, strict=True)])
    v = torch.cat([x[x.shape[0] - n :] for x, n in zip(batch.v, lens, strict=True)])
    return k, v


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (NaN anywhere: inf)."""
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
