"""Decode context parallelism on vLLM's CPU backend: the K/V slot mapping of a split cache.

With ``--decode-context-parallel-size N`` vLLM's model runner maps each scheduled token to its K/V
slot on the rank that holds its position (the others get -1; `ops.qsa_paged.DcpShard` is the
layout). On CUDA its Triton kernel does it. vLLM's CPU backend replaces that kernel, through its
registry of Triton-kernel overrides (`vllm.triton_utils.dispatcher.register_kernels`), with a C++
function that asserts ``TOTAL_CP_WORLD_SIZE == 1``: stock vLLM 0.32 has no context parallelism on
CPU. The portable Qwen4Exp model does its QSA attention over a split cache itself
(`vllm_qsa.PortableQSAAttention`), so on CPU it registers, through the same registry, a slot
mapping that computes the split layout in torch and hands every unsplit call to the platform's own
function. `install()` runs when the model is built with decode context parallelism on CPU: in each
worker, after vLLM registered the platform's overrides (it does so right after loading plugins),
so this one replaces it (vLLM logs the replacement); a kernel vLLM renamed fails there, naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from qwen38_plugin.ops.qsa_paged import DcpShard, kv_rows

logger = logging.getLogger("vllm.plugins.qwen38_plugin")

KERNEL = "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel"
# vLLM's speculative proposer maps each chained draft step's token to its K/V slot with this kernel,
# which knows nothing of context parallelism (its arguments carry no rank); see `draft_step_slot_mapping`.
DRAFT_STEP_KERNEL = "vllm.v1.spec_decode.utils.eagle_step_slot_mapping_metadata_kernel"
_installed: list[str] = []


def split_slot_mapping(
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_tokens: int,
    max_num_tokens: int,
    block_size: int,
    shard: DcpShard,
    pad_id: int = -1,
) -> None:
    """What vLLM's slot-mapping kernel writes for a rank of a decode-context-parallel group:
    ``slot_mapping[t]`` = the row of token t's position in this rank's cache (block
    ``block_table[r, p // (BS * N)]``), ``pad_id`` where another rank holds it and past the step."""
    starts = query_start_loc.long()
    tokens = int(starts[-1])
    req = torch.repeat_interleave(torch.arange(starts.numel() - 1), starts.diff())
    block, row, local = kv_rows(positions[:tokens], block_table, req, block_size, shard)
    assert local is not None
    slot_mapping[:tokens] = torch.where(local, block * block_size + row, pad_id)
    slot_mapping[tokens:max_num_tokens] = pad_id


def draft_step_slot_mapping(
    positions: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out_clamped_positions: torch.Tensor,
    out_slot_mapping: torch.Tensor,
    *,
    block_size: int,
    max_model_len: int,
    shard: DcpShard,
    pad_id: int = -1,
) -> None:
    """What vLLM's draft-step kernel writes, for a rank of a decode-context-parallel group: each
    request's next position (``positions + 1``; 0 past ``max_model_len``, as vLLM clamps it), the
    row of that position in this rank's cache (``pad_id`` where another rank holds it, or past the
    model length) and its sequence length (+1; 1 past the model length). ``out_slot_mapping`` rows
    past the batch (CUDA-graph padding) get ``pad_id``."""
    batch = positions.shape[0]
    new = positions.long() + 1
    exceeds = new >= max_model_len
    clamped = torch.where(exceeds, torch.zeros_like(new), new)
    req = torch.arange(batch, device=positions.device)
    block, row, local = kv_rows(clamped, block_table, req, block_size, shard)
    assert local is not None
    out_clamped_positions[:batch] = clamped
    out_slot_mapping[:batch] = torch.where(local & ~exceeds, block * block_size + row, pad_id)
    out_slot_mapping[batch:] = pad_id
    seq_lens.copy_(torch.where(exceeds, torch.ones_like(seq_lens), seq_lens + 1).clamp(max=max_model_len))


def _draft_step_with_context_parallelism(shard: DcpShard) -> Callable[..., Any]:
    def eagle_step_slot_mapping(
        positions: torch.Tensor,
        block_table: torch.Tensor,
        stride: int,
        seq_lens: torch.Tensor,
        out_clamped_positions: torch.Tensor,
        out_slot_mapping: torch.Tensor,
        block_size: int,
        max_model_len: int,
        n_blocks_per_req: int,
        PAD_ID: int,  # the platform function's names
        batch_size: int | None = None,
    ) -> None:
        draft_step_slot_mapping(
            positions, block_table, seq_lens, out_clamped_positions, out_slot_mapping, block_size=block_size,
            max_model_len=max_model_len, shard=shard, pad_id=PAD_ID,
        )  # fmt: skip

    return eagle_step_slot_mapping


def _with_context_parallelism(platform_impl: Callable[..., Any]) -> Callable[..., Any]:
    def compute_slot_mapping(
        num_tokens: int,
        max_num_tokens: int,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
        block_table_stride: int,
        slot_mapping: torch.Tensor,
        KV_CACHE_BLOCK_SIZE: int,  # the platform function's names
        TOTAL_CP_WORLD_SIZE: int = 1,
        TOTAL_CP_RANK: int = 0,
        CP_KV_CACHE_INTERLEAVE_SIZE: int = 1,
        PAD_ID: int = -1,
        BLOCK_SIZE: int = 1024,
    ) -> None:
        if TOTAL_CP_WORLD_SIZE == 1:
            platform_impl(
                num_tokens, max_num_tokens, query_start_loc, positions, block_table, block_table_stride,
                slot_mapping, KV_CACHE_BLOCK_SIZE, TOTAL_CP_WORLD_SIZE, TOTAL_CP_RANK, CP_KV_CACHE_INTERLEAVE_SIZE,
                PAD_ID, BLOCK_SIZE,
            )  # fmt: skip
            return
        split_slot_mapping(
            query_start_loc, positions, block_table, slot_mapping, num_tokens=num_tokens,
            max_num_tokens=max_num_tokens, block_size=KV_CACHE_BLOCK_SIZE,
            shard=DcpShard(TOTAL_CP_WORLD_SIZE, TOTAL_CP_RANK, CP_KV_CACHE_INTERLEAVE_SIZE), pad_id=PAD_ID,
        )  # fmt: skip

    return compute_slot_mapping


def install(shard: DcpShard | None = None) -> str:
    """Register the split-aware slot mappings in vLLM's kernel-override registry (CPU only, once
    per process): the engine's and, given this rank's ``shard``, the speculative proposer's draft
    steps'. Returns what it did."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "not CPU"
    if _installed:
        return _installed[0]
    from vllm.triton_utils import dispatcher

    registered = dispatcher._registry.get(KERNEL)
    if registered is None:
        # Stock registers its C++ fallback only without Triton-CPU; with it, vLLM's own kernel runs,
        # and its assertion is the platform's, not ours to lift.
        raise RuntimeError(
            f"qwen38_plugin: decode context parallelism on CPU needs vLLM's CPU override of {KERNEL}, which this vLLM "
            "did not register (Triton-CPU present, or the kernel renamed); run without --decode-context-parallel-size"
        )
    _, platform_impl = registered
    kernels = {KERNEL: _with_context_parallelism(platform_impl)}
    if shard is not None and shard.world > 1:
        if dispatcher._registry.get(DRAFT_STEP_KERNEL) is None:
            raise RuntimeError(
                f"qwen38_plugin: decode context parallelism on CPU needs vLLM's CPU override of {DRAFT_STEP_KERNEL}, "
                "which this vLLM did not register (renamed?); run without --decode-context-parallel-size"
            )
        kernels[DRAFT_STEP_KERNEL] = _draft_step_with_context_parallelism(shard)
    dispatcher.register_kernels(kernels)
    logger.info("qwen38_plugin: decode context parallelism on CPU: the K/V slot mapping splits positions over ranks")
    _installed.append("installed")
    return "installed"
