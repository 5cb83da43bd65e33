"""Hyper-connections: ``hc`` residual streams of width H around every block.

The residual state of a token is ``[hc * H]`` (the streams side by side). Before a block, a
mixer reads it: grouped RMSNorm (per stream), a low-rank gate ``sigmoid(up(silu(down(n) / hc)))``
per feature, and the mean over streams of ``gate * n`` is the block input ``[H]``. After the
block, its output ``[H]`` is added to each stream s scaled by the injection weight
``2 * sigmoid(inject(n) / hc)[s]``. The final mixer (before lm_head) has no injection.

`hc_mix` and `hc_inject` are the reference (the oracle, as transformers computes them). A served
model runs a mixer as three steps, each one kernel on CUDA (Triton) and the same torch code as
the reference elsewhere, behind one dispatcher per step:

1. `hc_norm`: the grouped RMSNorm, optionally after adding the previous block's output
   (`hc_inject` fused in: the streams are read and written once);
2. `hc_mix_normed`: ``down(n)`` and ``inject(n)``, the two small projections of the normed
   streams (one kernel), then ``up``, the sigmoid gate, the mean over streams and the injection
   weights (another).

On CUDA the torch reference launches about twenty kernels a mixer (each 1-5 us at decode);
the three kernels round at the same points as the reference (every intermediate in the model
dtype), so they differ from it only by summation order inside the reductions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qwen38_plugin.ops import triton_dispatch
from qwen38_plugin.ops.common import rms_norm
from qwen38_plugin.ops.triton_dispatch import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

REFERENCE_ENV = "QWEN38_HC_REFERENCE"


def hc_mix(
    streams: torch.Tensor,
    norm_weight: torch.Tensor,
    down_weight: torch.Tensor,
    up_weight: torch.Tensor,
    inject_weight: torch.Tensor | None,
    *,
    hc_count: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read the block input from the streams.

    streams: ``[..., hc * H]``; norm_weight: ``[hc * H]``; down_weight: ``[R, hc * H]``;
    up_weight: ``[hc * H, R]``; inject_weight: ``[hc, hc * H]`` or None (final mixer).
    Returns (block input ``[..., H]``, injection weights ``[..., hc]`` or None).
    """
    hidden = streams.shape[-1] // hc_count
    normed = rms_norm(streams, norm_weight, eps, group_size=hidden)
    down = F.linear(normed, down_weight)
    projected = F.linear(normed, inject_weight) if inject_weight is not None else None
    return _gate_mix_torch(normed, down, projected, up_weight, hc_count)


def _gate_mix_torch(
    normed: torch.Tensor, down: torch.Tensor, projected: torch.Tensor | None, up_weight: torch.Tensor, hc_count: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = normed.shape[-1] // hc_count
    gate = torch.sigmoid(F.linear(F.silu(down / hc_count), up_weight))
    mixed = (gate.unflatten(-1, (hc_count, hidden)) * normed.unflatten(-1, (hc_count, hidden))).mean(dim=-2)
    if projected is None:
        return mixed, None
    return mixed, 2 * torch.sigmoid(projected / hc_count)


def hc_inject(streams: torch.Tensor, block_output: torch.Tensor, injection: torch.Tensor) -> torch.Tensor:
    """streams ``[..., hc * H]`` + block_output ``[..., H]`` scaled per stream by injection ``[..., hc]``."""
    return streams + (block_output.unsqueeze(-2) * injection.unsqueeze(-1)).flatten(-2)


def hc_expand(embeddings: torch.Tensor, hc_count: int) -> torch.Tensor:
    """The initial residual state: every stream starts as the token embedding ``[..., H]``."""
    return embeddings.repeat(*([1] * (embeddings.dim() - 1)), hc_count)


def hc_mean(streams: torch.Tensor, hc_count: int) -> torch.Tensor:
    """The mean over the residual streams, ``[..., hc * H]`` -> ``[..., H]``: the target feature a
    DFlash drafter for a hyper-connection model reads (``target_feature_reduction = "hc_mean"``)."""
    *lead, width = streams.shape
    return streams.view(*lead, hc_count, width // hc_count).mean(dim=-2)


# ---------------------------------------------------------------------------------------------
# The mixer in three steps (what a served model runs): references, kernels, dispatchers
# ---------------------------------------------------------------------------------------------


def use_triton(x: torch.Tensor, backend: str = "auto") -> bool:
    """Triton for CUDA tensors unless ``QWEN38_HC_REFERENCE=1`` (see `triton_dispatch`)."""
    return triton_dispatch.use_triton(x.is_cuda, backend, reference_env=REFERENCE_ENV, op="hyper_connection")


def hc_norm_torch(
    streams: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    hc_count: int,
    eps: float,
    block_output: torch.Tensor | None = None,
    injection: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if block_output is not None:
        assert injection is not None
        streams = hc_inject(streams, block_output, injection)
    return streams, rms_norm(streams, norm_weight, eps, group_size=streams.shape[-1] // hc_count)


def hc_norm(
    streams: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    hc_count: int,
    eps: float,
    block_output: torch.Tensor | None = None,
    injection: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(streams, normed streams) ``[T, hc * H]`` each: with ``block_output [T, H]`` and
    ``injection [T, hc]``, the streams first receive the block's output (`hc_inject`)."""
    if (block_output is None) != (injection is None):
        raise ValueError("hc_norm: block_output and injection come together")
    if not use_triton(streams, backend):
        return hc_norm_torch(
            streams, norm_weight, hc_count=hc_count, eps=eps, block_output=block_output, injection=injection
        )
    tokens, width = streams.shape
    hidden = width // hc_count
    normed = torch.empty_like(streams)
    out = streams if block_output is None else torch.empty_like(streams)
    if tokens:
        block = block_output if block_output is not None else streams  # unread without an injection
        scales = injection if injection is not None else streams
        _hc_norm_kernel[(tokens, hc_count)](
            streams, block, scales, norm_weight, out, normed, streams.stride(0), block.stride(0), scales.stride(0),
            hidden, eps, INJECT=block_output is not None, HC=hc_count, BLOCK_H=triton.next_power_of_2(hidden),
            enable_fp_fusion=False,  # the injection rounds its product before the sum, as torch does
        )  # fmt: skip
    return out, normed


def hc_mix_normed_torch(
    normed: torch.Tensor,
    down_weight: torch.Tensor,
    up_weight: torch.Tensor,
    inject_weight: torch.Tensor | None,
    hc_count: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    down = F.linear(normed, down_weight)
    projected = F.linear(normed, inject_weight) if inject_weight is not None else None
    return _gate_mix_torch(normed, down, projected, up_weight, hc_count)


def gate_tiles(tokens: int, block_r: int) -> tuple[int, int, int]:
    """The gate kernel's (token tile, feature tile, warps) for a step of ``tokens`` rows.

    Decode-sized steps (up to 256 tokens) take 16-token tiles, so that about a hundred programs share
    the up weight's reads; longer steps 32. The feature tile is 32 (64 above 256 tokens) with 4 warps,
    or 16 with 8 warps for a rank above 128, whose up-weight tiles (HC of them) would not fit a
    thread's registers otherwise: sm_90 SASS at Flash-Next's rank 320 spills 7 loads a program with
    (32, 16, 8) where (32, 64, 8) spilled 714 (tests/qwen38_plugin/test_qwen38_fused_ops.py)."""
    block_t = 16 if tokens <= 256 else 32
    if block_r > 128:
        return block_t, 16, 8
    return block_t, 32 if tokens <= 256 else 64, 4


def gate_split_group(splits: int, block_t: int, block_r: int) -> int:
    """How many of the projection's K splits the gate kernel loads at once: a power of two, at most
    8 K fp32 a tile (64 registers a thread at 4 warps). sm_90 SASS of a decode step: no spills at the
    medium config's rank 64 (16 splits in two loads); at Flash-Next's rank 320 (one a load, 16-feature
    tiles, 8 warps) 3 spilled registers, where the kernel summing one split at a time spilled 6,673
    (tests/qwen38_plugin/test_qwen38_fused_ops.py)."""
    return min(triton.next_power_of_2(splits), max(1, 8192 // (block_t * block_r)))


def hc_mix_normed(
    normed: torch.Tensor,
    down_weight: torch.Tensor,
    up_weight: torch.Tensor,
    inject_weight: torch.Tensor | None,
    *,
    hc_count: int,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(block input ``[T, H]``, injection weights ``[T, hc]`` or None) from the normed streams
    ``[T, hc * H]``: `hc_mix` after its norm.

    Triton: the two projections in one kernel, split over K so that a decode step's few tokens
    still fill the GPU (fp32 partial sums, added in a fixed order by the second kernel, then
    rounded once as the reference's projection rounds), then the gate, mean and injection weights."""
    if not use_triton(normed, backend):
        return hc_mix_normed_torch(normed, down_weight, up_weight, inject_weight, hc_count)
    tokens, width = normed.shape
    hidden, rank = width // hc_count, down_weight.shape[0]
    hc = inject_weight.shape[0] if inject_weight is not None else 0
    mixed = normed.new_empty(tokens, hidden)
    injection = normed.new_empty(tokens, hc_count) if inject_weight is not None else None
    if not tokens:
        return mixed, injection
    block_t = 16 if tokens <= 16 else 32
    block_n, block_k = 16, 128
    t_blocks = triton.cdiv(tokens, block_t)
    down_blocks = triton.cdiv(rank, block_n)
    n_blocks = down_blocks + triton.cdiv(hc, block_n)
    # split K until about 128 programs run (one chunk per program, whole BLOCK_K steps)
    splits = max(1, min(triton.cdiv(width, block_k), triton.cdiv(128, t_blocks * n_blocks)))
    chunk = triton.cdiv(triton.cdiv(width, splits), block_k) * block_k
    splits = triton.cdiv(width, chunk)
    columns = rank + hc
    partials = torch.empty(splits, tokens, columns, dtype=torch.float32, device=normed.device)
    fp32 = normed.dtype == torch.float32
    _hc_project_kernel[(t_blocks, n_blocks, splits)](
        normed, down_weight, inject_weight if inject_weight is not None else down_weight, partials,
        tokens, width, rank, hc, down_blocks, chunk, normed.stride(0), down_weight.stride(0),
        inject_weight.stride(0) if inject_weight is not None else 0, columns,
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k, FP32_DOT=fp32,
    )  # fmt: skip
    block_r = max(16, triton.next_power_of_2(rank))
    gate_t, block_h, num_warps = gate_tiles(tokens, block_r)
    group = gate_split_group(splits, gate_t, block_r)
    _hc_gate_mix_kernel[(triton.cdiv(tokens, gate_t), triton.cdiv(hidden, block_h))](
        normed, partials, up_weight, mixed, injection if injection is not None else mixed,
        tokens, hidden, rank, columns, normed.stride(0), up_weight.stride(0), mixed.stride(0),
        injection.stride(0) if injection is not None else 0,
        INJECT=inject_weight is not None, HC=hc_count, SPLITS=splits, GROUP_S=group, BLOCK_T=gate_t,
        BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_HC=max(2, triton.next_power_of_2(hc_count)), FP32_DOT=fp32,
        num_warps=num_warps,
    )  # fmt: skip
    return mixed, injection


if HAVE_TRITON:

    @triton.jit
    def _hc_norm_kernel(  # type: ignore[no-untyped-def]
        streams_ptr,
        block_ptr,
        injection_ptr,
        weight_ptr,
        out_ptr,
        normed_ptr,
        stride_streams,
        stride_block,
        stride_injection,
        hidden,
        eps,
        INJECT: tl.constexpr,
        HC: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        # One program per (token, stream): H contiguous features. Every product and sum is
        # rounded to the model dtype where the reference rounds it.
        token = tl.program_id(0)
        stream = tl.program_id(1)
        cols = tl.arange(0, BLOCK_H)
        ok = cols < hidden
        offset = token * stride_streams + stream * hidden + cols
        x = tl.load(streams_ptr + offset, mask=ok, other=0.0)
        dtype = x.dtype
        if INJECT:
            block = tl.load(block_ptr + token * stride_block + cols, mask=ok, other=0.0)
            scale = tl.load(injection_ptr + token * stride_injection + stream)
            x = (x.to(tl.float32) + (block.to(tl.float32) * scale.to(tl.float32)).to(dtype).to(tl.float32)).to(dtype)
            tl.store(out_ptr + offset, x, mask=ok)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
        weight = tl.load(weight_ptr + stream * hidden + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(normed_ptr + offset, ((xf * rstd) * (1.0 + weight)).to(dtype), mask=ok)

    @triton.jit
    def _project_tile(  # type: ignore[no-untyped-def]
        x_ptr,
        w_ptr,
        t0,
        n0,
        k_begin,
        tokens,
        width,
        outputs,
        chunk,
        stride_x,
        stride_w,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        FP32_DOT: tl.constexpr,
    ):
        # x[t0:, :] @ w[n0:, :].T over the K range [k_begin, k_begin + chunk): [BLOCK_T, BLOCK_N] fp32
        rows = t0 + tl.arange(0, BLOCK_T)
        cols = n0 + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_begin, k_begin + chunk, BLOCK_K):
            k_ok = ((k0 + ks) < width) & ((k0 + ks) < k_begin + chunk)
            x = tl.load(
                x_ptr + rows[:, None] * stride_x + (k0 + ks)[None, :],
                mask=(rows[:, None] < tokens) & k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + cols[:, None] * stride_w + (k0 + ks)[None, :],
                mask=(cols[:, None] < outputs) & k_ok[None, :],
                other=0.0,
            )
            if FP32_DOT:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")  # no TF32 for fp32 models
            else:
                acc += tl.dot(x, tl.trans(w))
        return acc

    @triton.jit
    def _hc_project_kernel(  # type: ignore[no-untyped-def]
        normed_ptr,
        down_w_ptr,
        inject_w_ptr,
        partials_ptr,
        tokens,
        width,
        rank,
        hc,
        down_blocks,
        chunk,
        stride_normed,
        stride_down_w,
        stride_inject_w,
        columns,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        FP32_DOT: tl.constexpr,
    ):
        # partials [splits, T, rank + hc] fp32: columns [0, rank) are down's, the rest inject's;
        # program (t block, column block, split) sums one K chunk.
        t0 = tl.program_id(0) * BLOCK_T
        block = tl.program_id(1)
        split = tl.program_id(2)
        k_begin = split * chunk
        rows = t0 + tl.arange(0, BLOCK_T)
        row_ok = rows[:, None] < tokens
        out = partials_ptr + (split * tokens + rows[:, None]) * columns
        if block < down_blocks:
            # (names differ between the branches: Triton requires a variable to keep one type)
            n_down = block * BLOCK_N
            acc_down = _project_tile(
                normed_ptr, down_w_ptr, t0, n_down, k_begin, tokens, width, rank, chunk,
                stride_normed, stride_down_w, BLOCK_T, BLOCK_N, BLOCK_K, FP32_DOT,
            )  # fmt: skip
            cols_down = n_down + tl.arange(0, BLOCK_N)
            tl.store(out + cols_down[None, :], acc_down, mask=row_ok & (cols_down[None, :] < rank))
        else:
            n_inject = (block - down_blocks) * BLOCK_N
            acc_inject = _project_tile(
                normed_ptr, inject_w_ptr, t0, n_inject, k_begin, tokens, width, hc, chunk,
                stride_normed, stride_inject_w, BLOCK_T, BLOCK_N, BLOCK_K, FP32_DOT,
            )  # fmt: skip
            cols_inject = n_inject + tl.arange(0, BLOCK_N)
            tl.store(out + rank + cols_inject[None, :], acc_inject, mask=row_ok & (cols_inject[None, :] < hc))

    @triton.jit
    def _hc_gate_mix_kernel(  # type: ignore[no-untyped-def]
        normed_ptr,
        partials_ptr,
        up_w_ptr,
        mixed_ptr,
        injection_ptr,
        tokens,
        hidden,
        rank,
        columns,
        stride_normed,
        stride_up_w,
        stride_mixed,
        stride_injection,
        INJECT: tl.constexpr,
        HC: tl.constexpr,
        SPLITS: tl.constexpr,
        GROUP_S: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_HC: tl.constexpr,
        FP32_DOT: tl.constexpr,
    ):
        # One program per (token block, feature block): the gate of each stream for these
        # features (up-projection of the silu'd low-rank code), times the normed stream,
        # averaged over the streams. The first feature block also writes the injection weights.
        t0 = tl.program_id(0) * BLOCK_T
        h0 = tl.program_id(1) * BLOCK_H
        rows = t0 + tl.arange(0, BLOCK_T)
        row_ok = rows < tokens
        rs = tl.arange(0, BLOCK_R)
        code_ok = row_ok[:, None] & (rs[None, :] < rank)
        # The projection's K splits, several a load (in flight together) and one sum: added one at a
        # time, each split's tile went through shared memory on its way to the dot's operand layout,
        # a barrier and a memory round trip per split (sm_90 SASS at a decode shape: 16 in a row).
        # GROUP_S splits a load (as many as keep the tile within registers).
        code = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        for first in tl.static_range(0, SPLITS, GROUP_S):
            split_ids = first + tl.arange(0, GROUP_S)
            rows_of = (split_ids[:, None, None] * tokens + rows[None, :, None]) * columns
            parts = tl.load(
                partials_ptr + rows_of + rs[None, None, :],
                mask=(split_ids < SPLITS)[:, None, None] & code_ok[None, :, :],
                other=0.0,
            )
            code += tl.sum(parts, axis=0)
        dtype = normed_ptr.dtype.element_ty
        code = code.to(dtype).to(tl.float32)  # the projection's output, rounded once
        code = (code / HC).to(dtype).to(tl.float32)
        code = (code / (1.0 + tl.exp(-code))).to(dtype)  # silu, rounded as torch rounds it
        hs = h0 + tl.arange(0, BLOCK_H)
        h_ok = hs < hidden
        acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for stream in tl.static_range(HC):
            up = tl.load(
                up_w_ptr + (stream * hidden + hs)[:, None] * stride_up_w + rs[None, :],
                mask=h_ok[:, None] & (rs[None, :] < rank),
                other=0.0,
            )
            logit = tl.dot(code, tl.trans(up), input_precision="ieee") if FP32_DOT else tl.dot(code, tl.trans(up))
            logit = logit.to(dtype).to(tl.float32)
            gate = (1.0 / (1.0 + tl.exp(-logit))).to(dtype).to(tl.float32)
            normed = tl.load(
                normed_ptr + rows[:, None] * stride_normed + (stream * hidden + hs)[None, :],
                mask=row_ok[:, None] & h_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += (gate * normed).to(dtype).to(tl.float32)
        tl.store(
            mixed_ptr + rows[:, None] * stride_mixed + hs[None, :],
            (acc * (1.0 / HC)).to(dtype),
            mask=row_ok[:, None] & h_ok[None, :],
        )
        if INJECT:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if tl.program_id(1) == 0:
                ss = tl.arange(0, BLOCK_HC)
                ok = row_ok[:, None] & (ss[None, :] < HC)
                p = tl.zeros((BLOCK_T, BLOCK_HC), dtype=tl.float32)
                for split in tl.static_range(SPLITS):
                    p += tl.load(
                        partials_ptr + (split * tokens + rows[:, None]) * columns + rank + ss[None, :], mask=ok
                    )
                p = p.to(dtype).to(tl.float32)
                p = (p / HC).to(dtype).to(tl.float32)
                weight = (1.0 / (1.0 + tl.exp(-p))).to(dtype).to(tl.float32)
                tl.store(
                    injection_ptr + rows[:, None] * stride_injection + ss[None, :], (2.0 * weight).to(dtype), mask=ok
                )
