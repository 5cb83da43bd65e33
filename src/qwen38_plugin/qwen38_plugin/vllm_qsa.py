"""Qwen4Exp's QSA (`indexed_attention`) layer on vLLM's parallel linear layers and paged caches.

The projections are vLLM's (`QKVParallelLinear` for the gated query, key and value,
`RowParallelLinear` for the output, a `ReplicatedLinear` for the indexer, whose single key head
every tensor-parallel rank holds whole), so tensor parallelism, weight loading and quantization
are vLLM's. One step of every request runs as one batch through `ops.qsa_paged`:

1. per token: q/k RMSNorm and partial RoPE, the indexer's queries;
2. K/V written to the paged cache; each group a token completes gets its compressed key
   (pooled from this step's raw keys and the key ring) written to the paged block-key cache;
   the step's raw keys go to the ring;
3. the indexer scores every request's complete groups and keeps the top ``budget / ratio``;
4. sparse attention reads only those groups and the open group through the block table.

The per-step metadata (request of each token, slots, block tables) comes from
`vllm_qsa_cache.QSAMetadataBuilder`, built once per step on the device; nothing here reads a
tensor back to the host, so decode steps can be captured in CUDA graphs.

This module imports vLLM; it is loaded only when vLLM builds the model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear

from qwen38_plugin import vllm_ops
from qwen38_plugin.ops import qsa_paged
from qwen38_plugin.ops.common import apply_partial_rope, rms_norm
from qwen38_plugin.ops.norm_rope import rms_norm_rope
from qwen38_plugin.vllm_qsa_cache import QSAKVCache, QSAMetadata

# transformers' `Qwen4ExpTextRotaryEmbedding` falls back to this when rope_parameters has none.
DEFAULT_MROPE_SECTION = (11, 11, 10)


def mrope_axes(rotary_dim: int, mrope_section: tuple[int, ...] | list[int]) -> torch.Tensor:
    """Which position row (0: T, 1: H, 2: W) rotates each of the ``rotary_dim`` features, as
    transformers' `Qwen4ExpTextRotaryEmbedding.recomposition_frequencies` lays them out
    (interleaved: frequency i takes H when ``i % 3 == 1`` and ``i < 3 * section[1]``, W when
    ``i % 3 == 2`` and ``i < 3 * section[2]``, T otherwise; both rotate-half halves alike).
    transformers applies this layout whatever ``mrope_interleaved`` says; so does this model."""
    half = rotary_dim // 2
    axes = torch.zeros(half, dtype=torch.long)
    for axis, offset in ((1, 1), (2, 2)):
        axes[offset : int(mrope_section[axis]) * 3 : 3] = axis
    return torch.cat([axes, axes])


class RotaryTable(nn.Module):
    """cos / sin of every position up to the model's context, computed once exactly as
    `ops.common.rotary_cos_sin` computes them per call (fp32, rounded to the model dtype).

    Positions are ``[T]`` (text) or vLLM's M-RoPE positions ``[3, T]`` (T, H, W rows, for
    checkpoints whose ``rope_parameters`` carry ``mrope_section``): each feature then takes its
    row's value (`mrope_axes`), which for three equal rows is the ``[T]`` table's value, bit for
    bit. Only the default RoPE: the model refuses any other ``rope_type`` at startup."""

    @classmethod
    def from_config(cls, config: Any, max_positions: int, dtype: torch.dtype) -> RotaryTable:
        rope = config.rope_parameters or {}
        rotary_dim = int(config.head_dim * rope.get("partial_rotary_factor", 1.0))
        section = rope.get("mrope_section") or DEFAULT_MROPE_SECTION
        return cls(rotary_dim, rope["rope_theta"], max_positions, dtype, mrope_section=section)

    def __init__(
        self,
        rotary_dim: int,
        theta: float,
        max_positions: int,
        dtype: torch.dtype,
        mrope_section: tuple[int, ...] | list[int] = DEFAULT_MROPE_SECTION,
    ) -> None:
        super().__init__()
        from qwen38_plugin.ops.common import rotary_cos_sin

        if len(mrope_section) != 3:
            raise ValueError(f"rope_parameters.mrope_section must have 3 entries (T, H, W), got {mrope_section!r}")
        self.rotary_dim = rotary_dim
        self.mrope_section = tuple(int(s) for s in mrope_section)
        cos, sin = rotary_cos_sin(torch.arange(max_positions), rotary_dim, theta, dtype)
        axes = mrope_axes(rotary_dim, self.mrope_section)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.takes_h: torch.Tensor
        self.takes_w: torch.Tensor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("takes_h", axes == 1, persistent=False)
        self.register_buffer("takes_w", axes == 2, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, rotary_dim]`` at ``positions [T]`` or M-RoPE ``positions [3, T]``."""
        if positions.dim() == 1:
            return self.cos[positions], self.sin[positions]
        return self._select_axes(self.cos[positions]), self._select_axes(self.sin[positions])

    def _select_axes(self, table: torch.Tensor) -> torch.Tensor:
        """``[3, T, rotary_dim]`` -> ``[T, rotary_dim]``: each feature from its row (a selection, no arithmetic)."""
        return torch.where(self.takes_h, table[1], torch.where(self.takes_w, table[2], table[0]))

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x ``[T, heads, D]`` rotated at ``positions`` ``[T]`` or ``[3, T]`` (partial RoPE, rotate-half layout)."""
        return apply_partial_rope(x, *self.cos_sin(positions))


class GemmaNorm(nn.Module):
    """Qwen4Exp's RMSNorm (``x / rms(x) * (1 + weight)`` in fp32), one weight of ``size``."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class QSAIndexer(nn.Module):
    """The indexer's projection and norms (replicated over tensor-parallel ranks)."""

    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.indexer_n_heads, config.indexer_head_dim
        self.index_qk_proj = ReplicatedLinear(
            config.hidden_size, (self.num_heads + 1) * self.head_dim, bias=False, quant_config=None,
            prefix=f"{prefix}.index_qk_proj",
        )  # fmt: skip
        self.q_layernorm = GemmaNorm(self.head_dim, config.rms_norm_eps)
        self.k_layernorm = GemmaNorm(self.head_dim, config.rms_norm_eps)


def decode_context_shard(vllm_config: VllmConfig, num_kv_heads: int) -> qsa_paged.DcpShard | None:
    """This rank's share of the K/V positions under decode context parallelism (None without it).
    vLLM only allows it with more tensor-parallel ranks than KV heads, so each rank holds one KV
    head and its DCP group is the ranks that replicate it."""
    parallel = vllm_config.parallel_config
    world = parallel.decode_context_parallel_size
    if world == 1:
        return None
    if num_kv_heads != 1:
        raise ValueError(
            f"--decode-context-parallel-size {world}: each rank holds {num_kv_heads} KV heads of the QSA layers; "
            "decode context parallelism needs one (more tensor-parallel ranks than KV heads)"
        )
    from vllm.distributed.parallel_state import get_dcp_group

    from qwen38_plugin import cpu_context_parallel

    group = get_dcp_group()
    shard = qsa_paged.DcpShard(group.world_size, group.rank_in_group, parallel.cp_kv_cache_interleave_size)
    cpu_context_parallel.install(shard)  # vLLM's CPU slot mappings cannot split positions over ranks; these can
    return shard


StepTensors = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor,
    torch.Tensor,
]  # fmt: skip


def real_tokens(
    meta: QSAMetadata | None,
    q: torch.Tensor,
    gate: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index_q: torch.Tensor | None,
    raw_keys: torch.Tensor | None,
    positions: torch.Tensor,
    out: torch.Tensor,
) -> StepTensors | None:
    """A step's inputs cut to its real tokens: vLLM pads a step (to a CUDA-graph size) and the
    metadata covers the real ones; padding rows of ``out`` are zeroed. None (and ``out`` zeroed)
    in vLLM's profiling run, which has no metadata."""
    if meta is None:
        out.zero_()
        return None
    n = meta.num_tokens
    if q.shape[0] != n:
        out[n:].zero_()
        q, gate, k, v, positions, out = q[:n], gate[:n], k[:n], v[:n], positions[..., :n], out[:n]
        index_q = None if index_q is None else index_q[:n]
        raw_keys = None if raw_keys is None else raw_keys[:n]
    return q, gate, k, v, index_q, raw_keys, positions, out


class PortableQSAAttention(nn.Module):
    """One rank's query heads (and the KV heads they read) of a QSA layer."""

    def __init__(self, vllm_config: VllmConfig, config: Any, rotary: RotaryTable, prefix: str) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.config = config
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = max(1, config.num_key_value_heads // tp_size)
        self.scale = self.head_dim**-0.5
        quant_config = vllm_config.quant_config
        # The gate doubles each query head (D query then D gate features), so the gated query
        # is 2 * heads "heads" of D: vLLM splits them over ranks without separating a pair.
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, 2 * config.num_attention_heads, config.num_key_value_heads,
            bias=False, quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
        )  # fmt: skip
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=False, quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )  # fmt: skip
        self.q_norm = GemmaNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaNorm(self.head_dim, config.rms_norm_eps)
        self.indexer = QSAIndexer(config, f"{prefix}.indexer") if config.indexer_budget is not None else None
        self.ratio = int(config.indexer_compress_ratio or 1)
        self.topk = int(config.indexer_budget // self.ratio) if config.indexer_budget is not None else 0
        self.max_groups = max(1, vllm_config.model_config.max_model_len // self.ratio)
        # One table for every QSA layer of the model (it spans the whole context).
        self.rotary = rotary
        self.index_rotary_dim = rotary.rotary_dim
        # What the ops cache per device is made now, outside any CUDA-graph capture.
        qsa_paged.prepare(
            rotary.cos.device, rope_theta=config.rope_parameters["rope_theta"], rotary_dim=rotary.rotary_dim
        )
        self.dcp = decode_context_shard(vllm_config, self.num_kv_heads)
        # Not a submodule: it carries no weights; vLLM binds its caches through the forward context.
        self._cache = (self.make_cache(vllm_config, f"{prefix}.kv"),)
        # The custom op finds this layer (and through it the caches) by name.
        self.op_layer_name = vllm_ops.register_owner(vllm_config, prefix, self)

    def make_cache(self, vllm_config: VllmConfig, prefix: str) -> QSAKVCache:
        """The cache layers this attention registers with vLLM (an MTP draft layer registers fewer)."""
        return QSAKVCache(vllm_config, prefix, self.num_kv_heads)

    @property
    def cache(self) -> QSAKVCache:
        return self._cache[0]

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """``positions``: ``[T]``, or vLLM's M-RoPE positions ``[3, T]`` (the op then reads each
        token's index in its sequence from the step's metadata)."""
        d = self.head_dim
        qkv, _ = self.qkv_proj(hidden_states)
        q_gate, k, v = qkv.split([2 * self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, gate = q_gate.unflatten(-1, (self.num_heads, 2 * d)).split(d, dim=-1)
        cos, sin = self.rotary.cos_sin(positions)
        eps = self.config.rms_norm_eps
        q = rms_norm_rope(q, self.q_norm.weight, cos, sin, eps)
        k = rms_norm_rope(k.unflatten(-1, (self.num_kv_heads, d)), self.k_norm.weight, cos, sin, eps)
        v = v.unflatten(-1, (self.num_kv_heads, d))
        index_q: torch.Tensor | None = None
        raw_keys: torch.Tensor | None = None
        if self.indexer is not None:
            index_q, raw_keys = self._index_queries_and_keys(hidden_states, cos, sin)
        out = q.new_empty(hidden_states.shape[0], self.num_heads * d)
        torch.ops.vllm.qwen38_qsa_attention(
            q, gate.flatten(1), k, v, index_q, raw_keys, positions, out, self.op_layer_name
        )
        return self.o_proj(out)[0]

    def attend(
        self,
        q: torch.Tensor,
        gate: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index_q: torch.Tensor | None,
        raw_keys: torch.Tensor | None,
        positions: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """The stateful part of a step (`vllm_ops.qwen38_qsa_attention`): writes ``out [T, Hq * D]``.

        ``positions``: the rope positions the forward rotated with, ``[T]`` (then also each
        token's index in its sequence) or M-RoPE ``[3, T]`` (the indices come from the metadata)."""
        cache = self.cache
        meta: QSAMetadata | None = vllm_ops.step_metadata(cache.prefix)
        step = real_tokens(meta, q, gate, k, v, index_q, raw_keys, positions, out)
        if meta is None or step is None:
            return
        q, gate, k, v, index_q, raw_keys, positions, out = step
        n = meta.num_tokens
        mrope = positions.dim() == 2
        rope_positions = positions
        if mrope:
            positions = meta.positions[:n]
        qsa_paged.write_kv(cache.kv_cache, meta.slots, k, v)
        selected = None
        if self.indexer is not None:
            assert cache.block_keys is not None and cache.ring is not None
            assert index_q is not None and raw_keys is not None
            keys_meta: QSAMetadata = vllm_ops.step_metadata(cache.block_keys.prefix)
            ring_meta: QSAMetadata = vllm_ops.step_metadata(cache.ring.prefix)
            ring_block = ring_meta.block_table[:, 0]
            start_cos_sin = None
            if mrope:
                start_cos_sin = self.rotary.cos_sin(
                    self._group_start_rope_positions(rope_positions, positions, meta, ring_block)
                )
            # The groups this step completes: pooled from this step's raw keys and the ring
            # (read before this step's raw keys overwrite it).
            group_keys = qsa_paged.group_keys(
                raw_keys, cache.ring.keys, ring_block, meta.token_req, positions,
                meta.step_start, ratio=self.ratio, k_norm_weight=self.indexer.k_layernorm.weight,
                eps=self.config.rms_norm_eps, rope_theta=self.config.rope_parameters["rope_theta"],
                rotary_dim=self.index_rotary_dim, start_cos_sin=start_cos_sin,
            )  # fmt: skip
            qsa_paged.write_rows(cache.block_keys.kv_cache, keys_meta.slots, group_keys)
            qsa_paged.write_rows(cache.ring.keys, ring_meta.slots, raw_keys)
            ring_positions = cache.ring.rope_positions
            if mrope:
                if ring_positions is None:
                    raise RuntimeError(
                        "QSA: M-RoPE positions reached a layer whose key ring keeps no rope positions "
                        "(vLLM's model config does not report M-RoPE)"
                    )
                qsa_paged.write_rows(ring_positions, ring_meta.slots, rope_positions.t())
            selected = qsa_paged.index_topk(
                index_q, cache.block_keys.kv_cache, keys_meta.block_table, meta.token_req, positions,
                ratio=self.ratio, topk=self.topk, max_groups=self.max_groups,
            )  # fmt: skip
        if self.dcp is not None:
            self._attend_decode_context_parallel(q, gate, cache.kv_cache, meta, positions, selected, out)
            return
        qsa_paged.sparse_attention(
            q, gate, cache.kv_cache, meta.block_table, meta.token_req, positions, selected,
            ratio=self.ratio, scale=self.scale, out=out,
        )  # fmt: skip

    def _attend_decode_context_parallel(
        self,
        q: torch.Tensor,
        gate: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: QSAMetadata,
        positions: torch.Tensor,
        selected: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        """Attention when decode context parallelism splits each request's K/V positions over the
        ranks that share this rank's KV head (vLLM's DCP group; the indexer, its keys and so the
        selection are the same on every rank): every rank scores the group's query heads against
        the positions it holds, the partials are gathered, and each rank merges its own heads."""
        from vllm.distributed.parallel_state import get_dcp_group

        assert self.dcp is not None
        group = get_dcp_group()
        q_group = group.all_gather(q.contiguous(), dim=1)  # [T, world * Hq, D], rank by rank
        acc, ml = qsa_paged.sparse_attention_partials(
            q_group, kv_cache, meta.block_table, meta.token_req, positions, selected,
            ratio=self.ratio, scale=self.scale, shard=self.dcp,
        )  # fmt: skip
        # one gather for both: [world * S, T, world * Hq, D + 2]
        packed = group.all_gather(torch.cat([acc, ml], dim=-1), dim=0)
        mine = packed[:, :, self.dcp.rank * self.num_heads : (self.dcp.rank + 1) * self.num_heads]
        qsa_paged.merge_partials(mine[..., : self.head_dim], mine[..., self.head_dim :], gate, out)

    def _group_start_rope_positions(
        self, rope_positions: torch.Tensor, positions: torch.Tensor, meta: QSAMetadata, ring_block: torch.Tensor
    ) -> torch.Tensor:
        """``[3, T]``: the M-RoPE positions of the first token of the group ending at each token
        (p - ratio + 1): this step's row when the step holds it, else the ring's (an earlier step
        wrote it; read before this step's write). Rows of tokens that close no group are clamped
        into the table and never stored. Device ops only."""
        ring_positions = self.cache.ring.rope_positions if self.cache.ring is not None else None
        assert ring_positions is not None
        tokens = positions.shape[0]
        req = meta.token_req[:tokens].long().clamp(min=0)
        first = positions - (self.ratio - 1)
        rows = (torch.arange(tokens, device=positions.device) - (self.ratio - 1)).clamp(min=0)
        in_step = first >= meta.step_start.long()[req]
        capacity = ring_positions.shape[2]
        from_ring = ring_positions[ring_block.long()[req], 0, first.clamp(min=0) % capacity].t()  # [3, T]
        start = torch.where(in_step, rope_positions[:, rows], from_ring)
        return start.clamp(0, self.rotary.cos.shape[0] - 1)

    def _index_queries_and_keys(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, rotated fp32 index queries ``[T, Hi, Di]``, raw index keys ``[T, Di]``)."""
        indexer = self.indexer
        assert indexer is not None
        index_qk, _ = indexer.index_qk_proj(hidden_states)
        q, raw_keys = index_qk.split([indexer.num_heads * indexer.head_dim, indexer.head_dim], dim=-1)
        q = rms_norm_rope(
            q.unflatten(-1, (indexer.num_heads, indexer.head_dim)), indexer.q_layernorm.weight, cos, sin,
            self.config.rms_norm_eps,
        )  # fmt: skip
        return q.float(), raw_keys.contiguous()
