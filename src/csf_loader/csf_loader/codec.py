"""CSF scale codecs: plain-torch encoder and decoder (no vLLM import).

Two published codecs share one idea: every row of a block-scale matrix gets a base
byte, each scale is stored as a small unsigned offset from that base in a fixed-size
stream, and the few scales that do not fit the window are stored verbatim as
exception words (24-bit flat position, 8-bit value).

* NVFP4-CSF, ``byte-window4-fixed-stream-u24-exceptions/1``: E4M3 scales, 4-bit
  offsets (window of 16 values), bases 0..240. ``fixed`` is uint8
  ``[rows // 16, 16 * (1 + cols // 2)]``.
* MXFP4-CSF, ``row-base-offset1-u24-exceptions/1``: UE8M0 scales, 1-bit offsets
  (window of 2 values), bases 0..254. ``fixed`` is uint8, 1-D, of
  ``rows // 16 * 16 * (1 + ceil(cols / 8))`` bytes.

In both, a 16-row slab stores its 16 base bytes first, then the 16 rows' packed
offsets row-major (NVFP4: two per byte, low nibble first; MXFP4: eight per byte,
least significant bit first).

Optimal bases: the exception count of a matrix is the sum over rows of the number
of that row's scales outside ``[base, base + window - 1]``, and rows do not
interact, so choosing for every row the base whose window covers the most of the
row's scales minimises the total. ``optimal_bases`` does that exactly (histogram
plus sliding window sum over all admissible bases); ties go to the smallest base,
which makes the encoding deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SLAB_ROWS = 16
POSITION_BITS = 24
MAX_POSITIONS = 1 << POSITION_BITS
POSITION_MASK = MAX_POSITIONS - 1


class CsfFormatError(ValueError):
    """A CSF plane (or its source) violates the format; the message names the tensor."""


@dataclass(frozen=True)
class CsfCodec:
    """One CSF codec: its published name, offset width and tensor-name suffixes."""

    name: str
    family: str  # "nvfp4" or "mxfp4"
    offset_bits: int
    fixed_suffix: str
    exceptions_suffix: str
    group: int  # FP4 weights per block scale
    scale_dtypes: tuple[str, ...]  # the scales' safetensors dtypes in a standard checkpoint

    @property
    def weight_bytes_per_scale(self) -> int:
        """Bytes of packed FP4 weight (two values per byte) per scale."""
        return self.group // 2

    @property
    def window(self) -> int:
        return 1 << self.offset_bits

    @property
    def max_base(self) -> int:
        # The largest base whose whole window stays inside a byte.
        return 256 - self.window

    def packed_cols(self, cols: int) -> int:
        """Bytes of packed offsets per row."""
        per_byte = 8 // self.offset_bits
        return (cols + per_byte - 1) // per_byte

    def fixed_numel(self, rows: int, cols: int) -> int:
        return rows * (1 + self.packed_cols(cols))

    def fixed_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        if self.family == "nvfp4":
            return (rows // SLAB_ROWS, SLAB_ROWS * (1 + self.packed_cols(cols)))
        return (self.fixed_numel(rows, cols),)


NVFP4_CSF = CsfCodec(
    name="byte-window4-fixed-stream-u24-exceptions/1",
    family="nvfp4",
    offset_bits=4,
    fixed_suffix=".nvfp4_csf_fixed",
    exceptions_suffix=".nvfp4_csf_exceptions",
    group=16,
    scale_dtypes=("F8_E4M3",),
)
MXFP4_CSF = CsfCodec(
    name="row-base-offset1-u24-exceptions/1",
    family="mxfp4",
    offset_bits=1,
    fixed_suffix=".mxfp4_csf_fixed",
    exceptions_suffix=".mxfp4_csf_exceptions",
    group=32,
    scale_dtypes=("U8", "F8_E8M0"),
)
CODECS: dict[str, CsfCodec] = {c.name: c for c in (NVFP4_CSF, MXFP4_CSF)}


@dataclass
class CsfPlane:
    """The two stored tensors of one compressed scale matrix."""

    fixed: torch.Tensor  # uint8
    exceptions: torch.Tensor  # uint32, 1-D, sorted by position


def nvfp4_plane_shape(fixed_shape: tuple[int, ...] | list[int]) -> tuple[int, int] | None:
    """The ``[rows, cols]`` scale plane an NVFP4-CSF fixed stream of this shape codes, None if no
    plane does (``fixed`` is ``[rows / 16, 16 * (1 + cols / 2)]``; MXFP4's 1-D stream does not
    carry its shape)."""
    if len(fixed_shape) != 2 or fixed_shape[1] % SLAB_ROWS or fixed_shape[1] < 2 * SLAB_ROWS:
        return None
    return int(fixed_shape[0]) * SLAB_ROWS, (int(fixed_shape[1]) // SLAB_ROWS - 1) * 2


def check_geometry(codec: CsfCodec, rows: int, cols: int, what: str) -> None:
    """Refuse shapes the codec cannot represent, naming the tensor."""
    if rows <= 0 or cols <= 0:
        raise CsfFormatError(f"{what}: empty scale matrix [{rows}, {cols}]")
    if rows % SLAB_ROWS:
        raise CsfFormatError(f"{what}: {rows} rows is not a multiple of the {SLAB_ROWS}-row slab of {codec.name}")
    if codec.family == "nvfp4" and cols % 2:
        raise CsfFormatError(f"{what}: {cols} scale columns is odd; {codec.name} packs two 4-bit codes per byte")
    if rows * cols > MAX_POSITIONS:
        raise CsfFormatError(
            f"{what}: {rows}x{cols} = {rows * cols} scales exceed the 24-bit exception position range ({MAX_POSITIONS})"
        )


def as_scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    """View an E4M3 / E8M0 / uint8 scale tensor as its raw bytes (same shape)."""
    if scales.element_size() != 1:
        raise CsfFormatError(f"scale tensor has dtype {scales.dtype}; expected a 1-byte dtype")
    return scales.contiguous().view(torch.uint8)


def optimal_bases(scales: torch.Tensor, codec: CsfCodec) -> torch.Tensor:
    """Per-row base that covers the most scales of the row (smallest on ties)."""
    rows = scales.shape[0]
    counts = torch.zeros(rows, 256, dtype=torch.int32)
    counts.scatter_add_(1, scales.long(), torch.ones_like(scales, dtype=torch.int32))
    # covered[:, b] = number of scales in [b, b + window - 1] for b in 0..max_base.
    prefix = torch.nn.functional.pad(counts.cumsum(1, dtype=torch.int32), (1, 0))
    covered = prefix[:, codec.window :] - prefix[:, : 256 - codec.window + 1]
    # argmax returns the first maximum: the smallest optimal base.
    return covered.argmax(dim=1).to(torch.uint8)


def pack_offsets(offsets: torch.Tensor, codec: CsfCodec) -> torch.Tensor:
    """[rows, cols] offsets (< window) -> [rows, packed_cols] bytes."""
    rows, cols = offsets.shape
    per_byte = 8 // codec.offset_bits
    padded = codec.packed_cols(cols) * per_byte
    wide = torch.zeros(rows, padded, dtype=torch.int32)
    wide[:, :cols] = offsets.to(torch.int32)
    wide = wide.view(rows, -1, per_byte)
    shifts = torch.arange(per_byte, dtype=torch.int32) * codec.offset_bits
    return (wide << shifts).sum(dim=2).to(torch.uint8)


def unpack_offsets(packed: torch.Tensor, cols: int, codec: CsfCodec) -> torch.Tensor:
    """[rows, packed_cols] bytes -> [rows, cols] uint8 offsets."""
    per_byte = 8 // codec.offset_bits
    shifts = torch.arange(per_byte, dtype=torch.uint8, device=packed.device) * codec.offset_bits
    mask = (1 << codec.offset_bits) - 1
    wide = (packed.unsqueeze(-1) >> shifts) & mask
    return wide.reshape(packed.shape[0], -1)[:, :cols]


def encode(scales: torch.Tensor, codec: CsfCodec, what: str = "scales") -> CsfPlane:
    """Compress a [rows, cols] 1-byte scale matrix losslessly."""
    if scales.dim() != 2:
        raise CsfFormatError(f"{what}: expected a 2-D scale matrix, got shape {list(scales.shape)}")
    raw = as_scale_bytes(scales).cpu()
    rows, cols = raw.shape
    check_geometry(codec, rows, cols, what)
    bases = optimal_bases(raw, codec)
    offsets = raw.to(torch.int16) - bases.to(torch.int16).unsqueeze(1)
    inside = (offsets >= 0) & (offsets < codec.window)
    codes = torch.where(inside, offsets, torch.zeros_like(offsets))
    packed = pack_offsets(codes, codec)
    fixed = torch.cat([bases.view(rows // SLAB_ROWS, SLAB_ROWS), packed.view(rows // SLAB_ROWS, -1)], dim=1).reshape(
        codec.fixed_shape(rows, cols)
    )
    positions = torch.nonzero(~inside.reshape(-1)).reshape(-1)
    values = raw.reshape(-1)[positions].to(torch.int64)
    words = (positions | (values << POSITION_BITS)).to(torch.uint32)
    return CsfPlane(fixed=fixed.contiguous(), exceptions=words)


def exception_fields(exceptions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split uint32 words into (int64 positions, uint8 values).

    The words are widened through their int32 view: torch's uint32 supports few operations on
    CUDA, a bit-preserving view and an int32 -> int64 conversion work everywhere."""
    words = exceptions.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return words & POSITION_MASK, (words >> POSITION_BITS).to(torch.uint8)


def check_plane_layout(plane: CsfPlane, codec: CsfCodec, rows: int, cols: int, what: str) -> None:
    """The checks that need no tensor data: geometry, dtypes and shapes (raise naming the stream)."""
    check_geometry(codec, rows, cols, what)
    fixed, exceptions = plane.fixed, plane.exceptions
    fname, ename = what + codec.fixed_suffix, what + codec.exceptions_suffix
    if fixed.dtype != torch.uint8:
        raise CsfFormatError(f"{fname}: dtype {fixed.dtype}, expected torch.uint8")
    if exceptions.dtype != torch.uint32:
        raise CsfFormatError(f"{ename}: dtype {exceptions.dtype}, expected torch.uint32")
    if exceptions.dim() != 1:
        raise CsfFormatError(f"{ename}: expected 1-D, got shape {list(exceptions.shape)}")
    if tuple(fixed.shape) != codec.fixed_shape(rows, cols):
        raise CsfFormatError(
            f"{fname}: shape {list(fixed.shape)} does not match {list(codec.fixed_shape(rows, cols))} "
            f"for a [{rows}, {cols}] scale matrix"
        )


def check_plane_values(plane: CsfPlane, codec: CsfCodec, rows: int, cols: int, what: str) -> None:
    """Base limits and exception positions (inside the plane, strictly increasing), read where the
    tensors are (any device); raise naming the stream. Assumes ``check_plane_layout`` passed."""
    fname, ename = what + codec.fixed_suffix, what + codec.exceptions_suffix
    bases = plane.fixed.reshape(rows // SLAB_ROWS, -1)[:, :SLAB_ROWS].reshape(-1)
    over = torch.nonzero(bases > codec.max_base)
    if over.numel():
        bad = int(over[0].item())
        raise CsfFormatError(
            f"{fname}: row {bad} has base {int(bases[bad].item())} above the {codec.name} limit {codec.max_base}"
        )
    if plane.exceptions.numel():
        positions, _ = exception_fields(plane.exceptions)
        last = int(positions.max().item())
        if last >= rows * cols:
            raise CsfFormatError(
                f"{ename}: exception position {last} lies outside the [{rows}, {cols}] plane ({rows * cols} scales)"
            )
        if positions.numel() > 1 and not bool((positions[1:] > positions[:-1]).all()):
            raise CsfFormatError(f"{ename}: exception positions are not strictly increasing")


def validate_plane(plane: CsfPlane, codec: CsfCodec, rows: int, cols: int, what: str) -> None:
    """Check dtypes, sizes, base limits and exception positions; raise naming the tensor."""
    check_plane_layout(plane, codec, rows, cols, what)
    check_plane_values(plane, codec, rows, cols, what)


def decode(plane: CsfPlane, codec: CsfCodec, rows: int, cols: int, what: str = "scales") -> torch.Tensor:
    """Reconstruct the [rows, cols] uint8 scale bytes (vectorised torch, any device)."""
    validate_plane(plane, codec, rows, cols, what)
    return decode_region(plane, codec, rows, cols, (0, rows), (0, cols), validate=False)


def decode_region(
    plane: CsfPlane,
    codec: CsfCodec,
    rows: int,
    cols: int,
    row_range: tuple[int, int],
    col_range: tuple[int, int],
    validate: bool = True,
    what: str = "scales",
) -> torch.Tensor:
    """Decode only ``scales[r0:r1, c0:c1]``, reading only the slabs and bytes it needs.

    This is how a tensor-parallel rank takes its extent from the TP-independent
    compressed payload.
    """
    if validate:
        validate_plane(plane, codec, rows, cols, what)
    r0, r1 = row_range
    c0, c1 = col_range
    if not (0 <= r0 <= r1 <= rows and 0 <= c0 <= c1 <= cols):
        raise CsfFormatError(f"{what}: region {row_range}x{col_range} outside [{rows}, {cols}]")
    per_byte = 8 // codec.offset_bits
    pc = codec.packed_cols(cols)
    s0, s1 = r0 // SLAB_ROWS, (r1 + SLAB_ROWS - 1) // SLAB_ROWS
    slabs = plane.fixed.reshape(rows // SLAB_ROWS, SLAB_ROWS * (1 + pc))[s0:s1]
    bases = slabs[:, :SLAB_ROWS].reshape(-1, 1)
    b0, b1 = c0 // per_byte, (c1 + per_byte - 1) // per_byte
    packed = slabs[:, SLAB_ROWS:].reshape(-1, pc)[:, b0:b1]
    offsets = unpack_offsets(packed, (b1 - b0) * per_byte, codec)
    lo = c0 - b0 * per_byte
    out = (bases + offsets[:, lo : lo + (c1 - c0)])[r0 - s0 * SLAB_ROWS : r1 - s0 * SLAB_ROWS]
    out = out.contiguous()
    if plane.exceptions.numel() and (r1 - r0, c1 - c0) == (rows, cols):
        # Whole plane: positions index the output directly.
        positions, values = exception_fields(plane.exceptions.to(out.device))
        out.view(-1)[positions] = values
    elif plane.exceptions.numel():
        positions, values = exception_fields(plane.exceptions.to(out.device))
        r, c = positions // cols, positions % cols
        keep = (r >= r0) & (r < r1) & (c >= c0) & (c < c1)
        out[r[keep] - r0, c[keep] - c0] = values[keep]
    return out


def exception_rate(plane: CsfPlane, rows: int, cols: int) -> float:
    return plane.exceptions.numel() / float(rows * cols)


def compressed_bytes(plane: CsfPlane) -> int:
    return plane.fixed.numel() + 4 * plane.exceptions.numel()
