"""FLASH_ATTN_V100: vLLM's attention-backend interface over `sm70_backend.kernels.attention`.

Registered by `register()` as a new member of vLLM's `AttentionBackendEnum`
(``register_backend("FLASH_ATTN_V100", ...)``); `--attention-backend FLASH_ATTN_V100` selects it
on any CUDA device of compute capability 7.0 or newer (the H200 tests run it), and the SM70
platform (`sm70_backend.platform`) selects it automatically on compute capability 7.x.

- fp16 only, KV cache "auto"/"float16", head sizes `SUPPORTED_HEAD_SIZES`, block sizes that are
  multiples of 16, decoder attention (causal or not: DFlash's non-causal drafting), sliding
  windows. Anything else is refused when the layer is built, naming the supported set.
- The metadata builder declares CUDA-graph support for uniform batches (decode, speculative
  verification): the kernel's grid depends only on the batch shape, its split workspace is
  allocated once, and nothing in `forward` reads a device value back to the host.
- The kernels are compiled (NVRTC) and loaded when the layer is built, not at the first request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from sm70_backend.kernels import attention as ops

BACKEND_NAME = "FLASH_ATTN_V100"
SUPPORTED_KV_CACHE_DTYPES = ("auto", "float16")


@dataclass
class FlashAttnV100Metadata(AttentionMetadata):
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool
    num_splits: int
    partials: tuple[torch.Tensor, torch.Tensor] | None


def _split_capacity(num_sms: int, num_q_heads: int, num_kv_heads: int) -> int:
    """Largest tokens x splits `choose_splits` can ask for (one request: fewest tiles, most splits)."""
    per_tile = ops.tokens_per_tile(num_q_heads, num_kv_heads)
    limit = 2 * num_sms * per_tile + 1
    return max(t * ops.choose_splits(t, 1, num_q_heads, num_kv_heads, num_sms) for t in range(1, limit + 1))


class FlashAttnV100MetadataBuilder(AttentionMetadataBuilder[FlashAttnV100Metadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        model_config = vllm_config.model_config
        parallel_config = vllm_config.parallel_config
        self.num_q_heads = model_config.get_num_attention_heads(parallel_config)
        self.num_kv_heads = model_config.get_num_kv_heads(parallel_config)
        self.head_size = model_config.get_head_size()
        ops.check_supported(
            self.head_size, kv_cache_spec.dtype, kv_cache_spec.block_size, self.num_q_heads, self.num_kv_heads
        )
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
        self.partial_o: torch.Tensor | None = None
        self.partial_ml: torch.Tensor | None = None
        self.split_capacity = 0
        if self.num_sms:
            # One workspace for every split batch, allocated now (CUDA graphs replay its addresses).
            self.split_capacity = _split_capacity(self.num_sms, self.num_q_heads, self.num_kv_heads)
            self.partial_o = torch.empty(
                self.split_capacity * self.num_q_heads * self.head_size, dtype=torch.float32, device=device
            )
            self.partial_ml = torch.empty(
                self.split_capacity * self.num_q_heads * 2, dtype=torch.float32, device=device
            )

    def splits_for(self, num_tokens: int, num_reqs: int) -> int:
        if not self.num_sms:
            return 1
        splits = ops.choose_splits(num_tokens, num_reqs, self.num_q_heads, self.num_kv_heads, self.num_sms)
        return max(1, min(splits, self.split_capacity // max(num_tokens, 1)))

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> FlashAttnV100Metadata:
        cm = common_attn_metadata
        causal = cm.causal
        if isinstance(causal, torch.Tensor):
            raise ValueError("FLASH_ATTN_V100 supports one causal flag per batch, not one per request")
        num_tokens = cm.num_actual_tokens
        splits = self.splits_for(num_tokens, cm.num_reqs)
        partials = None
        if splits > 1 and self.partial_o is not None and self.partial_ml is not None:
            partials = (
                self.partial_o[: num_tokens * self.num_q_heads * splits * self.head_size].view(
                    num_tokens, self.num_q_heads, splits, self.head_size
                ),
                self.partial_ml[: num_tokens * self.num_q_heads * splits * 2].view(
                    num_tokens, self.num_q_heads, splits, 2
                ),
            )
        return FlashAttnV100Metadata(
            num_actual_tokens=num_tokens,
            max_query_len=cm.max_query_len,
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            causal=bool(causal),
            num_splits=splits,
            partials=partials,
        )

    def update_draft_decode_metadata(self, metadata: FlashAttnV100Metadata) -> None:
        pass  # every field references the runner's persistent buffers


class FlashAttnV100Impl(AttentionImpl[FlashAttnV100Metadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        refusals = []
        if alibi_slopes is not None:
            refusals.append("ALiBi")
        if logits_soft_cap:
            refusals.append("logits soft cap")
        if sinks is not None:
            refusals.append("attention sinks")
        if attn_type != AttentionType.DECODER:
            refusals.append(f"attention type {attn_type} (supported: decoder)")
        if kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            refusals.append(f"KV cache dtype {kv_cache_dtype} (supported: {SUPPORTED_KV_CACHE_DTYPES})")
        if refusals:
            raise ValueError(f"{BACKEND_NAME} does not support {', '.join(refusals)}")
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        dtype = config.model_config.dtype if config is not None and config.model_config is not None else None
        ops.check_supported(
            head_size, dtype if isinstance(dtype, torch.dtype) else torch.float16, None, num_heads, self.num_kv_heads
        )
        # vLLM's sliding_window W: a token sees itself and the W - 1 before it.
        self.window_left = sliding_window - 1 if sliding_window else -1
        if torch.cuda.is_available():
            ops.prepare(torch.device("cuda", torch.cuda.current_device()), head_size)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttnV100Metadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{BACKEND_NAME} has no fused output quantization")
        if attn_metadata is None:  # the profiling run
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        ops.paged_attention(
            query[:n],
            kv_cache,
            attn_metadata.block_table,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            self.scale,
            causal=attn_metadata.causal,
            window_left=self.window_left,
            window_right=-1,
            out=output[:n],
            num_splits=attn_metadata.num_splits,
            partials=attn_metadata.partials,
        )
        return output

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        n = slot_mapping.shape[0]
        ops.write_kv(key[:n], value[:n], kv_cache, slot_mapping)


class FlashAttnV100Backend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = list(ops.SUPPORTED_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list[Any]] = list(SUPPORTED_KV_CACHE_DTYPES)
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[FlashAttnV100Impl]:
        return FlashAttnV100Impl

    @staticmethod
    def get_builder_cls() -> type[FlashAttnV100MetadataBuilder]:
        return FlashAttnV100MetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(ops.BLOCK_SIZE_MULTIPLE)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(ops.SUPPORTED_HEAD_SIZES)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        return (capability.major, capability.minor) >= (7, 0)

    @classmethod
    def validate_configuration(cls, **kwargs: Any) -> list[str]:  # type: ignore[override]
        """vLLM's reasons, with the supported set named for each refused value."""
        named = {
            "head_size not supported": f"head size {kwargs.get('head_size')} not supported "
            f"(supported: {', '.join(map(str, ops.SUPPORTED_HEAD_SIZES))})",
            "dtype not supported": f"dtype {kwargs.get('dtype')} not supported (supported: torch.float16)",
            "kv_cache_dtype not supported": f"KV cache dtype {kwargs.get('kv_cache_dtype')} not supported "
            f"(supported: {', '.join(SUPPORTED_KV_CACHE_DTYPES)})",
            "block_size not supported": f"block size {kwargs.get('block_size')} not supported "
            f"(supported: multiples of {ops.BLOCK_SIZE_MULTIPLE})",
            "compute capability not supported": f"compute capability {kwargs.get('device_capability')} not "
            "supported (supported: 7.0 and newer)",
        }
        return [named.get(reason, reason) for reason in super().validate_configuration(**kwargs)]
