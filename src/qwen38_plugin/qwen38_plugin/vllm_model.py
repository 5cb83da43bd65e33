"""The portable Qwen4Exp model inside vLLM, built from vLLM's own layers.

Where stock vLLM cannot run Qwen3.8 Flash-Next (CPU, CUDA below 8.0, fp16 / fp32), this model
serves it with vLLM's layers, so tensor parallelism, weight loading and every quantization
method registered with vLLM apply through ``quant_config``:

| block | built from |
|---|---|
| token embedding, lm_head | `VocabParallelEmbedding`, `ParallelLMHead`, `LogitsProcessor` |
| Gated DeltaNet (`linear_attention`) | vLLM's `QwenGatedDeltaNetAttention` (`vllm_gdn`) |
| QSA (`indexed_attention`) | `QKVParallelLinear` / `RowParallelLinear` + `ops.qsa_paged` on paged caches (`vllm_qsa`) |
| MoE | vLLM's `Qwen3NextSparseMoeBlock` (`FusedMoE` with a gated shared expert) |
| PLE | vLLM linear layers, the table in host memory, `ops.ple_varlen` (`vllm_ple`) |
| hyper-connections | `ops.hyper_connection` (replicated mixers: three Triton kernels each on CUDA) |

States live in vLLM's hybrid cache: a mamba-style slot per `linear_attention` layer (GDN conv
and recurrent states, plus the PLE states when the model has PLE) with vLLM's GDN metadata, and
three paged caches per `indexed_attention` layer (`vllm_qsa_cache`). Every op of a step runs on
all of its requests at once, reads nothing back to the host and builds its per-step metadata in
the attention backends' builders, so decode steps run in CUDA graphs.

The plain-torch reference (`qwen38_plugin.model`, `qwen38_plugin.ops`) stays the oracle of the
tests; this module imports vLLM and is loaded only when vLLM builds the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import (
    EagleModelMixin,
    HasInnerState,
    IsHybrid,
    SupportsEagle3,
    SupportsMambaPrefixCaching,
)
from vllm.model_executor.models.qwen3_next import Qwen3NextSparseMoeBlock
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from qwen38_plugin.dispatch import logger
from qwen38_plugin.model import GatedResidual
from qwen38_plugin.ops import hyper_connection
from qwen38_plugin.vllm_gdn import (
    PortableGatedDeltaNet,
    slot_state_copy_funcs,
    slot_state_dtypes,
    slot_state_shapes,
)
from qwen38_plugin.vllm_ple import NGramTable, PortablePLE
from qwen38_plugin.vllm_qsa import PortableQSAAttention, RotaryTable
from qwen38_plugin.vllm_qsa_cache import model_dtype
from qwen38_plugin.vllm_quant import configure_quantization
from qwen38_plugin.vllm_startup import settle_portable_config

# The QSA and shared-expert projections fused in vLLM's modules (the MTP head has them too).
QSA_MOE_STACKED: dict[str, tuple[str, Any]] = {
    ".q_proj": (".qkv_proj", "q"),
    ".k_proj": (".qkv_proj", "k"),
    ".v_proj": (".qkv_proj", "v"),
    ".shared_expert.gate_proj": (".shared_expert.gate_up_proj", 0),
    ".shared_expert.up_proj": (".shared_expert.gate_up_proj", 1),
}

# Checkpoint names -> the fused vLLM modules (shard ids as vLLM's loaders expect them).
_WEIGHTS_MAPPER = WeightsMapper(
    orig_to_new_prefix={"model.language_model.": "model.", "mtp.": None, "model.visual.": None},
    orig_to_new_stacked={
        **QSA_MOE_STACKED,
        ".in_proj_qkv": (".in_proj_qkvz", (0, 1, 2)),
        ".in_proj_z": (".in_proj_qkvz", 3),
        ".in_proj_b": (".in_proj_ba", 0),
        ".in_proj_a": (".in_proj_ba", 1),
    },
)
_PLE_SHARD = ".ple_embedding.ngram_embedding.shard_"
_PLE_SCALE = ".ple_embedding.ngram_embedding.weight_scale"


# A block's output and its injection weights ([T, H], [T, hc]) not yet added to the streams.
Pending = tuple[torch.Tensor, torch.Tensor] | None


def apply_pending(streams: torch.Tensor, pending: Pending) -> torch.Tensor:
    return streams if pending is None else hyper_connection.hc_inject(streams, *pending)


class PortableDecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, index: int, rotary: RotaryTable, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.layer_type = config.layer_types[index]
        if self.layer_type == "linear_attention":
            self.linear_attn = PortableGatedDeltaNet(config, vllm_config, prefix=f"{prefix}.linear_attn")
        else:
            self.self_attn = PortableQSAAttention(vllm_config, config, rotary, prefix=f"{prefix}.self_attn")
        self.mlp = Qwen3NextSparseMoeBlock(vllm_config, prefix=f"{prefix}.mlp")
        ple_ids = list(config.ple_layer_ids or [])
        self.ple = (
            PortablePLE(vllm_config, config, ple_ids.index(index + 1), self.linear_attn, prefix=f"{prefix}.ple")
            if index + 1 in ple_ids
            else None
        )
        self.attn_hyper_connection = GatedResidual(config)
        self.mlp_hyper_connection = GatedResidual(config)

    def forward(
        self, streams: torch.Tensor, pending: Pending, positions: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, Pending]:
        """(streams, the MoE output and its injection weights, not yet added to the streams: the
        next mixer's norm adds them as it reads the streams, one kernel instead of two)."""
        if self.ple is not None:
            streams = apply_pending(streams, pending)  # PLE reads the whole residual state
            streams = self.ple(streams, input_ids)
            pending = None
        streams, normed = self.attn_hyper_connection.norm(streams, *(pending or (None, None)))
        x, inject = self.attn_hyper_connection.mix_normed(normed)
        assert inject is not None
        attn = self.linear_attn(x) if self.layer_type == "linear_attention" else self.self_attn(positions, x)
        streams, normed = self.mlp_hyper_connection.norm(streams, attn, inject)
        x, inject = self.mlp_hyper_connection.mix_normed(normed)
        assert inject is not None
        return streams, (self.mlp(x), inject)


# positions: [T], or [3, T] under M-RoPE (the token count is the last dimension either way). vLLM
# strips mrope_section from a text-only Qwen4ExpForCausalLM's config (stock's config hook), so
# [3, T] comes only with the multimodal model's text config.
@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "inputs_embeds": 0})
class PortableQwen4ExpModel(nn.Module, EagleModelMixin):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        rotary = RotaryTable.from_config(config, vllm_config.model_config.max_model_len, model_dtype(vllm_config))
        self.layers = nn.ModuleList(
            PortableDecoderLayer(vllm_config, i, rotary, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.hyper_connection_mixer = GatedResidual(config, inject=False)
        # `[max tokens, hc * H]`, filled every step, only when an MTP head drafts (stock's buffer).
        self.mtp_target_streams: torch.Tensor | None = None
        spec = vllm_config.speculative_config
        if spec is not None and spec.method == "mtp":
            self.keep_mtp_target_streams(vllm_config.scheduler_config.max_num_batched_tokens, model_dtype(vllm_config))

    def keep_mtp_target_streams(self, max_tokens: int, dtype: torch.dtype) -> None:
        """Keep each step's pre-final-mixer streams for vLLM's MTP proposer (the V1 model runner
        asks the target for them through `get_mtp_target_hidden_states`)."""
        width = self.config.hc_count * self.config.hidden_size
        self.mtp_target_streams = torch.empty(max_tokens, width, dtype=dtype, device=next(self.parameters()).device)

    def decoder_layers(self) -> list[PortableDecoderLayer]:
        return [layer for layer in self.layers if isinstance(layer, PortableDecoderLayer)]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """``inputs_embeds [T, H]`` (the multimodal model's: image and video features scattered
        over their placeholder rows) replace the token embeddings; ``input_ids`` are still needed,
        placeholders included, for PLE's n-gram hashes (as transformers' ``ple_input_ids``)."""
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        streams = hyper_connection.hc_expand(embeds, self.config.hc_count)
        aux: list[torch.Tensor] = []
        pending: Pending = None
        for index, layer in enumerate(self.layers):
            if index in self.aux_hidden_state_layers:
                streams, pending = apply_pending(streams, pending), None
                self._add_aux_hidden_state(aux, index, streams)
            streams, pending = layer(streams, pending, positions, input_ids)
        if len(self.layers) in self.aux_hidden_state_layers:
            streams, pending = apply_pending(streams, pending), None
            self._add_aux_hidden_state(aux, len(self.layers), streams)
        streams, normed = self.hyper_connection_mixer.norm(streams, *(pending or (None, None)))
        if self.mtp_target_streams is not None:
            # The MTP head reads the streams before the final mixer (`get_mtp_target_hidden_states`).
            self.mtp_target_streams[: streams.shape[0]].copy_(streams)
        hidden, _ = self.hyper_connection_mixer.mix_normed(normed)
        return (hidden, aux) if aux else hidden

    def _add_aux_hidden_state(self, aux: list[torch.Tensor], index: int, streams: torch.Tensor) -> None:
        """vLLM's auxiliary hidden states (EAGLE-3 / DFlash target features): the residual state
        entering layer `index` (the number of layers: the last layer's output), averaged over the
        hyper-connection streams (``hc_mean``, which a DFlash drafter for this model declares)."""
        if index in self.aux_hidden_state_layers:
            aux.append(hyper_connection.hc_mean(streams, self.config.hc_count))


class PortableQwen4ExpForCausalLM(nn.Module, HasInnerState, IsHybrid, SupportsMambaPrefixCaching, SupportsEagle3):
    """`Qwen4ExpForCausalLM` for vLLM on CPU, CUDA < 8.0 and fp16 / fp32 (see the module docstring)."""

    is_portable_qwen4exp: ClassVar[bool] = True
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
        "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
        "in_proj_ba": ["in_proj_b", "in_proj_a"],
    }
    hf_to_vllm_mapper = _WEIGHTS_MAPPER

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        settle_portable_config(vllm_config)  # as the config hook did, for a config built another way
        configure_quantization(vllm_config, self.packed_modules_mapping)
        config = vllm_config.model_config.hf_text_config
        if config.output_gate_type is None:
            # transformers gates the GDN output with hidden_act when the field is unset;
            # vLLM's GDN layer reads the field.
            config.output_gate_type = config.hidden_act
        self.config = config
        self.vllm_config = vllm_config
        self.model = PortableQwen4ExpModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config,
            prefix=maybe_prefix(prefix, "lm_head"),
        )  # fmt: skip
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.tp_size = get_tensor_model_parallel_world_size()

    # -- vLLM's hybrid-model interface ----------------------------------------------------------
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> Any:
        return slot_state_shapes(vllm_config)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return slot_state_dtypes(vllm_config)

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple[Any, ...]:
        from vllm.config import get_current_vllm_config

        return slot_state_copy_funcs(get_current_vllm_config())

    @classmethod
    def get_mamba_state_copy_funcs_from_config(
        cls, vllm_config: VllmConfig, mamba_types: set[MambaAttentionBackendEnum]
    ) -> dict[MambaAttentionBackendEnum, tuple[Any, ...]]:
        """One copy function per state of a slot, for the types vLLM asks about (the dispatcher
        asks the class with a config)."""
        return dict.fromkeys(mamba_types, slot_state_copy_funcs(vllm_config))

    def get_mamba_state_copy_funcs(  # type: ignore[override]
        self, mamba_types: set[MambaAttentionBackendEnum]
    ) -> dict[MambaAttentionBackendEnum, tuple[Any, ...]]:
        return self.get_mamba_state_copy_funcs_from_config(self.vllm_config, mamba_types)

    # -- forward --------------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        if input_ids is None:
            raise NotImplementedError("the portable Qwen4Exp model needs token ids (PLE hashes them)")
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def get_mtp_target_hidden_states(self) -> torch.Tensor | None:
        """The last step's residual streams before the final mixer, ``[max tokens, hc * H]`` (rows
        of the step's tokens first), or None when no MTP head drafts: what vLLM's V1 model runner
        hands an MTP proposer instead of the final hidden states (stock's Qwen4Exp does the same)."""
        return self.model.mtp_target_streams

    # -- weights --------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tables: dict[str, NGramTable] = {
            f"model.layers.{i}.ple.ple_embedding": layer.ple.ple_embedding
            for i, layer in enumerate(self.model.decoder_layers())
            if layer.ple is not None
        }

        def checkpoint_tensors() -> Iterable[tuple[str, torch.Tensor]]:
            # The PLE tables may live in host memory, outside the module's parameters: their
            # shards are copied in here, every other tensor goes through vLLM's loader.
            for name, tensor in weights:
                mapped = _WEIGHTS_MAPPER.map_name(name) if _PLE_SHARD in name or name.endswith(_PLE_SCALE) else None
                if mapped is not None and mapped.endswith(_PLE_SCALE):
                    owner = mapped.removesuffix(".ngram_embedding.weight_scale")
                    if owner in tables:
                        tables[owner].load_scale(tensor)
                        continue
                elif mapped is not None:
                    owner, _, rest = mapped.partition(".ngram_embedding.shard_")
                    if owner in tables:
                        tables[owner].load_shard(int(rest.split(".")[0]), tensor)
                        continue
                yield name, tensor

        loader = AutoWeightsLoader(self)
        loaded = loader.load_weights(checkpoint_tensors(), mapper=_WEIGHTS_MAPPER)
        host_bytes = 0
        for owner, table in tables.items():
            host_bytes += table.finish_loading()  # names a table without shards, or an FP8 one without scale
            if table.placement == "device":
                loaded.add(f"{owner}.weight")
            # Derived from the config when the checkpoint leaves them out (transformers rebuilds them).
            loaded |= {f"{owner}.ngram_heads_vocab_sizes", f"{owner}.ngram_heads_offsets"}
        _log_memory(self, host_bytes, sorted({str(t.dtype).removeprefix("torch.") for t in tables.values()}))
        return loaded


def _log_memory(model: nn.Module, ple_host_bytes: int, ple_dtypes: list[str]) -> None:
    """One startup line: the weights' bytes per device, the PLE tables' in host memory and their
    dtypes (the checkpoint's)."""
    per_device: dict[str, int] = {}
    for param in model.parameters():
        per_device[param.device.type] = per_device.get(param.device.type, 0) + param.numel() * param.element_size()
    where = ", ".join(f"{size / 2**20:.1f} MiB on {device}" for device, size in sorted(per_device.items()))
    logger.info(
        "portable Qwen4Exp weights: %s; PLE tables: %.1f MiB in host memory (one copy for this node's "
        "tensor-parallel ranks), stored as %s (the checkpoint's dtype)",
        where,
        ple_host_bytes / 2**20,
        ", ".join(ple_dtypes) or "-",
    )
