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
_fixed_bytes_kernel: Any = None
_fixed_words_kernel: Any = None
_stacked_exceptions_kernel: Any = None

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
    def _csf_fixed_bytes_kernel(  # type: ignore[no-untyped-def]
        fixed_ptr,
        out_ptr,
        rows,
        cols,
        packed_cols,
        OFFSET_BITS: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # Same result as _csf_fixed_kernel, but each packed byte is loaded once and
        # expanded in registers to its 8 // OFFSET_BITS scales, so both the loads and
        # the stores are contiguous runs.
        PER_BYTE: tl.constexpr = 8 // OFFSET_BITS
        BLOCK_B: tl.constexpr = BLOCK_C // PER_BYTE
        MASK: tl.constexpr = (1 << OFFSET_BITS) - 1
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = r < rows
        slab = r // 16
        in_slab = r % 16
        slab_start = slab.to(tl.int64) * (16 * (1 + packed_cols))
        base = tl.load(fixed_ptr + slab_start + in_slab, mask=row_ok, other=0).to(tl.int32)
        b = pid_c * BLOCK_B + tl.arange(0, BLOCK_B)
        row_codes = slab_start + 16 + in_slab.to(tl.int64) * packed_cols
        ok_b = row_ok[:, None] & (b < packed_cols)[None, :]
        packed = tl.load(fixed_ptr + row_codes[:, None] + b[None, :], mask=ok_b, other=0).to(tl.int32)
        shifts = tl.arange(0, PER_BYTE) * OFFSET_BITS
        codes = (packed[:, :, None] >> shifts[None, None, :]) & MASK
        values = tl.reshape(base[:, None, None] + codes, [BLOCK_R, BLOCK_C]).to(tl.uint8)
        c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = row_ok[:, None] & (c < cols)[None, :]
        tl.store(out_ptr + r.to(tl.int64)[:, None] * cols + c[None, :], values, mask=ok)

    @triton.jit
    def _csf_fixed_words_kernel(  # type: ignore[no-untyped-def]
        unit_ptr,
        out_ptr,
        rows,
        words_per_row,
        unit_row_stride,
        slab_units,
        OFFSET_BITS: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_W: tl.constexpr,
        WIDE: tl.constexpr,
    ):
        # Needs cols % 8 == 0. Each thread turns one packed unit (NVFP4: a 32-bit word of
        # 8 nibbles; MXFP4: a byte of 8 bits) into one 64-bit word of 8 offsets, one per
        # byte, by spreading the bits, then adds the row base to all 8 bytes at once
        # (base + offset <= 255, so no byte carries into the next). Loads and stores
        # are whole words: no per-byte gathers, no layout shuffles. Strides arrive as
        # arguments (in units of the pointer's type) so Triton can specialise on their
        # divisibility and vectorise; WIDE selects 64-bit offsets for huge planes.
        pid_r = tl.program_id(0)
        pid_w = tl.program_id(1)
        r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        if WIDE:
            r = r.to(tl.int64)
        row_ok = r < rows
        slab_start = (r // 16) * slab_units
        in_slab = r % 16
        # unit_ptr is the fixed stream as int32 (NVFP4) or uint8 (MXFP4); one pointer
        # only, since the interpreter cannot pass two views of one buffer.
        if OFFSET_BITS == 4:
            packed_base = tl.load(unit_ptr + slab_start + in_slab // 4, mask=row_ok, other=0)
            base = ((packed_base.to(tl.uint32, bitcast=True) >> ((in_slab % 4) * 8)) & 0xFF).to(tl.uint64)
            row_codes = slab_start + 4 + in_slab * unit_row_stride
        else:
            base = tl.load(unit_ptr + slab_start + in_slab, mask=row_ok, other=0).to(tl.uint64)
            row_codes = slab_start + 16 + in_slab * unit_row_stride
        w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
        ok = row_ok[:, None] & (w < words_per_row)[None, :]
        unit = tl.load(unit_ptr + row_codes[:, None] + w[None, :], mask=ok, other=0)
        if OFFSET_BITS == 4:
            x = unit.to(tl.uint32, bitcast=True).to(tl.uint64)
            x = (x | (x << 16)) & 0x0000FFFF0000FFFF
            x = (x | (x << 8)) & 0x00FF00FF00FF00FF
            x = (x | (x << 4)) & 0x0F0F0F0F0F0F0F0F
        else:
            x = unit.to(tl.uint64)
            x = (x | (x << 28)) & 0x0000000F0000000F
            x = (x | (x << 14)) & 0x0003000300030003
            x = (x | (x << 7)) & 0x0101010101010101
        value = x + base[:, None] * 0x0101010101010101
        out_off = r[:, None] * words_per_row + w[None, :]
        tl.store(out_ptr + out_off, value.to(tl.int64, bitcast=True), mask=ok)

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

    @triton.jit
    def _csf_stacked_exceptions_kernel(  # type: ignore[no-untyped-def]
        words_ptr, starts_ptr, out_ptr, plane_numel, BLOCK: tl.constexpr
    ):
        # One program column per plane: its words are words[starts[e]:starts[e + 1]] and
        # their positions are relative to that plane's first scale.
        e = tl.program_id(0)
        begin = tl.load(starts_ptr + e)
        end = tl.load(starts_ptr + e + 1)
        i = begin + tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = i < end
        word = tl.load(words_ptr + i, mask=ok, other=0)
        position = e.to(tl.int64) * plane_numel + (word & 0xFFFFFF)
        value = ((word >> 24) & 0xFF).to(tl.uint8)
        tl.store(out_ptr + position, value, mask=ok)

    _fixed_kernel = _csf_fixed_kernel
    _fixed_bytes_kernel = _csf_fixed_bytes_kernel
    _fixed_words_kernel = _csf_fixed_words_kernel
    _exceptions_kernel = _csf_exceptions_kernel
    _stacked_exceptions_kernel = _csf_stacked_exceptions_kernel


def _launch_fixed(
    fixed: torch.Tensor,
    out_bytes: torch.Tensor,
    codec: CsfCodec,
    rows: int,
    cols: int,
    block_r: int,
    block_c: int,
    num_warps: int,
    variant: str,
) -> None:
    """Write base + offset for every scale of a [rows, cols] plane (exceptions not applied).

    Variants, all bit-exact: "words" (default where cols % 8 == 0 and the buffers are
    8-byte aligned: 64-bit loads/stores, see _csf_fixed_words_kernel), "bytes" (each
    packed byte loaded once and expanded in registers), "cols" (one load per scale).
    "auto" picks "words" when it applies, else "bytes".
    """
    packed_cols = codec.packed_cols(cols)
    words_ok = cols % 8 == 0 and fixed.data_ptr() % 8 == 0 and out_bytes.data_ptr() % 8 == 0
    if variant == "auto":
        variant = "words" if words_ok else "bytes"
    if variant == "words":
        if not words_ok:
            raise ValueError(f"the 'words' decode needs cols % 8 == 0 and 8-byte aligned buffers (cols={cols})")
        unit = fixed.view(torch.int32) if codec.offset_bits == 4 else fixed
        per_unit = 4 if codec.offset_bits == 4 else 1  # bytes per load unit
        block_w = max(1, block_c // 8)
        grid = (triton.cdiv(rows, block_r), triton.cdiv(cols // 8, block_w))
        _fixed_words_kernel[grid](
            unit,
            out_bytes.view(torch.int64),
            rows,
            cols // 8,
            packed_cols // per_unit,
            SLAB_ROWS * (1 + packed_cols) // per_unit,
            OFFSET_BITS=codec.offset_bits,
            BLOCK_R=block_r,
            BLOCK_W=block_w,
            WIDE=max(out_bytes.numel(), fixed.numel()) >= 2**31 - 2**20,
            num_warps=num_warps,
        )
        return
    kernels = {"bytes": _fixed_bytes_kernel, "cols": _fixed_kernel}
    if variant not in kernels:
        raise ValueError(f"unknown decode kernel variant {variant!r}")
    grid = (triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))
    kernels[variant][grid](
        fixed,
        out_bytes,
        rows,
        cols,
        packed_cols,
        OFFSET_BITS=codec.offset_bits,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=num_warps,
    )


def decode_triton(
    plane: CsfPlane,
    codec: CsfCodec,
    rows: int,
    cols: int,
    out: torch.Tensor | None = None,
    validate: bool = True,
    what: str = "scales",
    block_r: int = 32,
    block_c: int = 128,
    num_warps: int = 4,
    variant: str = "auto",
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
    _launch_fixed(plane.fixed.reshape(-1), out_bytes, codec, rows, cols, block_r, block_c, num_warps, variant)
    count = plane.exceptions.numel()
    if count:
        block = 1024
        words = plane.exceptions.view(torch.int32)
        _exceptions_kernel[(triton.cdiv(count, block),)](words, out_bytes, count, BLOCK=block)
    return out


def decode_triton_stacked(
    fixed: torch.Tensor,
    exceptions: torch.Tensor,
    starts: torch.Tensor,
    codec: CsfCodec,
    planes: int,
    rows: int,
    cols: int,
    out: torch.Tensor,
    block_r: int = 32,
    block_c: int = 128,
    num_warps: int = 4,
    max_count: int | None = None,
    variant: str = "auto",
) -> torch.Tensor:
    """Decode ``planes`` same-shape planes (e.g. one layer's experts) in two launches.

    ``fixed`` is the planes' fixed streams back to back: because a stream is a
    sequence of 16-row slabs, that is exactly the stream of one ``[planes * rows,
    cols]`` matrix. ``exceptions`` holds every plane's words back to back, plane
    ``e`` owning ``exceptions[starts[e]:starts[e + 1]]`` (int64 ``starts``, on the
    device). The caller validates the planes (``codec.validate_plane``) beforehand.
    """
    if not HAVE_TRITON:
        raise RuntimeError("csf_loader.triton_decode needs triton; use csf_loader.codec.decode")
    if out.numel() != planes * rows * cols or out.element_size() != 1 or not out.is_contiguous():
        raise ValueError(f"output must be a contiguous 1-byte tensor of {planes}x{rows}x{cols}")
    if fixed.numel() != planes * codec.fixed_numel(rows, cols):
        raise ValueError(
            f"stacked fixed stream has {fixed.numel()} bytes, expected {planes}x{codec.fixed_numel(rows, cols)}"
        )
    out_bytes = out.view(torch.uint8)
    total_rows = planes * rows
    _launch_fixed(fixed.reshape(-1), out_bytes, codec, total_rows, cols, block_r, block_c, num_warps, variant)
    if max_count is None:
        max_count = int((starts[1:] - starts[:-1]).max().item()) if planes else 0
    if max_count:
        block = 1024
        _stacked_exceptions_kernel[(planes, triton.cdiv(max_count, block))](
            exceptions.view(torch.int32), starts, out_bytes, rows * cols, BLOCK=block
        )
    return out


__all__ = ["HAVE_TRITON", "SLAB_ROWS", "decode_triton", "decode_triton_stacked"]
