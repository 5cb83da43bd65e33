"""A simulated serving run for `qwen38_plugin.ops.qsa_paged`: paged caches against per-sequence tensors.

`PagedRun` keeps what vLLM would: caches with shuffled block ids whose dim 0 is strided past one
page (a bigger tensor viewed through every other page), poisoned with NaN so that a read of a row
nobody wrote shows; block tables in the step's row order; padding tokens. `OracleRun` keeps each
sequence's tensors and runs `ops.qsa`'s ring form (`attend_ring` with `IndexerPast`). Both take the
same random per-token tensors step after step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from qwen38_plugin.ops import qsa, qsa_paged

EPS = 1e-6
ROPE_THETA = 10000.0


@dataclass(frozen=True)
class Geometry:
    heads: int
    kv_heads: int
    dim: int
    index_heads: int
    index_dim: int
    ratio: int
    topk: int  # groups: indexer_budget // ratio
    block_size: int
    ring_capacity: int
    rotary_dim: int
    max_len: int  # per request; max_groups = max_len // ratio

    @property
    def budget(self) -> int:
        return self.topk * self.ratio

    @property
    def max_groups(self) -> int:
        return self.max_len // self.ratio


@dataclass
class StepTokens:
    """One step's per-token inputs, the same on both sides (on the CPU)."""

    requests: list[int]  # request ids in row order
    counts: list[int]  # tokens per row
    starts: list[int]  # position of each row's first token
    q: torch.Tensor  # [N, Hq, D]
    gate: torch.Tensor  # [N, Hq * D]
    k: torch.Tensor  # [N, Hkv, D]
    v: torch.Tensor
    index_q: torch.Tensor  # [N, Hi, Di] fp32
    raw_keys: torch.Tensor  # [N, Di]


def random_step(
    geo: Geometry, requests: list[int], counts: list[int], starts: list[int], dtype: torch.dtype, gen: torch.Generator
) -> StepTokens:
    n = sum(counts)

    def r(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dt)

    return StepTokens(
        requests,
        counts,
        starts,
        r(n, geo.heads, geo.dim),
        r(n, geo.heads * geo.dim),
        r(n, geo.kv_heads, geo.dim),
        r(n, geo.kv_heads, geo.dim),
        r(n, geo.index_heads, geo.index_dim, dt=torch.float32),
        r(n, geo.index_dim),
    )


def strided_pages(pages: int, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> tuple[torch.Tensor, Any]:
    """A NaN-filled ``[pages, *shape]`` view whose dim 0 steps over two pages (vLLM interleaves
    other layers' pages), and the whole storage (to check that nothing else was written)."""
    storage = torch.full((pages, 2, *shape), float("nan"), dtype=dtype, device=device)
    return storage[:, 0], storage


@dataclass
class PagedRun:
    geo: Geometry
    num_requests: int
    dtype: torch.dtype
    device: str
    gen: torch.Generator
    k_norm_weight: torch.Tensor  # on the device
    backend: str = "torch"
    kv_cache: torch.Tensor = field(init=False)
    key_cache: torch.Tensor = field(init=False)
    ring_cache: torch.Tensor = field(init=False)
    storages: dict[str, torch.Tensor] = field(init=False)
    lengths: list[int] = field(init=False)

    def __post_init__(self) -> None:
        geo, n = self.geo, self.num_requests
        per_request = -(-geo.max_len // geo.block_size)
        # block 0 is the null block; the ids of every request are a shuffled draw of 1..
        self.kv_cache, kv_storage = strided_pages(
            1 + n * per_request + 3, (geo.kv_heads, geo.block_size, 2 * geo.dim), self.dtype, self.device
        )
        self.key_cache, key_storage = strided_pages(
            1 + n * per_request + 2, (1, geo.block_size // geo.ratio, geo.index_dim), self.dtype, self.device
        )
        self.ring_cache, ring_storage = strided_pages(
            1 + n + 1, (1, geo.ring_capacity, geo.index_dim), self.dtype, self.device
        )
        self.storages = {"kv": kv_storage, "key": key_storage, "ring": ring_storage}
        self.kv_table = (1 + torch.randperm(n * per_request + 3, generator=self.gen)[: n * per_request]).view(n, -1)
        self.key_table = (1 + torch.randperm(n * per_request + 2, generator=self.gen)[: n * per_request]).view(n, -1)
        self.ring_ids = 1 + torch.randperm(n + 1, generator=self.gen)[:n]
        self.lengths = [0] * n

    def step(self, tokens: StepTokens, padding: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer step of the ops for the step's tokens plus ``padding`` padding tokens.
        Returns (out ``[N, Hq * D]``, selected ``[N, topk]``) of the real tokens, on the CPU."""
        geo, dev, b = self.geo, self.device, self.backend
        rows = len(tokens.requests)
        ids = torch.tensor(tokens.requests)
        token_req = torch.cat(
            [torch.arange(rows).repeat_interleave(torch.tensor(tokens.counts)), torch.full((padding,), -1)]
        ).to(torch.int32)
        positions = torch.cat(
            [torch.arange(s, s + c) for s, c in zip(tokens.starts, tokens.counts, strict=True)]
            + [torch.zeros(padding, dtype=torch.long)]
        )
        seq_lens = torch.tensor([s + c for s, c in zip(tokens.starts, tokens.counts, strict=True)], dtype=torch.int32)
        step_start = torch.tensor(tokens.starts, dtype=torch.int32)

        def pad(x: torch.Tensor) -> torch.Tensor:  # padding tokens carry random finite values
            extra = torch.randn(padding, *x.shape[1:], generator=self.gen).to(x.dtype)
            return torch.cat([x, extra]).to(dev)

        token_req, positions, seq_lens, step_start = (t.to(dev) for t in (token_req, positions, seq_lens, step_start))
        kv_table = self.kv_table[ids].to(torch.int32).to(dev)
        key_table = self.key_table[ids].to(torch.int32).to(dev)
        ring_block = self.ring_ids[ids].to(torch.int32).to(dev)
        q, gate, k, v, index_q, raw_keys = (
            pad(x) for x in (tokens.q, tokens.gate, tokens.k, tokens.v, tokens.index_q, tokens.raw_keys)
        )
        slots = qsa_paged.slot_mappings(
            token_req,
            positions,
            seq_lens,
            kv_table,
            block_size=geo.block_size,
            key_block_table=key_table,
            ring_block=ring_block,
            ratio=geo.ratio,
            ring_capacity=geo.ring_capacity,
        )
        assert slots.key is not None and slots.ring is not None
        qsa_paged.write_kv(self.kv_cache, slots.kv, k, v, backend=b)
        keys = qsa_paged.group_keys(
            raw_keys,
            self.ring_cache,
            ring_block,
            token_req,
            positions,
            step_start,
            ratio=geo.ratio,
            k_norm_weight=self.k_norm_weight,
            eps=EPS,
            rope_theta=ROPE_THETA,
            rotary_dim=geo.rotary_dim,
        )
        qsa_paged.write_rows(self.key_cache, slots.key, keys, backend=b)
        qsa_paged.write_rows(self.ring_cache, slots.ring, raw_keys, backend=b)
        selected = qsa_paged.index_topk(
            index_q,
            self.key_cache,
            key_table,
            token_req,
            positions,
            ratio=geo.ratio,
            topk=geo.topk,
            max_groups=geo.max_groups,
            backend=b,
        )
        out = qsa_paged.sparse_attention(
            q,
            gate,
            self.kv_cache,
            kv_table,
            token_req,
            positions,
            selected,
            ratio=geo.ratio,
            scale=geo.dim**-0.5,
            backend=b,
        )
        for r, c in zip(tokens.requests, tokens.counts, strict=True):
            self.lengths[r] += c
        n = sum(tokens.counts)
        assert torch.isfinite(out).all(), "padding or masked rows produced non-finite outputs"
        return out[:n].cpu(), selected[:n].cpu()


@dataclass
class OracleRun:
    """Per-sequence tensors and `ops.qsa`'s ring form, on the CPU."""

    geo: Geometry
    num_requests: int
    k_norm_weight: torch.Tensor
    k: list[torch.Tensor | None] = field(init=False)
    v: list[torch.Tensor | None] = field(init=False)
    indexer: list[qsa.IndexerPast | None] = field(init=False)
    raw: list[list[torch.Tensor]] = field(init=False)

    def __post_init__(self) -> None:
        n = self.num_requests
        self.k, self.v, self.indexer, self.raw = [None] * n, [None] * n, [None] * n, [[] for _ in range(n)]

    def step(self, tokens: StepTokens) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(out ``[n, Hq * D]``, mask ``[n, seq_len]``) of each row's tokens."""
        geo = self.geo
        prepared = qsa.PreparedTokens(tokens.q, tokens.gate, tokens.k, tokens.v, tokens.index_q, tokens.raw_keys)
        outs, masks = [], []
        first = 0
        for r, count, start in zip(tokens.requests, tokens.counts, tokens.starts, strict=True):
            rows = prepared.rows(slice(first, first + count))
            first += count
            positions = torch.arange(start, start + count)
            past = self.indexer[r]
            out, k_new, v_new, step = qsa.attend_ring(
                rows,
                positions,
                index_k_norm_weight=self.k_norm_weight,
                rotary_dim=geo.rotary_dim,
                rope_theta=ROPE_THETA,
                eps=EPS,
                budget=geo.budget,
                ratio=geo.ratio,
                past_k=self.k[r],
                past_v=self.v[r],
                past_indexer=past,
            )
            assert step is not None and rows.index_q is not None
            keys = step.block_keys if past is None else torch.cat([past.block_keys, step.block_keys])
            mask = qsa.select_with_index_queries(
                rows.index_q, keys, start + count, positions, budget=geo.budget, ratio=geo.ratio
            )
            masks.append(mask)
            outs.append(out)
            old_k, old_v = self.k[r], self.v[r]
            self.k[r] = k_new if old_k is None else torch.cat([old_k, k_new])
            self.v[r] = v_new if old_v is None else torch.cat([old_v, v_new])
            self.indexer[r] = qsa.IndexerPast(keys, step.open_keys)
            self.raw[r].append(step.raw_keys)
        return outs, masks


def selection_mask(selected: torch.Tensor, positions: torch.Tensor, ratio: int, num_keys: int) -> torch.Tensor:
    """The token mask ``[n, num_keys]`` that a row of `index_topk` plus the open group mean."""
    mask = torch.zeros(selected.shape[0], num_keys, dtype=torch.bool)
    for i, (row, p) in enumerate(zip(selected.tolist(), positions.tolist(), strict=True)):
        complete = (p + 1) // ratio
        mask[i, complete * ratio : p + 1] = True
        for g in row:
            if g >= 0:
                mask[i, g * ratio : (g + 1) * ratio] = True
    return mask


def expected_storages(paged: PagedRun, oracle: OracleRun, initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The caches' storages as they must be: the initial ones with each request's rows written
    from the oracle's tensors, through the same block ids, and nothing else."""
    geo = paged.geo
    out = {name: t.clone() for name, t in initial.items()}
    kv, key, ring = out["kv"][:, 0], out["key"][:, 0], out["ring"][:, 0]
    for r in range(paged.num_requests):
        k, v, indexer = oracle.k[r], oracle.v[r], oracle.indexer[r]
        if k is None or v is None or indexer is None:
            continue
        length = k.shape[0]
        pos = torch.arange(length)
        kv[paged.kv_table[r, pos // geo.block_size], :, pos % geo.block_size] = torch.cat([k, v], -1).to(kv.dtype)
        groups = torch.arange(indexer.block_keys.shape[0])
        per_block = geo.block_size // geo.ratio
        key[paged.key_table[r, groups // per_block], 0, groups % per_block] = indexer.block_keys.to(key.dtype)
        raw = torch.cat(oracle.raw[r])
        kept = pos[max(0, length - geo.ring_capacity) :]
        ring[paged.ring_ids[r], 0, kept % geo.ring_capacity] = raw[kept].to(ring.dtype)
    return out
