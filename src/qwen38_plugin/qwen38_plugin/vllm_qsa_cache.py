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
still divides it. Where vLLM puts a platform default back later (a V1 proposer building its
drafter's config does), the ring is fitted again when its cache spec is taken.

A minimal attention backend only turns vLLM's common metadata into block tables and lengths;
the attention itself is `qwen38_plugin.ops.qsa`. Nothing here assumes one tensor-parallel rank:
the indexer key is one head that every rank holds whole, so every rank keeps the same ring and
block keys.

This module imports vLLM; it is loaded only when vLLM builds the model.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from vllm.config import CacheConfig, VllmConfig
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import CircularBufferSpec, FullAttentionSpec, KVCacheSpec, MLAAttentionSpec

from qwen38_plugin.ops import qsa, qsa_step_metadata
from qwen38_plugin.ops.qsa_step_metadata import CacheKind

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
# The attention backend: per-step metadata, built once per step on the device
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QSAStepInputs:
    """The vLLM device tensors a step's `QSAMetadata` was computed from. In a V2 speculator's draft
    decode steps they are views of its persistent buffers, which it advances in place between
    steps (sequence lengths, slot mappings), so the metadata can be recomputed from them."""

    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32, after the step
    block_table: torch.Tensor  # [R, max_blocks] int32
    slot_mapping: torch.Tensor | None  # [T] int64, the K/V group's only


@dataclass
class QSAMetadata:
    """One QSA cache group's view of a step. Device tensors in persistent buffers (the same
    addresses every step, so a captured CUDA graph replays with the step's values).

    Rows ``T`` are the step's tokens, CUDA-graph padding included; rows ``R`` its requests
    (padding requests have no tokens).
    """

    num_tokens: int
    token_req: torch.Tensor  # [T] int32: request row of each token, -1 for padding tokens
    step_start: torch.Tensor  # [R] int32: position of each request's first token of the step
    block_table: torch.Tensor  # [R, max_blocks] int32: this cache's blocks
    slots: torch.Tensor  # [T] int64: where each token writes in this cache, -1 = no write
    positions: torch.Tensor  # [T] int64: each token's index in its sequence (M-RoPE positions are not)
    inputs: QSAStepInputs | None = None  # what `QSAMetadataBuilder.build` computed it from


class QSAMetadataBuilder(AttentionMetadataBuilder[QSAMetadata]):
    """Turns vLLM's common metadata into `QSAMetadata` for one of the three QSA caches.

    Everything is computed with device ops from vLLM's device tensors (no host reads of
    per-request values), written into buffers allocated once, so decode steps can be captured
    in CUDA graphs (`AttentionCGSupport.UNIFORM_BATCH`, as vLLM's GDN builder: the GDN layers
    of the same model set that bound anyway).
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    reorder_batch_threshold: int | None = 1  # decodes first, as vLLM's GDN builder orders them

    def __init__(
        self, kv_cache_spec: KVCacheSpec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.kind = cache_kind(kv_cache_spec)
        # With it, vLLM's V2 speculators (MTP) record `update_draft_decode_metadata` inside one CUDA
        # graph for all draft steps after the first, instead of building each step's metadata eagerly
        # and launching a graph per step. The V1 runner (CPU) does not use it. `DRAFT_UPDATE_ENV`=0
        # turns it off, to compare the two on a GPU.
        self.supports_draft_decode_metadata_update = draft_update_enabled()
        config = vllm_config.model_config.hf_text_config
        self.ratio = int(config.indexer_compress_ratio or 1)
        scheduler = vllm_config.scheduler_config
        spec_tokens = vllm_config.num_speculative_tokens
        max_tokens = max(scheduler.max_num_batched_tokens, scheduler.max_num_seqs * (1 + spec_tokens))
        max_reqs = self._max_reqs = scheduler.max_num_seqs
        self._token_req = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self._step_start = torch.zeros(max_reqs, dtype=torch.int32, device=device)
        self._slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self._positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> QSAMetadata:
        m = common_attn_metadata
        num_tokens, num_reqs = m.num_actual_tokens, m.num_reqs
        inputs = QSAStepInputs(
            m.query_start_loc[: num_reqs + 1], m.seq_lens[:num_reqs], m.block_table_tensor[:num_reqs],
            m.slot_mapping if self.kind is CacheKind.KV else None,
        )  # fmt: skip
        self._compute(inputs, num_tokens)
        return QSAMetadata(
            num_tokens, self._token_req[:num_tokens], self._step_start[:num_reqs], inputs.block_table,
            self._slots[:num_tokens], self._positions[:num_tokens], inputs,
        )  # fmt: skip

    def update_draft_decode_metadata(self, metadata: QSAMetadata) -> None:
        """Recompute ``metadata`` in place from its inputs' current values (a V2 speculator advanced
        them for the next draft step): the same kernel as `build`, into the same buffers, with no
        host reads, so it can run inside a CUDA graph capture."""
        if metadata.inputs is None:
            raise ValueError("QSA metadata built outside QSAMetadataBuilder.build has no inputs to recompute from")
        self._compute(metadata.inputs, metadata.num_tokens)

    def _compute(self, inputs: QSAStepInputs, num_tokens: int) -> None:
        # One kernel on CUDA (every step, outside the CUDA graph; inside a speculator's draft-step graph
        # too); the torch reference elsewhere.
        qsa_step_metadata.step_metadata(
            self.kind, inputs.query_start_loc, inputs.seq_lens, inputs.block_table, inputs.slot_mapping, num_tokens,
            block_size=self.kv_cache_spec.block_size, ratio=self.ratio, token_req=self._token_req,
            step_start=self._step_start, positions=self._positions, slots=self._slots, max_reqs=self._max_reqs,
        )  # fmt: skip


DRAFT_UPDATE_ENV = "QWEN38_QSA_DRAFT_UPDATE"


def draft_update_enabled() -> bool:
    """``QWEN38_QSA_DRAFT_UPDATE``: 1 (the default) lets V2 speculators update the QSA metadata of
    draft steps in place; 0 makes them build it for every step."""
    value = os.environ.get(DRAFT_UPDATE_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{DRAFT_UPDATE_ENV}={value!r}: set it to 1 (the default) or 0")
    return value == "1"


def cache_kind(spec: KVCacheSpec) -> CacheKind:
    if isinstance(spec, CircularBufferSpec):
        return CacheKind.KEY_RING
    if isinstance(spec, MLAAttentionSpec):
        return CacheKind.BLOCK_KEYS
    return CacheKind.KV


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

    vLLM binds a ``[blocks, heads, rows, features]`` view in the spec's dtype (dim 0 may be
    strided: other layers' pages can sit between two blocks).
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


class QSAKeyRing(_CacheLayer):
    """The raw indexer keys of each request's most recent positions: row ``p % capacity`` of its one block.

    With M-RoPE (``rope_positions``) each row also holds its token's (T, H, W) rope positions,
    three int64 after the key (from an 8-byte aligned column): a group's compressed key is
    rotated at its first token's positions, which an earlier step may have seen (stock's raw key
    cache stores them the same way)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        prefix: str,
        index_dim: int,
        capacity: int,
        ratio: int,
        rope_positions: bool = False,
    ) -> None:
        super().__init__(vllm_config, prefix)
        self.index_dim, self.capacity, self.ratio = index_dim, capacity, ratio
        per_int64 = max(1, 8 // self.dtype.itemsize)
        self.rope_position_offset = -(-index_dim // per_int64) * per_int64 if rope_positions else None
        self.row_size = index_dim if self.rope_position_offset is None else self.rope_position_offset + 3 * per_int64

    @property
    def keys(self) -> torch.Tensor:
        """``[NB, 1, capacity, index_dim]``: the raw keys (a view of the bound cache)."""
        return self.kv_cache[..., : self.index_dim]

    @property
    def rope_positions(self) -> torch.Tensor | None:
        """``[NB, 1, capacity, 3]`` int64: each row's rope positions (a view), None without M-RoPE."""
        if self.rope_position_offset is None:
            return None
        return self.kv_cache[..., self.rope_position_offset :].view(torch.int64)

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        block_size = vllm_config.cache_config.block_size
        if block_size % self.capacity:
            # The block size changed after the model was built: building a drafter's config (vLLM's
            # V1 proposers replace the VllmConfig, whose check runs again on the shared cache config)
            # puts a platform default back, e.g. the CPU's 128 where this plugin had rounded it up to
            # 384 for a 12-token ring. The ring is only sized here, so it is fitted again (rule R38:
            # whole groups, at most 4x), or the error names the --block-size multiple to use.
            capacity = resolve_ring_capacity(vllm_config, self.ratio)
            _log_once(
                f"qwen38_plugin: QSA key ring fitted again, {self.capacity} -> {capacity} tokens: the attention "
                f"block size became {block_size} after the model was built"
            )
            self.capacity = capacity
        return CircularBufferSpec(
            block_size=self.capacity, num_kv_heads=1, head_size=self.row_size, head_size_v=0, dtype=self.dtype,
            dcp_sharded=False, max_tp_shards=1,  # every tensor-parallel rank holds the same ring
        )  # fmt: skip


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
        # Replicated over decode-context-parallel ranks. With a DFlash drafter, at one DCP rank
        # (where replicated and sharded are the same layout) they say sharded, as the K/V's spec
        # does: else vLLM's KV-layout resolver takes the drafter's K/V pages (another size) for a
        # replicated draft beside a DCP-sharded target and asks for a block-outer layout the CPU
        # backend lacks. Only then: vLLM groups sharded block keys so that prefix-cache hits stop
        # (seen on CPU), and the dispatcher refuses DFlash with prefix caching.
        spec = vllm_config.speculative_config
        dflash = spec is not None and spec.method == "dflash"
        dcp_sharded = dflash and vllm_config.parallel_config.decode_context_parallel_size == 1
        return MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=self.index_dim, dtype=self.dtype,
            tokens_per_state=self.ratio, dcp_sharded=dcp_sharded, max_tp_shards=1,  # replicated over TP ranks
        )  # fmt: skip


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
            self.ring = QSAKeyRing(
                vllm_config, f"{prefix}.key_ring", config.indexer_head_dim, capacity, ratio,
                rope_positions=vllm_config.model_config.uses_mrope,
            )  # fmt: skip

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            dtype=self.dtype,
        )
