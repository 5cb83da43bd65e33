"""Triton decode of CSF planes straight into the native [rows, cols] scale layout.

The plain-torch reference is ``csf_loader.codec.decode``; tests compare the two
bit for bit under ``TRITON_INTERPRET=1`` on CPU and on CUDA. Triton is optional:
importing this module without it works, calling the kernels does not.

Default ("fused", where ``cols % 8 == 0``): one launch. Each program owns a run of
whole 16-row slabs of one plane; it expands the packed offsets of those slabs in
wide contiguous chunks (16-byte loads of the stream, 8 output bytes per packed unit
built with a few 32-bit integer operations, 16-byte stores), then, after a barrier
that orders its own stores, applies the exception words whose positions fall in its
rows. It finds them by sampling the plane's sorted exception list, so each program
reads only its own words (plus at most two sample gaps), and the exception bytes land
in L2 lines it has just written instead of in evicted ones. The steps are software
pipelined (step i + 1's loads are issued before step i's stores), and the exception
lookup is spread over the first steps so that its two dependent reads (samples, then
words) hide behind the expansion instead of stalling the program before or after it.

Fallbacks (any column count): the fixed stream is expanded by one kernel and the
exception words are scattered by a second launch on the same stream (stream order
makes the second see the first's writes).
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
_fixed_bytes_kernel: Any = None
_fixed_words_kernel: Any = None
_stacked_exceptions_kernel: Any = None
_fused_kernel: Any = None

if HAVE_TRITON:

    @triton.jit
    def _exception_samples(words_ptr, begin, end, SAMPLES: tl.constexpr):  # type: ignore[no-untyped-def]
        """SAMPLES evenly spaced positions of the sorted words[begin:end] (the loads only)."""
        n = end - begin
        s = tl.arange(0, SAMPLES).to(tl.int64)
        return tl.load(words_ptr + begin + s * n // SAMPLES, mask=(s * 0 + n) > 0, other=0) & 0xFFFFFF

    @triton.jit
    def _exception_bracket(sampled, begin, end, lo_pos, hi_pos, SAMPLES: tl.constexpr):  # type: ignore[no-untyped-def]
        """[first, stop) of the sorted words[begin:end] that can hold positions in [lo_pos, hi_pos)."""
        n = end - begin
        below_lo = tl.sum((sampled < lo_pos).to(tl.int64), axis=0)
        below_hi = tl.sum((sampled < hi_pos).to(tl.int64), axis=0)
        first = begin + tl.maximum(below_lo - 1, 0) * n // SAMPLES
        stop = tl.where(n > 0, tl.where(below_hi < SAMPLES, begin + below_hi * n // SAMPLES, end), begin)
        return first, stop

    @triton.jit
    def _fused_inputs(  # type: ignore[no-untyped-def]
        fixed_ptr,
        units_ptr,
        it,
        slab0,
        n_chunks,
        U: tl.constexpr,
        SLAB_BYTES: tl.constexpr,
        CPS: tl.constexpr,
        CW: tl.constexpr,
        BLOCK_CH: tl.constexpr,
        OFFSET_BITS: tl.constexpr,
    ):
        """Row bases and packed units (as uint32) of step ``it``'s BLOCK_CH x CW units."""
        c = it * BLOCK_CH + tl.arange(0, BLOCK_CH)
        ok = (c < n_chunks)[:, None]
        slab = slab0 + c // CPS
        u = (c % CPS)[:, None] * CW + tl.arange(0, CW)[None, :]  # unit within the slab's code area
        slab_byte = slab * SLAB_BYTES
        base = tl.load(fixed_ptr + slab_byte[:, None] + u // U, mask=ok, other=0).to(tl.uint32)
        if OFFSET_BITS == 4:
            unit = tl.load(units_ptr + (slab * (SLAB_BYTES // 4) + 4)[:, None] + u, mask=ok, other=0)
            raw = unit.to(tl.uint32, bitcast=True)
        else:
            raw = tl.load(fixed_ptr + (slab_byte + 16)[:, None] + u, mask=ok, other=0).to(tl.uint32)
        return base, raw

    @triton.jit
    def _fused_store(  # type: ignore[no-untyped-def]
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
        """Expand step ``it``'s units to 8 output bytes each and store them (16-byte stores)."""
        c = it * BLOCK_CH + tl.arange(0, BLOCK_CH)
        ok = (c < n_chunks)[:, None]
        slab = slab0 + c // CPS
        u = (c % CPS)[:, None] * CW + tl.arange(0, CW)[None, :]
        rep = base * 0x01010101
        if OFFSET_BITS == 4:
            lo = raw & 0xFFFF
            hi = raw >> 16
            lo = (lo | (lo << 8)) & 0x00FF00FF
            hi = (hi | (hi << 8)) & 0x00FF00FF
            lo = (lo | (lo << 4)) & 0x0F0F0F0F
            hi = (hi | (hi << 4)) & 0x0F0F0F0F
        else:
            # Bit i of a nibble moves to bit 8 * i: the four shifted copies of the
            # multiplier never overlap, so nothing carries.
            lo = ((raw & 0xF) * 0x00204081) & 0x01010101
            hi = ((raw >> 4) * 0x00204081) & 0x01010101
        value = ((lo + rep).to(tl.uint64) | ((hi + rep).to(tl.uint64) << 32)).to(tl.int64, bitcast=True)
        where = out_words + (slab * (16 * U))[:, None] + u
        if EVICT == 1:
            tl.store(where, value, mask=ok, cache_modifier=".cs")
        elif EVICT == 2:
            tl.store(where, value, mask=ok, eviction_policy="evict_first")
        else:
            tl.store(where, value, mask=ok)

    @triton.jit
    def _fused_pipelined_step(  # type: ignore[no-untyped-def]
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
        """One software-pipelined step: issue step ``it + 1``'s loads, then expand and store step
        ``it`` (whose inputs ``base, raw`` were loaded a step earlier); returns step it + 1's inputs."""
        base_next, raw_next = _fused_inputs(
            fixed_ptr, units_ptr, it + 1, slab0, n_chunks, U, SLAB_BYTES, CPS, CW, BLOCK_CH, OFFSET_BITS
        )
        _fused_store(out_words, base, raw, it, slab0, n_chunks, U, CPS, CW, BLOCK_CH, OFFSET_BITS, EVICT)
        return base_next, raw_next

    @triton.jit
    def _csf_fused_kernel(  # type: ignore[no-untyped-def]
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
        # Needs COLS % 8 == 0. Both codecs then have U = COLS // 8 packed units per row
        # (NVFP4: int32 words of 8 nibbles, read through units_ptr; MXFP4: bytes of 8 bits)
        # and every unit expands to one 8-byte output word. A slab's 16 * U units are
        # contiguous in the stream right after its 16 base bytes, and its 16 * U output
        # words are contiguous in out, so the slab is cut into CPS chunks of CW units
        # (CW a power of two dividing 16 * U) with no masked lanes.
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
            # Software pipelining: step it + 1's loads are in flight while step it is
            # expanded and stored (the step past the end loads nothing: all masked).
            base, raw = _fused_inputs(
                fixed_ptr, units_ptr, 0, slab0, n_chunks, U, SLAB_BYTES, CPS, CW, BLOCK_CH, OFFSET_BITS
            )
        if APPLY_EXCEPTIONS:
            # Positions are sorted, so SAMPLES evenly spaced words bracket this program's
            # [lo_pos, hi_pos) to within two sample gaps. PREFETCH 1: the bracket and the
            # first EBLOCK words are looked up before the expansion (their latency hides
            # behind it); 2: only the samples are loaded before it; 0: all after it;
            # 3 / 4 (with PIPE): samples before it, the words after its first 1 / 2 steps.
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
            # PREFETCH 3 / 4: the first EXC_AT steps are peeled off the loop, then the
            # bracket is found (its samples have arrived meanwhile) and the first EBLOCK
            # words are requested; their latency hides behind the remaining steps.
            base, raw = _fused_pipelined_step(
                out_words, fixed_ptr, units_ptr, base, raw, 0, slab0, n_chunks, U, SLAB_BYTES, CPS, CW, BLOCK_CH,
                OFFSET_BITS, EVICT,
            )  # fmt: skip
        if EXC_AT >= 2:
            base, raw = _fused_pipelined_step(
                out_words, fixed_ptr, units_ptr, base, raw, 1, slab0, n_chunks, U, SLAB_BYTES, CPS, CW, BLOCK_CH,
                OFFSET_BITS, EVICT,
            )  # fmt: skip
        if EXC_AT >= 1:
            first, stop = _exception_bracket(sampled, begin, end, lo_pos, hi_pos, SAMPLES)
            k0 = first + tl.arange(0, EBLOCK)
            word0 = tl.load(words_ptr + k0, mask=k0 < stop, other=0)
        for it in range(EXC_AT, ITERS):
            if PIPE:
                base, raw = _fused_pipelined_step(
                    out_words, fixed_ptr, units_ptr, base, raw, it, slab0, n_chunks, U, SLAB_BYTES, CPS, CW,
                    BLOCK_CH, OFFSET_BITS, EVICT,
                )  # fmt: skip
            else:
                b_it, r_it = _fused_inputs(
                    fixed_ptr, units_ptr, it, slab0, n_chunks, U, SLAB_BYTES, CPS, CW, BLOCK_CH, OFFSET_BITS
                )
                _fused_store(out_words, b_it, r_it, it, slab0, n_chunks, U, CPS, CW, BLOCK_CH, OFFSET_BITS, EVICT)
        if APPLY_EXCEPTIONS:
            # Exception bytes overwrite bytes this program stored above: the barrier
            # orders every thread's stores before any exception store.
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
    _stacked_exceptions_kernel = _csf_stacked_exceptions_kernel
    _fused_kernel = _csf_fused_kernel


def fused_applies(codec: CsfCodec, cols: int, fixed: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the one-launch kernel can decode this plane (else the two-launch fallback)."""
    unit_align = 4 if codec.offset_bits == 4 else 1
    return cols % 8 == 0 and fixed.data_ptr() % unit_align == 0 and out.data_ptr() % 8 == 0


def _chunk_width(cols: int, cap: int) -> int:
    """Largest power of two dividing a slab's 16 * cols / 8 units, at most ``cap``."""
    units = 2 * cols  # 16 * cols // 8
    width = units & -units
    return max(1, min(width, cap))


def _launch_fused(
    fixed: torch.Tensor,
    exceptions: torch.Tensor,
    starts: torch.Tensor,
    out_bytes: torch.Tensor,
    codec: CsfCodec,
    planes: int,
    rows: int,
    cols: int,
    rows_per_prog: int,
    chunk: int,
    block_ch: int,
    num_warps: int,
    apply_exceptions: bool = True,
    streaming: int = 0,
    prefetch: int = 1,
    pipe: int = 0,
    samples: int = 64,
    eblock: int = 256,
) -> Any:
    """Launch the one-pass kernel; returns Triton's compiled-kernel handle (for its PTX)."""
    if rows_per_prog % SLAB_ROWS:
        raise ValueError(f"rows_per_prog must be a multiple of {SLAB_ROWS}, got {rows_per_prog}")
    progs_per_plane = triton.cdiv(rows, rows_per_prog)
    words = exceptions.view(torch.int32)
    if not words.numel():  # never read (no exception pass), but Triton needs a pointer
        words = torch.zeros(1, dtype=torch.int32, device=fixed.device)
    units = fixed.view(torch.int32) if codec.offset_bits == 4 else fixed
    if prefetch not in (0, 1, 2, 3, 4) or (prefetch >= 3 and not pipe):
        raise ValueError(f"prefetch must be 0..4 (3 and 4 need pipe=1), got prefetch={prefetch} pipe={pipe}")
    apply = apply_exceptions and exceptions.numel() > 0
    return _fused_kernel[(planes * progs_per_plane,)](
        fixed,
        units,
        words,
        starts,
        out_bytes,
        rows,
        progs_per_plane,
        COLS=cols,
        OFFSET_BITS=codec.offset_bits,
        ROWS_PER_PROG=rows_per_prog,
        CW=_chunk_width(cols, chunk),
        BLOCK_CH=block_ch,
        SAMPLES=samples,
        EBLOCK=eblock,
        APPLY_EXCEPTIONS=apply,
        EVICT=streaming,
        PREFETCH=prefetch,
        PIPE=bool(pipe),
        EXC_AT=prefetch - 2 if apply and prefetch >= 3 else 0,
        num_warps=num_warps,
    )


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

    Variants, all bit-exact: "words" (cols % 8 == 0 and 8-byte aligned buffers: 64-bit
    loads/stores, see _csf_fixed_words_kernel), "bytes" (each packed byte loaded once
    and expanded in registers), "cols" (one load per scale).
    """
    packed_cols = codec.packed_cols(cols)
    if variant == "words":
        if not (cols % 8 == 0 and fixed.data_ptr() % 8 == 0 and out_bytes.data_ptr() % 8 == 0):
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
    variant: str = "auto",
    **tuning: int,
) -> torch.Tensor:
    """Decode ``plane`` into ``out`` (uint8 or a 1-byte float view, [rows, cols]).

    ``variant``: "auto" ("fused" where ``cols % 8 == 0`` and the buffers are aligned,
    else "bytes"), "fused", "words", "bytes" or "cols"; ``tuning`` overrides the launch
    parameters (see ``decode_triton_stacked``).
    """
    if not HAVE_TRITON:
        raise RuntimeError("csf_loader.triton_decode needs triton; use csf_loader.codec.decode")
    if validate:
        validate_plane(plane, codec, rows, cols, what)
    device = plane.fixed.device
    if out is None:
        out = torch.empty(rows, cols, dtype=torch.uint8, device=device)
    if tuple(out.shape) != (rows, cols) or out.element_size() != 1 or not out.is_contiguous():
        raise ValueError(f"{what}: output must be a contiguous 1-byte [{rows}, {cols}] tensor")
    starts = torch.zeros(2, dtype=torch.int64, device=device)
    starts[1] = plane.exceptions.numel()
    return decode_triton_stacked(
        plane.fixed, plane.exceptions, starts, codec, 1, rows, cols, out, variant=variant, **tuning
    )


DEFAULT_TUNING: dict[str, int] = {
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


# Per-family defaults of the fused kernel, the fastest one-layer configurations of
# benchmarks/csf_loader/bench_decode.py on the H200 (results/h200_decode_pipelined.txt).
FAMILY_TUNING: dict[str, dict[str, int]] = {
    "nvfp4": {"rows_per_prog": 64, "chunk": 128, "block_ch": 8, "num_warps": 4, "prefetch": 3, "pipe": 1},
    "mxfp4": {"rows_per_prog": 144, "chunk": 64, "block_ch": 16, "num_warps": 4, "prefetch": 4, "pipe": 1},
}


def decode_triton_stacked(
    fixed: torch.Tensor,
    exceptions: torch.Tensor,
    starts: torch.Tensor,
    codec: CsfCodec,
    planes: int,
    rows: int,
    cols: int,
    out: torch.Tensor,
    max_count: int | None = None,
    variant: str = "auto",
    **tuning: int,
) -> torch.Tensor:
    """Decode ``planes`` same-shape planes (e.g. one layer's experts) into ``out``.

    ``fixed`` is the planes' fixed streams back to back: because a stream is a
    sequence of 16-row slabs, that is exactly the stream of one ``[planes * rows,
    cols]`` matrix. ``exceptions`` holds every plane's words back to back, plane
    ``e`` owning ``exceptions[starts[e]:starts[e + 1]]`` (int64 ``starts``, on the
    device). The caller validates the planes (``codec.validate_plane``) beforehand.

    ``tuning`` (defaults ``DEFAULT_TUNING`` updated by ``FAMILY_TUNING[codec.family]``):
    for "fused", ``rows_per_prog`` (rows of one plane per program, a multiple of 16),
    ``chunk`` (units per chunk, at most), ``block_ch`` (chunks per step), ``num_warps``,
    ``streaming`` (store cache policy: 0 default, 1 ".cs", 2 evict_first), ``pipe`` (1:
    each step's loads are issued before the previous step's stores), ``prefetch`` (when
    the exception words are looked up: 0 after the expansion, 1 before it, 2 samples
    before it and words after it, 3 / 4 samples before it and words after its first
    1 / 2 steps, which needs ``pipe=1``), ``samples`` and ``eblock`` (exception lookup
    widths); for the fallbacks ``block_r``, ``block_c``, ``num_warps``. ``max_count``
    (the largest per-plane exception count) saves the fallback a device-to-host read.
    """
    if not HAVE_TRITON:
        raise RuntimeError("csf_loader.triton_decode needs triton; use csf_loader.codec.decode")
    unknown = set(tuning) - set(DEFAULT_TUNING)
    if unknown:
        raise TypeError(f"unknown decode tuning parameter(s) {sorted(unknown)}")
    t = {**DEFAULT_TUNING, **FAMILY_TUNING.get(codec.family, {}), **tuning}
    if out.numel() != planes * rows * cols or out.element_size() != 1 or not out.is_contiguous():
        raise ValueError(f"output must be a contiguous 1-byte tensor of {planes}x{rows}x{cols}")
    if fixed.numel() != planes * codec.fixed_numel(rows, cols):
        raise ValueError(
            f"stacked fixed stream has {fixed.numel()} bytes, expected {planes}x{codec.fixed_numel(rows, cols)}"
        )
    out_bytes = out.view(torch.uint8).reshape(-1)
    fixed = fixed.reshape(-1)
    if variant == "auto":
        variant = "fused" if fused_applies(codec, cols, fixed, out_bytes) else "bytes"
    if variant in ("fused", "fused-noexc"):
        if not fused_applies(codec, cols, fixed, out_bytes):
            raise ValueError(f"the fused decode needs cols % 8 == 0 and aligned buffers (cols={cols})")
        _launch_fused(
            fixed,
            exceptions,
            starts,
            out_bytes,
            codec,
            planes,
            rows,
            cols,
            t["rows_per_prog"],
            t["chunk"],
            t["block_ch"],
            t["num_warps"],
            apply_exceptions=variant == "fused",  # "fused-noexc" only for timing breakdowns
            streaming=t["streaming"],
            prefetch=t["prefetch"],
            pipe=t["pipe"],
            samples=t["samples"],
            eblock=t["eblock"],
        )
        return out
    _launch_fixed(fixed, out_bytes, codec, planes * rows, cols, t["block_r"], t["block_c"], t["num_warps"], variant)
    if max_count is None:
        max_count = int((starts[1:] - starts[:-1]).max().item()) if planes else 0
    if max_count:
        block = 1024
        _stacked_exceptions_kernel[(planes, triton.cdiv(max_count, block))](
            exceptions.view(torch.int32), starts, out_bytes, rows * cols, BLOCK=block
        )
    return out


__all__ = [
    "DEFAULT_TUNING",
    "FAMILY_TUNING",
    "HAVE_TRITON",
    "SLAB_ROWS",
    "decode_triton",
    "decode_triton_stacked",
    "fused_applies",
]
