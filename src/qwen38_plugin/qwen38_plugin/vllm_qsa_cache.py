"""The paged cache of the QSA (`indexed_attention`) layers inside vLLM.

A minimal attention backend that only turns vLLM's common metadata into block tables and
lengths, and the cache layer each `indexed_attention` layer registers with vLLM's KV cache
manager. The attention itself is `qwen38_plugin.ops.qsa`.

This module imports vLLM; it is loaded only when vLLM builds the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import AttentionBackend, AttentionMetadataBuilder, CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec


def model_dtype(vllm_config: VllmConfig) -> torch.dtype:
    dtype = vllm_config.model_config.dtype
    assert isinstance(dtype, torch.dtype), f"unresolved model dtype {dtype!r}"
    return dtype


# ---------------------------------------------------------------------------------------------
# QSA KV cache: a minimal attention backend that only prepares metadata
# ---------------------------------------------------------------------------------------------


@dataclass
class QSAMetadata:
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor  # [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # [num_actual_tokens]
    num_actual_tokens: int


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
        return QSAMetadata(
            query_start_loc=m.query_start_loc_cpu[: num_reqs + 1].tolist(),
            seq_lens=m.seq_lens[:num_reqs].cpu().tolist(),
            block_table=m.block_table_tensor[:num_reqs],
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
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


class QSAKVCache(nn.Module, AttentionLayerBase):
    """The paged KV cache of one `indexed_attention` layer (no weights).

    Per token and KV head: K then V (``2 * head_dim``); ``index_heads`` extra heads carry the
    indexer's raw key in their K half (zero-padded), so one block table serves both.
    """

    def __init__(self, vllm_config: VllmConfig, prefix: str, num_kv_heads: int) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.prefix = prefix
        self.head_dim = config.head_dim
        self.num_kv_heads = num_kv_heads
        self.index_dim = config.indexer_head_dim if config.indexer_budget is not None else 0
        self.index_heads = math.ceil(self.index_dim / self.head_dim)
        self.dtype = model_dtype(vllm_config)
        self.kv_cache: torch.Tensor = torch.empty(0)
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    def get_attn_backend(self) -> type[AttentionBackend]:
        return QSABackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=self.num_kv_heads + self.index_heads,
            head_size=self.head_dim,
            dtype=self.dtype,
        )

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        # vLLM hands a [blocks, heads, block_size, bytes] int8 view; reinterpret its bytes.
        self.kv_cache = kv_cache.view(self.dtype)  # [blocks, heads, block_size, 2 * head_dim]

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """The cached rows ``[len(slots), heads, 2 * head_dim]`` of slots (block * block_size + offset)."""
        size = self.block_size()
        return self.kv_cache[slots // size, :, slots % size]

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        # Index the cache itself: a reshaped copy of the strided view would silently drop the write.
        size = self.block_size()
        self.kv_cache[slots // size, :, slots % size] = rows

    def block_size(self) -> int:
        return int(self.kv_cache.shape[2])
