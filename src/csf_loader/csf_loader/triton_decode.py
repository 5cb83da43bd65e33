"""Triton decode of CSF planes straight into the native [rows, cols] scale layout.

The plain-torch reference is ``csf_loader.codec.decode``; tests compare the two
bit for bit under ``TRITON_INTERPRET=1`` on CPU and on CUDA. Triton is optional:
importing this module without it works, calling the kernels does not.

Two launches on one stream: the first writes ``base + offset`` for every scale
(each program owns a tile of rows x output columns and reads only its packed
bytes), the second scatters the exception words over it. Stream order makes the
second see the first's writes.
"""

from __future__ import annotations

from typing import Any

import torch

from csf_loader.codec import SLAB_ROWS, CsfCodec, CsfPlane, validate_plane

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAVE_TRITON = False

_fixed_kernel: Any = None
_exceptions_kernel: Any = None

if HAVE_TRITON:

    @triton.jit
    def _csf_fixed_kernel(  # type: ignore[no-untyped-def]
        fixed_ptr,
        out_ptr,
        rows,
        cols,
        packed_cols,
        OFFSET_BITS: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        row_ok = r < rows
        slab = r // 16
        in_slab = r % 16
        slab_bytes = 16 * (1 + packed_cols)
        slab_start = slab.to(tl.int64) * slab_bytes
        base = tl.load(fixed_ptr + slab_start + in_slab, mask=row_ok, other=0).to(tl.int32)
        PER_BYTE: tl.constexpr = 8 // OFFSET_BITS
        MASK: tl.constexpr = (1 << OFFSET_BITS) - 1
        byte_col = c // PER_BYTE
        shift = (c % PER_BYTE) * OFFSET_BITS
        row_codes = slab_start + 16 + in_slab.to(tl.int64) * packed_cols
        ok = row_ok[:, None] & (c < cols)[None, :]
        packed = tl.load(fixed_ptr + row_codes[:, None] + byte_col[None, :], mask=ok, other=0)
        code = (packed.to(tl.int32) >> shift[None, :]) & MASK
        value = (base[:, None] + code).to(tl.uint8)
        out_off = r.to(tl.int64)[:, None] * cols + c[None, :]
        tl.store(out_ptr + out_off, value, mask=ok)

    @triton.jit
    def _csf_exceptions_kernel(  # type: ignore[no-untyped-def]
        words_ptr, out_ptr, count, BLOCK: tl.constexpr
    ):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < count
        word = tl.load(words_ptr + i, mask=ok, other=0)
        position = word & 0xFFFFFF
        value = ((word >> 24) & 0xFF).to(tl.uint8)
        tl.store(out_ptr + position, value, mask=ok)

    _fixed_kernel = _csf_fixed_kernel
    _exceptions_kernel = _csf_exceptions_kernel


def decode_triton(
    plane: CsfPlane,
    codec: CsfCodec,
    rows: int,
    cols: int,
    out: torch.Tensor | None = None,
    validate: bool = True,
    what: str = "scales",
    block_r: int = 16,
    block_c: int = 128,
) -> torch.Tensor:
    """Decode ``plane`` into ``out`` (uint8 or a 1-byte float view, [rows, cols])."""
    if not HAVE_TRITON:
        raise RuntimeError("csf_loader.triton_decode needs triton; use csf_loader.codec.decode")
    if validate:
        validate_plane(plane, codec, rows, cols, what)
    device = plane.fixed.device
    if out is None:
        out = torch.empty(rows, cols, dtype=torch.uint8, device=device)
    if tuple(out.shape) != (rows, cols) or out.element_size() != 1 or not out.is_contiguous():
        raise ValueError(f"{what}: output must be a contiguous 1-byte [{rows}, {cols}] tensor")
    out_bytes = out.view(torch.uint8)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))
    _fixed_kernel[grid](
        plane.fixed,
        out_bytes,
        rows,
        cols,
        codec.packed_cols(cols),
        OFFSET_BITS=codec.offset_bits,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
    )
    count = plane.exceptions.numel()
    if count:
        block = 1024
        words = plane.exceptions.view(torch.int32)
        _exceptions_kernel[(triton.cdiv(count, block),)](words, out_bytes, count, BLOCK=block)
    return out


__all__ = ["HAVE_TRITON", "SLAB_ROWS", "decode_triton"]
