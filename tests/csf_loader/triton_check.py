"""Compare the Triton decode kernels with csf_loader.codec.decode on adversarial planes.

    python tests/csf_loader/triton_check.py [--variants]

Runs under TRITON_INTERPRET=1 on CPU (tests) and natively on CUDA (benchmarks/csf_loader/
gpu_session.py). Without arguments it checks the library (``csf_loader.triton_decode``): the
family configuration and other launch shapes of the one-pass kernel, the two-launch fallback
(column counts not divisible by 8), stacked planes. ``--variants`` checks the exploration
variants of ``benchmarks/csf_loader/decode_variants.py`` instead. Prints one summary line; exits
non-zero on any mismatch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from csf_loader.codec import MXFP4_CSF, NVFP4_CSF, CsfCodec, CsfPlane, decode, encode
from csf_loader.triton_decode import LaunchConfig, decode_triton, decode_triton_stacked

# Launch shapes of the library kernel besides the family's own: one program per slab (exceptions
# split between programs, short loops), narrow chunks and several chunks per step, a partial last
# program, the exception words requested after one or after two steps.
LAUNCH_SHAPES: list[LaunchConfig | None] = [
    None,
    LaunchConfig(rows_per_prog=16, chunk=16, block_ch=2, num_warps=4, exc_at=1, eblock=16),
    LaunchConfig(rows_per_prog=48, chunk=16, block_ch=2, num_warps=1, exc_at=2, samples=16, eblock=16),
    LaunchConfig(rows_per_prog=32, chunk=32, block_ch=4, num_warps=2, exc_at=1),
]

# Exploration variants (benchmarks/csf_loader/decode_variants.py) and their tunings.
VARIANT_TUNINGS: list[tuple[str, dict[str, int]]] = [
    ("fused", {"rows_per_prog": 16, "chunk": 16, "block_ch": 2}),
    ("fused", {"rows_per_prog": 32, "chunk": 32, "block_ch": 4, "num_warps": 1, "prefetch": 0}),
    (
        "fused",
        {"rows_per_prog": 48, "chunk": 16, "block_ch": 2, "pipe": 1, "prefetch": 2, "streaming": 2, "eblock": 16},
    ),
    (
        "fused",
        {"rows_per_prog": 32, "chunk": 32, "block_ch": 4, "pipe": 1, "prefetch": 1, "streaming": 1, "samples": 16},
    ),
    ("fused", {"rows_per_prog": 48, "chunk": 16, "block_ch": 2, "pipe": 1, "prefetch": 3, "eblock": 16}),
    ("fused", {"rows_per_prog": 64, "chunk": 32, "block_ch": 2, "pipe": 1, "prefetch": 4}),
    ("words", {}),
    ("cols", {}),
    ("bytes", {}),
]


def cases(codec: CsfCodec) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for rows, cols in [(16, 2), (32, 40), (48, 130), (16, 258), (32, 64), (16, 160), (160, 24)]:
        if codec is MXFP4_CSF and cols % 8 != 0:
            cols += 1  # column counts that are not multiples of 8
        centre = torch.randint(0, 256, (rows, 1), generator=g)
        noisy = (centre + torch.randint(-20, 21, (rows, cols), generator=g)).clamp(0, 255).to(torch.uint8)
        out.append((f"random {rows}x{cols}", noisy))
    out.append(("all equal", torch.full((32, 64), 0x38, dtype=torch.uint8)))
    out.append(("all 255 (base at limit)", torch.full((16, 66), 255, dtype=torch.uint8)))
    spread = torch.tensor([[(i * 2 * codec.window) % 256 for i in range(34)]] * 16, dtype=torch.uint8)
    out.append(("nearly all exceptions", spread))
    return out


Decoder = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, CsfCodec, int, int, int, torch.Tensor], object]


def decoders(variants: bool, cols: int) -> list[tuple[str, Decoder]]:
    """(label, decode(fixed, exceptions, starts, codec, planes, rows, cols, out)) to check."""
    if not variants:
        return [
            (f"library {shape}", lambda *a, shape=shape: decode_triton_stacked(*a, config=shape))  # type: ignore[misc]
            for shape in LAUNCH_SHAPES
        ]
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "csf_loader"))
    import decode_variants

    needs_fused = ("fused", "words")
    return [
        (f"{name} {tuning}", lambda *a, name=name, tuning=tuning: decode_variants.decode_variant(*a, name, **tuning))  # type: ignore[misc]
        for name, tuning in VARIANT_TUNINGS
        if cols % 8 == 0 or name not in needs_fused
    ]


def main() -> int:
    variants = sys.argv[1:] == ["--variants"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    checked = mismatches = 0
    for codec in (NVFP4_CSF, MXFP4_CSF):
        for label, scales in cases(codec):
            rows, cols = scales.shape
            plane = encode(scales, codec)
            reference = decode(plane, codec, rows, cols)
            assert torch.equal(reference, scales)
            fixed, words = plane.fixed.to(device), plane.exceptions.to(device)
            starts = torch.tensor([0, words.numel()], dtype=torch.int64, device=device)
            for name, run in decoders(variants, cols):
                out = torch.full((rows, cols), 0xA5, dtype=torch.uint8, device=device)  # poison
                run(fixed, words, starts, codec, 1, rows, cols, out)
                checked += 1
                if not torch.equal(out.cpu(), reference):
                    mismatches += 1
                    print(f"MISMATCH {codec.family} {label} {name}")
            if not variants:
                # The one-plane entry point, which validates and allocates.
                got = decode_triton(CsfPlane(fixed, words), codec, rows, cols).cpu()
                checked += 1
                if not torch.equal(got, reference):
                    mismatches += 1
                    print(f"MISMATCH {codec.family} {label} decode_triton")
        # A plane whose every scale is an exception, fixed stream all zero (more words than
        # the kernel samples, spread over several programs).
        rows, cols = 48, 24
        values = torch.arange(rows * cols, dtype=torch.int64) * 7 % 256
        words = (torch.arange(rows * cols, dtype=torch.int64) | (values << 24)).to(torch.uint32).to(device)
        fixed = torch.zeros(codec.fixed_shape(rows, cols), dtype=torch.uint8, device=device)
        starts = torch.tensor([0, words.numel()], dtype=torch.int64, device=device)
        for name, run in decoders(variants, cols):
            out = torch.full((rows, cols), 0xA5, dtype=torch.uint8, device=device)
            run(fixed, words, starts, codec, 1, rows, cols, out)
            checked += 1
            if not torch.equal(out.cpu().reshape(-1).to(torch.int64), values):
                mismatches += 1
                print(f"MISMATCH {codec.family} every scale an exception {name}")
        # Several planes ("experts") decoded in one stacked launch; one plane without exceptions.
        for experts, rows, cols in [(3, 32, 18), (4, 48, 24)]:
            g = torch.Generator().manual_seed(11)
            stack = torch.randint(60, 90, (experts, rows, cols), generator=g).to(torch.uint8)
            stack[1] = 70
            encoded = [encode(stack[e], codec) for e in range(experts)]
            counts = torch.tensor([0] + [p.exceptions.numel() for p in encoded], dtype=torch.int64)
            fixed = torch.cat([p.fixed.reshape(-1) for p in encoded]).to(device)
            words = torch.cat([p.exceptions for p in encoded]).to(device)
            for name, run in decoders(variants, cols):
                out = torch.full((experts, rows, cols), 0xA5, dtype=torch.uint8, device=device)
                run(fixed, words, counts.cumsum(0).to(device), codec, experts, rows, cols, out)
                checked += 1
                if not torch.equal(out.cpu(), stack):
                    mismatches += 1
                    print(f"MISMATCH {codec.family} stacked {experts}x{rows}x{cols} {name}")
    print(f"device={device} {'variants' if variants else 'library'} cases={checked} mismatches={mismatches}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
