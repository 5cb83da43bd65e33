"""Qwen4Exp's Gated DeltaNet layers on vLLM's own GDN layer, for every dtype and platform.

vLLM's `QwenGatedDeltaNetAttention` already is the layer we need on CUDA: its projections are
vLLM's parallel linear layers (tensor parallelism, weight loading, quantization), its core runs
vLLM's Triton kernels (causal conv1d and the gated delta rule of flash-linear-attention, varlen
prefill through ``cu_seqlens``, decode updating the state slots in place through the state
indices of vLLM's GDN metadata, CUDA-graph capable) and it handles speculative decoding. What
this subclass changes:

- **CPU, any dtype.** Stock's CPU op asserts bfloat16; ours runs `ops.gdn_varlen` (plain torch,
  fp32 / fp16 / bf16, all requests of a step batched) and our gated RMSNorm, which rounds where
  transformers rounds. Verify rows of speculative decoding take vLLM's layout (a state slot per
  draft position, the wide conv buffer; `gdn_varlen.gdn_core_step`).
- **The recurrent state is fp32** unless ``--mamba-ssm-cache-dtype`` says otherwise (stock keeps
  it in the model dtype): transformers keeps it in fp32, and fp16's range is too small for it.
- **PLE states.** A model with PLE keeps each PLE layer's conv state and n-gram context in the
  state slot of the same `linear_attention` layer (every `linear_attention` layer gets the two
  extra states so that all slots share one layout and one KV-cache group). vLLM's GDN metadata
  (state index per request, initial-state flags) is exactly what they need.
- **Prefill kernel.** Stock picks FlashInfer's GDN prefill on Hopper; where FlashInfer is not
  installed (the portable model's platforms never have it), or its kernel cannot take the head
  dims (128 only), the Triton kernel is used, decided once per config so the layers and vLLM's
  GDN metadata builder agree (`vllm_startup.prefer_triton_prefill`).

This module imports vLLM; it is loaded only when vLLM builds the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    get_temporal_copy_spec,
    is_conv_state_dim_first,
)
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE, get_kv_cache_torch_dtype

from qwen38_plugin import vllm_ops
from qwen38_plugin.ops import gdn, gdn_varlen


def gdn_state_dtypes(vllm_config: VllmConfig) -> tuple[torch.dtype, torch.dtype]:
    """(conv state, recurrent state) dtypes: the conv state in the cache dtype, the recurrent
    state fp32 unless ``--mamba-ssm-cache-dtype`` names another."""
    cache = vllm_config.cache_config
    conv = get_kv_cache_torch_dtype(cache.mamba_cache_dtype, vllm_config.model_config.dtype)
    ssm_name = cache.mamba_ssm_cache_dtype
    recurrent = torch.float32 if ssm_name == "auto" else STR_DTYPE_TO_TORCH_DTYPE[ssm_name]
    return conv, recurrent


def ple_state_shapes(config: Any) -> tuple[tuple[int, ...], ...]:
    """The PLE states a `linear_attention` slot adds when the model has PLE: the conv state
    ``[hc * H, (K - 1) * n]`` (the last inputs of the dilated convolution) and the n-gram
    context ``[n - 1]`` (the last token ids)."""
    if not config.ple_layer_ids:
        return ()
    width = config.hc_count * config.hidden_size
    return ((width, (config.ple_conv_kernel_size - 1) * config.ngram_size), (config.ngram_size - 1,))


def slot_state_shapes(vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
    """Shapes of one rank's `linear_attention` state slot: GDN conv, GDN recurrent[, PLE conv, context]."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    config = vllm_config.model_config.hf_text_config
    spec = vllm_config.speculative_config
    gdn_shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        vllm_config.parallel_config.tensor_parallel_size,
        config.linear_num_key_heads,
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
        config.linear_conv_kernel_dim,
        spec.num_speculative_tokens if spec is not None and spec.num_speculative_tokens else 0,
    )
    return (*gdn_shapes, *ple_state_shapes(config))


def slot_state_dtypes(vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
    config = vllm_config.model_config.hf_text_config
    dtypes: tuple[torch.dtype, ...] = gdn_state_dtypes(vllm_config)
    if config.ple_layer_ids:
        dtypes += (gdn_state_dtypes(vllm_config)[0], torch.int64)
    return dtypes


def slot_state_copy_funcs(vllm_config: VllmConfig) -> tuple[Any, ...]:
    """vLLM's copy functions for a prefix-cache hit, one per state of a slot: vLLM's own for the
    GDN states, a whole copy for each PLE state."""
    config = vllm_config.model_config.hf_text_config
    funcs: tuple[Any, ...] = MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()
    return funcs + (get_temporal_copy_spec,) * len(ple_state_shapes(config))


class PortableGatedDeltaNet(QwenGatedDeltaNetAttention):
    """vLLM's Qwen GDN layer with Qwen4Exp's state slot and a CPU path for every dtype."""

    def __init__(self, config: Any, vllm_config: VllmConfig, prefix: str = "") -> None:
        # Stock's __init__ already asks for the state dtypes (on CUDA), so the config comes first.
        self._vllm_config = vllm_config
        self._gdn_states_only = False
        super().__init__(config, vllm_config=vllm_config, prefix=prefix, gqa_interleaved_layout=False)
        self.gate_activation = self.norm.activation
        vllm_ops.register_ops()
        # The GDN layer registered itself under its prefix; the CPU core op finds it there.
        self.op_layer_name = vllm_ops.layer_name(prefix)

    # -- the state slot ---------------------------------------------------------------------------
    def get_state_shape(self) -> Any:
        return slot_state_shapes(self._vllm_config)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        dtypes = slot_state_dtypes(self._vllm_config)
        # Stock's own kernel choices read (conv, recurrent) only: the first two states of our slot.
        return dtypes[:2] if self._gdn_states_only else dtypes

    @contextlib.contextmanager
    def _gdn_states(self) -> Iterator[None]:
        self._gdn_states_only = True
        try:
            yield
        finally:
            self._gdn_states_only = False

    def _warmup_prefill_kernels(self, qkv_or_qkvz: torch.Tensor, v_dim: int) -> None:
        with self._gdn_states():
            super()._warmup_prefill_kernels(qkv_or_qkvz, v_dim)

    def _fused_gdn_decode_unsupported_reason(self, vllm_config: VllmConfig) -> str | None:
        # Stock's fused CUDA decode kernel (bf16, K = V = 128) has not been run on our state slot,
        # which also carries the PLE states; the Triton decode path it falls back to has.
        return "the portable Qwen4Exp's GDN state slot (with PLE states) is proven with the Triton decode path only"

    # -- CPU ------------------------------------------------------------------------------------
    def forward_cpu(self, hidden_states: torch.Tensor) -> torch.Tensor:
        mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
        ba, _ = self.in_proj_ba(hidden_states)
        qkv_size = (self.key_dim * 2 + self.value_dim) // self.tp_size
        mixed_qkv, z = mixed_qkvz.split([qkv_size, self.value_dim // self.tp_size], dim=-1)
        b, a = self.split_ba(ba)
        num_tokens = hidden_states.shape[0]
        core = hidden_states.new_empty(num_tokens, self.num_v_heads // self.tp_size, self.head_v_dim)
        torch.ops.vllm.qwen38_gdn_core_cpu(mixed_qkv, b, a, core, self.op_layer_name)
        z = z.reshape(num_tokens, -1, self.head_v_dim)
        y = gdn.gated_rms_norm(core, z, self.norm.weight, self.layer_norm_epsilon, self.gate_activation)
        output, _ = self.out_proj(y.flatten(-2))
        return output

    def core_cpu(self, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, core_out: torch.Tensor) -> None:
        """`vllm_ops.qwen38_gdn_core_cpu`: the delta-rule output of every token into ``core_out``."""
        meta = vllm_ops.step_metadata(self.prefix)
        core_out.zero_()
        if meta is None:  # vLLM's profiling run, which has no states
            return
        n = meta.num_actual_tokens
        states = self.kv_cache
        conv_weight = cast(torch.Tensor, self.conv1d.weight)
        # Verify rows of speculative decoding (vLLM's spec fields) roll back through their
        # per-draft-position slots and the wide conv buffer; the rest run as before.
        core_out[:n] = gdn_varlen.gdn_core_step(
            mixed_qkv[:n], a[:n], b[:n], conv_weight.view(conv_weight.shape[0], -1),
            self.A_log, self.dt_bias, states[0], states[1], meta,
            num_k_heads=self.num_k_heads // self.tp_size, head_k_dim=self.head_k_dim, head_v_dim=self.head_v_dim,
            conv_state_dim_first=is_conv_state_dim_first(),
        )  # fmt: skip
