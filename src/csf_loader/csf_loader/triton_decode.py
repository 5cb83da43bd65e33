"""Triton decode of CSF planes straight into the native [rows, cols] scale layout.

The plain-torch reference is ``csf_loader.codec.decode``; tests compare the two bit for bit
under ``TRITON_INTERPRET=1`` on CPU and natively on CUDA (``tests/csf_loader/triton_check.py``).
Triton is optional: importing this module without it works, calling the kernels does not.

One kernel configuration per codec family (``FAMILY_CONFIG``), the fastest of the H200 sweeps
of ``benchmarks/csf_loader/bench_decode.py``; the variants explored there (store cache policies,
other exception-prefetch depths, unpipelined steps, the timing-only run without exceptions, the
older two-launch "words" and one-load-per-scale kernels) live in
``benchmarks/csf_loader/decode_variants.py``.

Where ``cols % 8 == 0`` (and the buffers are aligned), one launch: each program owns a run of
whole 16-row slabs of one plane; it expands the packed offsets of those slabs in wide contiguous
chunks (16-byte loads of the stream, 8 output bytes per packed unit built with a few 32-bit
integer operations, 16-byte stores), software pipelined (step i + 1's loads are issued before
step i's stores). It looks its exception words up by sampling the plane's sorted exception list
(the samples are requested before the expansion, the program's words after its first
``exc_at`` steps, so both dependent reads hide behind the expansion), then, after a barrier that
orders its own stores, writes the exception bytes into the lines it has just written.

Any other column count: the fixed stream is expanded by one kernel (each packed byte loaded once)
and the exception words are scattered by a second launch on the same stream (stream order makes
the second see the first's writes).
"""

from __future__ import annotations

import importlib
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from csf_loader.codec import SLAB_ROWS, CsfCodec, CsfPlane, validate_plane

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAVE_TRITON = False


@dataclass
class TritonStart:
    """Triton's once-per-process start, run on a helper thread beside the load.

    Before its first compile or cache lookup in a process, Triton hashes its own installation
    (``triton_key``: sha256 over its compiler sources and its 400+ MB ``libtriton`` shared
    library; 0.9 s on two shared cores here). A CSF load on CUDA launches the first Triton kernel
    of the process, so it paid that hash inside the load, where a plain checkpoint's process pays
    it later, at its first forward pass (2026-12-03, H200: 0.38-0.45 s of a 0.42-0.49 s decode
    were the first launches). The hash releases the GIL (file reads and hashlib's updates), so a
    helper thread started when the loader is built overlaps it with building the model and
    reading the weights; the first launch joins it. Triton caches the result for the process.
    """

    thread: threading.Thread | None = None
    seconds: float | None = None  # the hash's own time, on the helper thread
    waited: float = 0.0  # what the first launch waited for it
    error: str = ""  # why it was not computed there (the launch then computes it itself)


TRITON_START = TritonStart()
_TRITON_START_LOCK = threading.Lock()


def _triton_key_function() -> Any:
    """Triton's installation-hash function (``triton.runtime.cache`` since 3.4, before that
    ``triton.compiler.compiler``), or None."""
    for module in ("triton.runtime.cache", "triton.compiler.compiler"):
        try:
            return importlib.import_module(module).triton_key
        except (ImportError, AttributeError):
            continue
    return None


def prefetch_triton_start() -> bool:
    """Start computing Triton's installation hash on a daemon thread (once per process).

    False when Triton, or the function, is not there (nothing started: the first launch computes
    it, as without this)."""
    with _TRITON_START_LOCK:
        if TRITON_START.thread is not None:
            return True
        key = _triton_key_function() if HAVE_TRITON else None
        if key is None:
            TRITON_START.error = "no triton_key in this Triton"
            return False

        def run() -> None:
            started = time.perf_counter()
            try:
                key()
            except Exception as exc:  # the first launch computes it again and raises there
                TRITON_START.error = f"{type(exc).__name__}: {exc}"
                return
            TRITON_START.seconds = time.perf_counter() - started

        TRITON_START.thread = threading.Thread(target=run, name="csf-triton-start", daemon=True)
        TRITON_START.thread.start()
        return True


def wait_triton_start() -> None:
    """Join the helper thread if one was started and is still running (before a first launch)."""
    thread = TRITON_START.thread
    if thread is not None and thread.is_alive():
        started = time.perf_counter()
        thread.join()
        TRITON_START.waited += time.perf_counter() - started


def describe_triton_start() -> str:
    """For the loader's log line: what the helper thread did."""
    if TRITON_START.thread is None:
        return ""
    if TRITON_START.seconds is None:
        return f"; Triton's start not computed beside the load ({TRITON_START.error or 'still running'})"
    return (
        f"; Triton's start (its installation hash) ran beside the load in {TRITON_START.seconds:.3f} s, "
        f"the first launch waited {TRITON_START.waited:.3f} s for it"
    )


@dataclass(frozen=True)
class LaunchConfig:
    """Launch shape of the one-pass kernel.

    ``rows_per_prog``: rows of one plane per program (a multiple of 16); ``chunk``: packed units
    per chunk, at most (the largest power of two dividing a slab's units is used); ``block_ch``:
    chunks per step; ``exc_at``: the program's exception words are requested after this many
    steps (1 or 2; the samples that bracket them before the first); ``samples`` and ``eblock``:
    widths of the exception lookup.
    """

    rows_per_prog: int
    chunk: int
    block_ch: int
    num_warps: int
    exc_at: int
    samples: int = 64
    eblock: int = 256

    def __post_init__(self) -> None:
        if self.rows_per_prog <= 0 or self.rows_per_prog % SLAB_ROWS:
            raise ValueError(f"rows_per_prog must be a positive multiple of {SLAB_ROWS}, got {self.rows_per_prog}")
        if self.exc_at not in (1, 2):
            raise ValueError(f"exc_at must be 1 or 2, got {self.exc_at}")


# The fastest one-layer configurations on the H200 (results/h200_decode_pipelined_run2.txt):
# NVFP4 0.86 of the copy ceiling, MXFP4 0.72.
FAMILY_CONFIG: dict[str, LaunchConfig] = {
    "nvfp4": LaunchConfig(rows_per_prog=64, chunk=128, block_ch=8, num_warps=4, exc_at=1),
    "mxfp4": LaunchConfig(rows_per_prog=144, chunk=64, block_ch=16, num_warps=4, exc_at=2),
}
# The two-launch fallback (any column count): rows x columns per program, warps.
FALLBACK_BLOCK_R, FALLBACK_BLOCK_C, FALLBACK_WARPS = 32, 256, 4
_SCATTER_BLOCK = 1024

_fused_kernel: Any = None
_fixed_bytes_kernel: Any = None
_scatter_kernel: Any = None

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
    def _expand_units(base, raw, OFFSET_BITS: tl.constexpr):  # type: ignore[no-untyped-def]
        """Each packed unit (8 offsets) plus its row base as one 8-byte word of 8 scale bytes."""
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
        # base + offset <= 255, so no byte carries into the next.
        return ((lo + rep).to(tl.uint64) | ((hi + rep).to(tl.uint64) << 32)).to(tl.int64, bitcast=True)

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
    ):
        """Expand step ``it``'s units and store them (16-byte stores)."""
        c = it * BLOCK_CH + tl.arange(0, BLOCK_CH)
        ok = (c < n_chunks)[:, None]
        slab = slab0 + c // CPS
        u = (c % CPS)[:, None] * CW + tl.arange(0, CW)[None, :]
        tl.store(out_words + (slab * (16 * U))[:, None] + u, _expand_units(base, raw, OFFSET_BITS), mask=ok)

    @triton.jit
    def _fused_step(  # type: ignore[no-untyped-def]
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
    ):
        """One software-pipelined step: issue step ``it + 1``'s loads, then expand and store step
        ``it`` (whose inputs ``base, raw`` were loaded a step earlier); returns step it + 1's inputs."""
        base_next, raw_next = _fused_inputs(
            fixed_ptr, units_ptr, it + 1, slab0, n_chunks, U, SLAB_BYTES, CPS, CW, BLOCK_CH, OFFSET_BITS
        )
        _fused_store(out_words, base, raw, it, slab0, n_chunks, U, CPS, CW, BLOCK_CH, OFFSET_BITS)
        return base_next, raw_next

    @triton.jit
    def _apply_exception_words(  # type: ignore[no-untyped-def]
        plane, words_ptr, word0, k0, first, stop, lo_pos, hi_pos, EBLOCK: tl.constexpr
    ):
        """Store the bytes of the words in [first, stop) whose positions lie in [lo_pos, hi_pos)
        (``word0`` holds words[k0], k0 = first + arange(EBLOCK), already loaded)."""
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
        # Step 0's loads; each step then issues the next step's loads before its own stores
        # (the step past the end loads nothing: all masked).
        base, raw = _fused_inputs(
            fixed_ptr, units_ptr, 0, slab0, n_chunks, U, SLAB_BYTES, CPS, CW, BLOCK_CH, OFFSET_BITS
        )
        if APPLY_EXCEPTIONS:
            # Positions are sorted, so SAMPLES evenly spaced words bracket this program's
            # [lo_pos, hi_pos) to within two sample gaps. The samples are requested now, the
            # words after EXC_AT steps: both reads hide behind the expansion.
            begin = tl.load(starts_ptr + e)
            end = tl.load(starts_ptr + e + 1)
            lo_pos = r0 * COLS
            hi_pos = r1 * COLS
            sampled = _exception_samples(words_ptr, begin, end, SAMPLES)
            base, raw = _fused_step(
                out_words, fixed_ptr, units_ptr, base, raw, 0, slab0, n_chunks, U, SLAB_BYTES, CPS, CW, BLOCK_CH,
                OFFSET_BITS,
            )  # fmt: skip
            if EXC_AT == 2:
                base, raw = _fused_step(
                    out_words, fixed_ptr, units_ptr, base, raw, 1, slab0, n_chunks, U, SLAB_BYTES, CPS, CW, BLOCK_CH,
                    OFFSET_BITS,
                )  # fmt: skip
            first, stop = _exception_bracket(sampled, begin, end, lo_pos, hi_pos, SAMPLES)
            k0 = first + tl.arange(0, EBLOCK)
            word0 = tl.load(words_ptr + k0, mask=k0 < stop, other=0)
            for it in range(EXC_AT, ITERS):
                base, raw = _fused_step(
                    out_words, fixed_ptr, units_ptr, base, raw, it, slab0, n_chunks, U, SLAB_BYTES, CPS, CW,
                    BLOCK_CH, OFFSET_BITS,
                )  # fmt: skip
            # Exception bytes overwrite bytes this program stored above: the barrier
            # orders every thread's stores before any exception store.
            tl.debug_barrier()
            plane = out_ptr + e.to(tl.int64) * rows * COLS
            _apply_exception_words(plane, words_ptr, word0, k0, first, stop, lo_pos, hi_pos, EBLOCK)
        else:
            for it in range(0, ITERS):
                base, raw = _fused_step(
                    out_words, fixed_ptr, units_ptr, base, raw, it, slab0, n_chunks, U, SLAB_BYTES, CPS, CW,
                    BLOCK_CH, OFFSET_BITS,
                )  # fmt: skip

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
        # base + offset for every scale (exceptions not applied); each packed byte is loaded
        # once and expanded in registers to its 8 // OFFSET_BITS scales, so both the loads
        # and the stores are contiguous runs. Any column count.
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
    def _csf_scatter_exceptions_kernel(  # type: ignore[no-untyped-def]
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

    _fused_kernel = _csf_fused_kernel
    _fixed_bytes_kernel = _csf_fixed_bytes_kernel
    _scatter_kernel = _csf_scatter_exceptions_kernel


def fused_applies(codec: CsfCodec, cols: int, fixed: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the one-launch kernel can decode this plane (else the two-launch fallback)."""
    unit_align = 4 if codec.offset_bits == 4 else 1
    return cols % 8 == 0 and fixed.data_ptr() % unit_align == 0 and out.data_ptr() % 8 == 0


def chunk_width(cols: int, cap: int) -> int:
    """Largest power of two dividing a slab's 16 * cols / 8 units, at most ``cap``."""
    units = 2 * cols  # 16 * cols // 8
    width = units & -units
    return max(1, min(width, cap))


def launch_fused(
    fixed: torch.Tensor,
    exceptions: torch.Tensor,
    starts: torch.Tensor,
    out_bytes: torch.Tensor,
    codec: CsfCodec,
    planes: int,
    rows: int,
    cols: int,
    config: LaunchConfig,
) -> Any:
    """Launch the one-pass kernel on flat ``fixed`` / ``out_bytes``; returns Triton's compiled-kernel
    handle. The exception pass runs only when there are exception words."""
    progs_per_plane = triton.cdiv(rows, config.rows_per_prog)
    # Without exception words the exception pass never runs, but Triton needs a pointer: the
    # starts serve (no allocation and fill a plane).
    words = exceptions.view(torch.int32) if exceptions.numel() else starts.view(torch.int32)
    units = fixed.view(torch.int32) if codec.offset_bits == 4 else fixed
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
        ROWS_PER_PROG=config.rows_per_prog,
        CW=chunk_width(cols, config.chunk),
        BLOCK_CH=config.block_ch,
        SAMPLES=config.samples,
        EBLOCK=config.eblock,
        APPLY_EXCEPTIONS=exceptions.numel() > 0,
        EXC_AT=config.exc_at,
        num_warps=config.num_warps,
    )


def launch_fallback(
    fixed: torch.Tensor,
    exceptions: torch.Tensor,
    starts: torch.Tensor,
    out_bytes: torch.Tensor,
    codec: CsfCodec,
    planes: int,
    rows: int,
    cols: int,
    max_count: int | None = None,
) -> None:
    """The two-launch decode (any column count): expand the fixed streams, then scatter each
    plane's exception words. ``max_count`` (the largest per-plane exception count) saves a
    device-to-host read."""
    packed_cols = codec.packed_cols(cols)
    grid = (triton.cdiv(planes * rows, FALLBACK_BLOCK_R), triton.cdiv(cols, FALLBACK_BLOCK_C))
    _fixed_bytes_kernel[grid](
        fixed,
        out_bytes,
        planes * rows,
        cols,
        packed_cols,
        OFFSET_BITS=codec.offset_bits,
        BLOCK_R=FALLBACK_BLOCK_R,
        BLOCK_C=FALLBACK_BLOCK_C,
        num_warps=FALLBACK_WARPS,
    )
    if max_count is None:
        max_count = int((starts[1:] - starts[:-1]).max().item()) if planes else 0
    if max_count:
        _scatter_kernel[(planes, triton.cdiv(max_count, _SCATTER_BLOCK))](
            exceptions.view(torch.int32), starts, out_bytes, rows * cols, BLOCK=_SCATTER_BLOCK
        )


def decode_triton(
    plane: CsfPlane,
    codec: CsfCodec,
    rows: int,
    cols: int,
    out: torch.Tensor | None = None,
    validate: bool = True,
    what: str = "scales",
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """Decode ``plane`` into ``out`` (uint8 or a 1-byte float view, [rows, cols], on the plane's
    device; allocated when None). ``config`` overrides the family's launch shape (tests)."""
    if not HAVE_TRITON:
        raise RuntimeError("csf_loader.triton_decode needs triton; use csf_loader.codec.decode")
    if validate:
        validate_plane(plane, codec, rows, cols, what)
    device = plane.fixed.device
    if out is None:
        out = torch.empty(rows, cols, dtype=torch.uint8, device=device)
    if tuple(out.shape) != (rows, cols) or out.element_size() != 1 or not out.is_contiguous():
        raise ValueError(f"{what}: output must be a contiguous 1-byte [{rows}, {cols}] tensor")
    starts = torch.tensor([0, plane.exceptions.numel()], dtype=torch.int64, device=device)
    return decode_triton_stacked(
        plane.fixed, plane.exceptions, starts, codec, 1, rows, cols, out, plane.exceptions.numel(), config=config
    )


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
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """Decode ``planes`` same-shape planes (e.g. one layer's experts) into ``out``.

    ``fixed`` is the planes' fixed streams back to back: because a stream is a sequence of
    16-row slabs, that is exactly the stream of one ``[planes * rows, cols]`` matrix.
    ``exceptions`` holds every plane's words back to back, plane ``e`` owning
    ``exceptions[starts[e]:starts[e + 1]]`` (int64 ``starts``, on the device). The caller
    validates the planes (``codec.validate_plane``) beforehand. The one-pass kernel runs with
    ``FAMILY_CONFIG[codec.family]`` (or ``config``) where it applies, else the two-launch
    fallback; ``max_count`` (the largest per-plane exception count) saves the fallback a
    device-to-host read.
    """
    if not HAVE_TRITON:
        raise RuntimeError("csf_loader.triton_decode needs triton; use csf_loader.codec.decode")
    if out.numel() != planes * rows * cols or out.element_size() != 1 or not out.is_contiguous():
        raise ValueError(f"output must be a contiguous 1-byte tensor of {planes}x{rows}x{cols}")
    if fixed.numel() != planes * codec.fixed_numel(rows, cols):
        raise ValueError(
            f"stacked fixed stream has {fixed.numel()} bytes, expected {planes}x{codec.fixed_numel(rows, cols)}"
        )
    out_bytes = out.view(torch.uint8).reshape(-1)
    fixed = fixed.reshape(-1)
    if fused_applies(codec, cols, fixed, out_bytes):
        launch_fused(
            fixed, exceptions, starts, out_bytes, codec, planes, rows, cols, config or FAMILY_CONFIG[codec.family]
        )
    else:
        launch_fallback(fixed, exceptions, starts, out_bytes, codec, planes, rows, cols, max_count)
    return out


__all__ = [
    "FAMILY_CONFIG",
    "HAVE_TRITON",
    "LaunchConfig",
    "decode_triton",
    "decode_triton_stacked",
    "fused_applies",
]
