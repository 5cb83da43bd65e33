"""Compare csf_loader.triton_decode with csf_loader.codec.decode on adversarial planes.

Runs under TRITON_INTERPRET=1 on CPU (tests) and natively on CUDA (benchmarks/csf_loader).
Prints one summary line; exits non-zero on any mismatch.
"""

from __future__ import annotations

import sys

import torch

from csf_loader.codec import MXFP4_CSF, NVFP4_CSF, CsfCodec, CsfPlane, decode, encode
from csf_loader.triton_decode import decode_triton, decode_triton_stacked

# Launch shapes of the fused kernel: one program per plane, one per slab (exceptions split
# between programs), narrow chunks and several chunks per step, a partial last program.
FUSED_TUNINGS: list[dict[str, int]] = [
    {},
    {"rows_per_prog": 16, "chunk": 16, "block_ch": 2},
    {"rows_per_prog": 32, "chunk": 32, "block_ch": 4, "num_warps": 1, "prefetch": 0},
    # Software-pipelined steps, samples loaded before the expansion, evict-first stores.
    {"rows_per_prog": 48, "chunk": 16, "block_ch": 2, "pipe": 1, "prefetch": 2, "streaming": 2, "eblock": 16},
    {"rows_per_prog": 32, "chunk": 32, "block_ch": 4, "pipe": 1, "prefetch": 1, "streaming": 1, "samples": 16},
    # Exception words requested after the first one / two steps (peeled off the loop).
    {"rows_per_prog": 48, "chunk": 16, "block_ch": 2, "pipe": 1, "prefetch": 3, "eblock": 16},
    {"rows_per_prog": 64, "chunk": 32, "block_ch": 2, "pipe": 1, "prefetch": 4},
]


def cases(codec: CsfCodec) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for rows, cols in [(16, 2), (32, 40), (48, 130), (16, 258), (32, 64), (16, 160)]:
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


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    checked = mismatches = 0
    for codec in (NVFP4_CSF, MXFP4_CSF):
        for label, scales in cases(codec):
            rows, cols = scales.shape
            plane = encode(scales, codec)
            reference = decode(plane, codec, rows, cols)
            on_device = CsfPlane(plane.fixed.to(device), plane.exceptions.to(device))
            variants = ["bytes", "cols", "auto"]
            if cols % 8 == 0:
                variants += ["words", "fused"]
            for variant in variants:
                tunings = FUSED_TUNINGS if variant in ("fused", "auto") and cols % 8 == 0 else [{}]
                for tuning in tunings:
                    out = torch.full((rows, cols), 0xA5, dtype=torch.uint8, device=device)  # poison
                    got = decode_triton(on_device, codec, rows, cols, out=out, variant=variant, **tuning).cpu()
                    checked += 1
                    if not (torch.equal(got, reference) and torch.equal(reference, scales)):
                        mismatches += 1
                        print(f"MISMATCH {codec.family} {label} {variant} {tuning}")
        # A plane whose every scale is an exception, fixed stream all zero (more words than
        # the fused kernel samples, spread over several programs).
        rows, cols = 48, 24
        values = torch.arange(rows * cols, dtype=torch.int64) * 7 % 256
        words = (torch.arange(rows * cols, dtype=torch.int64) | (values << 24)).to(torch.uint32)
        plane = CsfPlane(torch.zeros(codec.fixed_shape(rows, cols), dtype=torch.uint8, device=device), words.to(device))
        for variant, tuning in [("auto", {}), ("fused", {"rows_per_prog": 16}), ("bytes", {})]:
            got = decode_triton(plane, codec, rows, cols, variant=variant, **tuning).cpu()
            checked += 1
            if not torch.equal(got.reshape(-1).to(torch.int64), values):
                mismatches += 1
                print(f"MISMATCH {codec.family} every scale an exception {variant} {tuning}")
        # Several planes ("experts") decoded in one stacked launch.
        # Several planes ("experts") decoded in one stacked launch; one plane without exceptions.
        for experts, rows, cols in [(3, 32, 18), (4, 48, 24)]:
            g = torch.Generator().manual_seed(11)
            stack = torch.randint(60, 90, (experts, rows, cols), generator=g).to(torch.uint8)
            stack[1] = 70
            encoded = [encode(stack[e], codec) for e in range(experts)]
            counts = torch.tensor([0] + [p.exceptions.numel() for p in encoded], dtype=torch.int64)
            for tuning in FUSED_TUNINGS if cols % 8 == 0 else [{}]:
                out = torch.full((experts, rows, cols), 0xA5, dtype=torch.uint8, device=device)
                decode_triton_stacked(
                    torch.cat([p.fixed.reshape(-1) for p in encoded]).to(device),
                    torch.cat([p.exceptions for p in encoded]).to(device),
                    counts.cumsum(0).to(device),
                    codec,
                    experts,
                    rows,
                    cols,
                    out,
                    **tuning,
                )
                checked += 1
                if not torch.equal(out.cpu(), stack):
                    mismatches += 1
                    print(f"MISMATCH {codec.family} stacked {experts}x{rows}x{cols} {tuning}")
    print(f"device={device} cases={checked} mismatches={mismatches}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
