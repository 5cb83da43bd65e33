"""Portable Qwen4Exp text model: the ops composed into layers, independent of vLLM.

`Qwen4ExpCore` holds the weights under transformers' checkpoint names (after the two
renames transformers also applies: per-expert tensors stacked into ``experts.gate_up_proj`` /
``experts.down_proj``, PLE table shards concatenated) and runs a *step*: new tokens of several
sequences at once, flattened to ``[N]``, each sequence continuing from the state a
`StateStore` gives it. The vLLM model implements a `StateStore` over vLLM's caches; the
tests use `DictStateStore`.

Per-token work (embedding, projections, MoE, hyper-connections) runs on all N tokens at once;
state-dependent work runs on all single-token (decode) sequences as one batch and on every
longer (prefill) sequence by itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from qwen38_plugin.ops import gdn, hyper_connection, moe, ple, qsa

LAYER_TYPES = ("linear_attention", "indexed_attention")


class ConfigError(ValueError):
    """A Qwen4Exp configuration this model cannot run; the message names the field and the fix."""


def eos_id(config: Any) -> int:
    eos = config.eos_token_id
    return int(eos[0] if isinstance(eos, (list, tuple)) else eos)


def check_config(config: Any) -> None:
    """Refuse configurations Qwen4Exp does not define, before any weight is allocated."""
    unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"layer_types: unknown layer types {unknown}; Qwen4Exp layers are {' or '.join(LAYER_TYPES)}")
    if len(config.layer_types) != config.num_hidden_layers:
        raise ConfigError(
            f"layer_types: {len(config.layer_types)} entries for num_hidden_layers={config.num_hidden_layers}; "
            "give one type per layer"
        )
    if config.hc_count < 2:
        raise ConfigError(f"hc_count: Qwen4Exp needs at least 2 residual streams, got {config.hc_count}")
    if "indexed_attention" in config.layer_types and config.indexer_budget is not None:
        if config.indexer_kv_heads != 1:
            raise ConfigError(f"indexer_kv_heads: QSA uses exactly 1 indexer key head, got {config.indexer_kv_heads}")
        ratio, budget = config.indexer_compress_ratio, config.indexer_budget
        if not ratio or ratio <= 0 or budget % ratio:
            raise ConfigError(
                f"indexer_budget: {budget} is not a multiple of indexer_compress_ratio={ratio}; "
                f"use a multiple such as {max(ratio or 1, (budget // max(ratio or 1, 1)) * (ratio or 1))}"
            )
    gate = config.output_gate_type or config.hidden_act
    if gate not in ("silu", "sigmoid"):
        raise ConfigError(f"output_gate_type: {gate!r} is not supported; use silu or sigmoid")
    if config.ple_layer_ids:
        bad = [i for i in config.ple_layer_ids if config.layer_types[i - 1] != "linear_attention"]
        if bad:
            raise ConfigError(f"ple_layer_ids: layers {bad} are not linear_attention layers; PLE needs them")


def check_tensor_parallel(config: Any, tp_size: int, split_vocabulary: bool = True) -> None:
    """Refuse a tensor-parallel size the geometry cannot be split over, naming the count.

    ``split_vocabulary=False`` for vLLM's vocabulary-parallel layers, which pad the vocabulary
    themselves, and a model that keeps the PLE table whole on every rank.

    The split mirrors stock vLLM's Qwen4Exp: query heads, GDN key and value heads (with their
    conv channels, gates and decay parameters) and every expert's intermediate dimension (routed
    and shared) are split evenly; KV heads are split when there are at least as many as ranks
    and otherwise replicated, which needs the rank count to be a multiple of them; the PLE table,
    the token embedding and lm_head are split by rows, so the PLE row padding and the vocabulary
    must divide by the rank count (Flash-Next: 24 Q / 2 KV / 16 linear-K / 48 linear-V heads).
    """
    if tp_size <= 1:
        return
    counts = {
        "num_attention_heads": (config.num_attention_heads, "heads"),
        "linear_num_key_heads": (config.linear_num_key_heads, "heads"),
        "linear_num_value_heads": (config.linear_num_value_heads, "heads"),
        "moe_intermediate_size": (config.moe_intermediate_size, "expert intermediate features"),
        "shared_expert_intermediate_size": (config.shared_expert_intermediate_size, "shared-expert features"),
    }
    if split_vocabulary:
        counts["vocab_size"] = (config.vocab_size, "vocabulary rows")
    if split_vocabulary and config.ple_layer_ids:
        counts["make_ngram_vocab_size_divisible_by"] = (config.make_ngram_vocab_size_divisible_by, "PLE table rows")
    for name, (count, what) in counts.items():
        if count % tp_size:
            raise ConfigError(
                f"{name}: {count} {what} cannot be split over tensor_parallel_size={tp_size}; "
                f"use a tensor-parallel size that divides {count}"
            )
    kv = config.num_key_value_heads
    if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
        raise ConfigError(
            f"num_key_value_heads: {kv} KV heads can be neither split nor evenly replicated over "
            f"tensor_parallel_size={tp_size}; use a tensor-parallel size that divides {kv} or a multiple of it"
        )


def _no_reduce(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group and the group's collectives.

    ``all_reduce`` sums a tensor over the ranks (in place or not) and returns the sum;
    ``all_gather`` concatenates the ranks' tensors along the last dimension. vLLM passes its
    tensor-parallel collectives; the defaults (one rank) return their input.
    """

    rank: int = 0
    size: int = 1
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = _no_reduce
    all_gather: Callable[[torch.Tensor], torch.Tensor] = _no_reduce  # concatenates the last dim in rank order

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside [0, {self.size})")

    def local(self, total: int) -> int:
        """This rank's share of ``total`` evenly split items (`check_tensor_parallel` ran first)."""
        return total // self.size

    def slice(self, dim: int, total: int, offset: int = 0) -> Shard:
        """This rank's contiguous share of ``total`` evenly split items of a dimension; with ``offset``
        the items start there (a part of a packed dimension: combine the pieces of such shares)."""
        n = self.local(total)
        return Shard(dim, total, ((offset + self.rank * n, n),))


@dataclass(frozen=True)
class Shard:
    """Which part of a checkpoint tensor a rank holds: ``pieces`` (start, length) of dimension
    ``dim`` (``full`` long in the checkpoint), concatenated in order."""

    dim: int
    full: int
    pieces: tuple[tuple[int, int], ...]

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor.narrow(self.dim, start, length) for start, length in self.pieces], self.dim)


def rotary_dim(config: Any) -> int:
    return int(config.head_dim * (config.rope_parameters or {}).get("partial_rotary_factor", 1.0))


# ---------------------------------------------------------------------------------------------
# Weights, under checkpoint names
# ---------------------------------------------------------------------------------------------


def _linear(out_features: int, in_features: int) -> nn.Linear:
    """A weight the ops read directly (the module only gives it its checkpoint name)."""
    return nn.Linear(in_features, out_features, bias=False)


def _vector(size: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(size))


class _Norm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = _vector(size)


class _Weight(nn.Module):
    """A module holding one tensor named ``weight`` (a checkpoint name level such as ``conv1d``)."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape))


class _Experts(nn.Module):
    def __init__(self, experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.zeros(experts, hidden, intermediate))


class _SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = _linear(intermediate, hidden)
        self.up_proj = _linear(intermediate, hidden)
        self.down_proj = _linear(hidden, intermediate)


class GatedResidual(nn.Module):
    def __init__(self, config: Any, inject: bool = True) -> None:
        super().__init__()
        width = config.hc_count * config.hidden_size
        self.hc_count, self.eps = config.hc_count, config.rms_norm_eps
        self.hc_norm = _Norm(width)
        self.input_mix_weight_down = _linear(config.hc_lowrank, width)
        self.input_mix_weight_up = _linear(width, config.hc_lowrank)
        self.block_inject_weight = _linear(config.hc_count, width) if inject else None

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        inject = self.block_inject_weight.weight if self.block_inject_weight is not None else None
        return hyper_connection.hc_mix(
            streams, self.hc_norm.weight, self.input_mix_weight_down.weight, self.input_mix_weight_up.weight, inject,
            hc_count=self.hc_count, eps=self.eps,
        )  # fmt: skip

    # The same mixer as the served model runs it (three kernels on CUDA):
    # ``mix_normed(norm(streams)[1])`` is ``mix(streams)``.
    def norm(
        self,
        streams: torch.Tensor,
        block_output: torch.Tensor | None = None,
        injection: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(streams, normed streams), the streams first receiving ``block_output`` scaled by
        ``injection`` when given (the previous block's `hc_inject`, fused)."""
        return hyper_connection.hc_norm(
            streams, self.hc_norm.weight, hc_count=self.hc_count, eps=self.eps, block_output=block_output,
            injection=injection,
        )  # fmt: skip

    def mix_normed(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        inject = self.block_inject_weight.weight if self.block_inject_weight is not None else None
        return hyper_connection.hc_mix_normed(
            normed, self.input_mix_weight_down.weight, self.input_mix_weight_up.weight, inject, hc_count=self.hc_count
        )


class GatedDeltaNet(nn.Module):
    """One rank's GDN heads: its key heads, their value heads and everything per channel or per
    value head that belongs to them; out_proj yields a partial sum over ranks."""

    def __init__(self, config: Any, tp: TensorParallel) -> None:
        super().__init__()
        total_k, total_v = config.linear_num_key_heads, config.linear_num_value_heads
        self.num_k_heads, self.num_v_heads = tp.local(total_k), tp.local(total_v)
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.conv_dim = 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim
        self.kernel = config.linear_conv_kernel_dim
        self.eps = config.rms_norm_eps
        self.gate_activation = config.output_gate_type or config.hidden_act
        hidden, value_dim = config.hidden_size, self.num_v_heads * self.head_v_dim
        self.in_proj_qkv = _linear(self.conv_dim, hidden)
        self.in_proj_z = _linear(value_dim, hidden)
        self.in_proj_b = _linear(self.num_v_heads, hidden)
        self.in_proj_a = _linear(self.num_v_heads, hidden)
        self.conv1d = _Weight(self.conv_dim, 1, self.kernel)
        self.A_log = _vector(self.num_v_heads)
        self.dt_bias = _vector(self.num_v_heads)
        self.norm = _Norm(self.head_v_dim)
        self.out_proj = _linear(hidden, value_dim)
        # Checkpoint layout of the conv channels: all q heads, all k heads, all v heads.
        key_dim, total_value_dim = total_k * self.head_k_dim, total_v * self.head_v_dim
        channels = tuple(
            piece
            for offset, total in ((0, key_dim), (key_dim, key_dim), (2 * key_dim, total_value_dim))
            for piece in tp.slice(0, total, offset).pieces
        )
        qkv = Shard(0, 2 * key_dim + total_value_dim, channels)
        self.tp_shards = {
            "in_proj_qkv.weight": qkv, "conv1d.weight": qkv, "in_proj_z.weight": tp.slice(0, total_value_dim),
            "in_proj_b.weight": tp.slice(0, total_v), "in_proj_a.weight": tp.slice(0, total_v),
            "A_log": tp.slice(0, total_v), "dt_bias": tp.slice(0, total_v),
            "out_proj.weight": tp.slice(1, total_value_dim),
        }  # fmt: skip

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.conv_dim, self.kernel - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The input projections of every token of a step ``[N, H]`` at once (one GEMM each):
        mixed qkv, z, a, b."""
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_a(x), self.in_proj_b(x)

    def core(
        self, projected: Sequence[torch.Tensor], conv_state: torch.Tensor, state: torch.Tensor, decode: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`project`'s rows of B sequences ``[B, T, ...]`` -> (y ``[B, T, Hv * Dv]`` before out_proj,
        conv state, recurrent state)."""
        mixed_qkv, z, a, b = projected
        return gdn.gated_delta_net(
            mixed_qkv, z, a, b, self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias, self.norm.weight,
            num_k_heads=self.num_k_heads, head_k_dim=self.head_k_dim, head_v_dim=self.head_v_dim, eps=self.eps,
            gate_activation=self.gate_activation, conv_state=conv_state, recurrent_state=state,
            chunk_size=None if decode else 64,
            # the stores hand over copies (gathered or stacked) that they replace by the result
            state_in_place=True,
        )  # fmt: skip


class Indexer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.index_qk_proj = _linear((config.indexer_n_heads + 1) * config.indexer_head_dim, config.hidden_size)
        self.q_layernorm = _Norm(config.indexer_head_dim)
        self.k_layernorm = _Norm(config.indexer_head_dim)


class QSAAttention(nn.Module):
    """One rank's query heads and the KV heads they read (split when there are at least as many
    KV heads as ranks, else replicated); the indexer is replicated; o_proj yields a partial sum."""

    def __init__(self, config: Any, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        self.config = config
        total_heads, total_kv, head_dim, hidden = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size,
        )  # fmt: skip
        self.num_heads = heads = tp.local(total_heads)
        self.num_kv_heads = kv_heads = max(1, total_kv // tp.size)
        # The KV heads of this rank's query heads: its share, or the one head its rank group shares.
        kv_index = tp.rank if total_kv >= tp.size else tp.rank // (tp.size // total_kv)
        self.q_proj = _linear(heads * head_dim * 2, hidden)
        self.k_proj = _linear(kv_heads * head_dim, hidden)
        self.v_proj = _linear(kv_heads * head_dim, hidden)
        self.o_proj = _linear(hidden, heads * head_dim)
        self.q_norm = _Norm(head_dim)
        self.k_norm = _Norm(head_dim)
        self.indexer = Indexer(config) if config.indexer_budget is not None else None
        kv_rows = Shard(0, total_kv * head_dim, ((kv_index * kv_heads * head_dim, kv_heads * head_dim),))
        self.tp_shards = {
            # per query head: D query features then D gate features
            "q_proj.weight": tp.slice(0, total_heads * 2 * head_dim), "k_proj.weight": kv_rows,
            "v_proj.weight": kv_rows, "o_proj.weight": tp.slice(1, total_heads * head_dim),
        }  # fmt: skip

    def prepare(self, x: torch.Tensor, positions: torch.Tensor) -> qsa.PreparedTokens:
        """Every token of a step ``[N, H]`` at once, whatever the number of sequences: the input
        projections (one GEMM each) and the per-token norms and rotations (`qsa.prepare_tokens`)."""
        c = self.config
        index_qk = self.indexer.index_qk_proj(x) if self.indexer is not None else x
        return qsa.prepare_tokens(
            self.q_proj(x), self.k_proj(x), self.v_proj(x), index_qk, positions,
            q_norm_weight=self.q_norm.weight, k_norm_weight=self.k_norm.weight,
            index_q_norm_weight=self.indexer.q_layernorm.weight if self.indexer is not None else None,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=c.head_dim,
            rotary_dim=rotary_dim(c), rope_theta=c.rope_parameters["rope_theta"], eps=c.rms_norm_eps,
            num_index_heads=c.indexer_n_heads, index_head_dim=c.indexer_head_dim, budget=c.indexer_budget,
        )  # fmt: skip

    def attend(
        self, prepared: qsa.PreparedTokens, positions: torch.Tensor, past: QSAPast
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, qsa.IndexerStep | None]:
        """One sequence: its rows of `prepare` -> (out before o_proj, new k, new v, the indexer
        keys it adds).

        past: what the cache holds of the sequence (`StateStore.kv`): k, v and the indexer's
        block keys plus open group; the complete groups' keys are never recomputed.
        """
        c = self.config
        past_k, past_v, past_indexer = past
        return qsa.attend_ring(
            prepared, positions,
            index_k_norm_weight=self.indexer.k_layernorm.weight if self.indexer is not None else None,
            rotary_dim=rotary_dim(c), rope_theta=c.rope_parameters["rope_theta"], eps=c.rms_norm_eps,
            budget=c.indexer_budget, ratio=c.indexer_compress_ratio, past_k=past_k, past_v=past_v,
            past_indexer=past_indexer,
        )  # fmt: skip


class NGramEmbedding(nn.Module):
    layer_multipliers: torch.Tensor
    ngram_heads_vocab_sizes: torch.Tensor
    ngram_heads_offsets: torch.Tensor

    def __init__(self, config: Any, ple_layer_index: int, tp: TensorParallel) -> None:
        super().__init__()
        heads = (config.ngram_size - 1) * config.heads_per_ngram
        sizes = ple.ngram_head_sizes(
            config.ngram_size, config.heads_per_ngram, config.ngram_vocab_size_base, ple_layer_index
        )
        self.register_buffer("layer_multipliers", torch.zeros(config.ngram_size, dtype=torch.long))
        self.register_buffer("ngram_heads_vocab_sizes", torch.tensor(sizes, dtype=torch.long))
        self.register_buffer("ngram_heads_offsets", torch.tensor([0, *sizes[:-1]], dtype=torch.long).cumsum(0))
        # Split by rows (vocabulary), as stock vLLM does: each rank looks up the rows it holds, zeros
        # elsewhere, and the ranks' lookups are summed.
        rows = ple.table_rows(sizes, config.make_ngram_vocab_size_divisible_by)
        self.ngram_embedding = _Weight(tp.local(rows), config.ple_embed_dim // heads)
        self.tp, self.row_start = tp, tp.rank * tp.local(rows)
        self.tp_shards = {"ngram_embedding.weight": tp.slice(0, rows)}

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """Embedding rows ``[..., E / heads]`` of global table rows ``[...]``."""
        return _row_parallel_lookup(rows, self.ngram_embedding.weight, self.row_start, self.tp)


def _row_parallel_lookup(ids: torch.Tensor, table: torch.Tensor, start: int, tp: TensorParallel) -> torch.Tensor:
    """Rows ``ids`` of a table split by rows over the ranks (this rank's rows begin at ``start``)."""
    if tp.size == 1:
        return nn.functional.embedding(ids.to(table.device), table)
    local = ids.to(table.device) - start
    outside = (local < 0) | (local >= table.shape[0])
    found = nn.functional.embedding(local.masked_fill(outside, 0), table).masked_fill(outside.unsqueeze(-1), 0)
    return tp.all_reduce(found)


class PLELayer(nn.Module):
    def __init__(self, config: Any, ple_layer_index: int, tp: TensorParallel) -> None:
        super().__init__()
        width = config.hc_count * config.hidden_size
        self.hc_count, self.eps = config.hc_count, config.rms_norm_eps
        self.heads_per_ngram, self.eos = config.heads_per_ngram, eos_id(config)
        self.ngram_size, self.kernel = config.ngram_size, config.ple_conv_kernel_size
        self.ple_embedding = NGramEmbedding(config, ple_layer_index, tp)
        self.key_proj = _linear(width, config.ple_embed_dim)
        self.value_proj = _linear(config.hidden_size, config.ple_embed_dim)
        self.norm_key, self.norm_query, self.norm_conv = _Norm(width), _Norm(width), _Norm(width)
        self.conv1d = _Weight(width, 1, self.kernel)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state, n-gram context) per sequence."""
        width = int(self.conv1d.weight.shape[0])
        return (width, (self.kernel - 1) * self.ngram_size), (self.ngram_size - 1,)

    def term(
        self, streams: torch.Tensor, ids: torch.Tensor, context: torch.Tensor, conv_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        emb = self.ple_embedding
        return ple.ple(
            streams, ids, emb.ngram_embedding.weight, emb.layer_multipliers, emb.ngram_heads_vocab_sizes,
            emb.ngram_heads_offsets, self.key_proj.weight, self.value_proj.weight, self.norm_key.weight,
            self.norm_query.weight, self.norm_conv.weight, self.conv1d.weight.squeeze(1), hc_count=self.hc_count,
            heads_per_ngram=self.heads_per_ngram, eos_token_id=self.eos, eps=self.eps, context=context,
            conv_state=conv_state, lookup=emb.lookup,
        )  # fmt: skip


class SparseMoe(nn.Module):
    """Every expert (routed and shared) holds this rank's slice of its intermediate dimension, as
    stock vLLM's tensor-parallel MoE does; the router and the shared-expert gate are replicated
    and the block's output is summed over ranks."""

    def __init__(self, config: Any, tp: TensorParallel) -> None:
        super().__init__()
        self.top_k, self.normalize, self.tp = config.num_experts_per_tok, config.norm_topk_prob, tp
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        shared_i = config.shared_expert_intermediate_size
        self.gate = _Weight(e, h)
        self.experts = _Experts(e, h, tp.local(i))
        self.shared_expert = _SwiGLU(h, tp.local(shared_i))
        self.shared_expert_gate = _linear(1, h)
        self.tp_shards = {
            # this rank's gate rows, then its up rows
            "experts.gate_up_proj": Shard(1, 2 * i, tp.slice(1, i).pieces + tp.slice(1, i, offset=i).pieces),
            "experts.down_proj": tp.slice(2, i),
            "shared_expert.gate_proj.weight": tp.slice(0, shared_i),
            "shared_expert.up_proj.weight": tp.slice(0, shared_i),
            "shared_expert.down_proj.weight": tp.slice(1, shared_i),
        }  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert
        return self.tp.all_reduce(moe.moe(
            x, self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj,
            torch.cat([shared.gate_proj.weight, shared.up_proj.weight]), shared.down_proj.weight,
            self.shared_expert_gate.weight, top_k=self.top_k, normalize=self.normalize,
        ))  # fmt: skip


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, index: int, tp: TensorParallel) -> None:
        super().__init__()
        self.layer_type = config.layer_types[index]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, tp)
        else:
            self.self_attn = QSAAttention(config, tp)
        self.mlp = SparseMoe(config, tp)
        ple_ids = list(config.ple_layer_ids or [])
        self.ple = PLELayer(config, ple_ids.index(index + 1), tp) if index + 1 in ple_ids else None
        self.attn_hyper_connection = GatedResidual(config)
        self.mlp_hyper_connection = GatedResidual(config)


class TextModel(nn.Module):
    def __init__(self, config: Any, tp: TensorParallel) -> None:
        super().__init__()
        # The token embedding is split by vocabulary rows (as lm_head); hyper-connections are replicated.
        self.tp = tp
        self.embed_tokens = nn.Embedding(tp.local(config.vocab_size), config.hidden_size)
        self.tp_shards = {"embed_tokens.weight": tp.slice(0, config.vocab_size)}
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.hyper_connection_mixer = GatedResidual(config, inject=False)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens.weight
        return _row_parallel_lookup(token_ids, table, self.tp.rank * table.shape[0], self.tp)

    def layer(self, index: int) -> DecoderLayer:
        block = self.layers[index]
        assert isinstance(block, DecoderLayer)
        return block


# ---------------------------------------------------------------------------------------------
# States
# ---------------------------------------------------------------------------------------------


QSAPast = tuple[torch.Tensor | None, torch.Tensor | None, "qsa.IndexerPast | None"]
"""(k, v, indexer keys) a cache holds of one QSA layer of one sequence (`StateStore.kv`)."""


class StateStore(Protocol):
    """Per-sequence states of one step; ``seqs`` are indices into the step's sequences."""

    def recurrent(self, layer: int, kind: str, seqs: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """kind "gdn": (conv, recurrent); kind "ple": (n-gram context, conv); batched over seqs.

        Fresh tensors the model owns (it may update them in place), not views of the store."""
        ...

    def set_recurrent(self, layer: int, kind: str, seqs: Sequence[int], a: torch.Tensor, b: torch.Tensor) -> None: ...

    def kv(self, layer: int, seq: int) -> QSAPast:
        """Past of one QSA layer of one sequence: k ``[P, Hkv, D]`` (normed, rotated), v and the
        indexer's `qsa.IndexerPast` (one key per complete group, raw keys of the open group);
        Nones when P = 0 (the indexer part is also None without an indexer)."""
        ...

    def append_kv(
        self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor, indexer: qsa.IndexerStep | None
    ) -> None:
        """Store the step's k, v ``[T, Hkv, D]`` and the indexer keys it adds."""
        ...


@dataclass
class SequenceCache:
    """Everything one sequence carries between steps (the reference `StateStore`'s unit)."""

    recurrent: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    kv: dict[int, QSAPast] = field(default_factory=dict)


class DictStateStore:
    """A `StateStore` over plain per-sequence dicts; fresh states are made on first use."""

    def __init__(self, core: Qwen4ExpCore, caches: Sequence[SequenceCache]) -> None:
        self.core, self.caches = core, caches

    def recurrent(self, layer: int, kind: str, seqs: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self.caches[s].recurrent.get((layer, kind)) or self.core.fresh_state(layer, kind) for s in seqs]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def set_recurrent(self, layer: int, kind: str, seqs: Sequence[int], a: torch.Tensor, b: torch.Tensor) -> None:
        for i, s in enumerate(seqs):
            self.caches[s].recurrent[(layer, kind)] = (a[i], b[i])

    def kv(self, layer: int, seq: int) -> QSAPast:
        return self.caches[seq].kv.get(layer, (None, None, None))

    def append_kv(
        self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor, indexer: qsa.IndexerStep | None
    ) -> None:
        old_k, old_v, old_indexer = self.caches[seq].kv.get(layer, (None, None, None))
        past_indexer = None
        if indexer is not None:
            # Like the serving cache: a key per complete group, the raw keys of the open group only.
            old_keys = [] if old_indexer is None else [old_indexer.block_keys]
            keys = torch.cat([*old_keys, indexer.block_keys])
            past_indexer = qsa.IndexerPast(keys, indexer.open_keys)
        k_all = k if old_k is None else torch.cat([old_k, k])
        v_all = v if old_v is None else torch.cat([old_v, v])
        self.caches[seq].kv[layer] = (k_all, v_all, past_indexer)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


class Qwen4ExpCore(nn.Module):
    """Qwen4ExpForCausalLM's text model and lm_head (parameter names = checkpoint names).

    With ``tp`` (tensor parallelism) this is one rank's part: it holds its slices of the split
    tensors (`check_tensor_parallel` says which) and sums block outputs over ranks through
    ``tp.all_reduce``; `load_checkpoint_tensors` takes the rank's slice of every full tensor.
    """

    def __init__(self, config: Any, tp: TensorParallel | None = None) -> None:
        super().__init__()
        check_config(config)
        self.tp = tp = tp or TensorParallel()
        check_tensor_parallel(config, tp.size)
        self.config = config
        self.model = TextModel(config, tp)
        # Split by vocabulary rows: each rank computes its logits, gathered over the ranks.
        self.lm_head = _linear(tp.local(config.vocab_size), config.hidden_size)
        self.tp_shards = {"lm_head.weight": tp.slice(0, config.vocab_size)}
        self._tp_shards: dict[str, Shard] = {
            f"{module_name}.{name}" if module_name else name: shard
            for module_name, module in self.named_modules()
            for name, shard in getattr(module, "tp_shards", {}).items()
        }

    # -- states ---------------------------------------------------------------------------------
    def fresh_state(self, layer: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        block = self.model.layer(layer)
        # (the embedding table: a projection's weight may have been handed to a kernel)
        dtype, device = self.model.embed_tokens.weight.dtype, self.model.embed_tokens.weight.device
        if kind == "gdn":
            conv, rec = block.linear_attn.state_shapes()
            return torch.zeros(conv, dtype=dtype, device=device), torch.zeros(rec, device=device)
        assert block.ple is not None, f"layer {layer} has no PLE"
        conv, context = block.ple.state_shapes()
        eos = torch.full(context, eos_id(self.config), dtype=torch.long, device=device)
        return eos, torch.zeros(conv, dtype=dtype, device=device)

    # -- forward --------------------------------------------------------------------------------
    def forward_step(
        self, token_ids: torch.Tensor, positions: torch.Tensor, query_lens: Sequence[int], store: StateStore
    ) -> torch.Tensor:
        """New tokens of several sequences (``[N]``, sequence after sequence) -> final hidden ``[N, H]``."""
        return self.forward_streams(token_ids, positions, query_lens, store)[0]

    def forward_streams(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        query_lens: Sequence[int],
        store: StateStore,
        entering: dict[int, torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_step`, also returning the residual streams before the final mixer ``[N, hc * H]``
        (what the MTP head reads: `qwen38_plugin.mtp_reference`). Each key of ``entering`` (a layer
        index, ``num_hidden_layers`` meaning after the last layer) is set to the streams entering
        that layer (what a DFlash drafter's target features reduce: `dflash2.drafter_reference`)."""
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        decodes = [s for s, n in enumerate(query_lens) if n == 1]
        prefills = [s for s, n in enumerate(query_lens) if n > 1]
        dec_rows = torch.tensor([starts[s] for s in decodes], dtype=torch.long, device=token_ids.device)
        groups: list[tuple[list[int], torch.Tensor | slice]] = []
        if decodes:
            groups.append((decodes, dec_rows))
        groups += [([s], slice(starts[s], starts[s + 1])) for s in prefills]

        cfg = self.config
        streams = hyper_connection.hc_expand(self.model.embed(token_ids), cfg.hc_count)
        for index in range(cfg.num_hidden_layers):
            if entering is not None and index in entering:
                entering[index] = streams
            layer = self.model.layer(index)
            if layer.ple is not None:
                term = torch.empty_like(streams)
                for seqs, rows in groups:
                    ctx, conv = store.recurrent(index, "ple", seqs)
                    out, ctx, conv = layer.ple.term(
                        _as_batch(streams, rows, len(seqs)), _as_batch(token_ids, rows, len(seqs)), ctx, conv
                    )
                    store.set_recurrent(index, "ple", seqs, ctx, conv)
                    term[rows] = out.flatten(0, 1)
                streams = streams + term
            x, inject = layer.attn_hyper_connection.mix(streams)
            assert inject is not None
            if layer.layer_type == "linear_attention":
                attn = layer.linear_attn
                y = x.new_empty(x.shape[0], attn.num_v_heads * attn.head_v_dim)
                projected = attn.project(x)
                for seqs, rows in groups:
                    conv, rec = store.recurrent(index, "gdn", seqs)
                    decode = isinstance(rows, torch.Tensor)
                    mine = [_as_batch(p, rows, len(seqs)) for p in projected]
                    out, conv, rec = attn.core(mine, conv, rec, decode)
                    store.set_recurrent(index, "gdn", seqs, conv, rec)
                    y[rows] = out.flatten(0, 1)
                block_out = self.tp.all_reduce(attn.out_proj(y))
            else:
                sa = layer.self_attn
                y = x.new_empty(x.shape[0], sa.num_heads * cfg.head_dim)
                prepared = sa.prepare(x, positions)
                for s, n in enumerate(query_lens):
                    rows_s = slice(starts[s], starts[s] + n)
                    out, k, v, keys = sa.attend(prepared.rows(rows_s), positions[rows_s], store.kv(index, s))
                    store.append_kv(index, s, k, v, keys)
                    y[rows_s] = out
                block_out = self.tp.all_reduce(sa.o_proj(y))
            streams = hyper_connection.hc_inject(streams, block_out, inject)
            x, inject = layer.mlp_hyper_connection.mix(streams)
            assert inject is not None
            streams = hyper_connection.hc_inject(streams, layer.mlp(x), inject)
        if entering is not None and cfg.num_hidden_layers in entering:
            entering[cfg.num_hidden_layers] = streams
        hidden, _ = self.model.hyper_connection_mixer.mix(streams)
        return hidden, streams

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(self.lm_head(hidden))

    # -- weights --------------------------------------------------------------------------------
    def load_checkpoint_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors in; raise `CheckpointError` naming missing or unexpected ones.

        Accepts transformers' on-disk names (per-expert ``experts.{e}.{gate,up,down}_proj.weight``,
        PLE ``ngram_embedding.shard_{i}.weight``) as well as the runtime ones. ``mtp.*`` tensors
        (the multi-token-prediction head) are not part of this model and are skipped.
        """
        params: dict[str, torch.Tensor] = dict(self.named_parameters())
        params.update(dict(self.named_buffers()))
        loaded: set[str] = set()
        unexpected: list[str] = []
        expert_parts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        shards: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in tensors:
            if name.startswith("mtp.") or name.startswith("model.visual."):
                continue
            name = name.removeprefix("model.language_model.").removeprefix("language_model.")
            if not name.startswith(("model.", "lm_head.")):
                name = "model." + name
            parts = name.split(".")
            if ".mlp.experts." in name and parts[-3].isdigit():
                prefix = ".".join(parts[:-3])
                expert_parts.setdefault(prefix, {}).setdefault(int(parts[-3]), {})[parts[-2]] = tensor
                continue
            if ".ngram_embedding.shard_" in name:
                prefix = name.split(".shard_")[0] + ".weight"
                shards.setdefault(prefix, {})[int(parts[-2].removeprefix("shard_"))] = tensor
                continue
            if name not in params:
                unexpected.append(name)
                continue
            self._copy(params[name], tensor, name)
            loaded.add(name)
        absent: list[str] = []
        for prefix, experts in expert_parts.items():
            names = [f"{prefix}.{e}.{part}.weight" for e in range(self.config.num_experts) for part in _EXPERT_PARTS]
            absent += [n for n in names if n.split(".")[-2] not in experts.get(int(n.split(".")[-3]), {})]
            if any(n.startswith(prefix + ".") for n in absent):
                continue
            stacked = {
                "gate_up_proj": torch.stack(
                    [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in sorted(experts)]
                ),
                "down_proj": torch.stack([experts[e]["down_proj"] for e in sorted(experts)]),
            }
            for suffix, value in stacked.items():
                target = f"{prefix}.{suffix}"
                if target not in params:
                    unexpected.append(target)
                    continue
                self._copy(params[target], value, target)
                loaded.add(target)
        for target, pieces in shards.items():
            if target not in params:
                unexpected.append(target)
                continue
            table = torch.cat([pieces[i] for i in sorted(pieces)])
            shard = self._tp_shards.get(target)
            rows = shard.full if shard is not None else params[target].shape[0]
            self._copy(params[target], table[:rows], target)
            loaded.add(target)
        missing = sorted(set(params) - loaded - self._derived_names())
        # A stacked expert tensor is missing because of the per-expert tensors named in `absent`.
        missing = sorted(
            [n for n in missing if not any(a.startswith(n.rsplit(".", 1)[0] + ".") for a in absent)] + absent
        )
        if unexpected or missing:
            raise CheckpointError(missing, sorted(unexpected))
        return loaded

    def _derived_names(self) -> set[str]:
        # Buffers the checkpoint may omit because they follow from the config.
        return {n for n, _ in self.named_buffers() if n.endswith(("ngram_heads_vocab_sizes", "ngram_heads_offsets"))}

    def _copy(self, param: torch.Tensor, value: torch.Tensor, name: str) -> None:
        """Copy a full checkpoint tensor in, or this rank's slice of it when the tensor is split."""
        shard = self._tp_shards.get(name)
        want = list(param.shape)
        if shard is not None:
            want[shard.dim] = shard.full
        if list(value.shape) != want:
            raise CheckpointError([], [], {name: (tuple(value.shape), tuple(want))})
        if shard is not None:
            value = shard.take(value)
        with torch.no_grad():
            param.copy_(value.to(param.dtype))


_EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


def _as_batch(t: torch.Tensor, rows: torch.Tensor | slice, batch: int) -> torch.Tensor:
    """Rows of t as ``[B, T, ...]``: decode rows become B sequences of 1 token, a slice one sequence."""
    picked = t[rows]
    return picked.unsqueeze(1) if isinstance(rows, torch.Tensor) else picked.unsqueeze(0)


class CheckpointError(ValueError):
    """Checkpoint tensors that do not match the model; names every offending tensor."""

    def __init__(
        self,
        missing: list[str],
        unexpected: list[str],
        bad_shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
    ) -> None:
        lines = []
        if missing:
            lines.append(f"missing tensors ({len(missing)}): {', '.join(missing)}")
        if unexpected:
            lines.append(f"unexpected tensors ({len(unexpected)}): {', '.join(unexpected)}")
        for name, (got, want) in (bad_shapes or {}).items():
            lines.append(f"tensor {name} has shape {list(got)}, the config implies {list(want)}")
        super().__init__(
            "Qwen4Exp checkpoint does not match its config: " + "; ".join(lines) + ". Check that config.json "
            "belongs to these weights (layer_types, ple_layer_ids, num_experts, head counts)."
        )
        self.missing, self.unexpected = missing, unexpected


def iter_safetensors(path: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint directory's ``*.safetensors`` files."""
    from pathlib import Path

    from safetensors import safe_open

    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def greedy_generate(
    core: Qwen4ExpCore, prompts: Sequence[Sequence[int]], steps: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy continuation of several prompts run together (prefill all, then decode all).

    Returns (generated ids per prompt, logits of the prefill's last position per prompt).
    """
    caches = [SequenceCache() for _ in prompts]
    store = DictStateStore(core, caches)
    device = core.model.embed_tokens.weight.device
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    positions = torch.cat([torch.arange(len(p), device=device) for p in prompts])
    hidden = core.forward_step(ids, positions, [len(p) for p in prompts], store)
    last_rows = torch.tensor([sum(len(q) for q in prompts[: i + 1]) - 1 for i in range(len(prompts))])
    first_logits = core.logits(hidden[last_rows])
    out = [[int(t)] for t in first_logits.argmax(-1)]
    lengths = [len(p) for p in prompts]
    for _ in range(steps - 1):
        ids = torch.tensor([o[-1] for o in out], device=device)
        positions = torch.tensor(lengths, device=device)
        hidden = core.forward_step(ids, positions, [1] * len(prompts), store)
        for o, t in zip(out, core.logits(hidden).argmax(-1), strict=True):
            o.append(int(t))
        lengths = [n + 1 for n in lengths]
    return out, list(first_logits)
