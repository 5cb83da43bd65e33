"""FLASH_ATTN_V100's attention ops: one dispatcher by device.

CUDA tensors run the NVRTC-compiled kernels of ``flash_v100.cu`` (compiled for the device's own
architecture: sm_70 on a V100); any other device runs the plain-torch references of
``reference.py``. This module imports neither vLLM nor a GPU: it is usable (and tested) alone.

``check_supported`` is the startup check: an unsupported head size, dtype, block size or head
grouping raises a ``ValueError`` naming the supported set, so that nothing fails at request time.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass

import torch

from sm70_backend.kernels import reference
from sm70_backend.kernels.nvrtc import compile_cached, kernel_source

SUPPORTED_HEAD_SIZES = (64, 80, 96, 112, 128, 256)
SUPPORTED_DTYPES = (torch.float16,)
BLOCK_SIZE_MULTIPLE = 16
# Kernel geometry (flash_v100.cu): 4 warps of 16 query rows, 32 keys per tile, 8 halves of padding.
BLOCK_M, BLOCK_N, NUM_THREADS, PAD = 64, 32, 128, 8
MAX_SPLITS = 16
SOURCE_NAME = "flash_v100.cu"


def shared_bytes(head_size: int) -> int:
    return 2 * ((BLOCK_M + 2 * BLOCK_N) * (head_size + PAD) + (NUM_THREADS // 32) * 16 * (BLOCK_N + PAD))


def check_supported(
    head_size: int, dtype: torch.dtype, block_size: int | None, num_q_heads: int, num_kv_heads: int
) -> None:
    """Raise ValueError naming the supported set for anything the kernels cannot run."""
    if head_size not in SUPPORTED_HEAD_SIZES:
        raise ValueError(f"FLASH_ATTN_V100: head size {head_size} is not supported; supported: {SUPPORTED_HEAD_SIZES}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"FLASH_ATTN_V100: dtype {dtype} is not supported; supported: torch.float16 (V100 has no bf16 "
            f"tensor cores: run bf16 checkpoints with --dtype float16)"
        )
    if block_size is not None and block_size % BLOCK_SIZE_MULTIPLE != 0:
        raise ValueError(
            f"FLASH_ATTN_V100: KV cache block size {block_size} is not supported; supported: multiples of "
            f"{BLOCK_SIZE_MULTIPLE}"
        )
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads != 0 or num_q_heads // num_kv_heads > BLOCK_M:
        raise ValueError(
            f"FLASH_ATTN_V100: {num_q_heads} query heads over {num_kv_heads} KV heads is not supported; "
            f"supported: query heads a multiple of the KV heads, at most {BLOCK_M} per KV head"
        )


@dataclass
class CompiledKernels:
    """The three kernels of one head size, loaded on one device."""

    write_kv: object
    attention: object
    merge: object


@functools.cache
def kernels_for(device_index: int, head_size: int) -> CompiledKernels:
    from sm70_backend.kernels.driver import Module

    device = torch.device("cuda", device_index)
    major, minor = torch.cuda.get_device_capability(device)
    compiled = compile_cached(kernel_source(SOURCE_NAME), major * 10 + minor, {"HEAD_DIM": head_size}, SOURCE_NAME)
    module = Module(compiled.cubin, device)
    return CompiledKernels(
        module.kernel("sm70_write_kv"), module.kernel("sm70_flash_attention"), module.kernel("sm70_merge_splits")
    )


def prepare(device: torch.device, head_size: int) -> None:
    """Compile and load the kernels of ``head_size`` now (startup), not at the first request."""
    if device.type == "cuda":
        kernels_for(device.index if device.index is not None else torch.cuda.current_device(), head_size)


def _i64(x: int) -> ctypes.c_int64:
    return ctypes.c_int64(x)


def _i32(x: int) -> ctypes.c_int32:
    return ctypes.c_int32(x)


def _stream(device: torch.device) -> int:
    return int(torch.cuda.current_stream(device).cuda_stream)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """K/V ``[tokens, num_kv_heads, D]`` into ``kv_cache`` at ``slot_mapping`` (int64; < 0 skipped)."""
    if kv_cache.device.type != "cuda":
        reference.write_kv_reference(key, value, kv_cache, slot_mapping)
        return
    from sm70_backend.kernels.driver import pointer

    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    head_size = key.shape[-1]
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.stride(-1) == 1
    kernels = kernels_for(kv_cache.device.index or 0, head_size)
    kernels.write_kv.launch(  # type: ignore[attr-defined]
        (num_tokens, 1, 1),
        (128, 1, 1),
        0,
        [
            pointer(key), _i64(key.stride(0)), _i64(key.stride(1)),
            pointer(value), _i64(value.stride(0)), _i64(value.stride(1)),
            pointer(kv_cache), _i64(kv_cache.stride(0)), _i64(kv_cache.stride(1)), _i64(kv_cache.stride(2)),
            pointer(slot_mapping), _i32(kv_cache.shape[1]), _i32(kv_cache.shape[2]),
        ],
        _stream(kv_cache.device),
    )  # fmt: skip


def tokens_per_tile(num_q_heads: int, num_kv_heads: int) -> int:
    return BLOCK_M // (num_q_heads // num_kv_heads)


def choose_splits(num_tokens: int, num_reqs: int, num_q_heads: int, num_kv_heads: int, num_sms: int) -> int:
    """KV splits for a batch shape (host values only, so a CUDA graph replays the same grid): enough
    CTAs for two waves of the SMs, at most MAX_SPLITS; 1 (no merge) once the tiles alone do that."""
    tiles = (num_tokens // tokens_per_tile(num_q_heads, num_kv_heads) + num_reqs) * num_kv_heads
    if tiles >= 2 * num_sms:
        return 1
    return max(1, min(MAX_SPLITS, math.ceil(2 * num_sms / max(tiles, 1))))


def workspace(num_tokens: int, num_q_heads: int, head_size: int, num_splits: int, device: torch.device):  # type: ignore[no-untyped-def]
    """fp32 partial outputs and (max, sum) statistics of ``num_splits`` KV splits."""
    partial_o = torch.empty(num_tokens, num_q_heads, num_splits, head_size, dtype=torch.float32, device=device)
    partial_ml = torch.empty(num_tokens, num_q_heads, num_splits, 2, dtype=torch.float32, device=device)
    return partial_o, partial_ml


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    causal: bool = True,
    window_left: int = -1,
    window_right: int = -1,
    out: torch.Tensor | None = None,
    num_splits: int = 1,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of ``q [tokens, num_q_heads, D]`` (fp16) over the paged ``kv_cache``.

    ``query_start_loc [num_reqs + 1]`` and ``seq_lens [num_reqs]`` (int32) describe the requests;
    tokens past ``query_start_loc[-1]`` (CUDA-graph padding) are not written. ``num_splits > 1``
    splits each request's keys over that many CTAs (flash decoding) and merges the fp32 partials
    (``partials``: `workspace` tensors for at least ``tokens`` tokens; allocated if None).
    """
    if out is None:
        out = torch.empty_like(q)
    if q.device.type != "cuda":
        return reference.paged_attention_reference(
            q, kv_cache, block_table, query_start_loc, seq_lens, scale, causal, window_left, window_right, out
        )
    from sm70_backend.kernels.driver import pointer

    num_tokens, num_q_heads, head_size = q.shape
    num_kv_heads = kv_cache.shape[1]
    num_reqs = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_reqs == 0:
        return out
    for name, t in (("q", q), ("kv_cache", kv_cache), ("out", out)):
        if t.stride(-1) != 1 or any(s % 8 for s in t.stride()[:-1]) or t.data_ptr() % 16:
            raise ValueError(f"FLASH_ATTN_V100: {name} needs a contiguous last dimension, 16-byte aligned rows")
    per_tile = tokens_per_tile(num_q_heads, num_kv_heads)
    kernels = kernels_for(q.device.index or 0, head_size)
    stream = _stream(q.device)
    if num_splits > 1 and partials is None:
        partials = workspace(num_tokens, num_q_heads, head_size, num_splits, q.device)
    partial_o, partial_ml = partials if num_splits > 1 and partials is not None else (None, None)
    log2e = 1.4426950408889634
    shared = shared_bytes(head_size)
    kernels.attention.launch(  # type: ignore[attr-defined]
        (num_tokens // per_tile + num_reqs, num_kv_heads, num_splits),
        (NUM_THREADS, 1, 1),
        shared,
        [
            pointer(q), _i64(q.stride(0)), _i64(q.stride(1)),
            pointer(kv_cache), _i64(kv_cache.stride(0)), _i64(kv_cache.stride(1)), _i64(kv_cache.stride(2)),
            pointer(block_table), _i64(block_table.stride(0)),
            pointer(query_start_loc), pointer(seq_lens),
            pointer(out), _i64(out.stride(0)), _i64(out.stride(1)),
            pointer(partial_o), pointer(partial_ml),
            _i32(num_reqs), _i32(num_q_heads), _i32(kv_cache.shape[2]), _i32(per_tile), _i32(num_splits),
            ctypes.c_float(scale * log2e), _i32(int(causal)), _i32(window_left), _i32(window_right),
        ],
        stream,
    )  # fmt: skip
    if num_splits > 1:
        kernels.merge.launch(  # type: ignore[attr-defined]
            (num_tokens, num_q_heads, 1),
            (min(head_size, 256), 1, 1),
            0,
            [
                pointer(partial_o), pointer(partial_ml), pointer(out), _i64(out.stride(0)), _i64(out.stride(1)),
                pointer(query_start_loc), _i32(num_reqs), _i32(num_splits),
            ],
            stream,
        )  # fmt: skip
    return out
