"""The caches of the QSA (`indexed_attention`) layers inside vLLM.

Each `indexed_attention` layer registers three cache layers with vLLM's hybrid KV cache
manager, each in its own KV-cache group with its own block table:
- ``...kv``: K and V per token, paged (`FullAttentionSpec`);
- ``...kv.block_keys``: one compressed indexer key (mean-pooled, normed, rotated at the
  group's first position) per complete group of ``indexer_compress_ratio`` tokens, paged
  (`MLAAttentionSpec` with ``tokens_per_state = ratio``: a block of B tokens holds B / ratio
  keys and follows the K/V blocks through prefix caching and preemption);
- ``...kv.key_ring``: the raw indexer keys of the open (incomplete) group, in one ring of
  ``capacity`` rows per request (`CircularBufferSpec`; position p lives in row
  ``p % capacity``; not prefix-cached: a prefix-cache hit lands on a block boundary, a
  multiple of the ratio, where the open group is empty).
A step reads K/V, the complete groups' keys and the open group; it writes K/V, the keys of the
groups it closes (each computed once) and its raw keys into the ring.

The ring must divide the attention block size (vLLM's scheduler block size is the LCM of the
groups' block sizes). At model construction, before any weight is loaded:
`qwen38_plugin.ops.qsa.ring_capacity` (rule R38) widens the ring by whole groups up to 4x until it
divides an explicit ``--block-size`` (logged), or fails naming the block-size multiple to use;
without an explicit block size, the platform default (128 on CPU) is rounded up to a multiple of
the ring. vLLM then fits the block size to the mamba state pages by multiplying it, so the ring
still divides it.

A minimal attention backend only turns vLLM's common metadata into block tables and lengths;
the attention itself is `qwen38_plugin.ops.qsa`. Nothing here assumes one tensor-parallel rank:
the indexer key is one head that every rank holds whole, so every rank keeps the same ring and
block keys.

This module imports vLLM; it is loaded only when vLLM builds the model.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from vllm.config import CacheConfig, VllmConfig
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import AttentionBackend, AttentionMetadataBuilder, CommonAttentionMetadata
from vllm.v1.kv_cache_interface import CircularBufferSpec, FullAttentionSpec, KVCacheSpec, MLAAttentionSpec

from qwen38_plugin.ops import qsa

# A child of the "vllm" logger, so vLLM's own logging configuration prints it.
logger = logging.getLogger("vllm.plugins.qwen38_plugin")
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def model_dtype(vllm_config: VllmConfig) -> torch.dtype:
    dtype = vllm_config.model_config.dtype
    assert isinstance(dtype, torch.dtype), f"unresolved model dtype {dtype!r}"
    return dtype


# ---------------------------------------------------------------------------------------------
# Block size and ring capacity
# ---------------------------------------------------------------------------------------------


def default_block_size(block_size: int, base_capacity: int) -> int:
    """The block size to use when none was given: the platform default rounded up to a multiple
    of the base ring capacity (vLLM later multiplies it to fit the mamba state pages)."""
    return math.lcm(block_size, base_capacity)


def prepare_block_size(cache_config: CacheConfig, base_capacity: int) -> None:
    """Before vLLM aligns the block size (at model construction): without an explicit
    ``--block-size``, make the default a multiple of the ring."""
    if cache_config.user_specified_block_size:
        return
    block_size = cache_config.block_size
    chosen = default_block_size(block_size, base_capacity)
    if chosen != block_size:
        cache_config.block_size = chosen
        _log_once(
            f"qwen38_plugin: KV cache block size {chosen} (the default {block_size} rounded up to a multiple of "
            f"the {base_capacity}-token QSA key ring)"
        )


def resolve_ring_capacity(vllm_config: VllmConfig, ratio: int) -> int:
    """The ring capacity for the block size (rule R38); logs a widening."""
    spec_tokens = vllm_config.num_speculative_tokens
    block_size = vllm_config.cache_config.block_size
    base = qsa.ring_base_capacity(ratio, spec_tokens)
    capacity = qsa.ring_capacity(ratio, spec_tokens, block_size)
    if capacity != base:
        _log_once(
            f"qwen38_plugin: QSA key ring widened from {base} to {capacity} tokens (whole {ratio}-token groups) "
            f"so that it divides the attention block size {block_size}"
        )
    return capacity


# ---------------------------------------------------------------------------------------------
# A minimal attention backend that only prepares metadata
# ---------------------------------------------------------------------------------------------


@dataclass
class QSAMetadata:
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor  # [num_reqs, max_blocks]
    slot_mapping: torch.Tensor | None  # [num_actual_tokens]; None for the ring (it has none)
    num_actual_tokens: int

    def past_len(self, seq: int) -> int:
        return self.seq_lens[seq] - (self.query_start_loc[seq + 1] - self.query_start_loc[seq])


class QSAMetadataBuilder(AttentionMetadataBuilder[QSAMetadata]):
    def __init__(
        self, kv_cache_spec: KVCacheSpec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> QSAMetadata:
        m = common_attn_metadata
        num_reqs = m.num_reqs
        slot_mapping = m.slot_mapping[: m.num_actual_tokens] if self.kv_cache_spec.uses_slot_mapping else None
        return QSAMetadata(
            query_start_loc=m.query_start_loc_cpu[: num_reqs + 1].tolist(),
            seq_lens=m.seq_lens[:num_reqs].cpu().tolist(),
            block_table=m.block_table_tensor[:num_reqs],
            slot_mapping=slot_mapping,
            num_actual_tokens=m.num_actual_tokens,
        )


class QSANoImpl:
    """vLLM asks every backend for an impl class; the QSA layer computes attention itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("the portable QSA backend has no standalone attention impl")


class QSABackend(AttentionBackend):
    accept_output_buffer = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.float16, torch.bfloat16]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> Any:
        return QSANoImpl

    @staticmethod
    def get_builder_cls() -> type[QSAMetadataBuilder]:
        return QSAMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)


# ---------------------------------------------------------------------------------------------
# The cache layers
# ---------------------------------------------------------------------------------------------


class _CacheLayer(nn.Module, AttentionLayerBase):
    """A weightless layer vLLM allocates a cache for; found through the forward context.

    vLLM binds a ``[blocks, heads, rows, features]`` view in the spec's dtype.
    """

    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.dtype = model_dtype(vllm_config)
        self.kv_cache: torch.Tensor = torch.empty(0)
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    def get_attn_backend(self) -> type[AttentionBackend]:
        return QSABackend

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache.view(self.dtype)

    def rows_per_block(self) -> int:
        return int(self.kv_cache.shape[2])


class QSAKeyRing(_CacheLayer):
    """The raw indexer keys of each request's open group: row ``p % capacity`` of its one block."""

    def __init__(self, vllm_config: VllmConfig, prefix: str, index_dim: int, capacity: int) -> None:
        super().__init__(vllm_config, prefix)
        self.index_dim, self.capacity = index_dim, capacity

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        block_size = vllm_config.cache_config.block_size
        if block_size % self.capacity:
            raise qsa.RingCapacityError(
                f"QSA key ring: the attention block size became {block_size}, which the {self.capacity}-token ring "
                f"does not divide; use a --block-size that is a multiple of {self.capacity}"
            )
        return CircularBufferSpec(
            block_size=self.capacity, num_kv_heads=1, head_size=self.index_dim, head_size_v=0, dtype=self.dtype,
            dcp_sharded=False, max_tp_shards=1,  # every tensor-parallel rank holds the same ring
        )  # fmt: skip

    def read(self, meta: QSAMetadata, seq: int, start: int, end: int) -> torch.Tensor:
        """Raw keys ``[end - start, Di]`` of positions start..end-1 (at most one ring apart)."""
        positions = torch.arange(start, end)
        return self.kv_cache[meta.block_table[seq, 0].long(), 0, positions % self.rows_per_block()]

    def write(self, meta: QSAMetadata, seq: int, start: int, keys: torch.Tensor) -> None:
        """Store the raw keys ``[T, Di]`` of positions start..start+T-1; only the last ring's worth
        can be kept (and is all a later step reads)."""
        capacity = self.rows_per_block()
        keep = min(keys.shape[0], capacity)
        positions = torch.arange(start + keys.shape[0] - keep, start + keys.shape[0])
        self.kv_cache[meta.block_table[seq, 0].long(), 0, positions % capacity] = keys[keys.shape[0] - keep :]


class QSABlockKeyCache(_CacheLayer):
    """One compressed indexer key per complete group, paged like the K/V it summarises."""

    def __init__(self, vllm_config: VllmConfig, prefix: str, index_dim: int, ratio: int) -> None:
        super().__init__(vllm_config, prefix)
        self.index_dim, self.ratio = index_dim, ratio

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        block_size = vllm_config.cache_config.block_size
        if block_size % self.ratio:
            raise qsa.RingCapacityError(
                f"QSA block keys: the attention block size {block_size} is not a multiple of indexer_compress_ratio "
                f"{self.ratio}; use a --block-size that is a multiple of {self.ratio}"
            )
        return MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=self.index_dim, dtype=self.dtype,
            tokens_per_state=self.ratio, dcp_sharded=False, max_tp_shards=1,  # replicated over TP ranks
        )  # fmt: skip

    def _rows(self, meta: QSAMetadata, seq: int, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        per_block = self.rows_per_block()
        return meta.block_table[seq, groups // per_block].long(), groups % per_block

    def read(self, meta: QSAMetadata, seq: int, num_groups: int) -> torch.Tensor:
        """Keys ``[num_groups, Di]`` of groups 0..num_groups-1."""
        blocks, rows = self._rows(meta, seq, torch.arange(num_groups))
        return self.kv_cache[blocks, 0, rows]

    def write(self, meta: QSAMetadata, seq: int, first_group: int, keys: torch.Tensor) -> None:
        blocks, rows = self._rows(meta, seq, torch.arange(first_group, first_group + keys.shape[0]))
        self.kv_cache[blocks, 0, rows] = keys


class QSAKVCache(_CacheLayer):
    """The caches of one `indexed_attention` layer: K/V here (per token and KV head, K then V:
    ``2 * head_dim``), plus the indexer's `QSABlockKeyCache` and `QSAKeyRing` when it has one."""

    def __init__(self, vllm_config: VllmConfig, prefix: str, num_kv_heads: int) -> None:
        super().__init__(vllm_config, prefix)
        config = vllm_config.model_config.hf_text_config
        self.head_dim = config.head_dim
        self.num_kv_heads = num_kv_heads
        self.ring: QSAKeyRing | None = None
        self.block_keys: QSABlockKeyCache | None = None
        self.ratio = 0
        if config.indexer_budget is not None:
            self.ratio = ratio = config.indexer_compress_ratio
            prepare_block_size(
                vllm_config.cache_config, qsa.ring_base_capacity(ratio, vllm_config.num_speculative_tokens)
            )
            # Rule R38 at construction, before any weight is loaded: vLLM later only multiplies the
            # block size (to fit the mamba state pages), which a ring dividing it still divides.
            capacity = resolve_ring_capacity(vllm_config, ratio)
            self.block_keys = QSABlockKeyCache(vllm_config, f"{prefix}.block_keys", config.indexer_head_dim, ratio)
            self.ring = QSAKeyRing(vllm_config, f"{prefix}.key_ring", config.indexer_head_dim, capacity)

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            dtype=self.dtype,
        )

    def _slots(self, meta: QSAMetadata, seq: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(end)
        size = self.rows_per_block()
        return meta.block_table[seq, positions // size].long(), positions % size

    def past(
        self, metadata: dict[str, Any], seq: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, qsa.IndexerPast | None]:
        """What the caches hold of sequence ``seq`` before this step (see `StateStore.kv`)."""
        meta = metadata[self.prefix]
        past = meta.past_len(seq)
        if past == 0:
            return None, None, None
        blocks, rows = self._slots(meta, seq, past)
        kv = self.kv_cache[blocks, :, rows]  # [P, Hkv, 2D]
        d = self.head_dim
        indexer = None
        if self.ring is not None and self.block_keys is not None:
            complete = past // self.ratio
            indexer = qsa.IndexerPast(
                self.block_keys.read(metadata[self.block_keys.prefix], seq, complete),
                self.ring.read(metadata[self.ring.prefix], seq, complete * self.ratio, past),
            )
        return kv[..., :d], kv[..., d:], indexer

    def append(
        self, metadata: dict[str, Any], seq: int, k: torch.Tensor, v: torch.Tensor, indexer: qsa.IndexerStep | None
    ) -> None:
        """Store one step of sequence ``seq``: k, v ``[T, Hkv, D]`` and the indexer keys it adds."""
        meta = metadata[self.prefix]
        assert meta.slot_mapping is not None
        slots = meta.slot_mapping[meta.query_start_loc[seq] : meta.query_start_loc[seq + 1]].long()
        size = self.rows_per_block()
        # Index the cache itself: a reshaped copy of the strided view would silently drop the write.
        self.kv_cache[slots // size, :, slots % size] = torch.cat([k, v], dim=-1).to(self.dtype)
        if indexer is None or self.ring is None or self.block_keys is None:
            return
        start = meta.past_len(seq)
        ring_meta, keys_meta = metadata[self.ring.prefix], metadata[self.block_keys.prefix]
        self.ring.write(ring_meta, seq, start, indexer.raw_keys.to(self.dtype))
        if indexer.block_keys.shape[0]:
            self.block_keys.write(keys_meta, seq, start // self.ratio, indexer.block_keys.to(self.dtype))
