"""The portable MTP drafter: the checkpoint's ``mtp.*`` head served as ``Qwen4ExpMTP`` by vLLM's V1
proposer where stock's cannot run (CPU, CUDA < 8.0, fp16 / fp32; the dispatcher's rule).

Semantics are stock's `Qwen4ExpMTP` (``vllm/models/qwen4_exp/nvidia/mtp.py``); the plain-torch
oracle is `qwen38_plugin.mtp_reference`. At each token the head reads the target's residual streams
before its final mixer (``[T, hc * H]``, `PortableQwen4ExpForCausalLM.get_mtp_target_hidden_states`,
or its own output streams in later draft steps) and the next token:

    streams = fc_hidden(norm_h(streams)) + expand(fc_embedding(norm_e(embed(token))))
    streams = the QSA decoder layer (hyper-connections, MoE, no PLE) on streams

and returns the layer's output streams; `compute_logits` applies the head's final mixer and the
lm_head. vLLM's V1 proposer uses one output tensor for both (the next step's hidden states and
the logits' input), shares the target's embedding and lm_head, and always runs layer 0.

Where the draft layer's indexer keys live depends on vLLM's model runner:

- vLLM's V2 model runner (its default on CUDA) builds the draft's attention metadata for every
  KV-cache group its layers use, so the draft QSA layer registers the same three caches as a
  target QSA layer (`QSAKVCache`: K/V, compressed block keys, key ring), all inside vLLM's
  KV-cache memory accounting, and attends exactly as a target layer does;
- vLLM's V1 model runner (the CPU's) imposes what follows. On CUDA the V1 runner is refused for
  MTP (its side tensors would be allocated after vLLM gave the GPU memory to the KV cache: the
  H200 ran out of memory at startup, 2026-12-01), naming ``VLLM_USE_V2_MODEL_RUNNER``.

What V1's proposer imposes, and how this module meets it:

- every draft layer in one KV-cache group: a draft QSA layer registers only its K/V with vLLM,
  the same `FullAttentionSpec` as the target's QSA K/V (so it joins that group and its block
  table). The indexer's raw keys and compressed block keys live in side tensors allocated when
  vLLM binds the K/V cache, indexed by the same K/V block ids: the raw key of position p in block
  ``table[p // B]`` row ``p % B``, the key of group g in block ``table[g * ratio // B]`` row
  ``g % (B / ratio)``, where B is the positions a block-table entry spans (the K/V block size, times
  the decode-context-parallel size under DCP, where these keys stay whole on every rank while the
  K/V is split). The ratio divides the block size, so a group never spans two blocks and the paged
  raw keys serve as `qsa_paged.group_keys`' ring (one ring block per token). These side tensors are
  outside vLLM's KV-cache memory accounting (logged at bind time; README);
- the hidden-state buffer ``hc * H`` wide: `widen_draft_hidden_buffer` (the target
  architecture's config hook, `qwen38_plugin.vllm_config_hook`).

This module imports vLLM; it is loaded only when vLLM builds the drafter.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, ClassVar, cast

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen3_next import Qwen3NextSparseMoeBlock
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

from qwen38_plugin import vllm_ops
from qwen38_plugin.model import ConfigError, GatedResidual
from qwen38_plugin.mtp_reference import mtp_layer_count
from qwen38_plugin.ops import hyper_connection, qsa_paged
from qwen38_plugin.vllm_model import QSA_MOE_STACKED
from qwen38_plugin.vllm_qsa import GemmaNorm, PortableQSAAttention, RotaryTable, real_tokens
from qwen38_plugin.vllm_qsa_cache import QSAKVCache, QSAMetadata, _CacheLayer, model_dtype

logger = logging.getLogger("vllm.plugins.qwen38_plugin")

# Checkpoint names (``mtp.*`` -> ``model.*``) to the fused vLLM modules.
_MTP_WEIGHTS_MAPPER = WeightsMapper(orig_to_new_stacked=dict(QSA_MOE_STACKED))


class DraftQSAKVCache(QSAKVCache):
    """A draft QSA layer's caches: K/V registered with vLLM (the target's K/V spec, so the same
    KV-cache group), the indexer's raw keys ``[NB, 1, B, Di]`` and block keys
    ``[NB, 1, B / ratio, Di]`` in side tensors sized from the bound K/V cache's block count
    (B: the block size, times ``dcp_world`` under decode context parallelism)."""

    def __init__(self, vllm_config: VllmConfig, prefix: str, num_kv_heads: int, dcp_world: int = 1) -> None:
        _CacheLayer.__init__(self, vllm_config, prefix)
        # Under decode context parallelism a block-table entry spans block_size * dcp_world positions
        # and this rank's K/V block holds its share of them; the indexer keys stay whole on every rank
        # (each rank selects the same groups), so their blocks hold all the entry's positions.
        self.dcp_world = dcp_world
        config = vllm_config.model_config.hf_text_config
        self.head_dim = config.head_dim
        self.num_kv_heads = num_kv_heads
        self.ring = None
        self.block_keys = None
        self.ratio = int(config.indexer_compress_ratio or 1) if config.indexer_budget is not None else 0
        self.index_dim = int(config.indexer_head_dim or 0)
        self.raw_keys = torch.empty(0)
        self.group_key_cache = torch.empty(0)
        # Under M-RoPE (the multimodal model) each raw key's (T, H, W) rope positions too: a group's
        # compressed key is rotated at its first token's.
        self.mrope = bool(vllm_config.model_config.uses_mrope)
        self.raw_rope_positions: torch.Tensor | None = None

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        super().bind_kv_cache(kv_cache)
        if not self.ratio:
            return
        blocks, _, block_size, _ = self.kv_cache.shape
        if block_size % self.ratio:
            raise ConfigError(
                f"MTP draft QSA: the K/V block size {block_size} is not a multiple of indexer_compress_ratio "
                f"{self.ratio}; use a --block-size that is a multiple of {self.ratio}"
            )
        device = self.kv_cache.device
        span = block_size * self.dcp_world  # positions per block-table entry
        self.raw_keys = torch.zeros(blocks, 1, span, self.index_dim, dtype=self.dtype, device=device)
        self.group_key_cache = torch.zeros(
            blocks, 1, span // self.ratio, self.index_dim, dtype=self.dtype, device=device
        )
        side = self.raw_keys.nbytes + self.group_key_cache.nbytes
        if self.mrope:
            # one block more: where padding tokens (no K/V slot) write, never read
            self.raw_rope_positions = torch.zeros(blocks + 1, 1, block_size, 3, dtype=torch.int64, device=device)
            side += self.raw_rope_positions.nbytes
        logger.info(
            "qwen38_plugin: MTP draft layer %s keeps its indexer keys in %.2f MiB outside vLLM's KV-cache "
            "accounting (%d blocks of %d tokens: raw keys and compressed block keys; its K/V: %.2f MiB in the cache)",
            self.prefix, side / 2**20, blocks, block_size, self.kv_cache.nbytes / 2**20,
        )  # fmt: skip


def draft_cache_class(vllm_config: VllmConfig, on_cuda: bool | None = None) -> type[QSAKVCache]:
    """The draft QSA layer's caches: the target's in vLLM's V2 model runner, side tensors in V1 on
    CPU; V1 on CUDA is refused. ``on_cuda`` overrides the platform check (for tests on a CPU machine)."""
    if on_cuda is None:
        from vllm.platforms import current_platform

        on_cuda = current_platform.is_cuda_alike()
    if not on_cuda:  # the CPU runs vLLM's V1 model runner
        return DraftQSAKVCache
    if vllm_config.use_v2_model_runner:
        return QSAKVCache
    raise ConfigError(
        "MTP on the portable Qwen4Exp on CUDA needs vLLM's V2 model runner (its default): the V1 runner "
        "keeps the draft layer's indexer keys outside vLLM's KV-cache memory; unset "
        "VLLM_USE_V2_MODEL_RUNNER or set it to 1"
    )


class DraftQSAAttention(PortableQSAAttention):
    """The MTP head's QSA attention: the target's projections and ops; in vLLM's V2 model runner
    the target's caches, in V1 `DraftQSAKVCache` (see the module docstring)."""

    def make_cache(self, vllm_config: VllmConfig, prefix: str) -> QSAKVCache:
        cls = draft_cache_class(vllm_config)
        if cls is DraftQSAKVCache:
            return DraftQSAKVCache(vllm_config, prefix, self.num_kv_heads, self.dcp.world if self.dcp else 1)
        return cls(vllm_config, prefix, self.num_kv_heads)

    def _draft_group_start_rope_positions(
        self,
        rope_positions: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        req: torch.Tensor,
        table: torch.Tensor,
        block_size: int,
    ) -> torch.Tensor:
        """``[3, T]``: the M-RoPE positions of the first token of the group ending at each token
        (p - ratio + 1), after this step's are stored at their K/V slots (`DraftQSAKVCache`'s
        ``raw_rope_positions``). Rows of tokens that close no group are never stored. Device ops only."""
        cache = self.cache
        assert isinstance(cache, DraftQSAKVCache)
        stored = cache.raw_rope_positions
        if stored is None:
            raise RuntimeError("the MTP draft layer got M-RoPE positions but its model config has no M-RoPE")
        n = positions.shape[0]
        flat = stored.view(-1, 3)
        # this step's rope positions at its K/V slots (a padding token, slot < 0, into the spare block)
        spare = (stored.shape[0] - 1) * block_size
        flat.index_copy_(0, torch.where(slots >= 0, slots, spare), rope_positions.t()[:n].to(torch.int64))
        first = (positions - (self.ratio - 1)).clamp(min=0)
        first_slot = table[req, (first // block_size).clamp(0, table.shape[1] - 1)].long() * block_size
        start = flat[first_slot + first % block_size].t()
        return start.clamp(0, self.rotary.cos.shape[0] - 1)

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
        cache = self.cache
        if not isinstance(cache, DraftQSAKVCache):  # V2 model runner: a target layer's caches
            super().attend(q, gate, k, v, index_q, raw_keys, positions, out)
            return
        meta: QSAMetadata | None = vllm_ops.step_metadata(cache.prefix)
        step = real_tokens(meta, q, gate, k, v, index_q, raw_keys, positions, out)
        if meta is None or step is None:
            return
        q, gate, k, v, index_q, raw_keys, positions, out = step
        n = meta.num_tokens
        rope_positions = positions  # [T], or M-RoPE's [3, T] (the multimodal model)
        positions = meta.positions[:n]  # each token's index in its sequence
        qsa_paged.write_kv(cache.kv_cache, meta.slots, k, v)
        selected = None
        if self.indexer is not None:
            assert index_q is not None and raw_keys is not None
            # The indexer keys' positions per block (all the block-table entry's, also under DCP).
            block_size = cache.raw_keys.shape[2]
            has_slot = self._has_kv_slot(meta.slots)
            real = meta.token_req >= 0
            req = meta.token_req.long().clamp(min=0)
            table = meta.block_table
            token_block = table[req, (positions // block_size).clamp(0, table.shape[1] - 1)]
            # The step's raw keys first, at their rows; then every member of a group is read
            # from the paged raw keys: each token is its own "request" whose ring block is the
            # block of its position (the whole group lies in it), and no member counts as
            # this step's row (step start past the token).
            raw_slots = torch.where(real & has_slot, token_block.long() * block_size + positions % block_size, -1)
            qsa_paged.write_rows(cache.raw_keys, raw_slots, raw_keys)
            start_cos_sin = None
            if rope_positions.dim() == 2:
                starts = self._draft_group_start_rope_positions(rope_positions, positions, meta.slots, req, table,
                                                                block_size)  # fmt: skip
                start_cos_sin = self.rotary.cos_sin(starts)
            own_row = torch.where(real, torch.arange(n, device=q.device, dtype=torch.int32), -1)
            group_keys = qsa_paged.group_keys(
                raw_keys, cache.raw_keys, token_block, own_row, positions, (positions + 1).to(torch.int32),
                ratio=self.ratio, k_norm_weight=self.indexer.k_layernorm.weight, eps=self.config.rms_norm_eps,
                rope_theta=self.config.rope_parameters["rope_theta"], rotary_dim=self.index_rotary_dim,
                start_cos_sin=start_cos_sin,
            )  # fmt: skip
            key_slots = qsa_paged.key_slots(meta.token_req, positions, table, block_size=block_size, ratio=self.ratio)
            # A draft past max_model_len has no K/V slot (vLLM clamps its position): store nothing.
            key_slots = torch.where(has_slot, key_slots, -1)
            qsa_paged.write_rows(cache.group_key_cache, key_slots, group_keys)
            selected = qsa_paged.index_topk(
                index_q, cache.group_key_cache, table, meta.token_req, positions,
                ratio=self.ratio, topk=self.topk, max_groups=self.max_groups,
            )  # fmt: skip
        if self.dcp is not None:
            self._attend_decode_context_parallel(q, gate, cache.kv_cache, meta, positions, selected, out)
            return
        qsa_paged.sparse_attention(
            q, gate, cache.kv_cache, meta.block_table, meta.token_req, positions, selected,
            ratio=self.ratio, scale=self.scale, out=out,
        )  # fmt: skip

    def _has_kv_slot(self, slots: torch.Tensor) -> torch.Tensor:
        """Which tokens have a K/V slot on some rank: vLLM gives a draft past max_model_len none (and
        clamps its position). Under decode context parallelism a rank sees only its own slots, so the
        ranks of the group take the maximum of theirs."""
        has_slot = slots >= 0
        if self.dcp is None:
            return has_slot
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_dcp_group

        flags = has_slot.to(torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=get_dcp_group().device_group)
        return flags > 0


class MTPDecoderLayer(nn.Module):
    """A QSA decoder layer without PLE (stock builds it with ``layer_type="qwen_sparse_attention"``)."""

    def __init__(self, vllm_config: VllmConfig, rotary: RotaryTable, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.self_attn = DraftQSAAttention(vllm_config, config, rotary, prefix=f"{prefix}.self_attn")
        self.mlp = Qwen3NextSparseMoeBlock(vllm_config, prefix=f"{prefix}.mlp")
        self.attn_hyper_connection = GatedResidual(config)
        self.mlp_hyper_connection = GatedResidual(config)

    def forward(self, streams: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, inject = self.attn_hyper_connection.mix(streams)
        assert inject is not None
        streams = hyper_connection.hc_inject(streams, self.self_attn(positions, x), inject)
        x, inject = self.mlp_hyper_connection.mix(streams)
        assert inject is not None
        return hyper_connection.hc_inject(streams, self.mlp(x), inject)


class PortableMultiTokenPredictor(nn.Module):
    """The ``mtp.*`` tensors (named ``model.*`` here) and the head's step."""

    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        count = mtp_layer_count(config)
        if count < 1:
            raise ConfigError(
                f"mtp_num_hidden_layers: {count}; the checkpoint has no MTP head, so --speculative-config "
                "method 'mtp' cannot draft (drop --speculative-config, or serve a checkpoint with mtp.* tensors)"
            )
        self.config = config
        h, hc = config.hidden_size, config.hc_count
        # No embed_tokens of its own: the proposer sets the target's here after loading (shared_from_target).
        self.fc_embedding = ReplicatedLinear(h, h, bias=False, prefix=f"{prefix}.fc_embedding")
        self.fc_hidden = ReplicatedLinear(h, h, bias=False, prefix=f"{prefix}.fc_hidden")
        self.pre_fc_norm_embedding = GemmaNorm(h, config.rms_norm_eps)
        self.pre_fc_norm_hidden = GemmaNorm(hc * h, config.rms_norm_eps)
        rotary = RotaryTable.from_config(config, vllm_config.model_config.max_model_len, model_dtype(vllm_config))
        self.layers = nn.ModuleList(
            MTPDecoderLayer(vllm_config, rotary, prefix=f"{prefix}.layers.{i}") for i in range(count)
        )
        self.hyper_connection_mixer = GatedResidual(config, inject=False)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        spec_step_idx: int = 0,
    ) -> torch.Tensor:
        c = self.config
        hc, h = c.hc_count, c.hidden_size
        if inputs_embeds is None:
            assert input_ids is not None
            inputs_embeds = shared_from_target(self, "embed_tokens")(input_ids)
        embeds, _ = self.fc_embedding(self.pre_fc_norm_embedding(inputs_embeds))
        normed = self.pre_fc_norm_hidden(hidden_states)
        projected, _ = self.fc_hidden(normed.reshape(-1, h))  # shared by the hc streams
        streams = projected.reshape(-1, hc * h) + hyper_connection.hc_expand(embeds, hc)
        layer = self.layers[spec_step_idx % len(self.layers)]
        assert isinstance(layer, MTPDecoderLayer)
        return layer(streams, positions)


class PortableQwen4ExpMTP(nn.Module):
    """`Qwen4ExpMTP` for vLLM on CPU, CUDA < 8.0 and fp16 / fp32 (see the module docstring).

    ``forward`` returns the head layer's output streams ``[T, hc * H]`` (the next draft step's
    hidden states); ``compute_logits`` mixes them and applies the lm_head."""

    is_portable_qwen4exp: ClassVar[bool] = True
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        from qwen38_plugin.vllm_startup import check_vllm_config

        check_vllm_config(vllm_config)  # the target's config: the same refusals (RoPE type, DCP, TP)
        config = vllm_config.model_config.hf_text_config
        if config.output_gate_type is None:
            config.output_gate_type = config.hidden_act
        self.config = config
        # Layer names "mtp.*": the target's own layers are "model.*".
        self.model = PortableMultiTokenPredictor(vllm_config, prefix="mtp")
        # No lm_head of its own either (shared_from_target): an unused copy of the vocabulary's rows
        # would be allocated and touched at load (2 x 1.3 GB for Flash-Next in fp16 at TP=1).
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return shared_from_target(self.model, "embed_tokens")(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | None = None,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        spec_step_idx: int = 0,
    ) -> torch.Tensor:
        if hidden_states is None:
            raise ValueError("the MTP drafter needs the target's hidden states (vLLM's proposer passes them)")
        return self.model(input_ids, positions, hidden_states, inputs_embeds, spec_step_idx)

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.model.hyper_connection_mixer.mix(streams)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor | None:
        lm_head = cast(ParallelLMHead, shared_from_target(self, "lm_head"))  # whatever the target's is
        return self.logits_processor(lm_head, self.final_hidden(hidden_states))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's ``mtp.*`` tensors (others skipped). The embedding and lm_head are the
        target's: vLLM's proposers (V1's and V2's) set them right after loading."""

        def mtp_tensors() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.removeprefix("model.language_model.").removeprefix("language_model.")
                name = name.removeprefix("model.")
                if not name.startswith("mtp."):
                    continue
                if name.startswith(("mtp.shared_head.", "mtp.hyper_connection_mixer.block_inject_weight")):
                    continue  # V1 shares the target's lm_head; the final mixer has no injection
                yield "model." + name.removeprefix("mtp."), tensor

        return AutoWeightsLoader(self).load_weights(mtp_tensors(), mapper=_MTP_WEIGHTS_MAPPER)


def shared_from_target(owner: nn.Module, name: str) -> nn.Module:
    """The target's embedding or lm_head, which vLLM's proposer sets on the drafter after loading it
    (V1: ``_maybe_share_embeddings`` / ``_maybe_share_lm_head``; V2: ``load_eagle_model``): the drafter
    allocates none of its own. If a vLLM stops sharing them, the first draft step fails here, by name."""
    module = owner._modules.get(name)
    if module is None:
        import vllm

        raise RuntimeError(
            f"the MTP drafter's {name} was not set from the target: vLLM {vllm.__version__}'s proposer no longer "
            "shares the target's embedding and lm_head with an MTP drafter as vLLM 0.32 does; this qwen38_plugin "
            "needs a release for that vLLM (or serve without --speculative-config)"
        )
    return module
