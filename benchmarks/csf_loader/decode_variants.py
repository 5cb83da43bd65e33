"""Exploration variants of the CSF decode kernel (benchmarks only; the library keeps one tuned
configuration per family in ``csf_loader.triton_decode``).

``decode_variant`` decodes stacked planes like ``csf_loader.triton_decode.decode_triton_stacked``
with one of:

* ``"library"``: the library's kernel and configuration (what the loader runs);
* ``"fused"``: the one-pass kernel with every knob the sweeps turned (``TUNING_DEFAULTS``):
  ``rows_per_prog``, ``chunk``, ``block_ch``, ``num_warps``; ``streaming`` (store cache policy:
  0 default, 1 ``.cs``, 2 evict_first); ``pipe`` (1: each step's loads are issued before the
  previous step's stores); ``prefetch`` (when the exception words are looked up: 0 after the
  expansion, 1 bracket and first words before it, 2 samples before it and words after it, 3 / 4
  samples before it and words after its first 1 / 2 steps, which needs ``pipe=1``; the library
  runs 3 for NVFP4 and 4 for MXFP4); ``samples``, ``eblock``;
* ``"fused-noexc"``: the same without the exception pass (timing breakdowns only: wrong bytes);
* ``"words"``: the older two-launch kernel, 64-bit loads / stores of 8 scales (``cols % 8 == 0``);
* ``"cols"``: one load per scale; ``"bytes"``: the library's fallback expansion.

All but ``fused-noexc`` are bit-exact; ``tests/csf_loader/test_triton_decode.py`` checks them
against the torch reference under ``TRITON_INTERPRET=1``, and ``bench_decode.py`` checks every
configuration on the device before timing it.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from csf_loader import triton_decode as lib
from csf_loader.codec import SLAB_ROWS, CsfCodec
from csf_loader.triton_decode import (
    _exception_bracket,
    _exception_samples,
    _expand_units,
    _fused_inputs,
    chunk_width,
    fused_applies,
)

TUNING_DEFAULTS: dict[str, int] = {
    "rows_per_prog": 256,
    "chunk": 128,
    "block_ch": 8,
    "num_warps": 4,
    "streaming": 0,
    "prefetch": 1,
    "pipe": 0,
    "samples": 64,
    "eblock": 256,
    "block_r": 32,
    "block_c": 256,
}
# The library's configurations in these knobs (for sweeps that start from them).
LIBRARY_TUNING: dict[str, dict[str, int]] = {
    family: {
        "rows_per_prog": c.rows_per_prog,
        "chunk": c.chunk,
        "block_ch": c.block_ch,
        "num_warps": c.num_warps,
        "streaming": 0,
        "prefetch": 2 + c.exc_at,
        "pipe": 1,
    }
    for family, c in lib.FAMILY_CONFIG.items()
}
VARIANTS = ("library", "fused", "fused-noexc", "words", "cols", "bytes")


@triton.jit
def _store_policy(  # type: ignore[no-untyped-def]
    out_words,
    base,
    raw,
    it,
    slab0,
    n_chunks,
    U: tl.constexpr,
    CPS: tl.constexpr,
    CW: tl.constexpr,
    BLOCK_CH: tl.constexpr,
    OFFSET_BITS: tl.constexpr,
    EVICT: tl.constexpr,
):
    c = it * BLOCK_CH + tl.arange(0, BLOCK_CH)
    ok = (c < n_chunks)[:, None]
    slab = slab0 + c // CPS
    u = (c % CPS)[:, None] * CW + tl.arange(0, CW)[None, :]
    value = _expand_units(base, raw, OFFSET_BITS)
    where = out_words + (slab * (16 * U))[:, None] + u
    if EVICT == 1:
        tl.store(where, value, mask=ok, cache_modifier=".cs")
    elif EVICT == 2:
        tl.store(where, value, mask=ok, eviction_policy="evict_first")
    else:
        tl.store(where, value, mask=ok)


@triton.jit
def _pipelined_step(  # type: ignore[no-untyped-def]
    out_words,
    fixed_ptr,
    units_ptr,
    base,
    raw,
    it,
    slab0,
    n_chunks,
    U: tl.constexpr,
    SLAB_BYTES: tl.constexpr,
    CPS: tl.constexpr,
    CW: tl.constexpr,
    BLOCK_CH: tl.constexpr,
    OFFSET_BITS: tl.constexpr,
    EVICT: tl.constexpr,
):
    base_next, raw_next = _fused_inputs(
        fixed_ptr, units_ptr, it + 1, slab0, n_chunks, U, SLAB_BYTES, CPS, CW, BLOCK_CH, OFFSET_BITS
    )
    _store_policy(out_words, base, raw, it, slab0, n_chunks, U, CPS, CW, BLOCK_CH, OFFSET_BITS, EVICT)
    return base_next, raw_next


@triton.jit
def _fused_explore_kernel(  # type: ignore[no-untyped-def]
    fixed_ptr,
    units_ptr,
    words_ptr,
    starts_ptr,
    out_ptr,
    rows,
    progs_per_plane,
    COLS: tl.constexpr,
    OFFSET_BITS: tl.constexpr,
    ROWS_PER_PROG: tl.constexpr,
    CW: tl.constexpr,
    BLOCK_CH: tl.constexpr,
    SAMPLES: tl.constexpr,
    EBLOCK: tl.constexpr,
    APPLY_EXCEPTIONS: tl.constexpr,
    EVICT: tl.constexpr,
    PREFETCH: tl.constexpr,
    PIPE: tl.constexpr,
    EXC_AT: tl.constexpr,
):
    U: tl.constexpr = COLS // 8
    PACKED: tl.constexpr = COLS // 2 if OFFSET_BITS == 4 else COLS // 8
    SLAB_BYTES: tl.constexpr = 16 * (1 + PACKED)
    CPS: tl.constexpr = 16 * U // CW
    ITERS: tl.constexpr = (ROWS_PER_PROG // 16 * CPS + BLOCK_CH - 1) // BLOCK_CH
    pid = tl.program_id(0)
    e = pid // progs_per_plane
    r0 = (pid % progs_per_plane) * ROWS_PER_PROG
    r1 = tl.minimum(r0 + ROWS_PER_PROG, rows)
    n_chunks = (r1 - r0) // 16 * CPS
    slab0 = e.to(tl.int64) * (rows // 16) + r0 // 16
    out_words = out_ptr.to(tl.pointer_type(tl.int64))
    if PIPE:
        base, raw = _fused_inputs(
            fixed_ptr, units_ptr, 0, slab0, n_chunks, U, SLAB_BYTES, CPS, CW, BLOCK_CH, OFFSET_BITS
        )
    if APPLY_EXCEPTIONS:
        begin = tl.load(starts_ptr + e)
        end = tl.load(starts_ptr + e + 1)
        lo_pos = r0 * COLS
        hi_pos = r1 * COLS
        if PREFETCH >= 1:
            sampled = _exception_samples(words_ptr, begin, end, SAMPLES)
        if PREFETCH == 1:
            first, stop = _exception_bracket(sampled, begin, end, lo_pos, hi_pos, SAMPLES)
            k0 = first + tl.arange(0, EBLOCK)
            word0 = tl.load(words_ptr + k0, mask=k0 < stop, other=0)
    if EXC_AT >= 1:
        base, raw = _pipelined_step(
            out_words, fixed_ptr, units_ptr, base, raw, 0, slab0, n_chunks, U, SLAB_BYTES, CPS, CW, BLOCK_CH,
            OFFSET_BITS, EVICT,
        )  # fmt: skip
    if EXC_AT >= 2:
        base, raw = _pipelined_step(
            out_words, fixed_ptr, units_ptr, base, raw, 1, slab0, n_chunks, U, SLAB_BYTES, CPS, CW, BLOCK_CH,
            OFFSET_BITS, EVICT,
        )  # fmt: skip
    if EXC_AT >= 1:
        first, stop = _exception_bracket(sampled, begin, end, lo_pos, hi_pos, SAMPLES)
        k0 = first + tl.arange(0, EBLOCK)
        word0 = tl.load(words_ptr + k0, mask=k0 < stop, other=0)
    for it in range(EXC_AT, ITERS):
        if PIPE:
            base, raw = _pipelined_step(
                out_words, fixed_ptr, units_ptr, base, raw, it, slab0, n_chunks, U, SLAB_BYTES, CPS, CW,
                BLOCK_CH, OFFSET_BITS, EVICT,
            )  # fmt: skip
        else:
            b_it, r_it = _fused_inputs(
                fixed_ptr, units_ptr, it, slab0, n_chunks, U, SLAB_BYTES, CPS, CW, BLOCK_CH, OFFSET_BITS
            )
            _store_policy(out_words, b_it, r_it, it, slab0, n_chunks, U, CPS, CW, BLOCK_CH, OFFSET_BITS, EVICT)
    if APPLY_EXCEPTIONS:
        tl.debug_barrier()
        plane = out_ptr + e.to(tl.int64) * rows * COLS
        if PREFETCH == 0 or PREFETCH == 2:
            if PREFETCH == 0:
                sampled = _exception_samples(words_ptr, begin, end, SAMPLES)
            first, stop = _exception_bracket(sampled, begin, end, lo_pos, hi_pos, SAMPLES)
            k0 = first + tl.arange(0, EBLOCK)
            word0 = tl.load(words_ptr + k0, mask=k0 < stop, other=0)
        position = word0 & 0xFFFFFF
        hit = (k0 < stop) & (position >= lo_pos) & (position < hi_pos)
        tl.store(plane + position, ((word0 >> 24) & 0xFF).to(tl.uint8), mask=hit)
        for i in range(first + EBLOCK, stop, EBLOCK):
            k = i + tl.arange(0, EBLOCK)
            word = tl.load(words_ptr + k, mask=k < stop, other=0)
            position = word & 0xFFFFFF
            hit = (k < stop) & (position >= lo_pos) & (position < hi_pos)
            tl.store(plane + position, ((word >> 24) & 0xFF).to(tl.uint8), mask=hit)


@triton.jit
def _fixed_cols_kernel(  # type: ignore[no-untyped-def]
    fixed_ptr,
    out_ptr,
    rows,
    cols,
    packed_cols,
    OFFSET_BITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # One load per scale (the first kernel).
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = r < rows
    slab = r // 16
    in_slab = r % 16
    slab_start = slab.to(tl.int64) * (16 * (1 + packed_cols))
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
    tl.store(out_ptr + r.to(tl.int64)[:, None] * cols + c[None, :], value, mask=ok)


@triton.jit
def _fixed_words_kernel(  # type: ignore[no-untyped-def]
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
    # Needs cols % 8 == 0: one packed unit (NVFP4 a 32-bit word of 8 nibbles, MXFP4 a byte of 8
    # bits) becomes one 64-bit word of 8 scales.
    pid_r = tl.program_id(0)
    pid_w = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    if WIDE:
        r = r.to(tl.int64)
    row_ok = r < rows
    slab_start = (r // 16) * slab_units
    in_slab = r % 16
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
    tl.store(out_ptr + r[:, None] * words_per_row + w[None, :], value.to(tl.int64, bitcast=True), mask=ok)


def launch_explore(
    fixed: torch.Tensor,
    exceptions: torch.Tensor,
    starts: torch.Tensor,
    out_bytes: torch.Tensor,
    codec: CsfCodec,
    planes: int,
    rows: int,
    cols: int,
    apply_exceptions: bool = True,
    **tuning: int,
) -> Any:
    """Launch the exploration kernel; returns Triton's compiled-kernel handle (for its PTX)."""
    t = {**TUNING_DEFAULTS, **tuning}
    if t["rows_per_prog"] % SLAB_ROWS:
        raise ValueError(f"rows_per_prog must be a multiple of {SLAB_ROWS}, got {t['rows_per_prog']}")
    if t["prefetch"] not in (0, 1, 2, 3, 4) or (t["prefetch"] >= 3 and not t["pipe"]):
        raise ValueError(f"prefetch must be 0..4 (3 and 4 need pipe=1), got prefetch={t['prefetch']} pipe={t['pipe']}")
    progs_per_plane = triton.cdiv(rows, t["rows_per_prog"])
    words = exceptions.view(torch.int32)
    if not words.numel():
        words = torch.zeros(1, dtype=torch.int32, device=fixed.device)
    units = fixed.view(torch.int32) if codec.offset_bits == 4 else fixed
    apply = apply_exceptions and exceptions.numel() > 0
    return _fused_explore_kernel[(planes * progs_per_plane,)](
        fixed,
        units,
        words,
        starts,
        out_bytes,
        rows,
        progs_per_plane,
        COLS=cols,
        OFFSET_BITS=codec.offset_bits,
        ROWS_PER_PROG=t["rows_per_prog"],
        CW=chunk_width(cols, t["chunk"]),
        BLOCK_CH=t["block_ch"],
        SAMPLES=t["samples"],
        EBLOCK=t["eblock"],
        APPLY_EXCEPTIONS=apply,
        EVICT=t["streaming"],
        PREFETCH=t["prefetch"],
        PIPE=bool(t["pipe"]),
        EXC_AT=t["prefetch"] - 2 if apply and t["prefetch"] >= 3 else 0,
        num_warps=t["num_warps"],
    )


def decode_variant(
    fixed: torch.Tensor,
    exceptions: torch.Tensor,
    starts: torch.Tensor,
    codec: CsfCodec,
    planes: int,
    rows: int,
    cols: int,
    out: torch.Tensor,
    variant: str,
    max_count: int | None = None,
    **tuning: int,
) -> Any:
    """Decode like ``decode_triton_stacked`` with one of ``VARIANTS``; returns the fused kernels'
    compiled handle (None for the others)."""
    unknown = set(tuning) - set(TUNING_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown decode tuning parameter(s) {sorted(unknown)}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown decode variant {variant!r}; one of {VARIANTS}")
    out_bytes = out.view(torch.uint8).reshape(-1)
    fixed = fixed.reshape(-1)
    if variant == "library":
        lib.decode_triton_stacked(fixed, exceptions, starts, codec, planes, rows, cols, out, max_count)
        return None
    if variant in ("fused", "fused-noexc"):
        if not fused_applies(codec, cols, fixed, out_bytes):
            raise ValueError(f"the fused decode needs cols % 8 == 0 and aligned buffers (cols={cols})")
        return launch_explore(
            fixed, exceptions, starts, out_bytes, codec, planes, rows, cols, variant == "fused", **tuning
        )
    t = {**TUNING_DEFAULTS, **tuning}
    packed_cols = codec.packed_cols(cols)
    if variant == "bytes":
        lib.launch_fallback(fixed, exceptions, starts, out_bytes, codec, planes, rows, cols, max_count)
        return None
    if variant == "words":
        if not (cols % 8 == 0 and fixed.data_ptr() % 8 == 0 and out_bytes.data_ptr() % 8 == 0):
            raise ValueError(f"the 'words' decode needs cols % 8 == 0 and 8-byte aligned buffers (cols={cols})")
        unit = fixed.view(torch.int32) if codec.offset_bits == 4 else fixed
        per_unit = 4 if codec.offset_bits == 4 else 1  # bytes per load unit
        block_w = max(1, t["block_c"] // 8)
        grid = (triton.cdiv(planes * rows, t["block_r"]), triton.cdiv(cols // 8, block_w))
        _fixed_words_kernel[grid](
            unit,
            out_bytes.view(torch.int64),
            planes * rows,
            cols // 8,
            packed_cols // per_unit,
            SLAB_ROWS * (1 + packed_cols) // per_unit,
            OFFSET_BITS=codec.offset_bits,
            BLOCK_R=t["block_r"],
            BLOCK_W=block_w,
            WIDE=max(out_bytes.numel(), fixed.numel()) >= 2**31 - 2**20,
            num_warps=t["num_warps"],
        )
    else:  # "cols"
        grid = (triton.cdiv(planes * rows, t["block_r"]), triton.cdiv(cols, t["block_c"]))
        _fixed_cols_kernel[grid](
            fixed,
            out_bytes,
            planes * rows,
            cols,
            packed_cols,
            OFFSET_BITS=codec.offset_bits,
            BLOCK_R=t["block_r"],
            BLOCK_C=t["block_c"],
            num_warps=t["num_warps"],
        )
    if max_count is None:
        max_count = int((starts[1:] - starts[:-1]).max().item()) if planes else 0
    if max_count:
        block = 1024
        lib._scatter_kernel[(planes, triton.cdiv(max_count, block))](
            exceptions.view(torch.int32), starts, out_bytes, rows * cols, BLOCK=block
        )
    return None
