"""The portable Qwen4Exp model inside vLLM: `Qwen4ExpCore` plus the wiring to vLLM's caches.

vLLM's hybrid cache manager owns every state:
- each `linear_attention` layer has one mamba-style state slot per request holding the GDN
  conv state, the GDN recurrent state (fp32) and, when the model has PLE, the PLE conv state
  and the n-gram context (int64) of that layer. The slot uses vLLM's GDN metadata (state
  index per request, whether it continues from a state), so chunked prefill, prefix caching
  (state copies in "align" mode) and preemption are vLLM's own;
- each `indexed_attention` layer has a paged K/V cache, a paged cache of one compressed QSA
  indexer key per complete group and a per-request ring of the open group's raw indexer keys
  (`vllm_qsa_cache`). Our small attention backend only turns vLLM's common metadata into block
  tables and lengths; the attention itself is `ops.qsa`.

This module imports vLLM; it is loaded only when vLLM builds the model.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsMambaPrefixCaching
from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from qwen38_plugin.dispatch import logger
from qwen38_plugin.model import (
    QSAPast,
    Qwen4ExpCore,
    TensorParallel,
    check_config,
    check_tensor_parallel,
    eos_id,
)
from qwen38_plugin.ops.qsa import IndexerStep
from qwen38_plugin.vllm_qsa_cache import QSAKVCache

# ---------------------------------------------------------------------------------------------
# State shapes (per request slot)
# ---------------------------------------------------------------------------------------------


def state_shapes(config: Any, tp_size: int = 1) -> tuple[tuple[int, ...], ...]:
    """Shapes of one rank's `linear_attention` state slot: GDN conv, GDN recurrent[, PLE conv, context].

    The GDN states hold the rank's heads; the PLE states (hyper-connection width) are replicated.
    """
    check_tensor_parallel(config, tp_size)
    k_heads, v_heads = config.linear_num_key_heads // tp_size, config.linear_num_value_heads // tp_size
    conv_dim = 2 * k_heads * config.linear_key_head_dim + v_heads * config.linear_value_head_dim
    shapes: tuple[tuple[int, ...], ...] = (
        (conv_dim, config.linear_conv_kernel_dim - 1),
        (v_heads, config.linear_key_head_dim, config.linear_value_head_dim),
    )
    if config.ple_layer_ids:
        width = config.hc_count * config.hidden_size
        shapes += ((width, (config.ple_conv_kernel_size - 1) * config.ngram_size), (config.ngram_size - 1,))
    return shapes


def state_dtypes(config: Any, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    # The recurrent state stays fp32 whatever the model dtype, as in the reference.
    dtypes: tuple[torch.dtype, ...] = (dtype, torch.float32)
    if config.ple_layer_ids:
        dtypes += (dtype, torch.int64)
    return dtypes


def state_copy_funcs(
    vllm_config: VllmConfig, mamba_types: set[MambaAttentionBackendEnum]
) -> dict[MambaAttentionBackendEnum, tuple[Any, ...]]:
    """vLLM's state copy functions for a prefix-cache hit, one per state of a slot (2 for GDN,
    4 with PLE): every state is copied whole when a request resumes from a cached block."""
    shapes = state_shapes(vllm_config.model_config.hf_text_config, vllm_config.parallel_config.tensor_parallel_size)
    return dict.fromkeys(mamba_types, (get_temporal_copy_spec,) * len(shapes))


def model_dtype(vllm_config: VllmConfig) -> torch.dtype:
    dtype = vllm_config.model_config.dtype
    assert isinstance(dtype, torch.dtype), f"unresolved model dtype {dtype!r}"
    return dtype


class LinearStateSlot(nn.Module, MambaBase):
    """The vLLM-managed state slot of one `linear_attention` layer (no weights)."""

    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.prefix = prefix
        self._shapes = state_shapes(config, vllm_config.parallel_config.tensor_parallel_size)
        self._dtypes = state_dtypes(config, model_dtype(vllm_config))
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        # vLLM's GDN metadata (state index per request, initial-state flags, decode/prefill
        # split) is exactly what these states need; its kernels are not used.
        return MambaAttentionBackendEnum.GDN_ATTN

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return self._shapes

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self._dtypes


# ---------------------------------------------------------------------------------------------
# The StateStore over vLLM's caches for one step
# ---------------------------------------------------------------------------------------------


class VllmStateStore:
    """Per-layer views of vLLM's caches for one step.

    Layers may sit in different KV-cache groups, each with its own block table, so every
    layer reads its own metadata (state slot per request, block table) by its layer name.
    """

    def __init__(
        self,
        core: Qwen4ExpCore,
        slots: dict[int, LinearStateSlot],
        kv_layers: dict[int, QSAKVCache],
        metadata: dict[str, Any],
        first_gdn_meta: Any,
    ) -> None:
        self.core, self.slots, self.kv_layers, self.metadata = core, slots, kv_layers, metadata
        fresh = torch.zeros(0, dtype=torch.bool)
        if first_gdn_meta is not None and first_gdn_meta.has_initial_state is not None:
            # decodes (first) always continue; prefills continue iff they have computed tokens
            fresh = torch.cat([
                torch.zeros(first_gdn_meta.num_decodes, dtype=torch.bool),
                ~first_gdn_meta.has_initial_state[first_gdn_meta.num_decodes :].cpu(),
            ])  # fmt: skip
        self.fresh = fresh

    def _indices(self, layer: int, seqs: Sequence[int]) -> torch.Tensor:
        meta = self.metadata[self.slots[layer].prefix]
        return meta.non_spec_state_indices_tensor[list(seqs)].long()

    def _is_fresh(self, seq: int) -> bool:
        return bool(seq < self.fresh.shape[0] and self.fresh[seq])

    def recurrent(self, layer: int, kind: str, seqs: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        states = self.slots[layer].kv_cache
        idx = self._indices(layer, seqs)
        # Indexing with a tensor gathers copies: the ops may update them in place.
        a, b = (states[0][idx], states[1][idx]) if kind == "gdn" else (states[3][idx], states[2][idx])
        for i, s in enumerate(seqs):
            if self._is_fresh(s):
                fresh_a, fresh_b = self.core.fresh_state(layer, kind)
                a[i], b[i] = fresh_a, fresh_b
        return a, b

    def set_recurrent(self, layer: int, kind: str, seqs: Sequence[int], a: torch.Tensor, b: torch.Tensor) -> None:
        states = self.slots[layer].kv_cache
        idx = self._indices(layer, seqs)
        if kind == "gdn":
            states[0][idx], states[1][idx] = a.to(states[0].dtype), b.to(states[1].dtype)
        else:
            states[3][idx], states[2][idx] = a.to(states[3].dtype), b.to(states[2].dtype)

    def kv(self, layer: int, seq: int) -> QSAPast:
        return self.kv_layers[layer].past(self.metadata, seq)

    def append_kv(self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor, indexer: IndexerStep | None) -> None:
        self.kv_layers[layer].append(self.metadata, seq, k, v, indexer)


# ---------------------------------------------------------------------------------------------
# The model class vLLM instantiates
# ---------------------------------------------------------------------------------------------


class PortableQwen4ExpForCausalLM(Qwen4ExpCore, HasInnerState, IsHybrid, SupportsMambaPrefixCaching):
    """`Qwen4ExpForCausalLM` for vLLM on CPU, CUDA < 8.0 and fp16, built on the plain-torch ops."""

    is_portable_qwen4exp: ClassVar[bool] = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        config = vllm_config.model_config.hf_text_config
        tp = vllm_config.parallel_config.tensor_parallel_size
        check_config(config)
        check_tensor_parallel(config, tp)
        if tp > 1:
            # Each rank holds its slices; vLLM's tensor-parallel collectives sum block outputs and
            # gather the vocabulary-split logits.
            rank = get_tensor_model_parallel_rank()
            super().__init__(
                config, TensorParallel(rank, tp, tensor_model_parallel_all_reduce, tensor_model_parallel_all_gather)
            )
        else:
            super().__init__(config)
        self.eos = eos_id(config)
        self._vllm_config = vllm_config
        self._slots: dict[int, LinearStateSlot] = {}
        self._kv: dict[int, QSAKVCache] = {}
        # Not submodules: they carry no weights; vLLM finds them through the forward context.
        for i, kind in enumerate(config.layer_types):
            if kind == "linear_attention":
                self._slots[i] = LinearStateSlot(vllm_config, f"{prefix}model.layers.{i}.linear_attn.state")
            else:
                # this rank's KV heads
                self._kv[i] = QSAKVCache(vllm_config, f"{prefix}model.layers.{i}.self_attn.kv",
                                         self.model.layer(i).self_attn.num_kv_heads)  # fmt: skip

    # -- vLLM's hybrid-model interface ----------------------------------------------------------
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> Any:
        return state_shapes(vllm_config.model_config.hf_text_config, vllm_config.parallel_config.tensor_parallel_size)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return state_dtypes(vllm_config.model_config.hf_text_config, model_dtype(vllm_config))

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple[Any, ...]:
        # The interface has no config here; vLLM asks get_mamba_state_copy_funcs (below), which
        # knows how many states a slot holds.
        return (get_temporal_copy_spec,) * 4

    @classmethod
    def get_mamba_state_copy_funcs_from_config(
        cls, vllm_config: VllmConfig, mamba_types: set[MambaAttentionBackendEnum]
    ) -> dict[MambaAttentionBackendEnum, tuple[Any, ...]]:
        """What the instance method gives, from a config (the dispatcher asks it on the class)."""
        return state_copy_funcs(vllm_config, mamba_types)

    def get_mamba_state_copy_funcs(  # type: ignore[override]
        self, mamba_types: set[MambaAttentionBackendEnum]
    ) -> dict[MambaAttentionBackendEnum, tuple[Any, ...]]:
        # vLLM 0.32 asks the built model (it pairs the functions with a slot's states).
        return state_copy_funcs(self._vllm_config, mamba_types)

    # -- forward --------------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if inputs_embeds is not None:
            raise NotImplementedError("the portable Qwen4Exp model needs token ids (PLE hashes them)")
        hidden = self.model.embed_tokens.weight.new_zeros(input_ids.shape[0], self.config.hidden_size)
        metadata: Any = get_forward_context().attn_metadata
        if not metadata:  # profiling / warm-up run: no requests, no states
            return hidden
        assert isinstance(metadata, dict)
        gdn_meta: Any = metadata.get(self._slots[min(self._slots)].prefix) if self._slots else None
        qsa_meta: Any = metadata.get(self._kv[min(self._kv)].prefix) if self._kv else None
        if qsa_meta is not None:
            query_start_loc = qsa_meta.query_start_loc
            num_tokens = qsa_meta.num_actual_tokens
        else:
            assert gdn_meta is not None
            query_start_loc = gdn_meta.non_spec_query_start_loc.cpu().tolist()
            num_tokens = gdn_meta.num_actual_tokens
        query_lens = [b - a for a, b in itertools.pairwise(query_start_loc)]
        query_lens = [n for n in query_lens if n > 0]
        num_tokens = sum(query_lens)
        store = VllmStateStore(self, self._slots, self._kv, metadata, gdn_meta)
        hidden[:num_tokens] = self.forward_step(input_ids[:num_tokens], positions[:num_tokens], query_lens, store)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = self.load_checkpoint_tensors(weights)
        if current_platform.is_cpu():
            from qwen38_plugin import vllm_cpu_kernels

            if vllm_cpu_kernels.enabled():
                used = vllm_cpu_kernels.install(self)
                logger.info("portable Qwen4Exp on CPU uses vLLM's CPU kernels: %s", used)
            else:
                logger.info("portable Qwen4Exp on CPU: %s=0, reference ops only", vllm_cpu_kernels.SWITCH_ENV)
        return loaded
