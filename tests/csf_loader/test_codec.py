"""CSF codecs: bit-exact round trips, byte layout from the spec, optimal bases, bad planes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from csf_loader.codec import (
    MXFP4_CSF,
    NVFP4_CSF,
    CsfCodec,
    CsfFormatError,
    CsfPlane,
    decode,
    decode_region,
    encode,
)

CODECS = [NVFP4_CSF, MXFP4_CSF]


def spec_decode(fixed: bytes, words: list[int], rows: int, cols: int, offset_bits: int) -> list[list[int]]:
    """Byte-at-a-time decoder written from csf-format.md, independent of the codec module."""
    per_byte = 8 // offset_bits
    row_bytes = (cols + per_byte - 1) // per_byte
    out = []
    for r in range(rows):
        slab, i = divmod(r, 16)
        start = slab * 16 * (1 + row_bytes)
        base = fixed[start + i]
        row = []
        for c in range(cols):
            byte = fixed[start + 16 + i * row_bytes + c // per_byte]
            code = (byte >> ((c % per_byte) * offset_bits)) & ((1 << offset_bits) - 1)
            row.append(base + code)
        out.append(row)
    for w in words:
        pos, val = w & 0xFFFFFF, w >> 24
        out[pos // cols][pos % cols] = val
    return out


def brute_force_min_exceptions(row: list[int], window: int) -> int:
    return min(sum(1 for v in row if not b <= v < b + window) for b in range(256 - window + 1))


def words_of(plane: CsfPlane) -> list[int]:
    return [int(w) for w in plane.exceptions.to(torch.int64).tolist()]


def random_scales(rows: int, cols: int, seed: int, spread: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    centre = torch.randint(0, 256, (rows, 1), generator=g)
    noise = torch.randint(-spread, spread + 1, (rows, cols), generator=g)
    return (centre + noise).clamp(0, 255).to(torch.uint8)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.family)
@settings(max_examples=40, deadline=None)
@given(
    slabs=st.integers(1, 3),
    cols_half=st.integers(1, 20),
    odd=st.booleans(),
    spread=st.integers(0, 40),
    seed=st.integers(0, 2**31),
)
def test_round_trip_matches_spec_decoder(
    codec: CsfCodec, slabs: int, cols_half: int, odd: bool, spread: int, seed: int
) -> None:
    rows = 16 * slabs
    cols = 2 * cols_half + (1 if odd and codec is MXFP4_CSF else 0)
    scales = random_scales(rows, cols, seed, spread)
    plane = encode(scales, codec)
    assert tuple(plane.fixed.shape) == codec.fixed_shape(rows, cols)
    assert plane.fixed.dtype == torch.uint8 and plane.exceptions.dtype == torch.uint32
    # The stored bytes decode, by the spec, to the source bytes.
    expected = scales.tolist()
    assert (
        spec_decode(bytes(plane.fixed.reshape(-1).tolist()), words_of(plane), rows, cols, codec.offset_bits) == expected
    )
    assert decode(plane, codec, rows, cols).tolist() == expected
    # Exceptions are sorted and hold exactly the scales outside each row's window.
    positions = [w & 0xFFFFFF for w in words_of(plane)]
    assert positions == sorted(set(positions))
    # Optimality: no base gives any row fewer exceptions.
    per_row = [0] * rows
    for p in positions:
        per_row[p // cols] += 1
    for r in range(rows):
        assert per_row[r] == brute_force_min_exceptions(expected[r], codec.window)


def test_hand_built_nvfp4_plane_decodes() -> None:
    # 16 rows x 4 cols; row r has base 10 + r, codes (1, 2, 15, 0); one exception at (5, 2) -> 0x7E.
    rows, cols = 16, 4
    fixed = bytes(range(10, 26)) + bytes([0x21, 0x0F] * 16)
    words = [(5 * cols + 2) | (0x7E << 24)]
    plane = CsfPlane(
        fixed=torch.tensor(list(fixed), dtype=torch.uint8).reshape(1, 48),
        exceptions=torch.tensor(words, dtype=torch.uint32),
    )
    got = decode(plane, NVFP4_CSF, rows, cols)
    for r in range(rows):
        expected_row = [10 + r + 1, 10 + r + 2, 10 + r + 15, 10 + r]
        if r == 5:
            expected_row[2] = 0x7E
        assert got[r].tolist() == expected_row


def test_hand_built_mxfp4_plane_decodes_little_bit_order_and_partial_byte() -> None:
    # 16 rows x 11 cols: 2 selector bytes per row; 0b00000101, 0b00000100 -> bits at cols 0, 2, 10.
    rows, cols = 16, 11
    fixed = bytes([120] * 16) + bytes([0b00000101, 0b00000100] * 16)
    plane = CsfPlane(fixed=torch.tensor(list(fixed), dtype=torch.uint8), exceptions=torch.zeros(0, dtype=torch.uint32))
    got = decode(plane, MXFP4_CSF, rows, cols)
    assert got[7].tolist() == [121, 120, 121, 120, 120, 120, 120, 120, 120, 120, 121]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.family)
def test_all_equal_has_no_exceptions(codec: CsfCodec) -> None:
    scales = torch.full((32, 24), 0x7F, dtype=torch.uint8)
    plane = encode(scales, codec)
    assert plane.exceptions.numel() == 0
    assert torch.equal(decode(plane, codec, 32, 24), scales)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.family)
def test_bases_at_the_limit(codec: CsfCodec) -> None:
    scales = torch.full((16, 10), 255, dtype=torch.uint8)
    scales[:, ::2] = 256 - codec.window
    plane = encode(scales, codec)
    assert plane.exceptions.numel() == 0
    assert set(plane.fixed.reshape(-1)[:16].tolist()) == {codec.max_base}
    assert torch.equal(decode(plane, codec, 16, 10), scales)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.family)
def test_nearly_every_scale_an_exception(codec: CsfCodec) -> None:
    # Values 2*window apart: any window covers one scale of the row, the rest are exceptions.
    cols = min(12, 256 // (2 * codec.window))
    row = [i * 2 * codec.window for i in range(cols)]
    scales = torch.tensor([row] * 16, dtype=torch.uint8)
    plane = encode(scales, codec)
    assert plane.exceptions.numel() == 16 * (cols - 1)
    assert torch.equal(decode(plane, codec, 16, cols), scales)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.family)
def test_decoder_accepts_every_scale_as_an_exception(codec: CsfCodec) -> None:
    rows, cols = 16, 8
    values = [(7 * i + 3) % 256 for i in range(rows * cols)]
    plane = CsfPlane(
        fixed=torch.zeros(codec.fixed_shape(rows, cols), dtype=torch.uint8),
        exceptions=torch.tensor([i | (v << 24) for i, v in enumerate(values)], dtype=torch.uint32),
    )
    assert decode(plane, codec, rows, cols).reshape(-1).tolist() == values


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.family)
def test_region_decode_equals_slice(codec: CsfCodec) -> None:
    rows, cols = 64, 44 if codec is NVFP4_CSF else 45
    scales = random_scales(rows, cols, 3, 12)
    plane = encode(scales, codec)
    for rr, cr in [
        ((0, 32), (0, cols)),
        ((32, 64), (0, cols)),
        ((0, 64), (0, 22)),
        ((0, 64), (22, cols)),
        ((5, 37), (3, 31)),
    ]:
        got = decode_region(plane, codec, rows, cols, rr, cr)
        assert torch.equal(got, scales[rr[0] : rr[1], cr[0] : cr[1]])


def test_e4m3_and_e8m0_views_encode_their_bytes() -> None:
    scales = random_scales(16, 8, 1, 5)
    e4m3 = scales.view(torch.float8_e4m3fn)
    assert torch.equal(decode(encode(e4m3, NVFP4_CSF), NVFP4_CSF, 16, 8), scales)
    e8m0 = scales.view(torch.float8_e8m0fnu)
    assert torch.equal(decode(encode(e8m0, MXFP4_CSF), MXFP4_CSF, 16, 8), scales)


def _plane(codec: CsfCodec, rows: int, cols: int) -> CsfPlane:
    return encode(random_scales(rows, cols, 0, 30), codec)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.family)
def test_bad_planes_fail_naming_the_tensor(codec: CsfCodec) -> None:
    name = "model.layers.0.mlp.experts.3.down_proj.weight_scale"
    good = _plane(codec, 32, 16)
    assert good.exceptions.numel() > 0

    over = CsfPlane(good.fixed.clone(), good.exceptions)
    over.fixed.view(-1)[16 * (1 + codec.packed_cols(16)) + 3] = codec.max_base + 1  # row 19
    with pytest.raises(CsfFormatError, match=rf"{name}{codec.fixed_suffix}: row 19 has base {codec.max_base + 1}"):
        decode(over, codec, 32, 16, what=name)

    outside = CsfPlane(good.fixed, torch.tensor([32 * 16 | (1 << 24)], dtype=torch.uint32))
    with pytest.raises(CsfFormatError, match=rf"{name}{codec.exceptions_suffix}: exception position 512 lies outside"):
        decode(outside, codec, 32, 16, what=name)

    unsorted = CsfPlane(good.fixed, torch.tensor([9, 4], dtype=torch.uint32))
    with pytest.raises(CsfFormatError, match="not strictly increasing"):
        decode(unsorted, codec, 32, 16, what=name)

    with pytest.raises(CsfFormatError, match=r"dtype torch.int32, expected torch.uint32"):
        decode(CsfPlane(good.fixed, good.exceptions.to(torch.int32)), codec, 32, 16, what=name)
    with pytest.raises(CsfFormatError, match=r"dtype torch.int8, expected torch.uint8"):
        decode(CsfPlane(good.fixed.view(torch.int8), good.exceptions), codec, 32, 16, what=name)
    with pytest.raises(CsfFormatError, match=r"does not match"):
        decode(CsfPlane(good.fixed.reshape(-1)[:-1], good.exceptions), codec, 32, 16, what=name)
    with pytest.raises(CsfFormatError, match="not a multiple of the 16-row slab"):
        encode(torch.zeros(24, 16, dtype=torch.uint8), codec, what=name)


def test_nvfp4_refuses_odd_columns_and_wide_dtypes() -> None:
    with pytest.raises(CsfFormatError, match="odd"):
        encode(torch.zeros(16, 7, dtype=torch.uint8), NVFP4_CSF)
    with pytest.raises(CsfFormatError, match="1-byte dtype"):
        encode(torch.zeros(16, 8, dtype=torch.float32), NVFP4_CSF)


def test_position_range_is_enforced() -> None:
    with pytest.raises(CsfFormatError, match="24-bit"):
        encode(torch.zeros(1 << 13, (1 << 11) + 2, dtype=torch.uint8), NVFP4_CSF)


def test_published_mxfp4_geometry_sizes() -> None:
    # DeepSeek-V4.1-Flash figures from the format note: w1/w3 R=2304, C=160; w2 R=5120, C=72.
    assert MXFP4_CSF.fixed_numel(2304, 160) == 48_384
    assert MXFP4_CSF.fixed_numel(5120, 72) == 51_200
