"""Qwen4Exp's PLE (per-layer n-gram embeddings) inside vLLM, with the table in host memory.

The n-gram tables are the largest tensors of Qwen3.8 Flash-Next (about 87 GiB); stock vLLM keeps
them in pinned host memory and gathers each step's rows to the GPU (rows K01 / R32 of the stock
matrix). So does this layer by default (``QWEN38_PLE_TABLE=host``):

- the table lives in one shared-memory segment per table that every tensor-parallel rank of the
  node maps (one copy per node, not one per rank); it is pinned for the GPU;
- on CUDA the rows are gathered by an ordinary embedding lookup on a CUDA view of that pinned
  memory (unified virtual addressing: the GPU reads host memory directly, no host sync, so the
  lookup can sit inside a CUDA graph), on CPU by a lookup in the mapped memory itself;
- ``QWEN38_PLE_TABLE=device`` keeps the table in device memory instead (small models, where the
  PCIe read per step is the larger cost).

The per-step work (n-gram hashing with the EOS rule, the key/query gate and the dilated causal
convolution continuing from each request's state) is `ops.ple_varlen`, batched over the step's
requests; the projections are vLLM linear layers. The states live in the state slot of the same
layer's GDN (`vllm_gdn.ple_state_shapes`).

This module imports vLLM; it is loaded only when vLLM builds the model.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.platforms import current_platform

from qwen38_plugin import vllm_ops
from qwen38_plugin.ops import ple, ple_varlen
from qwen38_plugin.vllm_qsa_cache import model_dtype

logger = logging.getLogger("vllm.plugins.qwen38_plugin")

PLACEMENT_ENV = "QWEN38_PLE_TABLE"
PLACEMENTS = ("host", "device")


class PLEConfigError(ValueError):
    """A PLE setting that cannot be honoured; the message names the setting and the fix."""


def table_placement(environ: dict[str, str] | None = None) -> str:
    value = (environ if environ is not None else os.environ).get(PLACEMENT_ENV, "host").strip() or "host"
    if value not in PLACEMENTS:
        raise PLEConfigError(f"{PLACEMENT_ENV}={value!r}: use host (default: pinned host memory) or device")
    return value


def ngram_head_sizes(config: Any, ple_layer_index: int) -> list[int]:
    return ple.ngram_head_sizes(
        config.ngram_size, config.heads_per_ngram, config.ngram_vocab_size_base, ple_layer_index
    )


class SharedHostTable:
    """A table in a shared-memory segment that every rank of the node maps.

    Each rank opens (or creates) the segment under a name derived from the engine instance and
    the layer, so the ranks of one engine share it and nothing else does; after every rank has
    mapped it, the name is removed, so the memory goes away with the last process that maps it,
    also after a crash. Every rank writes the rows it loads (all of them: they are identical,
    so concurrent writes store the same bytes).
    """

    def __init__(self, name: str, rows: int, dim: int, dtype: torch.dtype) -> None:
        self.path = f"/dev/shm/qwen38-ple-{name}"
        nbytes = rows * dim * torch.empty(0, dtype=dtype).element_size()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != nbytes:
                os.ftruncate(fd, nbytes)
            self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=dtype).view(rows, dim)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):  # another rank removed the name first
            os.unlink(self.path)


# The dtypes a PLE table may be stored in (K15: taken from the checkpoint, whatever --dtype says).
# float8_e4m3fn tables carry one global scale per table, ``ngram_embedding.weight_scale``, as in
# stock's Qwen4ExpPLEFp8EmbeddingMethod: a row is ``fp8.to(dtype) * scale``.
TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)


class NGramTable(nn.Module):
    """One PLE layer's n-gram embedding table ``[rows, E / heads]`` and its lookup.

    The checkpoint stores it in ``split_ngram_parts`` shards (``ngram_embedding.shard_{i}.weight``),
    loaded in order into consecutive rows. The table keeps the checkpoint's dtype (row K15 of the
    stock matrix: stock resolves the PLE storage dtype from the checkpoint), not the model's: it is
    allocated when the first shard arrives, in that shard's dtype, and each looked-up row is
    converted to the model's dtype (``PortablePLE.embed``). A float8_e4m3fn table is dequantized
    with its global scale. A config's ``ple_embedding_dtype`` that disagrees with the shards, shards
    of different dtypes, or an FP8 table without its scale fail at startup, naming the tensor.
    """

    def __init__(self, vllm_config: VllmConfig, config: Any, ple_layer_index: int, prefix: str) -> None:
        super().__init__()
        heads = (config.ngram_size - 1) * config.heads_per_ngram
        sizes = ngram_head_sizes(config, ple_layer_index)
        self.rows = ple.table_rows(sizes, config.make_ngram_vocab_size_divisible_by)
        self.dim = config.ple_embed_dim // heads
        self.name = f"{prefix}.ngram_embedding"
        self.compute_dtype = model_dtype(vllm_config)
        self.declared_dtype: str | None = getattr(config, "ple_embedding_dtype", None)
        self.dtype: torch.dtype | None = None  # the checkpoint's, set by the first shard
        self.placement = table_placement()
        self.layer_multipliers = nn.Parameter(torch.zeros(config.ngram_size, dtype=torch.long), requires_grad=False)
        self.ngram_heads_vocab_sizes = nn.Parameter(torch.tensor(sizes, dtype=torch.long), requires_grad=False)
        self.ngram_heads_offsets = nn.Parameter(
            torch.tensor([0, *sizes[:-1]], dtype=torch.long).cumsum(0), requires_grad=False
        )
        self._shared: SharedHostTable | None = None
        self._shared_key = hashlib.sha256(f"{vllm_config.instance_id}/{prefix}".encode()).hexdigest()[:24]
        if self.placement == "device":
            # Placeholder on the model's device; the rows arrive with the checkpoint's dtype.
            self.weight = nn.Parameter(torch.empty(0, self.dim, dtype=self.compute_dtype), requires_grad=False)
        self._host: torch.Tensor | None = None
        self._scale: torch.Tensor | None = None  # FP8 tables: the global scale, on the lookup device
        self._view: torch.Tensor | None = None  # what the lookup reads (set by `finish_loading`)

    def _allocate(self, dtype: torch.dtype, what: str) -> torch.Tensor:
        """The table's storage in the checkpoint's ``dtype`` (first shard); later shards must match."""
        if self.dtype is None:
            if dtype not in TABLE_DTYPES:
                raise ValueError(
                    f"{what}: a PLE table stored as {dtype} is not supported; store it as one of "
                    f"{', '.join(str(d).removeprefix('torch.') for d in TABLE_DTYPES)}"
                )
            declared = self.declared_dtype
            if declared and declared.removeprefix("torch.") != str(dtype).removeprefix("torch."):
                raise ValueError(
                    f"{what}: config ple_embedding_dtype is {declared!r} but the checkpoint stores the table as "
                    f"{str(dtype).removeprefix('torch.')}; fix the config or the checkpoint"
                )
            self.dtype = dtype
            if self.placement == "device":
                self.weight.data = torch.empty(self.rows, self.dim, dtype=dtype, device=self.weight.device)
            else:
                self._shared = SharedHostTable(self._shared_key, self.rows, self.dim, dtype)
                self._host = self._shared.tensor
        elif dtype != self.dtype:
            raise ValueError(f"{what}: stored as {dtype}, the table's other shards as {self.dtype}")
        return self.weight.data if self._host is None else self._host

    def load_shard(self, index: int, shard: torch.Tensor) -> None:
        """Copy checkpoint shard ``index`` into its rows (shards are equal slices of the table)."""
        what = f"{self.name}.shard_{index}.weight"
        start = index * shard.shape[0]
        if shard.dim() != 2 or shard.shape[1] != self.dim or start >= self.rows:
            raise ValueError(
                f"{what}: shape {list(shard.shape)}; the config implies {self.rows} rows of "
                f"{self.dim} (check ple_embed_dim, heads_per_ngram, ngram_size and split_ngram_parts)"
            )
        target = self._allocate(shard.dtype, what)
        rows = min(shard.shape[0], self.rows - start)
        target[start : start + rows].copy_(shard[:rows])

    def load_scale(self, scale: torch.Tensor) -> None:
        """The FP8 table's global scale (``ngram_embedding.weight_scale``, one value)."""
        if scale.numel() != 1:
            raise ValueError(f"{self.name}.weight_scale: shape {list(scale.shape)}, expected one value")
        self._scale = scale.reshape(()).to(torch.float32)

    def finish_loading(self) -> int:
        """After the weights are in: make the table readable by the device. Returns host bytes held."""
        if self.dtype is None:
            raise ValueError(f"Qwen4Exp checkpoint has no shards of the PLE table {self.name}")
        if self.dtype == torch.float8_e4m3fn and self._scale is None:
            raise ValueError(
                f"{self.name}: the table is stored as float8_e4m3fn but the checkpoint has no {self.name}.weight_scale"
            )
        if self.dtype != torch.float8_e4m3fn and self._scale is not None:
            raise ValueError(f"{self.name}.weight_scale: unexpected, the table is stored as {self.dtype}")
        if self._scale is not None:
            self._scale = self._scale.to(self.layer_multipliers.device)
        if self._host is None:
            self._view = self.weight.data
            return 0
        assert self._shared is not None
        from vllm.distributed import get_tp_group

        get_tp_group().barrier()  # every rank of the engine has mapped the segment: drop its name
        self._shared.unlink()
        host = self._host
        if current_platform.is_cuda_alike():
            from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

            cudart = torch.cuda.cudart()
            status = cudart.cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(), 0)
            if int(status) != 0:
                raise RuntimeError(
                    f"PLE table: pinning {host.numel() * host.element_size() / 2**30:.2f} GiB of host memory failed "
                    f"(cudaHostRegister error {int(status)}); set {PLACEMENT_ENV}=device to keep the table on the GPU "
                    "or free host memory"
                )
            self._view = get_accelerator_view_from_cpu_tensor(host)
        else:
            self._view = host
        return host.numel() * host.element_size()

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[..., E / heads]`` (on ``rows.device``) of table rows ``[...]``, in the table's
        dtype (FP8 tables dequantized to the model's dtype with their scale)."""
        assert self._view is not None, "PLE table read before finish_loading"
        found = nn.functional.embedding(rows, self._view)
        if self._scale is None:
            return found
        return found.to(self.compute_dtype) * self._scale.to(self.compute_dtype)


class GroupedNorm(nn.Module):
    """Qwen4Exp's RMSNorm over each stream of the hyper-connection width (one weight per feature)."""

    def __init__(self, width: int, group: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))
        self.group = group


class PortablePLE(nn.Module):
    """One PLE layer: table, projections, norms and the dilated convolution's weight."""

    def __init__(self, vllm_config: VllmConfig, config: Any, ple_layer_index: int, gdn: nn.Module, prefix: str) -> None:
        super().__init__()
        hidden, hc = config.hidden_size, config.hc_count
        # The GDN layer of the same decoder layer: its state slot holds this layer's states.
        self._gdn = (gdn,)
        width = hc * hidden
        self.hc_count, self.ngram_size, self.eps = hc, config.ngram_size, config.rms_norm_eps
        self.heads_per_ngram = config.heads_per_ngram
        eos = config.eos_token_id
        self.eos = int(eos[0] if isinstance(eos, (list, tuple)) else eos)
        self.ple_embedding = NGramTable(vllm_config, config, ple_layer_index, f"{prefix}.ple_embedding")
        quant_config = vllm_config.quant_config
        self.key_proj = ReplicatedLinear(
            config.ple_embed_dim, width, bias=False, quant_config=quant_config, prefix=f"{prefix}.key_proj"
        )
        self.value_proj = ReplicatedLinear(
            config.ple_embed_dim, hidden, bias=False, quant_config=quant_config, prefix=f"{prefix}.value_proj"
        )
        self.norm_key, self.norm_query, self.norm_conv = (GroupedNorm(width, hidden) for _ in range(3))
        self.conv1d = _ConvWeight(width, config.ple_conv_kernel_size)
        self.op_layer_name = vllm_ops.register_owner(vllm_config, prefix, self)

    @property
    def gdn(self) -> Any:
        return self._gdn[0]

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """streams ``[T, hc * H]`` plus this layer's term."""
        embedded = streams.new_empty(streams.shape[0], self.key_proj.input_size)
        torch.ops.vllm.qwen38_ple_embed(input_ids, embedded, self.op_layer_name)
        key, _ = self.key_proj(embedded)
        value, _ = self.value_proj(embedded)
        term = torch.empty_like(streams)
        torch.ops.vllm.qwen38_ple_mix(streams, key, value, term, self.op_layer_name)
        return streams + term

    def _steps(self) -> list[PLEStep] | None:
        """This layer's view of the step (None in vLLM's profiling run): `step_parts`."""
        meta = vllm_ops.step_metadata(self.gdn.prefix)
        if meta is None:
            return None
        states = self.gdn.kv_cache
        return step_parts(meta, states[2], states[3])

    def embed(self, input_ids: torch.Tensor, embedded: torch.Tensor) -> None:
        """`vllm_ops.qwen38_ple_embed`: each token's n-gram rows (advancing the n-gram contexts)
        looked up in the table, into ``embedded [T, E]``."""
        steps = self._steps()
        if steps is None or len(steps) > 1 or steps[0].rows is not None:
            embedded.zero_()  # the profiling run; or parts, which leave the padding rows
        if steps is None:
            return
        emb = self.ple_embedding
        for step in steps:
            ids = step.take(input_ids)
            rows = ple_varlen.ngram_rows_varlen(
                ids, step.token_req(ids.shape[0]), step.query_start, step.context_cache, step.state_indices,
                step.has_initial_state, emb.layer_multipliers, emb.ngram_heads_vocab_sizes, emb.ngram_heads_offsets,
                heads_per_ngram=self.heads_per_ngram, eos_token_id=self.eos, write_indices=step.write_indices,
                query_start_loc=step.query_start_loc,
            )  # fmt: skip
            step.put(embedded, emb.lookup(rows).flatten(-2))

    def mix(self, streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, term: torch.Tensor) -> None:
        """`vllm_ops.qwen38_ple_mix`: the term added to the streams (advancing the conv states)."""
        steps = self._steps()
        if steps is None or len(steps) > 1 or steps[0].rows is not None:
            term.zero_()
        if steps is None:
            return
        for step in steps:
            part_streams = step.take(streams)
            mixed = ple_varlen.ple_mix_varlen(
                part_streams, step.take(key), step.take(value), self.norm_key.weight, self.norm_query.weight,
                self.norm_conv.weight, self.conv1d.weight.squeeze(1), step.conv_cache,
                step.token_req(part_streams.shape[0]), step.query_start, step.state_indices, step.has_initial_state,
                hc_count=self.hc_count, ngram_size=self.ngram_size, eps=self.eps, write_indices=step.write_indices,
                query_start_loc=step.query_start_loc,
            )  # fmt: skip
            step.put(term, mixed)


class _ConvWeight(nn.Module):
    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel))


def step_parts(meta: Any, conv_cache: torch.Tensor, context_cache: torch.Tensor) -> list[PLEStep]:
    """A PLE layer's view of a step from vLLM's GDN metadata of its slot (`GDNAttentionMetadata`),
    one part per kind of row. Without speculative verify rows one part holds every token; with
    them (``spec_sequence_masks``), the verify rows (``spec_token_indx``: read the slot of the last
    kept token, ``num_accepted_tokens - 1``, and write one slot per draft position,
    ``spec_state_indices_tensor``) and the other rows (``non_spec_token_indx``) are two parts."""
    caches = (conv_cache, context_cache)
    if meta.spec_sequence_masks is None:
        return [
            PLEStep(meta.non_spec_query_start_loc, meta.non_spec_state_indices_tensor, meta.has_initial_state, *caches)
        ]
    spec_slots = meta.spec_state_indices_tensor
    last_kept = (meta.num_accepted_tokens.long() - 1).clamp(0, spec_slots.shape[1] - 1)
    read = spec_slots.gather(1, last_kept[:, None].to(spec_slots.device))[:, 0]
    parts = [
        PLEStep(
            meta.spec_query_start_loc, read, None, *caches, rows=meta.spec_token_indx.long(), write_indices=spec_slots
        )
    ]
    if meta.num_prefills > 0 or meta.num_decodes > 0:
        rows = meta.non_spec_token_indx.long()
        parts.append(
            PLEStep(
                meta.non_spec_query_start_loc,
                meta.non_spec_state_indices_tensor,
                meta.has_initial_state,
                *caches,
                rows=rows,
            )
        )
    return parts


class PLEStep:
    """What a PLE layer reads of a step (or of one part of it): vLLM's GDN metadata of its slot
    and the slot's PLE states. ``rows``: the step's token rows of this part (None: all of them);
    ``write_indices``: the per-draft-position slots of speculative verify rows (None: write the
    state after the last token into ``state_indices``)."""

    def __init__(
        self,
        query_start_loc: torch.Tensor,
        state_indices: torch.Tensor,
        has_initial_state: torch.Tensor | None,
        conv_cache: torch.Tensor,
        context_cache: torch.Tensor,
        rows: torch.Tensor | None = None,
        write_indices: torch.Tensor | None = None,
    ) -> None:
        self.query_start_loc, self.query_start = query_start_loc, query_start_loc[:-1]
        self.state_indices, self.has_initial_state = state_indices, has_initial_state
        self.conv_cache, self.context_cache = conv_cache, context_cache
        self.rows, self.write_indices = rows, write_indices

    def token_req(self, num_tokens: int) -> torch.Tensor:
        """The request row of each of the step's (possibly padded) tokens, -1 for padding."""
        return ple_varlen.token_requests(self.query_start_loc, num_tokens)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This part's rows of a step tensor ``[T, ...]``."""
        return x if self.rows is None else x.index_select(0, self.rows)

    def put(self, out: torch.Tensor, part: torch.Tensor) -> None:
        """Write this part's rows of ``out [T, ...]``."""
        if self.rows is None:
            out.copy_(part)
        else:
            out.index_copy_(0, self.rows, part.to(out.dtype))
